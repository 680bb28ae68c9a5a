"""The ``pad`` strategy: padding-aware values (rules: the package docstring,
``bucketing/__init__.py``)."""

from __future__ import annotations

from vllm_gaudi_platform.bucketing.buckets import BucketPlan
from vllm_gaudi_platform.bucketing.grid import grid_plan
from vllm_gaudi_platform.bucketing.limits import Limits
from vllm_gaudi_platform.bucketing.settings import Env, user_ranges


def padding_aware_range(
    bmin: int, step: int, bmax: int, pad_max: int, pad_percent: int
) -> list[int]:
    """Padding-aware values (``pad``): the ``lin`` ramp-up, then a multiple of ``step`` is kept
    only where dropping it would let the values it covers pad by more than ``pad_percent`` percent
    of the next candidate or by more than ``pad_max``; multiples of ``pad_max`` are always kept
    (``pad_max`` 0 means ``bmax``). ``bmin`` and ``bmax`` are always included."""
    if bmax == 0:
        return [0]
    if pad_max == 0:
        pad_max = bmax
    values = [bmin]
    current = bmin
    while current <= bmax and current <= step:  # ramp-up: 0 -> 1, then doubling
        nxt = current * 2 if current else 1
        if nxt <= bmax:
            values.append(nxt)
        current = nxt
    while current <= bmax:
        nxt = current + step
        last = values[-1]
        # Without `current`, a value just above `last` would be padded up to `nxt`.
        worst_pad = nxt - last - 1
        needed = (
            worst_pad / nxt > pad_percent / 100 or worst_pad > pad_max or current % pad_max == 0
        )
        if needed and current != last:
            values.append(current)
        current = nxt
    if values[-1] != bmax:
        values.append(bmax)
    return values


def pad_plan(env: Env, lim: Limits) -> BucketPlan:
    """The ``pad`` plan: the padding-aware values of each dimension's range, combined."""
    ranges = user_ranges(env, lim, pad=True)
    values = {
        d: padding_aware_range(r.min, r.step, r.max, r.pad_max, r.pad_percent)
        for d, r in ranges.items()
    }
    return grid_plan("pad", values, lim)
