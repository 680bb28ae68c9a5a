"""The ``fitted`` strategy (ours, not Intel's): the buckets fitted to a trace of real step shapes
within a graph budget (rules: the package docstring, ``bucketing/__init__.py``)."""

from __future__ import annotations

import bisect
import heapq
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import product

from vllm_gaudi_platform.bucketing.buckets import (
    PACKED_CONTEXT_FACTOR,
    Bucket,
    BucketPlan,
    graph_count,
)
from vllm_gaudi_platform.bucketing.exp import exponential_ranges
from vllm_gaudi_platform.bucketing.grid import grids
from vllm_gaudi_platform.bucketing.limits import Limits
from vllm_gaudi_platform.bucketing.settings import PROMPT_BS, Env
from vllm_gaudi_platform.envs import (
    VLLM_BUCKETING_GRAPH_BUDGET,
    VLLM_BUCKETING_STRATEGY,
    VLLM_BUCKETING_TRACE,
    EnvError,
)
from vllm_gaudi_platform.observability.step_trace import TracedShape, read_trace

logger = logging.getLogger(f"vllm.{__name__}")

FITTED_STRATEGY = "fitted"

# The fit chooses among traced shapes rounded up to FIT_BITS significant bits per dimension (at
# most 1/64 relative padding at 7 bits), fewer bits while a phase has more than FIT_MAX_CELLS
# distinct rounded shapes, so that planning stays around a second; each chosen bucket is then
# lowered to the exact largest shape it serves.
FIT_BITS = 7
FIT_MIN_BITS = 2
FIT_MAX_CELLS = 1000
# Cell evaluations the swap refinement after the greedy choice may spend (about a second): small
# traces reach a swap-optimal choice, large ones keep most of the greedy one.
FIT_SWAP_WORK = 300_000
# A phase whose traced coordinates combine into at most this many buckets chooses among all the
# combinations (an optimal bucket is the largest of the shapes it serves, so its coordinates are
# traced ones); a larger one among the traced shapes and per-batch-size corners.
FIT_GRID_CANDIDATES = 3000
# The four padding columns (prompt tokens, prompt context blocks, decode batch slots, decode
# blocks) are priced so that the fit minimises the sum, over the columns, of each column's padding
# ratio on the trace divided by the default strategy's (exp's) ratio of that column on the same
# trace: no column is given up for the others, and the one exp already pads least weighs most.
# exp's ratio counts as at least FIT_REFERENCE_FLOOR (a column exp pads by 0.5% weighs as one it
# pads by 1%).
FIT_REFERENCE_FLOOR = 0.01
# Steps unlike the traced ones: per prefill batch size, buckets with the batch's largest query at
# contexts 1, R, R**2, ... (R = FIT_CONTEXT_LADDER) below its largest context, so that a prefill
# whose (query, context) the trace did not show pads its context by less than R times rather
# than to the coverage bucket's. They take at most 1/FIT_LADDER_SHARE of the budget left after
# coverage (a ratio R**2, then none, when they would take more).
FIT_CONTEXT_LADDER = 4
FIT_LADDER_SHARE = 4
# The balancing round's exponent (`_fit_graphs`).
FIT_BALANCE_EXPONENT = 0.5


def _round_bits(value: int, bits: int) -> int:
    """``value`` rounded up to a number with at most ``bits`` significant bits."""
    shift = value.bit_length() - bits
    return value if shift <= 0 else -(-value >> shift) << shift


@dataclass
class _Cell:
    """Traced shapes that round to the same coordinates."""

    bucket: Bucket  # the rounded coordinates, a candidate bucket
    top: tuple[int, int, int]  # exact largest (batch, query_len, ctx_blocks) among its shapes
    count: int  # steps


def trace_padding(
    shapes: Mapping[TracedShape, int],
    find_prompt: Callable[[int, int, int], Bucket | None],
    find_decode: Callable[[int, int], Bucket | None],
) -> tuple[list[float], list[float]]:
    """Traced and padded units of the four columns (prompt tokens, prompt context blocks, decode
    batch slots, decode blocks) over ``shapes`` with these lookups (a shape no bucket holds
    counts unpadded)."""
    real = [0.0] * 4
    padded = [0.0] * 4
    for s, n in shapes.items():
        if s.phase == "prompt":
            got = (s.batch_size * s.query_len, s.batch_size * s.ctx_blocks)
            b = find_prompt(s.batch_size, s.query_len, s.ctx_blocks)
            fit = (b.batch_size * b.query_len, b.batch_size * b.ctx_blocks) if b else got
            columns = (0, 1)
        else:
            got = (s.batch_size, s.ctx_blocks)
            b = find_decode(s.batch_size, s.ctx_blocks)
            fit = (b.batch_size, b.ctx_blocks) if b else got
            columns = (2, 3)
        for k, g, f in zip(columns, got, fit):
            real[k] += n * g
            padded[k] += n * f
    return real, padded


