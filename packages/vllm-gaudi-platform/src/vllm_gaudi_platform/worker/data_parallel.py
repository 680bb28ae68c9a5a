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
