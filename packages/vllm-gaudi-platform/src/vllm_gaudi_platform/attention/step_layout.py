"""How one scheduler step is laid out in static, bucketed shapes.

A step is split into a prefill part (requests with more than one new token) and a decode part (one
new token each). Each part is padded to a bucket of the plan:

- prefill: bucket (batch, query_len, ctx_blocks). One request per grid row when a bucket fits the
  batch; otherwise all prefill requests are packed into ONE row (bucket (1, sum of query lengths,
  sum of context blocks)), which always fits the plan's batch-size-1 buckets because the scheduler
  never schedules more tokens than the prefill query buckets cover. The attention mask keeps packed
  requests apart, so both layouts compute the same result.
- decode: bucket (batch, 1, total context blocks of the batch), as Gaudi's paged decode reads a
  flat list of blocks.

A shape that no bucket covers runs at its exact size and is reported as not warmed (a recompile
on Gaudi). This module is pure Python (no torch) so the bucket arithmetic is cheap to test.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field

from vllm_gaudi_platform.bucketing import PACKED_CONTEXT_FACTOR, Bucket, BucketPlan, can_pack


@dataclass(frozen=True)
class PrefillPart:
    rows: int
    query_bucket: int
    ctx_bucket: int
    row_members: tuple[tuple[int, ...], ...]  # request indices (batch order) per grid row
    bucket: Bucket
    warmed: bool


@dataclass(frozen=True)
class DecodePart:
    batch_bucket: int
    blocks_bucket: int
    members: tuple[int, ...]  # request indices (batch order)
    bucket: Bucket
    warmed: bool


@dataclass(frozen=True)
class StepLayout:
    query_lens: tuple[int, ...]
    prefill: PrefillPart | None
    decode: DecodePart | None
    # A step the runner runs as several forward passes, each on a bucket (see `split_passes`).
    parts: SplitStep | None = field(default=None, compare=False)

    @property
    def num_tokens_padded(self) -> int:
        """The step's tokens with padding: its parts' cells, and room for the largest pass."""
        n = 0
        if self.prefill is not None:
            n += self.prefill.rows * self.prefill.query_bucket
        if self.decode is not None:
            n += self.decode.batch_bucket
        if self.parts is not None:
            n = max(n, *(p.layout.num_tokens_padded for p in self.parts.passes))
        return n

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        """The buckets the step runs: one per part, or one per pass of a step run in passes."""
        if self.parts is not None:
            return tuple(b for p in self.parts.passes for b in p.layout.buckets)
        return tuple(p.bucket for p in (self.prefill, self.decode) if p is not None)

    @property
    def warmed(self) -> bool:
        if self.parts is not None:
            return all(p.layout.warmed for p in self.parts.passes)
        return all(p.warmed for p in (self.prefill, self.decode) if p is not None)


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def with_packed_context(
    plan: BucketPlan, factor: int = PACKED_CONTEXT_FACTOR, *, packed_rows: tuple[int, int] = (0, 0)
) -> BucketPlan:
    """Add the single-row prompt buckets that packed prefills need.

    A packed row holds the context blocks of all its requests, so its context can exceed one
    sequence's maximum. For every single-row query bucket this adds context buckets doubling from
    the plan's largest up to `factor` times it, so that a step with several chunked or
    prefix-cached prefills still finds a warmed shape. Its new tokens can exceed one sequence's
    maximum too, when the token budget is above max_model_len (`packed_rows`: the budget and
    max_model_len): query buckets above max_model_len, doubling from the plan's largest up to the
    budget, are added at every context of the single-row buckets; only packed rows can fill them
    (`packed_only`). Below max_model_len the plan's query range is kept as it is. A plan read
    from a bucket file is kept exactly as the operator wrote it; a fitted plan already holds its
    packed-prefill bucket.
    """
    if plan.strategy in ("file", "fitted"):
        return plan
    singles = [b for b in plan.prompt if b.batch_size == 1]
    if not singles:
        return plan
    top = max(b.ctx_blocks for b in singles)
    extra_ctx, c = [], max(top, 1) * 2
    while c <= max(top, 1) * factor:
        extra_ctx.append(c)
        c *= 2
    queries = sorted({b.query_len for b in singles})
    extra = [Bucket("prompt", 1, q, c) for q in queries for c in extra_ctx]
    budget, longest = packed_rows
    longer, q = [], queries[-1] * 2
    while q < budget:
        longer.append(q)
        q *= 2
    longer = [q for q in (*longer, budget) if q > max(longest, queries[-1])]
    contexts = sorted({b.ctx_blocks for b in singles} | set(extra_ctx))
    extra += [Bucket("prompt", 1, q, c) for q in longer for c in contexts]
    return dataclasses.replace(plan, prompt=(*plan.prompt, *extra))


def packed_only(bucket: Bucket, max_model_len: int) -> bool:
    """A single-row prompt bucket with more new tokens than one sequence can have: only rows
    packed with several prompts reach it, so warmup runs its packed variant alone."""
    return can_pack(bucket) and bucket.query_len > max_model_len


def plan_prefill(
    members: list[int],
    query_lens: list[int],
    ctx_lens: list[int],
    block_size: int,
    plan: BucketPlan | None,
    pack: bool = True,
) -> PrefillPart:
    n = len(members)
    max_q = max(query_lens[i] for i in members)
    max_ctx = max(_blocks(ctx_lens[i], block_size) for i in members)
    if plan is not None:
        b = plan.find_prompt(n, max_q, max_ctx)
        if b is not None:
            rows = tuple((i,) for i in members)
            return PrefillPart(b.batch_size, b.query_len, b.ctx_blocks, rows, b, True)
    total_q = sum(query_lens[i] for i in members)
    capacity = max((b.batch_size * b.query_len for b in plan.prompt), default=0) if plan else 0
    if not pack and n * max_q <= max(capacity, total_q):
        # One request per row even where no bucket has that many rows: the exact shape, as
        # long as the padded rows fit the largest bucket's tokens; else packed at the exact
        # shape (a state-space layer then scans each request on its own: not warmed).
        exact = Bucket("prompt", n, max_q, max_ctx)
        return PrefillPart(n, max_q, max_ctx, tuple((i,) for i in members), exact, False)
    total_ctx = sum(_blocks(ctx_lens[i], block_size) for i in members)
    packed = (tuple(members),)
    if plan is not None and pack:
        b = plan.find_prompt(1, total_q, total_ctx)
        if b is not None:
            return PrefillPart(1, b.query_len, b.ctx_blocks, packed, b, True)
    exact = Bucket("prompt", 1, total_q, total_ctx)
    return PrefillPart(1, total_q, total_ctx, packed, exact, False)


def plan_decode(
    members: list[int], seq_lens: list[int], block_size: int, plan: BucketPlan | None
) -> DecodePart:
    n = len(members)
    total_blocks = sum((seq_lens[i] + block_size - 1) // block_size for i in members)
    if plan is not None:
        b = plan.find_decode(n, total_blocks)
        if b is not None:
            return DecodePart(b.batch_size, b.ctx_blocks, tuple(members), b, True)
    exact = Bucket("decode", n, 1, total_blocks)
    return DecodePart(n, total_blocks, tuple(members), exact, False)


def plan_step(
    *,
    query_lens: list[int],
    seq_lens: list[int],
    block_size: int,
    plan: BucketPlan | None,
    pack: bool | None = None,
) -> StepLayout:
    """Lay out a step. `seq_lens` count context plus this step's tokens, per request. `pack`:
    whether prompts that fit no bucket row by row may share one row (default: the plan's
    `pack_prefills`, True without a plan)."""
    if pack is None:
        pack = plan is None or plan.pack_prefills
    ctx_lens = [s - q for s, q in zip(seq_lens, query_lens)]
    prefill_members = [i for i, q in enumerate(query_lens) if q > 1]
    decode_members = [i for i, q in enumerate(query_lens) if q == 1]
    prefill = (
        plan_prefill(prefill_members, list(query_lens), ctx_lens, block_size, plan, pack)
        if prefill_members
        else None
    )
    decode = plan_decode(decode_members, seq_lens, block_size, plan) if decode_members else None
    return StepLayout(tuple(query_lens), prefill, decode)


@dataclass(frozen=True)
class Pass:
    """One forward pass of a step run in passes: a one-part layout over its own requests,
    renumbered from 0, and which of the step's requests and tokens it takes (in its order)."""

    layout: StepLayout
    requests: tuple[int, ...]
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class SplitStep:
    """A step run as several forward passes: prefill passes first, then the decode pass."""

    passes: tuple[Pass, ...]