def padding_ratios(real: list[float], padded: list[float]) -> list[float]:
    return [p / r - 1 if r else 0.0 for r, p in zip(real, padded)]


def _reference_lookups(
    prompt: list[Bucket], decode: list[Bucket]
) -> tuple[Callable[[int, int, int], Bucket | None], Callable[[int, int], Bucket | None]]:
    """The reference plan's lookups, the decode one by batch size and bisection (a long-context
    trace holds tens of thousands of decode shapes): the plan ranks decode buckets by batch size,
    then blocks."""
    plan = BucketPlan("reference", tuple(prompt), tuple(decode))
    by_batch: dict[int, list[int]] = {}
    for b in plan.decode:
        by_batch.setdefault(b.batch_size, []).append(b.ctx_blocks)
    batches = sorted(by_batch)
    for blocks in by_batch.values():
        blocks.sort()

    def find_decode(batch: int, ctx_blocks: int) -> Bucket | None:
        for size in batches[bisect.bisect_left(batches, batch) :]:
            blocks = by_batch[size]
            i = bisect.bisect_left(blocks, ctx_blocks)
            if i < len(blocks):
                return Bucket("decode", size, 1, blocks[i])
        return None

    return plan.find_prompt, find_decode


def _price(b: Bucket, prices: tuple[float, ...]) -> float:
    if b.phase == "prompt":
        return b.batch_size * (b.query_len * prices[0] + b.ctx_blocks * prices[1])
    return b.batch_size * prices[2] + b.ctx_blocks * prices[3]


def _covers(b: Bucket, c: Bucket) -> bool:
    return (
        b.phase == c.phase
        and b.batch_size >= c.batch_size
        and b.query_len >= c.query_len
        and b.ctx_blocks >= c.ctx_blocks
    )


def fit_buckets(
    trace: Mapping[TracedShape, int],
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    block_size: int,
    num_kv_blocks: int | None = None,
    budget: int,
    max_prefill_batch: int = 1,
) -> BucketPlan:
    """The fitted plan: at most ``budget`` graphs (``graph_count``) whose buckets cover every
    legal step and minimise the padding of the traced steps (``trace``: shape -> number of steps).

    Raises EnvError naming VLLM_BUCKETING_GRAPH_BUDGET when the budget is below the buckets that
    coverage needs. Shapes no step within the engine limits can have are dropped with a warning.
    """
    lim = Limits(max_num_seqs, max_num_batched_tokens, max_model_len, block_size, num_kv_blocks)
    env = Env({PROMPT_BS.var("MAX"): str(max_prefill_batch)})
    return _fit_graphs(trace, lim, budget, max_prefill_batch, _exp_buckets(env, lim))


def _exp_buckets(env: Env, lim: Limits) -> tuple[list[Bucket], list[Bucket]]:
    """exp's buckets for these limits: the reference the fit's prices are relative to, and
    (``graph_count``) its default budget."""
    return grids(exponential_ranges(env, lim, FITTED_STRATEGY, VLLM_BUCKETING_TRACE), lim)


