"""How a step's attention metadata (`metadata.py`) is built from its layout (`step_layout.py`):
`build_metadata` turns a planned `StepLayout` into the metadata's tensors, vectorized in numpy on
the host, every step; `HPUAttentionMetadataBuilder` is vLLM's way in (it reads the host copies of
the block tables, `host_tables.py`); `state_fields` adds the state slots of Mamba layers.
"""

from __future__ import annotations

import numpy as np
import torch
from vllm.v1.attention.backend import AttentionMetadataBuilder, CommonAttentionMetadata

from vllm_gaudi_platform.attention import host_tables, step_layout
from vllm_gaudi_platform.attention.metadata import UNUSED_LAG, HPUAttentionMetadata


class HPUAttentionMetadataBuilder(AttentionMetadataBuilder[HPUAttentionMetadata]):
    # No batch reordering: the step layout takes each part's requests wherever they sit in the
    # batch (step_layout.plan_step), so vLLM's decodes-first sort would only cost host time.
    reorder_batch_threshold: int | None = None
    # Whether a step the runner did not plan (profiling, dummy runs) may pack several prompts
    # into one prefill row.
    pack_prefills = True

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size
        # Gemma 3 style: bidirectional attention within each image's tokens (vLLM passes the
        # spans as `mm_req_doc_ranges`; the platform keeps an image in one prefill chunk).
        model_config = vllm_config.model_config
        self.mm_prefix = bool(model_config is not None and model_config.is_mm_prefix_lm)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> HPUAttentionMetadata:
        cm = common_attn_metadata
        num_reqs = cm.num_reqs
        query_lens = np.diff(cm.query_start_loc_cpu[: num_reqs + 1].numpy()).tolist()
        seq_lens = _seq_lens_cpu(cm, num_reqs)
        layout = step_layout.current()
        if layout is None or layout.query_lens != tuple(query_lens):
            # Not planned by the HPU runner (a profiling or dummy run): use the exact shape.
            layout = step_layout.plan_step(
                query_lens=query_lens,
                seq_lens=seq_lens,
                block_size=self.block_size,
                plan=None,
                pack=self.pack_prefills,
            )
        return build_metadata(
            layout=layout,
            seq_lens=seq_lens,
            block_table=self.block_table(cm, layout, seq_lens),
            slot_mapping=cm.slot_mapping[: cm.num_actual_tokens],
            block_size=self.block_size,
            device=self.device,
            image_spans=(cm.mm_req_doc_ranges or {}) if self.mm_prefix else None,
            state_slots=self.state_slots(cm, seq_lens),
        )

    def block_table(
        self, cm: CommonAttentionMetadata, layout: step_layout.StepLayout, seq_lens: list[int]
    ) -> torch.Tensor:
        """The block ids the step's paged attention reads, per request (host tensor)."""
        return host_tables.host_rows(cm.block_table_tensor, cm.num_reqs)

    def state_slots(self, cm: CommonAttentionMetadata, seq_lens: list[int]) -> list[int] | None:
        """Each request's state slot, for state-space layers (None: attention layers)."""
        return None


def _seq_lens_cpu(cm: CommonAttentionMetadata, num_reqs: int) -> list[int]:
    upper = getattr(cm, "seq_lens_cpu_upper_bound", None)
    src = upper if upper is not None else cm.seq_lens
    return src[:num_reqs].tolist()  # an integer tensor: Python ints already


_NO_TOKENS = torch.empty(0, dtype=torch.int64)


