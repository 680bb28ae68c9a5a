"""The ``lin`` strategy: linear values with ramp-up (rules: the package docstring,
``bucketing/__init__.py``)."""

from __future__ import annotations

import logging

from vllm_gaudi_platform.bucketing.buckets import BucketPlan
from vllm_gaudi_platform.bucketing.grid import grid_plan
from vllm_gaudi_platform.bucketing.limits import Limits
from vllm_gaudi_platform.bucketing.settings import DIMS, Env, user_ranges
from vllm_gaudi_platform.envs import VLLM_BUCKETING_STRATEGY

logger = logging.getLogger(f"vllm.{__name__}")


def linear_range(bmin: int, step: int, bmax: int) -> list[int]:
    """Linear values with ramp-up (``lin``): ``bmin`` doubles while below ``step``, then the
    multiples of ``step`` up to ``bmax``. A ``bmin`` of 0 adds 0 and ramps from ``step``.
    ``bmin`` and ``bmax`` are always included."""
    values = {bmin, bmax}
    current = step if bmin == 0 else bmin
    while current < step and current <= bmax:
        values.add(current)
        current *= 2
    values.update(range(step, bmax + 1, step))
    return sorted(v for v in values if bmin <= v <= bmax)


def lin_plan(env: Env, lim: Limits) -> BucketPlan:
    """The ``lin`` plan: the linear values of each dimension's range, combined."""
    ranges = user_ranges(env, lim, pad=False)
    unused = [n for d in DIMS for p in ("PAD_MAX", "PAD_PERCENT") if env.raw(n := d.var(p))]
    if unused:
        logger.info(
            "%s=lin ignores %s (used by pad only).", VLLM_BUCKETING_STRATEGY, ", ".join(unused)
        )
    return grid_plan("lin", {d: linear_range(r.min, r.step, r.max) for d, r in ranges.items()}, lim)