def _fit_graphs(
    trace: Mapping[TracedShape, int],
    lim: Limits,
    budget: int,
    prefill_bs: int,
    reference: tuple[list[Bucket], list[Bucket]],
) -> BucketPlan:
    """The fitted plan within ``budget`` graphs, its prices relative to ``reference`` (exp's
    buckets), then one balancing round: each column whose padding relative to the reference's
    is above the mean of the columns' has its price raised by the square root of the excess,
    and the refit replaces the fit if its worst relative column is lower."""
    problem = _prepare(trace, lim, prefill_bs)
    if budget < len(problem.fixed):
        raise EnvError(
            f"{VLLM_BUCKETING_GRAPH_BUDGET}={budget} is below the {len(problem.fixed)} buckets "
            "the fitted plan needs to cover every step (the largest decode shape and, for each "
            "prefill batch size up to VLLM_PROMPT_BS_BUCKET_MAX, the largest prompt shape); "
            f"raise it to at least {len(problem.fixed)} or unset it."
        )
    real, padded = trace_padding(problem.shapes, *_reference_lookups(*reference))
    scale = [max(e, FIT_REFERENCE_FLOOR) for e in padding_ratios(real, padded)]
    traced = [k for k in range(4) if real[k]]
    base = [1 / (real[k] * scale[k]) if real[k] else 1.0 for k in range(4)]

    def relative(plan: BucketPlan) -> list[float]:
        got = padding_ratios(*trace_padding(problem.shapes, plan.find_prompt, plan.find_decode))
        return [got[k] / scale[k] if real[k] else 0.0 for k in range(4)]

    plan = _fit_within(problem, budget, _prices(base, (1.0,) * 4))
    worst = relative(plan)
    mean = sum(worst[k] for k in traced) / len(traced) if traced else 0.0
    if mean > 0 and max(worst) > mean * (1 + 1e-6):
        weights = [max(1.0, x / mean) ** FIT_BALANCE_EXPONENT for x in worst]
        other = _fit_within(problem, budget, _prices(base, weights))
        if max(relative(other)) < max(worst):
            plan = other
    return plan


def _prices(base: list[float], weights: Sequence[float]) -> tuple[float, float, float, float]:
    token, ctx, slot, block = (p * w for p, w in zip(base, weights))
    return token, ctx, slot, block


def _fit_within(
    problem: _Problem, budget: int, prices: tuple[float, float, float, float]
) -> BucketPlan:
    """`_choose` within a budget of graphs rather than buckets: a fit whose packed-prefill
    variants overrun the budget is fitted again with fewer buckets. A bucket given up saves up to
    two graphs (itself and its variant), so each round gives up half the overrun; the coverage
    buckets have no variant, so a budget that holds them ends the rounds."""
    buckets = budget
    while True:
        plan = _choose(problem, buckets, prices)
        over = graph_count(plan.prompt, plan.decode) - budget
        if over <= 0:
            return plan
        buckets -= (over + 1) // 2


@dataclass
class _Problem:
    """What every fit of one trace within some budget shares."""

    lim: Limits
    prefill_cap: int  # largest prefill batch
    packed_c: int  # largest context of a packed (single) prefill row
    shapes: dict[TracedShape, int]  # the legal traced shapes
    fixed: set[Bucket]  # the coverage buckets
    cells: list[_Cell]
    candidates: list[Bucket]


