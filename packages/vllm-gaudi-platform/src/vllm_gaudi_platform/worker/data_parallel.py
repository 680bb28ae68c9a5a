"""One padded bucket per step for all data-parallel ranks.

In a mixture-of-experts model, data-parallel (DP) ranks exchange hidden states inside every MoE
layer, so each step must run on every rank (idle ranks run a dummy step) with shapes the other
ranks expect. On Gaudi a shape is a compiled graph: if each rank padded its own batch to its own
bucket, the exchanged tensors would take shapes that warmup never saw. So the ranks agree each
step on ONE layout: every dimension of the step's buckets (prefill rows, query length, context
blocks; decode batch, decode blocks) is the maximum over the ranks, rounded up to a bucket of the
plan, and each rank pads its own requests into that layout. An idle rank contributes zeros and
runs the agreed buckets with padding only.

The maxima of several ranks' prefill buckets may form no bucket of the plan (one rank with two
rows of 64 tokens, another with one packed row of 256: 2 x 256 exceeds the token budget). Then
every rank packs its prefill requests into ONE row, whose size is the largest packed size of any
rank (total new tokens, total context blocks); that always fits the plan's single-row buckets,
as each rank's own packed row does.

The exchange itself is one all-reduce (MAX) of `shape_vector` over the DP group; everything else
here is pure Python so it is unit-tested without processes.
"""

from __future__ import annotations

from typing import Any

from vllm_gaudi_platform.attention.step_layout import DecodePart, PrefillPart, StepLayout
from vllm_gaudi_platform.bucketing import Bucket, BucketPlan

# shape_vector's entries: prefill rows, query bucket, context blocks; decode batch, blocks;
# the prefill part packed into one row: its new tokens, its context blocks.
SHAPE_LEN = 7
IDLE: tuple[int, ...] = (0,) * SHAPE_LEN


def shape_vector(layout: StepLayout | None, ctx_blocks: list[int] | None = None) -> tuple[int, ...]:
    """The padded dimensions of a step's layout (zeros for a missing part or an idle rank).

    `ctx_blocks`: context blocks per request of the step (for the packed-row size); none when
    the layout has no prefill part.
    """
    if layout is None:
        return IDLE
    p, d = layout.prefill, layout.decode
    members = [i for row in p.row_members for i in row] if p else []
    if members and ctx_blocks is None:
        raise ValueError("shape_vector needs the context blocks of a step with a prefill part")
    return (
        p.rows if p else 0,
        p.query_bucket if p else 0,
        p.ctx_bucket if p else 0,
        d.batch_bucket if d else 0,
        d.blocks_bucket if d else 0,
        sum(layout.query_lens[i] for i in members),
        sum(ctx_blocks[i] for i in members) if ctx_blocks is not None else 0,
    )


def combine(vectors: list[tuple[int, ...]]) -> tuple[int, ...]:
    """Element-wise maximum of the ranks' shape vectors (what the all-reduce MAX computes)."""
    return tuple(max(v[i] for v in vectors) for i in range(SHAPE_LEN))


def agreed_buckets(
    maxima: tuple[int, ...], plan: BucketPlan
) -> tuple[tuple[Bucket, bool] | None, tuple[Bucket, bool] | None]:
    """The prefill and decode buckets every rank runs for element-wise `maxima`, each with
    whether warmup ran it (a bucket of the plan) or not (exact shape: a recompile on Gaudi)."""
    rows, query, ctx, batch, blocks, packed_query, packed_ctx = maxima
    prefill = decode = None
    if rows:
        found = plan.find_prompt(rows, query, ctx)
        if found is None:  # every rank packs its prefill part into one row
            rows, query, ctx = 1, packed_query, packed_ctx
            found = plan.find_prompt(rows, query, ctx)
        prefill = (found, True) if found else (Bucket("prompt", rows, query, ctx), False)
    if batch:
        found = plan.find_decode(batch, blocks)
        decode = (found, True) if found else (Bucket("decode", batch, 1, blocks), False)
    return prefill, decode


def pad_to_agreed(
    layout: StepLayout | None, maxima: tuple[int, ...], plan: BucketPlan
) -> StepLayout:
    """This rank's requests (none for an idle rank) laid out in the buckets all ranks agreed on.

    A part this rank lacks becomes a part of padding only; a part it has keeps its members and
    grows to the agreed bucket (more padding rows, columns, batch slots or blocks).
    """
    prefill_bucket, decode_bucket = agreed_buckets(maxima, plan)
    own_prefill = layout.prefill if layout else None
    own_decode = layout.decode if layout else None
    prefill = decode = None
    if prefill_bucket is not None:
        b, warmed = prefill_bucket
        rows = own_prefill.row_members if own_prefill else ()
        if b.batch_size < len(rows):  # the packed agreement: this rank's requests in one row
            rows = (tuple(i for row in rows for i in row),)
        prefill = PrefillPart(b.batch_size, b.query_len, b.ctx_blocks, rows, b, warmed)
    elif own_prefill is not None:
        raise ValueError("the agreed shape has no prefill part but this rank has one")
    if decode_bucket is not None:
        b, warmed = decode_bucket
        members = own_decode.members if own_decode else ()
        decode = DecodePart(b.batch_size, b.ctx_blocks, members, b, warmed)
    elif own_decode is not None:
        raise ValueError("the agreed shape has no decode part but this rank has one")
    query_lens = layout.query_lens if layout else ()
    return StepLayout(query_lens, prefill, decode)


# ---------------------------------------------------------------------- the runner's DP steps


def agree(
    runner: Any, layout: StepLayout | None, ctx_blocks: list[int] | None = None
) -> StepLayout:
    """This step's layout in the buckets all DP ranks run: one all-reduce (MAX) of the padded
    dimensions over the DP group, every step, on every rank."""
    import torch
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_dp_group

    shape = torch.tensor(shape_vector(layout, ctx_blocks), dtype=torch.int64)
    dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=get_dp_group().cpu_group)
    maxima = tuple(int(x) for x in shape.tolist())
    return pad_to_agreed(layout, maxima, runner.bucket_plan)


def tokens_across_dp(runner: Any, num_tokens: int) -> Any:
    """vLLM's per-DP-rank token counts for the forward context (MoE token exchange): every rank
    runs the same agreed bucket, so every count is this rank's padded count (None without DP)."""
    import torch

    size = runner.parallel_config.data_parallel_size
    if size == 1:
        return None
    return torch.full((size,), num_tokens, dtype=torch.int32)


def run_idle_step(runner: Any) -> None:
    """A step of a DP rank without requests while other DP ranks have some: agree on the step's
    buckets like a busy rank and run them on padding only, so that the MoE token exchange in
    every layer meets the same collectives, shapes and warmed buckets."""
    import torch

    from vllm_gaudi_platform.attention.metadata_builder import build_metadata

    with torch.inference_mode():  # as every serving step and warmup run (see warmup.run_bucket)
        layout = runner._agree_across_dp(None)
        total = layout.num_tokens_padded
        if total == 0:
            return
        runner.recompiles.record(layout)
        metadata = build_metadata(
            layout=layout,
            seq_lens=[],
            block_table=torch.zeros(0, 1, dtype=torch.int32),
            slot_mapping=torch.zeros(0, dtype=torch.int64, device=runner.device),
            block_size=runner.block_size,
            device=runner.device,
            image_spans={} if runner.is_mm_prefix_lm else None,
            state_slots=[] if runner.has_state_layers else None,  # padding: the null slot
        )
        runner._forward_with_metadata(metadata, total, 0, capture=False)
        runner.idle_dp_steps += 1
