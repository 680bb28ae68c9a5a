"""Reading the bucketing settings: the strategy and the ``VLLM_*_BUCKET_*`` ranges.

The variables are declared (with their meaning) in envs.py, the one list of settings; their
defaults and rules are in the package docstring (``bucketing/__init__.py``). Every bad value
raises ``EnvError`` naming the variable and the fix.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from vllm_gaudi_platform.bucketing.limits import Limits
from vllm_gaudi_platform.envs import (
    BUCKET_PARAMS as PARAMS,
)
from vllm_gaudi_platform.envs import (
    BUCKET_VARIABLES,
    LEGACY_QUERY_VARIABLES,
    VLLM_BUCKETING_GRAPH_BUDGET,
    VLLM_BUCKETING_STRATEGY,
    VLLM_BUCKETING_TRACE,
    VLLM_EXPONENTIAL_BUCKETING,
    EnvError,
)

logger = logging.getLogger(f"vllm.{__name__}")

DEFAULT_STRATEGY = "exp"
DEFAULT_PAD_PERCENT = 25
MAX_PAD_PERCENT = 50

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class Dim:
    phase: str  # "PROMPT" or "DECODE"
    name: str  # "BS", "QUERY", "CTX" or "BLOCK"
    floor: int  # smallest legal value: 0 for prompt context, 1 otherwise

    def var(self, param: str) -> str:
        return f"VLLM_{self.phase}_{self.name}_BUCKET_{param}"


PROMPT_BS = Dim("PROMPT", "BS", 1)
PROMPT_QUERY = Dim("PROMPT", "QUERY", 1)
PROMPT_CTX = Dim("PROMPT", "CTX", 0)
DECODE_BS = Dim("DECODE", "BS", 1)
DECODE_BLOCK = Dim("DECODE", "BLOCK", 1)
DIMS = (PROMPT_BS, PROMPT_QUERY, PROMPT_CTX, DECODE_BS, DECODE_BLOCK)
# Smallest legal value of each parameter; MIN and MAX take the dimension's floor.
_PARAM_FLOOR = {"STEP": 1, "PAD_MAX": 0, "PAD_PERCENT": 0}


@dataclass(frozen=True)
class Range:
    min: int
    step: int
    max: int
    pad_max: int = 0
    pad_percent: int = DEFAULT_PAD_PERCENT
    limit: int = 0


class Env:
    """Validated integer settings from one environment mapping."""

    def __init__(self, environ: Mapping[str, str]):
        self.environ = environ
        self._warned: set[str] = set()

    def raw(self, name: str) -> str | None:
        value = self.environ.get(name)
        # `VAR=` (set but empty) in an env file means unset, as for vLLM's own variables.
        return None if value is None or not value.strip() else value

    def integer(self, name: str, floor: int, ceiling: int | None = None) -> int | None:
        raw = self.raw(name)
        if raw is None:
            return None
        try:
            value = int(raw.strip())
        except ValueError:
            raise EnvError(
                f"{name}={raw!r} is not an integer; set a whole number >= {floor} or unset it "
                "to use the default derived from the engine limits."
            ) from None
        if value < floor or (ceiling is not None and value > ceiling):
            bounds = f"from {floor} to {ceiling}" if ceiling is not None else f">= {floor}"
            raise EnvError(f"{name}={raw!r} is out of range; set a value {bounds} or unset it.")
        return value

    def param(self, dim: Dim, param: str) -> tuple[str, int] | None:
        """(variable that supplied it, value) for one parameter, or None when unset."""
        floor = _PARAM_FLOOR.get(param, dim.floor)
        ceiling = MAX_PAD_PERCENT if param == "PAD_PERCENT" else None
        names = [dim.var(param)]
        if dim == PROMPT_QUERY:
            names.append(f"VLLM_PROMPT_SEQ_BUCKET_{param}")
        for name in names:
            value = self.integer(name, floor, ceiling)
            if value is not None:
                if name != names[0] and name not in self._warned:
                    self._warned.add(name)
                    logger.warning("%s is deprecated; use %s instead.", name, names[0])
                return name, value
        return None

    def validate_all(self) -> None:
        """Check every bucketing variable that is set, used by this strategy or not."""
        for dim in DIMS:
            for param in PARAMS:
                self.param(dim, param)
        self.integer(VLLM_BUCKETING_GRAPH_BUDGET, 1)

    def warn_unknown(self) -> None:
        known = set(BUCKET_VARIABLES) | set(LEGACY_QUERY_VARIABLES)
        for name in sorted(self.environ):
            if (
                name.startswith(("VLLM_PROMPT_", "VLLM_DECODE_"))
                and "_BUCKET_" in name
                and name not in known
            ):
                close = difflib.get_close_matches(name, sorted(known), n=1)
                hint = f"; did you mean {close[0]}?" if close else ""
                logger.warning("%s is not a bucketing variable and is ignored%s", name, hint)


def read_strategy(env: Env, known: Collection[str]) -> str:
    """The strategy VLLM_BUCKETING_STRATEGY names (one of ``known``), or the one the deprecated
    VLLM_EXPONENTIAL_BUCKETING forces."""
    raw = env.raw(VLLM_BUCKETING_STRATEGY)
    strategy = DEFAULT_STRATEGY if raw is None else raw.strip().lower()
    if strategy not in known:
        raise EnvError(
            f"{VLLM_BUCKETING_STRATEGY}={raw!r} is not a bucketing strategy; set it to exp "
            "(exponential, the default), lin (linear), pad (padding-aware) or fitted (fitted to "
            f"the trace in {VLLM_BUCKETING_TRACE}), or unset it."
        )
    legacy = env.raw(VLLM_EXPONENTIAL_BUCKETING)
    if legacy is not None:
        flag = legacy.strip().lower()
        if flag not in _TRUE | _FALSE:
            raise EnvError(
                f"{VLLM_EXPONENTIAL_BUCKETING}={legacy!r} is not a boolean; it is deprecated: "
                f"unset it and choose with {VLLM_BUCKETING_STRATEGY}=exp, lin or pad."
            )
        forced = "exp" if flag in _TRUE else "lin"
        logger.warning(
            "%s is deprecated; use %s instead. It forces %s (over %s).",
            VLLM_EXPONENTIAL_BUCKETING,
            VLLM_BUCKETING_STRATEGY,
            forced,
            strategy,
        )
        strategy = forced
    return strategy


def _user_range(env: Env, dim: Dim, default: Range, *, pad_max_of_max: bool = False) -> Range:
    """A lin/pad range: each parameter from the environment, else its default."""
    found = {p: env.param(dim, p) for p in PARAMS}
    value = {p: (hit[1] if (hit := found[p]) else getattr(default, p.lower())) for p in PARAMS}
    bmin, step, bmax = value["MIN"], value["STEP"], value["MAX"]
    if bmin > bmax:
        if found["MIN"] or found["MAX"]:
            min_name = found["MIN"][0] if found["MIN"] else dim.var("MIN")
            max_name = found["MAX"][0] if found["MAX"] else dim.var("MAX")
            origin = "as set" if found["MAX"] else "the default for these engine limits"
            raise EnvError(
                f"{min_name}={bmin} is greater than the maximum {bmax} ({max_name}, {origin}); "
                f"lower {min_name} or raise {max_name}."
            )
        # Both derived: Intel's rule for a default minimum above the maximum.
        bmin = max(dim.floor, bmax - step)
    pad_max = value["PAD_MAX"]
    if pad_max_of_max and not found["PAD_MAX"]:
        pad_max = math.ceil(bmax / 4)
    return Range(bmin, step, bmax, pad_max, value["PAD_PERCENT"])


def user_ranges(env: Env, lim: Limits, *, pad: bool) -> dict[Dim, Range]:
    """Each dimension's lin (``pad`` False) or pad range: the variables set, else the defaults
    derived from the engine limits."""
    bs = lim.block_size
    found_bs_max = env.param(PROMPT_BS, "MAX")
    prefill_bs = found_bs_max[1] if found_bs_max else 1
    tokens = lim.max_num_batched_tokens
    defaults = {
        PROMPT_BS: Range(1, 1, prefill_bs, math.ceil(prefill_bs / 4)),
        PROMPT_QUERY: Range(bs, bs, lim.query_max, math.ceil(tokens / 4)),
        PROMPT_CTX: Range(0, 2 if pad else 1, lim.prompt_ctx_max, math.ceil(tokens / bs)),
        DECODE_BS: Range(1, 2 if pad else 32, lim.max_num_seqs, math.ceil(lim.max_num_seqs / 4)),
        DECODE_BLOCK: Range(bs if pad else 1, bs, lim.decode_blocks_max),
    }
    return {
        d: _user_range(env, d, r, pad_max_of_max=d == DECODE_BLOCK) for d, r in defaults.items()
    }


def prefill_batch_max(environ: Mapping[str, str] | None = None) -> int:
    """The most sequences one prefill bucket holds: VLLM_PROMPT_BS_BUCKET_MAX, default 1."""
    found = Env(os.environ if environ is None else environ).param(PROMPT_BS, "MAX")
    return found[1] if found else 1