def _prepare(trace: Mapping[TracedShape, int], lim: Limits, prefill_bs: int) -> _Problem:
    q_max, c_max, d_max = lim.query_max, lim.prompt_ctx_max, lim.decode_blocks_max
    packed_c = max(c_max, 1) * PACKED_CONTEXT_FACTOR
    tokens, per_seq = lim.max_num_batched_tokens, lim.blocks_per_seq
    prefill_cap = min(prefill_bs, lim.max_num_seqs)

    def ctx_limit(batch: int) -> int:
        return packed_c if batch == 1 else c_max  # a single row may be a packed prefill

    def q_limit(batch: int) -> int:
        # A packed row holds up to the token budget, above max_model_len if the budget is.
        return tokens if batch == 1 else min(q_max, tokens // batch)

    def legal(s: TracedShape) -> bool:
        if s.phase == "prompt":
            return (
                s.batch_size <= prefill_cap
                and s.query_len <= q_limit(s.batch_size)
                and s.ctx_blocks <= ctx_limit(s.batch_size)
            )
        return s.batch_size <= min(lim.max_num_seqs, s.ctx_blocks) and s.ctx_blocks <= min(
            d_max, s.batch_size * per_seq
        )

    shapes = {s: n for s, n in trace.items() if legal(s)}
    dropped = sorted((s for s in trace if s not in shapes), key=lambda s: (s.phase, s.batch_size))
    if dropped:
        logger.warning(
            "%s: dropped %d traced shape(s) (%d steps) no step within these engine limits can have "
            "(prefill batch above VLLM_PROMPT_BS_BUCKET_MAX=%d or over max_num_batched_tokens, "
            "context or decode blocks beyond max_model_len / the KV cache), e.g. %s",
            VLLM_BUCKETING_TRACE,
            len(dropped),
            sum(trace[s] for s in dropped),
            prefill_bs,
            dropped[:3],
        )

    # Coverage first: with these every legal step has a bucket, traced or not, and every
    # prefill batch of up to VLLM_PROMPT_BS_BUCKET_MAX sequences within the token budget runs as
    # a batch (the largest query for its batch size, the largest context); the single row also
    # holds packed prefills.
    decode_bs = min(lim.max_num_seqs, d_max)
    fixed = {
        Bucket("prompt", 1, tokens, packed_c),
        Bucket("decode", decode_bs, 1, min(d_max, decode_bs * per_seq)),
    }
    fixed.update(
        Bucket("prompt", b, q_limit(b), ctx_limit(b))
        for b in range(1, prefill_cap + 1)
        if tokens // b >= 1
    )

    def rounded(s: TracedShape, bits: int) -> Bucket:
        if s.phase == "prompt":  # the batch stays exact: it is small and bounds the query
            q = min(_round_bits(s.query_len, bits), q_limit(s.batch_size))
            c = min(_round_bits(s.ctx_blocks, bits), ctx_limit(s.batch_size))
            return Bucket("prompt", s.batch_size, q, c)
        b = min(_round_bits(s.batch_size, bits), decode_bs)
        blocks = min(max(_round_bits(s.ctx_blocks, bits), b), d_max, b * per_seq)
        return Bucket("decode", b, 1, max(blocks, s.ctx_blocks))

    bits = FIT_BITS
    while True:
        cells: dict[Bucket, _Cell] = {}
        for s, n in shapes.items():
            key = rounded(s, bits)
            exact = (s.batch_size, s.query_len, s.ctx_blocks)
            cell = cells.get(key)
            if cell is None:
                cells[key] = _Cell(key, exact, n)
            else:
                cell.top = (
                    max(cell.top[0], exact[0]),
                    max(cell.top[1], exact[1]),
                    max(cell.top[2], exact[2]),
                )
                cell.count += n
        largest = max((sum(k.phase == p for k in cells) for p in ("prompt", "decode")), default=0)
        if largest <= FIT_MAX_CELLS or bits == FIT_MIN_BITS:
            break
        bits -= 1

    candidates = _candidates(list(cells), tokens, c_max, per_seq)
    return _Problem(lim, prefill_cap, packed_c, shapes, fixed, list(cells.values()), candidates)


def _choose(
    problem: _Problem, budget: int, prices: tuple[float, float, float, float]
) -> BucketPlan:
    """The coverage buckets, the context ladder, then the traced candidates chosen greedily and
    improved by swaps within ``budget`` buckets, each lowered to the shapes it serves."""
    fixed, cells, candidates = problem.fixed, problem.cells, problem.candidates
    keep = fixed | _ladder(problem.lim, problem.prefill_cap, problem.packed_c, budget - len(fixed))
    chosen = _greedy(cells, candidates, keep, budget - len(keep), prices)
    chosen = _refine(cells, candidates, chosen, keep, prices)
    return BucketPlan(FITTED_STRATEGY, *_lower(cells, chosen, keep, prices), prices)


def _ladder(lim: Limits, prefill_cap: int, packed_c: int, room: int) -> set[Bucket]:
    """The context ladder (``FIT_CONTEXT_LADDER``) within ``room // FIT_LADDER_SHARE`` buckets:
    per prefill batch size, its largest query at contexts 1, R, R**2, ... below its largest
    context (the coverage bucket's)."""
    tokens = lim.max_num_batched_tokens
    ratio = FIT_CONTEXT_LADDER
    while ratio <= FIT_CONTEXT_LADDER**2:
        ladder = set()
        for batch in range(1, prefill_cap + 1):
            query = tokens if batch == 1 else min(lim.query_max, tokens // batch)
            top = packed_c if batch == 1 else lim.prompt_ctx_max
            ctx = 1
            while query >= 1 and ctx < top:
                ladder.add(Bucket("prompt", batch, query, ctx))
                ctx *= ratio
        if len(ladder) * FIT_LADDER_SHARE <= room:
            return ladder
        ratio *= ratio
    return set()


def _candidates(cells: list[Bucket], tokens: int, c_max: int, per_seq: int) -> list[Bucket]:
    """The buckets the fit chooses from: every traced (rounded) shape, and per phase and batch
    size the smallest bucket holding every shape of that batch size or less (a bucket that
    serves many shapes at once, which no single traced shape is; a prefill batch's context stays
    within one sequence's, ``c_max``)."""
    found = dict.fromkeys(cells)
    for phase in ("prompt", "decode"):
        query = ctx = 0
        for batch in sorted({b.batch_size for b in cells if b.phase == phase}):
            for b in cells:
                if b.phase == phase and b.batch_size == batch:
                    query, ctx = max(query, b.query_len), max(ctx, b.ctx_blocks)
            if phase == "decode":
                found.setdefault(Bucket(phase, batch, query, ctx))
            elif batch * query <= tokens:
                found.setdefault(
                    Bucket(phase, batch, query, ctx if batch == 1 else min(ctx, c_max))
                )
        mine = [b for b in cells if b.phase == phase]
        axes = [
            sorted({getattr(b, d) for b in mine}) for d in ("batch_size", "query_len", "ctx_blocks")
        ]
        if math.prod(map(len, axes)) <= FIT_GRID_CANDIDATES:
            for batch, query, ctx in product(*axes):
                if phase == "decode":
                    ok = batch <= ctx <= batch * per_seq
                else:
                    ok = batch * query <= tokens and (batch == 1 or ctx <= c_max)
                if ok:
                    found.setdefault(Bucket(phase, batch, query, ctx))
    return list(found)


def _greedy(
    cells: list[_Cell],
    candidates: list[Bucket],
    fixed: set[Bucket],
    slots: int,
    prices: tuple[float, ...],
) -> set[Bucket]:
    """Add up to ``slots`` candidates as buckets, each time the one that lowers the traced
    padding most (lazy greedy: a candidate's gain only shrinks as buckets are added)."""

    chosen = set(fixed)
    cost = []
    for cell in cells:
        fits = [_price(b, prices) for b in fixed if _covers(b, cell.bucket)]
        cost.append(min(fits))  # the coverage buckets hold every legal shape
    served: list[tuple[int, list[int]]] = []
    for phase in ("prompt", "decode"):
        # Cells of the phase sorted by batch size: a candidate serves cells in a prefix of it.
        idx = sorted(
            (i for i, c in enumerate(cells) if c.bucket.phase == phase),
            key=lambda i: cells[i].bucket.batch_size,
        )
        bs = [cells[i].bucket.batch_size for i in idx]
        qs = [cells[i].bucket.query_len for i in idx]
        cs = [cells[i].bucket.ctx_blocks for i in idx]
        for m, cand in enumerate(candidates):
            if cand.phase != phase:
                continue
            b, q, c = cand.batch_size, cand.query_len, cand.ctx_blocks
            end = bisect.bisect_right(bs, b)
            served.append((m, [idx[j] for j in range(end) if qs[j] <= q and cs[j] <= c]))
    served.sort()
    served_by = [members for _, members in served]
    price = [_price(b, prices) for b in candidates]
    count = [c.count for c in cells]

    def gain(m: int) -> float:
        p = price[m]
        # A cell already served at this price or less never counts again: forget it.
        live = served_by[m] = [i for i in served_by[m] if cost[i] > p]
        return sum(count[i] * (cost[i] - p) for i in live)

    heap = [(-gain(m), m) for m in range(len(candidates)) if candidates[m] not in chosen]
    heapq.heapify(heap)
    while slots > 0 and heap:
        _, m = heapq.heappop(heap)
        g = gain(m)
        if g <= 0:
            continue
        if heap and g < -heap[0][0]:
            heapq.heappush(heap, (-g, m))  # stale: another candidate may now gain more
            continue
        chosen.add(candidates[m])
        slots -= 1
        for i in served_by[m]:
            cost[i] = min(cost[i], price[m])
    return chosen


def _refine(
    cells: list[_Cell],
    candidates: list[Bucket],
    chosen: set[Bucket],
    fixed: set[Bucket],
    prices: tuple[float, ...],
) -> set[Bucket]:
    """Swap a chosen bucket for another traced cell while that lowers the traced padding (first
    improvement, within FIT_SWAP_WORK cell evaluations): greedy picks large buckets early and
    cannot take them back."""
    chosen = set(chosen)
    work = 0
    for phase in ("prompt", "decode"):
        mine = [c for c in cells if c.bucket.phase == phase]
        shapes = [(c.bucket.batch_size, c.bucket.query_len, c.bucket.ctx_blocks) for c in mine]
        counts = [c.count for c in mine]
        improved = True
        while improved and work < FIT_SWAP_WORK:
            improved = False
            current = sorted(
                (b for b in chosen if b.phase == phase), key=lambda b: _price(b, prices)
            )
            best, second, owner = [], [], []
            for shape in shapes:
                fits = [b for b in current if _holds(b, shape)][:2]
                best.append(_price(fits[0], prices))
                owner.append(fits[0])
                second.append(_price(fits[1], prices) if len(fits) > 1 else math.inf)
            total = sum(n * c for n, c in zip(counts, best))
            for out in (b for b in current if b not in fixed):
                without = [s if o == out else b for b, s, o in zip(best, second, owner)]
                for cand in (b for b in candidates if b.phase == phase):
                    if cand in chosen:
                        continue
                    work += len(shapes)
                    p = _price(cand, prices)
                    new = sum(
                        n * (min(w, p) if _holds(cand, shape) else w)
                        for n, w, shape in zip(counts, without, shapes)
                    )
                    if new < total * (1 - 1e-9):
                        chosen.discard(out)
                        chosen.add(cand)
                        improved = True
                        break
                    if work >= FIT_SWAP_WORK:
                        break
                if improved or work >= FIT_SWAP_WORK:
                    break
    return chosen


def _holds(b: Bucket, shape: tuple[int, int, int]) -> bool:
    return b.batch_size >= shape[0] and b.query_len >= shape[1] and b.ctx_blocks >= shape[2]


def _lower(
    cells: list[_Cell], chosen: set[Bucket], keep: set[Bucket], prices: tuple[float, ...]
) -> tuple[tuple[Bucket, ...], tuple[Bucket, ...]]:
    """Each chosen bucket lowered to the exact largest shape among the cells it serves best
    (``keep``, the coverage buckets, stay as they are); a bucket serving none is dropped."""
    ranked = sorted(chosen, key=lambda b: _price(b, prices))
    tops: dict[Bucket, tuple[int, int, int]] = {}
    for cell in cells:
        best = next(b for b in ranked if _covers(b, cell.bucket))
        t = tops.get(best, (0, 0, 0))
        tops[best] = (max(t[0], cell.top[0]), max(t[1], cell.top[1]), max(t[2], cell.top[2]))
    final = set(keep)
    for b, (batch, query, ctx) in tops.items():
        final.add(b if b in keep else Bucket(b.phase, batch, query, ctx))
    prompt = tuple(b for b in final if b.phase == "prompt")
    decode = tuple(b for b in final if b.phase == "decode")
    return prompt, decode


def _fitted_from_env(
    env: Env, lim: Limits, *, exp_buckets: tuple[list[Bucket], list[Bucket]]
) -> BucketPlan:
    raw = env.raw(VLLM_BUCKETING_TRACE)
    if raw is None:
        raise EnvError(
            f"{VLLM_BUCKETING_STRATEGY}=fitted needs {VLLM_BUCKETING_TRACE}=<file>, a trace of "
            "step shapes; record one while serving under another strategy with "
            "VLLM_BUCKETING_RECORD_TRACE=<file>, or choose exp, lin or pad."
        )
    budget = env.integer(VLLM_BUCKETING_GRAPH_BUDGET, 1)
    found = env.param(PROMPT_BS, "MAX")
    exp_graphs = graph_count(*exp_buckets)
    plan = _fit_graphs(
        read_trace(raw.strip()),
        lim,
        exp_graphs if budget is None else budget,
        found[1] if found else 1,
        exp_buckets,
    )
    logger.info(
        "%s=fitted: %d buckets (%d graphs) fitted to %s within a budget of %d graphs%s",
        VLLM_BUCKETING_STRATEGY,
        len(plan.prompt) + len(plan.decode),
        graph_count(plan.prompt, plan.decode),
        raw.strip(),
        exp_graphs if budget is None else budget,
        "" if budget is not None else f" (exp's count; set {VLLM_BUCKETING_GRAPH_BUDGET})",
    )
    return plan


def fitted_plan(env: Env, lim: Limits) -> BucketPlan:
    """The ``fitted`` plan, from the trace and budget the environment names."""
    # exp's buckets give its default budget (the graphs exp warms up; the grid may list a bucket
    # twice) and the padding its prices are relative to.
    return _fitted_from_env(env, lim, exp_buckets=_exp_buckets(env, lim))