def build_metadata(
    *,
    layout: step_layout.StepLayout,
    seq_lens: list[int],
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
    device: torch.device,
    image_spans: dict[int, list[tuple[int, int]]] | None = None,
    state_slots: list[int] | None = None,
) -> HPUAttentionMetadata:
    """Turn a planned step layout into the index tensors the attention kernels consume.

    `image_spans` (mm prefix LMs only, else None): request index -> inclusive (first, last)
    positions of its images' tokens, which attend each other both ways. `state_slots` (state-
    space layers only, else None): request index -> its state slot; fills the `state_*` fields.

    All index arithmetic is vectorized in numpy (one pass per part, no per-sequence tensor ops):
    it runs every step, on the host, before the forward pass.
    """
    query_lens = np.asarray(layout.query_lens, dtype=np.int64)
    seq = np.asarray(seq_lens, dtype=np.int64)
    ctx_lens = seq - query_lens
    starts = np.zeros(len(query_lens) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=starts[1:])
    total = layout.num_tokens_padded
    table = block_table.numpy()  # block ids (int32 from vLLM), gathered into int64 arrays
    cell_to_token = np.full(total, -1, dtype=np.int64)

    md = HPUAttentionMetadata(
        layout=layout,
        num_actual_tokens=int(starts[-1]),
        slot_mapping=slot_mapping,
        cell_to_token=_NO_TOKENS,  # both set below, once the layout's cells are all known
        token_to_cell=_NO_TOKENS,
    )

    prefill = layout.prefill
    if prefill is not None:
        rows, qb, cb = prefill.rows, prefill.query_bucket, prefill.ctx_bucket
        kv_len = cb * block_size + qb
        members = np.array([i for row in prefill.row_members for i in row], dtype=np.int64)
        # Rows past row_members are padding rows of the bucket.
        row_sizes = [len(row) for row in prefill.row_members]
        row_of = np.repeat(np.arange(len(row_sizes), dtype=np.int64), row_sizes)
        q = query_lens[members]
        c = ctx_lens[members]
        n_blk = -(-c // block_size)
        # Offsets of each member inside its row: query columns and context blocks.
        col = _offsets_within_rows(q, row_of)
        blk = _offsets_within_rows(n_blk, row_of)

        # Context blocks: row r holds its members' blocks back to back.
        ctx_blocks = np.zeros((rows, max(cb, 0)), dtype=np.int64)
        m_rep = np.repeat(np.arange(len(members)), n_blk)
        j = np.arange(m_rep.size) - np.repeat(np.cumsum(n_blk) - n_blk, n_blk)
        if n_blk.sum():
            ctx_blocks[row_of[m_rep], blk[m_rep] + j] = table[members[m_rep], j]

        # Owner (-1: padding) and absolute position of every query cell and key slot.
        q_seq = np.full((rows, qb), -1, dtype=np.int64)
        q_pos = np.zeros((rows, qb), dtype=np.int64)
        k_seq = np.full((rows, kv_len), -2, dtype=np.int64)
        k_pos = np.zeros((rows, kv_len), dtype=np.int64)
        t_rep = np.repeat(np.arange(len(members)), q)  # member of each new token
        t_off = np.arange(t_rep.size) - np.repeat(np.cumsum(q) - q, q)
        r_t, col_t = row_of[t_rep], col[t_rep] + t_off
        q_seq[r_t, col_t] = members[t_rep]
        q_pos[r_t, col_t] = c[t_rep] + t_off
        k_seq[r_t, cb * block_size + col_t] = members[t_rep]
        k_pos[r_t, cb * block_size + col_t] = c[t_rep] + t_off
        cell_to_token[r_t * qb + col_t] = starts[members[t_rep]] + t_off
        c_rep = np.repeat(np.arange(len(members)), c)  # member of each cached token
        c_off = np.arange(c_rep.size) - np.repeat(np.cumsum(c) - c, c)
        k_seq[row_of[c_rep], blk[c_rep] * block_size + c_off] = members[c_rep]
        k_pos[row_of[c_rep], blk[c_rep] * block_size + c_off] = c_off

        # Padding queries attend to their own (padding) key only: finite, and never read. A
        # per-column negative id shared by the cell and its key column says so in the mask.
        pad_r, pad_c = np.nonzero(q_seq < 0)
        q_seq[pad_r, pad_c] = -3 - pad_c
        k_seq[pad_r, cb * block_size + pad_c] = -3 - pad_c

        # Lag of each context block: first new position of its owner minus its last position.
        lag = np.full((rows, max(cb, 0)), UNUSED_LAG, dtype=np.int64)
        if n_blk.sum():
            last = np.minimum((j + 1) * block_size, c[m_rep]) - 1
            lag[row_of[m_rep], blk[m_rep] + j] = c[m_rep] - last
        valid = np.full(rows, qb, dtype=np.int64)  # padding rows: any length >= 1 stays finite
        valid[row_of] = 0
        np.add.at(valid, row_of, q)

        md.prefill_packed = any(len(row) > 1 for row in prefill.row_members)
        md.prefill_ctx_blocks = torch.from_numpy(ctx_blocks).to(device)
        md.prefill_q_seq = torch.from_numpy(q_seq).to(device)
        md.prefill_k_seq = torch.from_numpy(k_seq).to(device)
        md.prefill_q_pos = torch.from_numpy(q_pos).to(device)
        md.prefill_k_pos = torch.from_numpy(k_pos).to(device)
        md.prefill_ctx_lag = torch.from_numpy(lag).to(device)
        md.prefill_valid_lens = torch.from_numpy(valid).to(device)
        if image_spans is not None:
            reach = _query_reach(q_pos, image_spans, members, row_of, col, c, q)
            md.prefill_q_reach = torch.from_numpy(reach).to(device)

    decode = layout.decode
    if decode is not None:
        base = prefill.rows * prefill.query_bucket if prefill is not None else 0
        nb = decode.blocks_bucket
        members = np.asarray(decode.members, dtype=np.int64)
        lens = seq[members]
        n_blk = -(-lens // block_size)
        used = int(n_blk.sum())
        m_rep = np.repeat(np.arange(len(members)), n_blk)
        j = np.arange(used) - np.repeat(np.cumsum(n_blk) - n_blk, n_blk)
        block_list = np.zeros(nb, dtype=np.int64)
        block_list[:used] = table[members[m_rep], j]
        groups = np.full(nb, decode.batch_bucket, dtype=np.int64)
        groups[:used] = m_rep
        usage = np.zeros(nb, dtype=np.int64)
        usage[:used] = block_size
        usage[np.cumsum(n_blk) - 1] = lens - (n_blk - 1) * block_size
        if prefill is not None:  # decode only: the cells are the tokens (set below)
            cell_to_token[base + np.arange(len(members))] = starts[members]
        md.decode_block_list = torch.from_numpy(block_list).to(device)
        md.decode_block_groups = torch.from_numpy(groups).to(device)
        md.decode_block_usage = torch.from_numpy(usage).to(device)
        start = np.zeros(nb, dtype=np.int64)
        start[:used] = j * block_size
        query_pos = np.zeros(nb, dtype=np.int64)
        query_pos[:used] = lens[m_rep] - 1
        md.decode_block_start = torch.from_numpy(start).to(device)
        md.decode_query_pos = torch.from_numpy(query_pos).to(device)

    if prefill is None:
        # Decode only: every request is a decode member, in batch order, and the padding cells
        # follow, so cell i is token i.
        cells = torch.arange(total, device=device)
        md.identity_layout, md.cell_to_token, md.token_to_cell = True, cells, cells
    else:
        # Padding cells take the padding token indices at the tail, in order: a permutation.
        free = cell_to_token < 0
        cell_to_token[free] = np.arange(int(starts[-1]), total)
        token_to_cell = np.empty_like(cell_to_token)
        token_to_cell[cell_to_token] = np.arange(total)
        md.identity_layout = bool((cell_to_token == np.arange(total)).all())
        md.cell_to_token = torch.from_numpy(cell_to_token).to(device)
        md.token_to_cell = torch.from_numpy(token_to_cell).to(device)
    if state_slots is not None:
        state_fields(md, np.asarray(state_slots, dtype=np.int64), query_lens, ctx_lens, device)
    if layout.parts is not None:
        parts = []
        for one in layout.parts.passes:
            requests = one.requests
            parts.append(
                build_metadata(
                    layout=one.layout,
                    seq_lens=[seq_lens[r] for r in requests],
                    block_table=block_table[list(requests)],
                    slot_mapping=slot_mapping[list(one.tokens)],
                    block_size=block_size,
                    device=device,
                    image_spans=None
                    if image_spans is None
                    else {i: image_spans[r] for i, r in enumerate(requests) if r in image_spans},
                    state_slots=None if state_slots is None else [state_slots[r] for r in requests],
                )
            )
        md.parts = tuple(parts)
    return md


def _query_reach(
    q_pos: np.ndarray,
    image_spans: dict[int, list[tuple[int, int]]],
    members: np.ndarray,
    row_of: np.ndarray,
    col: np.ndarray,
    ctx: np.ndarray,
    new: np.ndarray,
) -> np.ndarray:
    """Last position each prefill query cell attends: its own, or the last of the image span
    holding it. A member's new tokens sit at columns col.. of its row, positions ctx..ctx+new."""
    reach = q_pos.copy()
    for m, request in enumerate(members.tolist()):
        for first, last in image_spans.get(request, ()):
            lo, hi = max(first, int(ctx[m])), min(last, int(ctx[m] + new[m]) - 1)
            if lo <= hi:
                start = int(col[m]) + lo - int(ctx[m])
                reach[row_of[m], start : start + hi - lo + 1] = last
    return reach


def _offsets_within_rows(sizes: np.ndarray, row_of: np.ndarray) -> np.ndarray:
    """Start of each item inside its row when a row's items are laid out back to back (items
    of one row are consecutive, in order)."""
    ends = np.cumsum(sizes)
    starts = ends - sizes
    first = np.r_[True, row_of[1:] != row_of[:-1]]
    row_start = np.maximum.accumulate(np.where(first, starts, 0))
    return starts - row_start


def state_fields(
    md: HPUAttentionMetadata,
    slots: np.ndarray,
    query_lens: np.ndarray,
    ctx_lens: np.ndarray,
    device: torch.device,
) -> None:
    """Fill the `state_*` fields of `md`: a state-space layer scans each prefill row as one
    sequence (the runner plans one request per row for models with such layers:
    `BucketPlan.pack_prefills`), and each request of a packed row on its own."""
    layout = md.layout
    prefill, decode = layout.prefill, layout.decode
    if prefill is not None and md.prefill_packed:
        # Requests sharing a row (a step no bucket holds row by row): per request, its row, first
        # column, new tokens, slot and stored-state flag; the layer scans each on its own.
        members = np.array([i for row in prefill.row_members for i in row], dtype=np.int64)
        row_of = np.repeat(
            np.arange(len(prefill.row_members)), [len(r) for r in prefill.row_members]
        )
        q = query_lens[members]
        col = _offsets_within_rows(q, row_of)
        md.state_packed = tuple(
            (int(r), int(c), int(n), int(slots[m]), bool(ctx_lens[m] > 0))
            for r, c, n, m in zip(row_of, col, q, members)
        )
    elif prefill is not None:
        members = np.array([row[0] for row in prefill.row_members], dtype=np.int64)
        rows = prefill.rows
        slot = np.zeros(rows, dtype=np.int64)
        lens = np.zeros(rows, dtype=np.int64)
        initial = np.zeros(rows, dtype=np.float32)
        n = len(members)
        slot[:n], lens[:n] = slots[members], query_lens[members]
        initial[:n] = ctx_lens[members] > 0
        md.state_slots_prefill = torch.from_numpy(slot).to(device)
        md.state_lens_prefill = torch.from_numpy(lens).to(device)
        md.state_initial_prefill = torch.from_numpy(initial).to(device)
    if decode is not None:
        members = np.asarray(decode.members, dtype=np.int64)
        slot = np.zeros(decode.batch_bucket, dtype=np.int64)
        initial = np.zeros(decode.batch_bucket, dtype=np.float32)
        slot[: len(members)] = slots[members]
        initial[: len(members)] = ctx_lens[members] > 0  # a one-token prompt starts from zeros
        md.state_slots_decode = torch.from_numpy(slot).to(device)
        md.state_initial_decode = torch.from_numpy(initial).to(device)
