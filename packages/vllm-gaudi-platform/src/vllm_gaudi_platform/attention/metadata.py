"""The HPU attention metadata: the index tensors one step's attention reads, all of shapes fixed
by the step's buckets.

- `HPUAttentionMetadata`: the step's tensors, and what the layers derive from them: the narrowing
  of the block gathers to a sliding window or to the current chunk of chunked local attention
  (`prefill_keys_for`, `decode_blocks_for`, bounded by `window_blocks`), the boolean mask of each
  prefill query slice (`prefill_slice_mask`), and
  any other per-step mask (`derived`). Each is built by the first layer that asks and reused by
  every later layer of the step with the same parameters, so the mask work of a step does not
  grow with the number of layers;
- `window_blocks`: the most blocks a sliding window touches.

How a step's metadata is built is `metadata_builder.py`.

The decoder attention (`impl.py`) and latent attention (`mla.py`) both read this metadata.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import torch

from vllm_gaudi_platform.attention import step_layout

T = TypeVar("T")
# Largest total of per-step masks kept for the later layers of a step (HPUAttentionMetadata.
# derived). Masks of one prefill slice are [rows, 1, slice, keys] booleans (float32 per head
# with ALiBi): the budget holds every slice of prompts up to several thousand tokens.
SHARED_MASK_BYTES = 256 << 20


@dataclass
class HPUAttentionMetadata:
    """Everything one step's attention needs; all tensors have bucket-determined shapes."""

    # vLLM's MLA layer splits a step by these counts; the HPU MLA backend (mla.py) takes every
    # token in one call, the step's parts laid out as below, so it reports no decode tokens.
    num_decodes: ClassVar[int] = 0
    num_decode_tokens: ClassVar[int] = 0
    num_prefills: ClassVar[int] = 1

    layout: step_layout.StepLayout
    num_actual_tokens: int
    slot_mapping: torch.Tensor  # [num_actual_tokens] flat cache slot of each real token
    cell_to_token: torch.Tensor  # [num_tokens_padded] flat token index of each layout cell
    token_to_cell: torch.Tensor  # [num_tokens_padded] inverse permutation
    identity_layout: bool = False  # cells already in token order: no reordering needed
    # prefill part (None when the step has none)
    prefill_ctx_blocks: torch.Tensor | None = None  # [rows, ctx_bucket] block ids
    # Owner of each query cell / key column: the request index; -2 for unused context slots; a
    # padding query cell and its own key column share a unique negative id (it sees only itself).
    prefill_q_seq: torch.Tensor | None = None  # [rows, q_bucket]
    prefill_k_seq: torch.Tensor | None = None  # [rows, ctx_bucket*bs + q_bucket]
    # Per context block slot: owner's first new position minus the block's last position (huge
    # for unused slots). A window w reaches into the block iff this is below w.
    prefill_ctx_lag: torch.Tensor | None = None  # [rows, ctx_bucket]
    prefill_valid_lens: torch.Tensor | None = None  # [rows] new tokens per row (>= 1)
    # Models vLLM calls "mm prefix LMs" (Gemma 3 with images): the last position each query cell
    # attends, its own or the end of the image span that holds it (bidirectional attention among
    # an image's tokens). None for every other model; set on every prefill step of such a model
    # (its own positions on text), so a graph's branch does not depend on the step's content.
    prefill_q_reach: torch.Tensor | None = None  # [rows, q_bucket]
    # Some row holds more than one sequence: the causal fast path and window narrowing are off.
    prefill_packed: bool = False
    # Chunked local attention (Llama 4's attention_chunk_size; None for every other layer): a
    # query at position p attends keys from position (p // chunk) * chunk up to p only. Set on
    # the metadata of the layers that have it (their own attention group: chunked_local.py).
    attention_chunk: int | None = None
    # decode part (None when the step has none)
    decode_block_list: torch.Tensor | None = None  # [num_blocks_bucket]
    decode_block_groups: torch.Tensor | None = None  # [num_blocks_bucket] sequence of each block
    decode_block_usage: torch.Tensor | None = None  # [num_blocks_bucket] used slots (0: padding)
    # Absolute positions (masks are built per slice, per window, from these)
    prefill_q_pos: torch.Tensor | None = None  # [rows, q_bucket]
    prefill_k_pos: torch.Tensor | None = None  # [rows, ctx_bucket*bs + q_bucket]
    decode_block_start: torch.Tensor | None = None  # [num_blocks_bucket] first slot's position
    decode_query_pos: torch.Tensor | None = None  # [num_blocks_bucket] position being decoded
    # State-space layers (Mamba2, `state_fields`): per prefill row and per decode cell, the
    # request's state slot (0, the null block, for padding), its new tokens (0 for padding) and
    # whether it continues from a stored state (1.0) or starts from zeros (0.0). None for
    # attention layers.
    state_slots_prefill: torch.Tensor | None = None  # [rows]
    state_lens_prefill: torch.Tensor | None = None  # [rows]
    state_initial_prefill: torch.Tensor | None = None  # [rows] float32
    state_slots_decode: torch.Tensor | None = None  # [batch_bucket]
    state_initial_decode: torch.Tensor | None = None  # [batch_bucket] float32
    # A packed prefill row (no bucket holds the step row by row): per request (row, first
    # column, new tokens, slot, continues from a stored state). Host data: an unwarmed shape.
    state_packed: tuple[tuple[int, int, int, int, bool], ...] | None = None
    # A step run as several forward passes (`StepLayout.parts`): each pass's own metadata,
    # laid out over its own tokens only.
    parts: tuple[HPUAttentionMetadata, ...] | None = None
    # Tensors the layers derive from the fields above, built by the first layer that asks and
    # shared by the later ones (see `derived`): per (part, window) the narrowed gather of that
    # window (("decode", "used slots") holds the bare decode slot bias), the prefill slice
    # masks, and the masks impl.py builds itself (ALiBi, encoder-only). Rebuilt when the fields
    # change (graph replays clear it).
    _derived: dict[tuple[Any, ...], Any] = field(default_factory=dict)

    def derived(self, key: tuple[Any, ...], build: Callable[..., T], *args: Any) -> T:
        """The step's tensor named `key`, built by `build(*args)` the first time a layer asks
        and kept for the later layers while the step's kept masks stay within
        SHARED_MASK_BYTES; past that (the slices of a very long prompt), each layer builds its
        own, so a prefill still holds one slice's mask at a time beyond the budget."""
        if key in self._derived:
            return self._derived[key]
        value = build(*args)
        if isinstance(value, torch.Tensor):
            kept = sum(
                v.numel() * v.element_size()
                for v in self._derived.values()
                if isinstance(v, torch.Tensor)
            )
            if kept + value.numel() * value.element_size() > SHARED_MASK_BYTES:
                return value
        self._derived[key] = value
        return value

    def prefill_causal_only(self) -> bool:
        """True when plain causal attention over each row's own new tokens is the whole mask:
        one sequence per row, no context in the bucket, no image spans to see ahead in, and with
        a chunked local attention, every position of the bucket inside the first chunk."""
        p = self.layout.prefill
        return (
            p is not None
            and p.ctx_bucket == 0
            and not self.prefill_packed
            and self.prefill_q_reach is None
            and (self.attention_chunk is None or p.query_bucket <= self.attention_chunk)
        )

    def prefill_keys_for(
        self, window: int | None, block_size: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Context blocks to gather, and owner and position of every key column (context then
        new tokens), for a layer with `window` (None: every context block).

        With a window and one sequence per row, only `window_blocks(window, block_size)` blocks
        per row are gathered (fewer when the bucket has fewer): the last blocks of the row's
        sequence that reach into the window of its first new token. Which blocks depends on the
        data; how many does not. Chunked local attention narrows the same way to the chunk of
        the row's first new token (later chunks of the row hold new tokens only).
        """
        assert self.prefill_ctx_blocks is not None and self.prefill_k_seq is not None
        assert self.prefill_k_pos is not None and self.prefill_ctx_lag is not None
        blocks, k_seq, k_pos = self.prefill_ctx_blocks, self.prefill_k_seq, self.prefill_k_pos
        cb = blocks.shape[1]
        chunk = self.attention_chunk
        if (window is None and chunk is None) or self.prefill_packed:
            return blocks, k_seq, k_pos
        span = min(s for s in (window, chunk) if s is not None)
        keep = min(cb, window_blocks(span, block_size))
        if keep == cb:
            return blocks, k_seq, k_pos
        key = ("prefill", window)
        if key not in self._derived:
            # A row's sequence owns slots [0, n); the blocks wholly behind the window (or before
            # the chunk) are a prefix of those. Start after that prefix, moved left so the slice
            # stays inside the bucket.
            lag = self.prefill_ctx_lag
            far = torch.zeros_like(lag, dtype=torch.bool)
            if window is not None:
                far |= lag >= window
            if chunk is not None:
                assert self.prefill_q_pos is not None
                # A block ends before the chunk of the first new token (position p) iff its
                # lag exceeds p's offset in its chunk.
                far |= lag > (self.prefill_q_pos[:, :1] % chunk)
            behind = (far & (lag < UNUSED_LAG)).sum(dim=1)
            start = behind.clamp(max=cb - keep)
            slots = start[:, None] + torch.arange(keep, device=blocks.device)  # [rows, keep]
            chosen = blocks.gather(1, slots)
            cols = slots[:, :, None] * block_size + torch.arange(block_size, device=blocks.device)
            cols = cols.reshape(blocks.shape[0], keep * block_size)
            new = slice(cb * block_size, None)
            sel_seq = torch.cat([k_seq.gather(1, cols), k_seq[:, new]], dim=1)
            sel_pos = torch.cat([k_pos.gather(1, cols), k_pos[:, new]], dim=1)
            self._derived[key] = (chosen, sel_seq, sel_pos)
        return self._derived[key]

    def prefill_slice_mask(
        self, q0: int, q1: int, window: int | None, block_size: int
    ) -> torch.Tensor:
        """Boolean mask [rows, 1, q1 - q0, keys] of query cells q0..q1 against the key columns
        of `prefill_keys_for(window)` up to the slice's last new token (up to the last new token
        of the bucket with image spans, `prefill_q_reach`): same owner, not in the future (not
        past the query's reach), (with a window) fewer than `window` positions behind, and (with
        chunked local attention) in the query's chunk. Built
        once per step for each slice and window; the attention reads as many keys as the mask
        has columns."""
        return self.derived(
            ("prefill_mask", window, q0, q1), self._build_slice_mask, q0, q1, window, block_size
        )

    def _build_slice_mask(
        self, q0: int, q1: int, window: int | None, block_size: int
    ) -> torch.Tensor:
        assert self.prefill_q_seq is not None and self.prefill_q_pos is not None
        blocks, k_seq, k_pos = self.prefill_keys_for(window, block_size)
        reach = self.prefill_q_reach
        # New-token keys past the slice's last cell are in the future of every query of the
        # slice, unless an image span reaches there.
        keys = blocks.shape[1] * block_size + q1 if reach is None else k_seq.shape[1]
        q_seq = self.prefill_q_seq[:, q0:q1, None]
        q_pos = self.prefill_q_pos[:, q0:q1, None]
        last = q_pos if reach is None else reach[:, q0:q1, None]
        k_pos = k_pos[:, None, :keys]
        mask = (q_seq == k_seq[:, None, :keys]) & (k_pos <= last)
        if window is not None:
            mask &= q_pos - k_pos < window
        if self.attention_chunk is not None:
            mask &= k_pos // self.attention_chunk == q_pos // self.attention_chunk
        return mask[:, None]

    def decode_blocks_for(
        self, window: int | None, batch_bucket: int, block_size: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Block list, block groups and slot bias of the decode part for a layer with `window`.

        The slot bias [entries, block_size] is 0 on a block's used slots and -inf past them: it
        is built on the device from the per-block usage, once per step (the host sends one
        integer per block, not a row of floats). With a window, blocks wholly behind it are
        dropped: the list keeps `batch_bucket * window_blocks(window, block_size)` entries (or
        the bucket's count if smaller), the blocks that reach into some sequence's window first,
        padding after; the slot bias is -inf also on slots `window` or more positions behind the
        query. Chunked local attention narrows the same way to the query's chunk: slots before
        the chunk's first position are masked, and `window_blocks(chunk)` blocks per sequence
        are kept.
        """
        blocks, groups, usage = (
            self.decode_block_list,
            self.decode_block_groups,
            self.decode_block_usage,
        )
        assert blocks is not None and groups is not None and usage is not None
        chunk = self.attention_chunk
        key = ("decode", window or 0)
        if key in self._derived:
            return self._derived[key]
        slot = torch.arange(block_size, device=usage.device)
        base = ("decode", "used slots")
        if base not in self._derived:
            bias = torch.zeros(usage.numel(), block_size, device=usage.device)
            self._derived[base] = bias.masked_fill_(slot[None, :] >= usage[:, None], float("-inf"))
        bias = self._derived[base]
        if window is None and chunk is None:
            self._derived[key] = (blocks, groups, bias)
            return self._derived[key]
        assert self.decode_block_start is not None and self.decode_query_pos is not None
        nb = bias.shape[0]
        pos = self.decode_block_start[:, None] + slot[None, :]
        query = self.decode_query_pos[:, None]
        far = torch.zeros_like(pos, dtype=torch.bool)
        span = min(s for s in (window, chunk) if s is not None)
        if window is not None:
            far |= query - pos >= window
        if chunk is not None:
            far |= pos < query // chunk * chunk  # before the query's chunk
        bias = bias.masked_fill(far, float("-inf"))
        keep = min(nb, batch_bucket * window_blocks(span, block_size))
        if keep < nb:
            # A block reaches into the window iff some used slot is not behind it; each
            # sequence has at most window_blocks such blocks, so `keep` holds them all.
            # Stable order puts them first; the rest of the kept entries are padding or
            # blocks whose slots the bias masks anyway.
            inside = (bias > float("-inf")).any(dim=1) & (groups < batch_bucket)
            order = torch.argsort((~inside).to(torch.int8), stable=True)[:keep]
            blocks, groups, bias = blocks[order], groups[order], bias[order]
            # Padding entries that survive the cut: no group, every slot masked.
            pad = ~inside[order]
            groups = groups.masked_fill(pad, batch_bucket)
            bias = bias.masked_fill(pad[:, None], float("-inf"))
        self._derived[key] = (blocks, groups, bias)
        return self._derived[key]


UNUSED_LAG = 1 << 40  # prefill_ctx_lag of context slots no sequence uses


def window_blocks(window: int, block_size: int) -> int:
    """Most blocks a window of `window` positions can touch: the `window - 1` positions before a
    query plus the query's own, at any offset inside a block."""
    return -(-(window - 1) // block_size) + 1