def split_passes(
    layout: StepLayout, seq_lens: list[int], block_size: int, plan: BucketPlan | None
) -> StepLayout:
    """`layout` with `parts` set when it runs better as several forward passes, each a warmed
    bucket of the plan (and its HPU graph), than as one:

    - a mixed step (prefill and decode requests): on a Gaudi one pass over both parts is a shape
      no bucket covers (the model's layers see prefill cells plus decode cells, a sum warmup
      never ran); a prefill pass and a decode pass are each exactly a warmed bucket;
    - prompts that must not share a row (a plan without packing: a model with state-space
      layers) and that no bucket holds row by row: they run in groups of rows that buckets hold
      (`_row_groups`), instead of once at an unwarmed shape.

    A pass reads its requests' tokens gathered in its order: the batch is not sorted (the
    attention builder asks vLLM for no reordering), so prefills and decodes may interleave.
    Returns `layout` unchanged when it runs as one pass.
    """
    prefill, decode = layout.prefill, layout.decode
    groups = _row_groups(layout, seq_lens, block_size, plan)
    if groups is None:
        if prefill is None or decode is None:
            return layout
        groups = [[i for row in prefill.row_members for i in row]]
    starts = [0]
    for q in layout.query_lens:
        starts.append(starts[-1] + q)
    query_lens = list(layout.query_lens)
    # Rows in groups (`_row_groups`): each group finds its bucket. Else one pass of the part.
    ctx_lens = [s - q for s, q in zip(seq_lens, query_lens)] if len(groups) > 1 else []
    passes = []
    for requests in groups:
        part = prefill
        assert part is not None
        if ctx_lens:
            part = plan_prefill(requests, query_lens, ctx_lens, block_size, plan, pack=False)
        renumber = {r: k for k, r in enumerate(requests)}
        rows = tuple(tuple(renumber[i] for i in row) for row in part.row_members)
        one = StepLayout(
            tuple(layout.query_lens[i] for i in requests),
            dataclasses.replace(part, row_members=rows),
            None,
        )
        tokens = tuple(t for r in requests for t in range(starts[r], starts[r + 1]))
        passes.append(Pass(one, tuple(requests), tokens))
    if decode is not None:
        one = StepLayout(
            (1,) * len(decode.members),
            None,
            dataclasses.replace(decode, members=tuple(range(len(decode.members)))),
        )
        passes.append(Pass(one, decode.members, tuple(starts[r] for r in decode.members)))
    return dataclasses.replace(layout, parts=SplitStep(tuple(passes)))


