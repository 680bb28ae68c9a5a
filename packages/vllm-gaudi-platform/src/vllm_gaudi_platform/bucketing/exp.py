"""The ``exp`` strategy (the default): exponentially spaced values derived from the engine limits
(rules: the package docstring, ``bucketing/__init__.py``)."""

from __future__ import annotations

import logging
import math

from vllm_gaudi_platform.bucketing.buckets import BucketPlan
from vllm_gaudi_platform.bucketing.grid import grid_plan
from vllm_gaudi_platform.bucketing.limits import Limits
from vllm_gaudi_platform.bucketing.settings import (
    DECODE_BLOCK,
    DECODE_BS,
    DIMS,
    PROMPT_BS,
    PROMPT_CTX,
    PROMPT_QUERY,
    Dim,
    Env,
    Range,
)
from vllm_gaudi_platform.envs import VLLM_BUCKETING_STRATEGY

logger = logging.getLogger(f"vllm.{__name__}")


def exponential_range(bmin: int, step: int, bmax: int, limit: int) -> list[int]:
    """Exponentially spaced values (``exp``): ``limit`` points ``bmin * (bmax/bmin) ** (i /
    (limit - 1))`` rounded up to a multiple of ``step`` (and not above ``bmax``), duplicates
    removed. A ``bmin`` of 0 or 1 is kept as an extra value and the spacing starts at ``step``.
    ``bmin`` and ``bmax`` are always included."""
    extra: set[int] = set()
    if bmin in (0, 1):
        extra = {bmin}
        bmin = step
    if bmax <= 0 or bmin >= bmax or limit <= 1:
        return sorted({bmax} | {v for v in extra if v <= bmax})
    values = {bmax} | extra
    for i in range(limit):
        # Rounded so that float error (32 ** 0.8 = 16.000000000000004) does not push a point
        # that is a multiple of step up to the next multiple (Intel's code warms 17 there).
        point = round(bmin * (bmax / bmin) ** (i / (limit - 1)), 9)
        values.add(min(math.ceil(point / step) * step, bmax))
    return sorted(values)


def _log2_limit(bmax: int) -> int:
    return math.ceil(math.log2(bmax)) + 1 if bmax > 1 else 1


def exponential_ranges(env: Env, lim: Limits, strategy: str, source: str) -> dict[Dim, list[int]]:
    """Each dimension's exponential values. The user ranges do not apply (a warning names those
    set, as ignored by ``strategy``, whose buckets derive from ``source``), except the prefill
    batch maximum and a query minimum of 1."""
    bs = lim.block_size
    found_bs_max = env.param(PROMPT_BS, "MAX")
    prefill_bs = found_bs_max[1] if found_bs_max else 1
    ignored = [
        dim.var(p)
        for dim in DIMS
        for p in ("MIN", "STEP", "MAX")
        if env.param(dim, p) and (dim, p) not in ((PROMPT_BS, "MAX"), (PROMPT_QUERY, "MIN"))
    ]
    query_min_found = env.param(PROMPT_QUERY, "MIN")
    query_min = 1 if query_min_found and query_min_found[1] == 1 else bs
    if query_min_found and query_min != 1:
        ignored.append(query_min_found[0])
    if ignored:
        logger.warning(
            "%s=%s derives its buckets from %s and ignores %s; set %s=lin or pad to use them.",
            VLLM_BUCKETING_STRATEGY,
            strategy,
            source,
            ", ".join(ignored),
            VLLM_BUCKETING_STRATEGY,
        )
    q_max, c_max, d_max = lim.query_max, lim.prompt_ctx_max, lim.decode_blocks_max
    ranges = {
        PROMPT_BS: Range(1, 2, prefill_bs, limit=_log2_limit(prefill_bs)),
        PROMPT_QUERY: Range(min(query_min, q_max), bs, q_max, limit=_log2_limit(q_max) - 1),
        PROMPT_CTX: Range(0, 1, c_max, limit=2 if c_max == 1 else _log2_limit(c_max)),
        DECODE_BS: Range(1, 2, lim.max_num_seqs, limit=_log2_limit(lim.max_num_seqs)),
        DECODE_BLOCK: Range(1, lim.max_num_seqs, d_max, limit=_log2_limit(d_max)),
    }
    return {d: exponential_range(r.min, r.step, r.max, r.limit) for d, r in ranges.items()}


def exp_plan(env: Env, lim: Limits) -> BucketPlan:
    """The ``exp`` plan: the exponential values of each dimension, combined."""
    return grid_plan("exp", exponential_ranges(env, lim, "exp", "the engine limits"), lim)