def _row_groups(
    layout: StepLayout, seq_lens: list[int], block_size: int, plan: BucketPlan | None
) -> list[list[int]] | None:
    """The prefill requests in groups that each fill a warmed bucket row by row, when the plan
    forbids packing and no bucket holds them all; None otherwise (or when one request fits no
    bucket even alone: the step then runs at its exact shape, counted). First fit in batch
    order: each request joins the first group a bucket still holds with it, else starts one."""
    prefill = layout.prefill
    if plan is None or plan.pack_prefills or prefill is None or prefill.warmed:
        return None
    q = layout.query_lens
    ctx = [_blocks(s - n, block_size) for s, n in zip(seq_lens, q)]
    groups: list[list[int]] = []
    # The groups that may still grow, each with its longest query and widest context.
    open_groups: list[tuple[list[int], int, int]] = []
    for i in (i for row in prefill.row_members for i in row):
        k = next(
            (
                k
                for k, (group, longest, widest) in enumerate(open_groups)
                if plan.find_prompt(len(group) + 1, max(longest, q[i]), max(widest, ctx[i]))
            ),
            None,
        )
        if k is None:
            if plan.find_prompt(1, q[i], ctx[i]) is None:
                return None
            groups.append([])
            open_groups.append((groups[-1], 0, 0))
            k = len(open_groups) - 1
        group, longest, widest = open_groups[k]
        group.append(i)
        longest, widest = max(longest, q[i]), max(widest, ctx[i])
        if plan.find_prompt(len(group) + 1, longest, widest) is None:
            del open_groups[k]  # no bucket holds one more row, even of the shortest prompt
        else:
            open_groups[k] = (group, longest, widest)
    return groups if len(groups) > 1 else None


def layout_for_bucket(
    bucket: Bucket, block_size: int, *, packed: bool = False, max_model_len: int = 0
) -> tuple[StepLayout, list[int]]:
    """A synthetic step that fills `bucket` exactly (for warmup), and its sequence lengths.

    `packed`: a single-row prompt bucket holding two sequences (query and context blocks split
    between them), the packed-prefill variant whose attention takes another branch; more than
    two where one sequence in two would be longer than `max_model_len` (when given), so that
    every warmup sequence is one the engine could schedule.
    """
    if packed:
        if not can_pack(bucket):
            raise ValueError(f"{bucket} has no packed variant (one row of >= 2 query tokens)")
        q, c = bucket.query_len, bucket.ctx_blocks
        n = 2
        if max_model_len:
            n = min(q, max(2, -(-(q + c * block_size) // max_model_len)))
        query_lens = [q // n + (i < q % n) for i in range(n)]
        ctx = [c // n + (i < c % n) for i in range(n)]
        seq_lens = [query_lens[i] + ctx[i] * block_size for i in range(n)]
        prefill = PrefillPart(1, q, c, (tuple(range(n)),), bucket, True)
        return StepLayout(tuple(query_lens), prefill, None), seq_lens
    if bucket.phase != "decode":  # prompt and verify buckets are prefill-shaped
        n, q, c = bucket.batch_size, bucket.query_len, bucket.ctx_blocks
        query_lens = [q] * n
        seq_lens = [q + c * block_size] * n
        rows = tuple((i,) for i in range(n))
        prefill = PrefillPart(n, q, c, rows, bucket, True)
        return StepLayout(tuple(query_lens), prefill, None), seq_lens
    n, blocks = bucket.batch_size, bucket.ctx_blocks
    per_seq = max(blocks // n, 1)
    query_lens = [1] * n
    seq_lens = [per_seq * block_size] * n
    decode = DecodePart(n, blocks, tuple(range(n)), bucket, True)
    return StepLayout(tuple(query_lens), None, decode), seq_lens


_local = threading.local()


def set_current(layout: StepLayout | None) -> None:
    """The runner publishes the layout of the step it is about to run for the metadata builder."""
    _local.layout = layout


def current() -> StepLayout | None:
    return getattr(_local, "layout", None)
