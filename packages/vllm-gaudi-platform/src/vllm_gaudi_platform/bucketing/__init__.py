"""Static-shape buckets: the shapes the HPU model runner warms up and pads every forward pass to.

Gaudi compiles one graph per input shape, so a shape first seen while serving is a latency spike.
Every step is padded to a *bucket* over three dimensions:

- prompt (prefill) steps: ``(batch_size, query_len, ctx_blocks)``, where ``query_len`` is the
  longest number of new tokens of a sequence in the batch and ``ctx_blocks`` the largest number of
  KV-cache blocks of already computed context (cached prefix or earlier chunks) of a sequence;
- decode steps: ``(batch_size, 1, ctx_blocks)``, where ``ctx_blocks`` is the number of KV-cache
  blocks of the WHOLE BATCH (the length of the flattened block list), as in Intel's vllm-gaudi.

The settings are those of Intel's vllm-gaudi, with the same names and meanings, so an operator's
existing environment carries over.

Choosing the buckets
--------------------
``VLLM_BUCKETING_FROM_FILE`` (a path) takes the buckets from a file (see below); otherwise
``VLLM_BUCKETING_STRATEGY`` picks how each dimension's values are generated:

``exp`` (default)
    Exponential spacing: ``limit`` values from ``min`` to ``max``, each ``min * (max/min) **
    (i / (limit - 1))`` rounded up to a multiple of ``step``, duplicates removed; a ``min`` of 0
    or 1 is kept as an extra value and the spacing starts at ``step``. The parameters derive from
    the engine limits and are not user-settable: ``VLLM_*_BUCKET_{MIN,STEP,MAX}`` are ignored with
    a warning. Two documented exceptions: ``VLLM_PROMPT_BS_BUCKET_MAX`` (the prefill batch size,
    every strategy) and ``VLLM_PROMPT_QUERY_BUCKET_MIN=1`` (for a P/D decode instance).
``lin``
    Linear with ramp-up: ``min`` doubles while below ``step``, then ``step, 2*step, ...`` up to
    ``max``. ``min=2, step=32, max=64`` gives ``2, 4, 8, 16, 32, 64``.
``pad``
    Padding-aware: the linear ramp-up, then a multiple of ``step`` is kept only where skipping it
    would let the padding of the values it covers exceed ``PAD_PERCENT`` percent or ``PAD_MAX``
    in absolute terms (or where it is a multiple of ``PAD_MAX``; ``PAD_MAX=0`` means ``max``).
    ``(min, step, max, pad_max, pad_percent) = (0, 8, 64, 16, 50)`` gives
    ``0, 1, 2, 4, 8, 16, 32, 48, 64``.

``fitted`` (ours, not Intel's)
    The buckets fitted to a trace of real step shapes (``VLLM_BUCKETING_TRACE``, a file the
    runner writes under ``VLLM_BUCKETING_RECORD_TRACE``; format in ``step_trace.py``), at most
    ``VLLM_BUCKETING_GRAPH_BUDGET`` graphs (default: as many as ``exp`` warms up; counted by
    ``graph_count``, packed-prefill variants included). Coverage
    first: for each prefill batch size up to ``VLLM_PROMPT_BS_BUCKET_MAX`` the largest prompt
    bucket within the token budget (batch size 1 with ``PACKED_CONTEXT_FACTOR`` times the context,
    for packed prefills), and the largest decode bucket, so every legal step has a bucket, traced
    or not. Then, among candidate buckets (the traced shapes, rounded up to ``FIT_BITS``
    significant bits per dimension; per batch size the bucket holding all shapes of that batch
    size or less; every combination of traced coordinates when a phase has few), a lazy greedy
    adds the one that lowers the traced padding most until the budget is spent, single swaps
    improve the choice while ``FIT_SWAP_WORK`` allows, and each bucket is lowered to the largest
    traced shape it serves. Padding is priced so that the fit minimises the sum of three ratios
    over the trace: padded / traced prompt work (a query token 1, a context token
    ``FIT_CONTEXT_TOKEN_COST``), decode batch slots and decode blocks. The plan keeps these prices
    (``BucketPlan.prices``) and its lookups return the cheapest bucket that fits by them. The
    ``VLLM_*_BUCKET_{MIN,STEP,MAX}`` ranges are ignored, except ``VLLM_PROMPT_BS_BUCKET_MAX``.
    Traced shapes no step within the engine limits can have are dropped with a warning. A
    missing or malformed trace, a missing ``VLLM_BUCKETING_TRACE`` or a budget below the coverage
    buckets raise ``EnvError`` naming the variable.

Variables ``VLLM_{PHASE}_{DIM}_BUCKET_{PARAM}``: PHASE/DIM is PROMPT with BS, QUERY or CTX, or
DECODE with BS or BLOCK; PARAM is MIN, STEP or MAX (``lin`` and ``pad``), PAD_MAX or PAD_PERCENT
(``pad`` only). Defaults, from the engine limits (``K = ceil(max_model_len / block_size)``):

======================  ========================  ============  ================================
variable prefix         lin (min, step, max)      pad           exp (min, step, max, limit)
======================  ========================  ============  ================================
VLLM_PROMPT_BS_BUCKET   1, 1, P                   1, 1, P       1, 2, P, ceil(log2 P)+1
VLLM_PROMPT_QUERY_...   bs, bs, Q                 bs, bs, Q     bs, bs, Q, ceil(log2 Q)
VLLM_PROMPT_CTX_BUCKET  0, 1, C                   0, 2, C       0, 1, C, ceil(log2 C)+1
VLLM_DECODE_BS_BUCKET   1, 32, S                  1, 2, S       1, 2, S, ceil(log2 S)+1
VLLM_DECODE_BLOCK_...   1, bs, D                  bs, bs, D     1, S, D, ceil(log2 D)+1
======================  ========================  ============  ================================

with ``bs = block_size``, ``P = VLLM_PROMPT_BS_BUCKET_MAX`` (default 1: Intel's runner prefills
one sequence per step unless this is raised), ``Q = min(max_num_batched_tokens, max_model_len)``,
``C = ceil((max_model_len - 1) / block_size)``, ``S = max_num_seqs``, ``D = K * max_num_seqs``
capped at ``3 * num_kv_blocks`` when that is known (prefix caching counts a shared block once per
sequence, hence Intel's 3x headroom). ``pad`` defaults: ``PAD_PERCENT`` 25; ``PAD_MAX``
``ceil(P/4)``, ``ceil(max_num_batched_tokens/4)``, ``ceil(max_num_batched_tokens/block_size)``,
``ceil(S/4)``, ``ceil(D/4)`` for the five rows. A default ``min`` above the ``max`` becomes
``max(floor, max - step)``. The deprecated ``VLLM_PROMPT_SEQ_BUCKET_*`` stand in for unset
``VLLM_PROMPT_QUERY_BUCKET_*``; the deprecated ``VLLM_EXPONENTIAL_BUCKETING`` (true: exp,
false: lin) overrides the strategy when set.

Every dimension's values include its ``min`` and ``max``. The buckets are all combinations of the
values, less those no legal step can need: a prompt bucket whose ``batch_size * query_len``
exceeds ``max_num_batched_tokens`` (Intel drops these: the runner must split such a prefill
batch), or whose smallest query plus smallest context it covers exceeds ``max_model_len``; a
decode bucket whose ``ctx_blocks`` is below its ``batch_size`` (every sequence holds a block).
A decode bucket's ``ctx_blocks`` is lowered to ``batch_size * K``, the most that many sequences
can hold. So with the defaults every single-sequence prefill and every decode step within the
engine limits (and the KV cap above) has a bucket. ``find_prompt``/``find_decode`` return the
bucket with the fewest padded tokens, then the fewest context blocks, among those that fit.

Bucket file
-----------
Intel's format: one bucket per line, ``(batch_size, query_len, ctx_blocks)``; ``#`` starts a
comment. Each item is an integer, a list of integers, or ``range(start, stop[, step])`` (Python's
range: ``stop`` is excluded, as in Intel's code; its documentation's example lists the stop value
too); a line stands for all combinations of its items. A bucket with
``query_len`` 1 is a decode bucket, any other a prompt bucket::

    (1, 2048, 0)                  # one prompt bucket
    (1, [256, 512], [0, 4, 8])    # six prompt buckets
    ([1, 2, 4], 1, range(4, 68, 16))  # twelve decode buckets: ctx_blocks 4, 20, 36, 52

The file is the exact warmup list, except that, as Intel does, prompt buckets over the token
budget or with more context than ``max_model_len`` allows, and decode buckets with fewer blocks
than sequences, are dropped with a warning. Unlike Intel, a line that does not parse is an error.

Differences from Intel's code, each so that every legal step has a bucket or to fail loudly:
the prompt context maximum is ``C`` above (Intel: ``(max_model_len - query min) / block_size``,
leaving a chunked prefill's last chunk to a runtime fallback); the query maximum is capped before
the values are generated, not filtered after; ``min`` and ``max`` are always values; prompt
buckets are filtered by reachability rather than ``query <= max_model_len``; ``D`` is the exact
worst case (no ``max(..., block_size)``) and the KV cap applies to every strategy; exponential
points are rounded to 9 decimals before rounding up. Not implemented (the runner has none of
these): merged prefill, contiguous PA, runtime fallback buckets. Speculative decoding adds its
verification buckets (phase ``verify``, query ``1 + k``) to the plan: see ``spec_decode.py``.

Bad values (not an integer, below the dimension's floor, ``STEP`` 0, ``PAD_PERCENT`` above 50,
``MIN`` above ``MAX``, an unknown strategy, an unreadable or malformed file) raise ``EnvError``
naming the variable and the fix. Pure Python: no torch, no vllm.
"""

from __future__ import annotations

import ast
import bisect
import difflib
import heapq
import logging
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from itertools import product

# The variables are declared (with their meaning) in envs.py, the one list of settings.
from vllm_gaudi_platform.envs import (
    BUCKET_PARAMS as PARAMS,
)
from vllm_gaudi_platform.envs import (
    BUCKET_VARIABLES,
    LEGACY_QUERY_VARIABLES,
    VLLM_BUCKETING_FROM_FILE,
    VLLM_BUCKETING_GRAPH_BUDGET,
    VLLM_BUCKETING_STRATEGY,
    VLLM_BUCKETING_TRACE,
    VLLM_EXPONENTIAL_BUCKETING,
    EnvError,
)
from vllm_gaudi_platform.observability.step_trace import TracedShape, read_trace

logger = logging.getLogger(f"vllm.{__name__}")

STRATEGIES = ("exp", "lin", "pad", "fitted")
DEFAULT_STRATEGY = "exp"
FILE_STRATEGY = "file"
FITTED_STRATEGY = "fitted"
# A packed prefill row holds the context of all its requests; generated plans cover rows with up
# to this many times one sequence's largest context (step_layout.with_packed_context).
PACKED_CONTEXT_FACTOR = 4

DEFAULT_PAD_PERCENT = 25
MAX_PAD_PERCENT = 50
# Headroom Intel keeps over the physical KV blocks for decode block references (prefix caching).
KV_BLOCK_REFERENCE_HEADROOM = 3
# A bucket-file line expanding to more buckets than this is surely a mistake.
MAX_BUCKETS_PER_FILE_LINE = 100_000

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


# --------------------------------------------------------------------------------- public types


@dataclass(frozen=True)
class Bucket:
    """One warmed shape.

    ``ctx_blocks`` is per sequence for a prompt bucket (the largest context of a sequence in the
    batch) and for the whole batch for a decode bucket (the flattened block list, as in Intel's
    vllm-gaudi).
    """

    phase: str  # "prompt" or "decode"
    batch_size: int
    query_len: int  # tokens per sequence in this step (1 for decode)
    ctx_blocks: int  # KV-cache blocks of context: per sequence (prompt); whole batch (decode)


def can_pack(bucket: Bucket) -> bool:
    """Whether a prompt bucket can hold a packed row (several prefills in its one row)."""
    return bucket.phase == "prompt" and bucket.batch_size == 1 and bucket.query_len >= 2


def graph_count(prompt: Iterable[Bucket], decode: Iterable[Bucket]) -> int:
    """Warmup graphs of a plan for a model without windowed layers: one per bucket, plus the
    packed-prefill variant of each single-row prompt bucket without context (a packed row does
    not take the one-sequence causal fast path; see hpu_graphs.py). A windowed model also
    captures the variant of single-row buckets with context."""
    prompt = set(prompt)
    extra = sum(can_pack(b) and b.ctx_blocks == 0 for b in prompt)
    return len(prompt) + len(set(decode)) + extra


def _prompt_cost(b: Bucket) -> tuple[int, ...]:
    # Fewest padded tokens first, then fewest context blocks: monotone in every dimension, so in a
    # full grid the bucket that rounds each dimension up is always the one chosen.
    return (
        b.batch_size * b.query_len,
        b.batch_size * b.ctx_blocks,
        b.batch_size,
        b.query_len,
        b.ctx_blocks,
    )


def _decode_cost(b: Bucket) -> tuple[int, ...]:
    return (b.batch_size, b.ctx_blocks)


@dataclass(frozen=True)
class BucketPlan:
    """The buckets to warm up, and the lookup the runner pads each step with."""

    strategy: str  # "exp", "lin", "pad", "fitted" or "file"
    prompt: tuple[Bucket, ...]
    decode: tuple[Bucket, ...]
    # Padding prices a lookup ranks the fitting buckets by, set by the fitted strategy: per
    # padded prompt token, per prompt context block (per row), per decode batch slot, per decode
    # block. None: padded tokens first, then context (prompt); batch first (decode). In a full
    # grid both pick the same bucket; a fitted set is no grid, so it needs a price per dimension.
    prices: tuple[float, float, float, float] | None = None

    def __post_init__(self) -> None:
        # Kept cheapest first so that a lookup is the first bucket that fits.
        prompt_key: Callable[[Bucket], tuple[float, ...]] = _prompt_cost
        decode_key: Callable[[Bucket], tuple[float, ...]] = _decode_cost
        if self.prices is not None:
            token, ctx, slot, block = self.prices

            def prompt_key(b: Bucket) -> tuple[float, ...]:
                return (b.batch_size * (b.query_len * token + b.ctx_blocks * ctx), *_prompt_cost(b))

            def decode_key(b: Bucket) -> tuple[float, ...]:
                return (b.batch_size * slot + b.ctx_blocks * block, *_decode_cost(b))

        object.__setattr__(self, "prompt", tuple(sorted(set(self.prompt), key=prompt_key)))
        object.__setattr__(self, "decode", tuple(sorted(set(self.decode), key=decode_key)))

    def find_prompt(self, batch_size: int, query_len: int, ctx_blocks: int) -> Bucket | None:
        """The smallest prompt bucket that holds the step in all three dimensions, or None."""
        for b in self.prompt:
            if (
                b.batch_size >= batch_size
                and b.query_len >= query_len
                and b.ctx_blocks >= ctx_blocks
            ):
                return b
        return None

    def find_decode(self, batch_size: int, ctx_blocks: int) -> Bucket | None:
        """The smallest decode bucket that holds the step (ctx_blocks of the batch), or None."""
        for b in self.decode:
            if b.batch_size >= batch_size and b.ctx_blocks >= ctx_blocks:
                return b
        return None

    def describe(self) -> str:
        """A few lines for the startup log: strategy, bucket counts and each dimension's values."""
        lines = [
            f"bucketing strategy {self.strategy}: {len(self.prompt) + len(self.decode)} warmup "
            f"graphs ({len(self.prompt)} prompt, {len(self.decode)} decode)"
        ]
        for name, buckets, dims in (
            ("prompt", self.prompt, ("batch_size", "query_len", "ctx_blocks")),
            ("decode", self.decode, ("batch_size", "ctx_blocks")),
        ):
            if not buckets:
                lines.append(f"  {name}: none")
                continue
            parts = [f"{d} {_format_values({getattr(b, d) for b in buckets})}" for d in dims]
            lines.append(f"  {name}: " + "; ".join(parts))
        return "\n".join(lines)


def _format_values(values: Iterable[int]) -> str:
    ordered = sorted(values)
    if len(ordered) <= 10:
        return "[" + ", ".join(map(str, ordered)) + "]"
    head = ", ".join(map(str, ordered[:4]))
    tail = ", ".join(map(str, ordered[-3:]))
    return f"[{head}, ..., {tail}] ({len(ordered)} values)"


# --------------------------------------------------------------------------- range generators


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


# ------------------------------------------------------------------------ reading the settings


@dataclass(frozen=True)
class _Dim:
    phase: str  # "PROMPT" or "DECODE"
    name: str  # "BS", "QUERY", "CTX" or "BLOCK"
    floor: int  # smallest legal value: 0 for prompt context, 1 otherwise

    def var(self, param: str) -> str:
        return f"VLLM_{self.phase}_{self.name}_BUCKET_{param}"


_PROMPT_BS = _Dim("PROMPT", "BS", 1)
_PROMPT_QUERY = _Dim("PROMPT", "QUERY", 1)
_PROMPT_CTX = _Dim("PROMPT", "CTX", 0)
_DECODE_BS = _Dim("DECODE", "BS", 1)
_DECODE_BLOCK = _Dim("DECODE", "BLOCK", 1)
_DIMS = (_PROMPT_BS, _PROMPT_QUERY, _PROMPT_CTX, _DECODE_BS, _DECODE_BLOCK)
# Smallest legal value of each parameter; MIN and MAX take the dimension's floor.
_PARAM_FLOOR = {"STEP": 1, "PAD_MAX": 0, "PAD_PERCENT": 0}


@dataclass(frozen=True)
class _Limits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int | None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"bucketing needs a positive integer {name}, got {value!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(
                f"bucketing needs num_kv_blocks >= 1 or None, got {self.num_kv_blocks!r}"
            )

    @property
    def blocks_per_seq(self) -> int:
        return math.ceil(self.max_model_len / self.block_size)

    @property
    def prompt_ctx_max(self) -> int:
        # A prompt step has at least one new token, so its context is at most max_model_len - 1.
        return math.ceil((self.max_model_len - 1) / self.block_size)

    @property
    def query_max(self) -> int:
        return min(self.max_num_batched_tokens, self.max_model_len)

    @property
    def decode_blocks_max(self) -> int:
        worst = self.blocks_per_seq * self.max_num_seqs
        if self.num_kv_blocks is not None:
            worst = min(worst, KV_BLOCK_REFERENCE_HEADROOM * self.num_kv_blocks)
        return worst


@dataclass(frozen=True)
class _Range:
    min: int
    step: int
    max: int
    pad_max: int = 0
    pad_percent: int = DEFAULT_PAD_PERCENT
    limit: int = 0


class _Env:
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

    def param(self, dim: _Dim, param: str) -> tuple[str, int] | None:
        """(variable that supplied it, value) for one parameter, or None when unset."""
        floor = _PARAM_FLOOR.get(param, dim.floor)
        ceiling = MAX_PAD_PERCENT if param == "PAD_PERCENT" else None
        names = [dim.var(param)]
        if dim == _PROMPT_QUERY:
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
        for dim in _DIMS:
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


def _read_strategy(env: _Env) -> str:
    raw = env.raw(VLLM_BUCKETING_STRATEGY)
    strategy = DEFAULT_STRATEGY if raw is None else raw.strip().lower()
    if strategy not in STRATEGIES:
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


def _user_range(env: _Env, dim: _Dim, default: _Range, *, pad_max_of_max: bool = False) -> _Range:
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
    return _Range(bmin, step, bmax, pad_max, value["PAD_PERCENT"])


def _log2_limit(bmax: int) -> int:
    return math.ceil(math.log2(bmax)) + 1 if bmax > 1 else 1


def _ranges(strategy: str, env: _Env, lim: _Limits) -> dict[_Dim, list[int]]:
    bs = lim.block_size
    found_bs_max = env.param(_PROMPT_BS, "MAX")
    prefill_bs = found_bs_max[1] if found_bs_max else 1
    if strategy in ("exp", FITTED_STRATEGY):
        # fitted: the exponential ranges give its default graph budget.
        ignored = [
            dim.var(p)
            for dim in _DIMS
            for p in ("MIN", "STEP", "MAX")
            if env.param(dim, p) and (dim, p) not in ((_PROMPT_BS, "MAX"), (_PROMPT_QUERY, "MIN"))
        ]
        query_min_found = env.param(_PROMPT_QUERY, "MIN")
        query_min = 1 if query_min_found and query_min_found[1] == 1 else bs
        if query_min_found and query_min != 1:
            ignored.append(query_min_found[0])
        if ignored:
            logger.warning(
                "%s=%s derives its buckets from %s and ignores %s; set %s=lin or pad to use them.",
                VLLM_BUCKETING_STRATEGY,
                strategy,
                "the engine limits" if strategy == "exp" else VLLM_BUCKETING_TRACE,
                ", ".join(ignored),
                VLLM_BUCKETING_STRATEGY,
            )
        q_max, c_max, d_max = lim.query_max, lim.prompt_ctx_max, lim.decode_blocks_max
        ranges = {
            _PROMPT_BS: _Range(1, 2, prefill_bs, limit=_log2_limit(prefill_bs)),
            _PROMPT_QUERY: _Range(min(query_min, q_max), bs, q_max, limit=_log2_limit(q_max) - 1),
            _PROMPT_CTX: _Range(0, 1, c_max, limit=2 if c_max == 1 else _log2_limit(c_max)),
            _DECODE_BS: _Range(1, 2, lim.max_num_seqs, limit=_log2_limit(lim.max_num_seqs)),
            _DECODE_BLOCK: _Range(1, lim.max_num_seqs, d_max, limit=_log2_limit(d_max)),
        }
        return {d: exponential_range(r.min, r.step, r.max, r.limit) for d, r in ranges.items()}

    pad = strategy == "pad"
    tokens = lim.max_num_batched_tokens
    defaults = {
        _PROMPT_BS: _Range(1, 1, prefill_bs, math.ceil(prefill_bs / 4)),
        _PROMPT_QUERY: _Range(bs, bs, lim.query_max, math.ceil(tokens / 4)),
        _PROMPT_CTX: _Range(0, 2 if pad else 1, lim.prompt_ctx_max, math.ceil(tokens / bs)),
        _DECODE_BS: _Range(1, 2 if pad else 32, lim.max_num_seqs, math.ceil(lim.max_num_seqs / 4)),
        _DECODE_BLOCK: _Range(bs if pad else 1, bs, lim.decode_blocks_max),
    }
    ranges = {
        d: _user_range(env, d, r, pad_max_of_max=d == _DECODE_BLOCK) for d, r in defaults.items()
    }
    if not pad:
        unused = [n for d in _DIMS for p in ("PAD_MAX", "PAD_PERCENT") if env.raw(n := d.var(p))]
        if unused:
            logger.info(
                "%s=lin ignores %s (used by pad only).", VLLM_BUCKETING_STRATEGY, ", ".join(unused)
            )
        return {d: linear_range(r.min, r.step, r.max) for d, r in ranges.items()}
    return {
        d: padding_aware_range(r.min, r.step, r.max, r.pad_max, r.pad_percent)
        for d, r in ranges.items()
    }


# ------------------------------------------------------------------------ building the buckets


def _with_lowest(values: list[int], floor: int) -> Iterator[tuple[int, int]]:
    """(lowest real value that rounds up to v, v) for each value v."""
    lowest = floor
    for v in values:
        yield lowest, v
        lowest = v + 1


def _min_context_tokens(blocks: int, block_size: int) -> int:
    return 0 if blocks == 0 else (blocks - 1) * block_size + 1


def _prompt_grid(bs: list[int], query: list[int], ctx: list[int], lim: _Limits) -> list[Bucket]:
    buckets = []
    for (b_lo, b), (q_lo, q), (c_lo, c) in product(
        _with_lowest(bs, 1), _with_lowest(query, 1), _with_lowest(ctx, 0)
    ):
        if b * q > lim.max_num_batched_tokens or b_lo > lim.max_num_seqs:
            continue
        if q_lo + _min_context_tokens(c_lo, lim.block_size) > lim.max_model_len:
            continue  # no legal step rounds up to this bucket
        buckets.append(Bucket("prompt", b, q, c))
    return buckets


def _decode_bucket(b: int, c: int, lim: _Limits) -> Bucket | None:
    if c < b:
        return None  # every sequence holds at least one block
    return Bucket("decode", b, 1, min(c, b * lim.blocks_per_seq))


def _decode_grid(bs: list[int], blocks: list[int], lim: _Limits) -> list[Bucket]:
    buckets = []
    for (b_lo, b), c in product(_with_lowest(bs, 1), blocks):
        if b_lo <= lim.max_num_seqs and (bucket := _decode_bucket(b, c, lim)):
            buckets.append(bucket)
    return buckets


# ---------------------------------------------------------------------------- fitted strategy

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
# What a padded context token of a prefill row costs, in padded query tokens: a query token goes
# through every layer's weights, a context token is only read by attention (for a 7B-class model
# and prompts of one to two thousand tokens, 3-6% of the work; the price errs on the high side).
FIT_CONTEXT_TOKEN_COST = 1 / 16


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


def _fit_prices(
    shapes: Mapping[TracedShape, int], block_size: int
) -> tuple[float, float, float, float]:
    """Per-unit padding prices that make the fit minimise the sum of three padding ratios over
    the trace: padded prompt work / traced prompt work (a query token 1, a context block
    ``block_size * FIT_CONTEXT_TOKEN_COST``), padded decode slots / traced sequences, padded
    decode blocks / traced blocks."""
    ctx_block = block_size * FIT_CONTEXT_TOKEN_COST
    work = slots = blocks = 0.0
    for s, n in shapes.items():
        if s.phase == "prompt":
            work += n * s.batch_size * (s.query_len + s.ctx_blocks * ctx_block)
        else:
            slots += n * s.batch_size
            blocks += n * s.ctx_blocks
    token = 1 / work if work else 1.0
    return (token, token * ctx_block, 1 / slots if slots else 1.0, 1 / blocks if blocks else 1.0)


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
    lim = _Limits(max_num_seqs, max_num_batched_tokens, max_model_len, block_size, num_kv_blocks)
    return _fit_graphs(trace, lim, budget, max_prefill_batch)


def _fit_graphs(
    trace: Mapping[TracedShape, int], lim: _Limits, budget: int, prefill_bs: int
) -> BucketPlan:
    """`_fit` within a budget of graphs rather than buckets: a fit whose packed-prefill variants
    overrun the budget is fitted again with fewer buckets. A bucket given up saves up to two
    graphs (itself and its variant), so each round gives up half the overrun; the coverage
    buckets have no variant, so a budget that holds them ends the rounds."""
    buckets = budget
    while True:
        plan = _fit(trace, lim, buckets, prefill_bs)
        over = graph_count(plan.prompt, plan.decode) - budget
        if over <= 0:
            return plan
        buckets -= (over + 1) // 2


def _fit(
    trace: Mapping[TracedShape, int], lim: _Limits, budget: int, prefill_bs: int
) -> BucketPlan:
    q_max, c_max, d_max = lim.query_max, lim.prompt_ctx_max, lim.decode_blocks_max
    packed_c = max(c_max, 1) * PACKED_CONTEXT_FACTOR
    tokens, per_seq = lim.max_num_batched_tokens, lim.blocks_per_seq
    prefill_cap = min(prefill_bs, lim.max_num_seqs)

    def ctx_limit(batch: int) -> int:
        return packed_c if batch == 1 else c_max  # a single row may be a packed prefill

    def legal(s: TracedShape) -> bool:
        if s.phase == "prompt":
            return (
                s.batch_size <= prefill_cap
                and s.batch_size * s.query_len <= tokens
                and s.query_len <= q_max
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
    prices = _fit_prices(shapes, lim.block_size)

    # Coverage first: with these every legal step has a bucket, traced or not, and every
    # prefill batch of up to VLLM_PROMPT_BS_BUCKET_MAX sequences within the token budget runs as
    # a batch (the largest query for its batch size, the largest context); the single row also
    # holds packed prefills.
    decode_bs = min(lim.max_num_seqs, d_max)
    fixed = {
        Bucket("prompt", 1, q_max, packed_c),
        Bucket("decode", decode_bs, 1, min(d_max, decode_bs * per_seq)),
    }
    fixed.update(
        Bucket("prompt", b, min(q_max, tokens // b), ctx_limit(b))
        for b in range(1, prefill_cap + 1)
        if tokens // b >= 1
    )
    if budget < len(fixed):
        raise EnvError(
            f"{VLLM_BUCKETING_GRAPH_BUDGET}={budget} is below the {len(fixed)} buckets the "
            "fitted plan needs to cover every step (the largest decode shape and, for each "
            "prefill batch size up to VLLM_PROMPT_BS_BUCKET_MAX, the largest prompt shape); raise "
            f"it to at least {len(fixed)} or unset it."
        )
    keep = set(fixed)

    def rounded(s: TracedShape, bits: int) -> Bucket:
        if s.phase == "prompt":  # the batch stays exact: it is small and bounds the query
            q = min(_round_bits(s.query_len, bits), q_max, tokens // s.batch_size)
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
    chosen = _greedy(list(cells.values()), candidates, fixed, budget - len(fixed), prices)
    chosen = _refine(list(cells.values()), candidates, chosen, fixed, prices)
    return BucketPlan(FITTED_STRATEGY, *_lower(list(cells.values()), chosen, keep, prices), prices)


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


def prefill_batch_max(environ: Mapping[str, str] | None = None) -> int:
    """The most sequences one prefill bucket holds: VLLM_PROMPT_BS_BUCKET_MAX, default 1."""
    found = _Env(os.environ if environ is None else environ).param(_PROMPT_BS, "MAX")
    return found[1] if found else 1


def _fitted_from_env(env: _Env, lim: _Limits, *, exp_graphs: int) -> BucketPlan:
    raw = env.raw(VLLM_BUCKETING_TRACE)
    if raw is None:
        raise EnvError(
            f"{VLLM_BUCKETING_STRATEGY}=fitted needs {VLLM_BUCKETING_TRACE}=<file>, a trace of "
            "step shapes; record one while serving under another strategy with "
            "VLLM_BUCKETING_RECORD_TRACE=<file>, or choose exp, lin or pad."
        )
    budget = env.integer(VLLM_BUCKETING_GRAPH_BUDGET, 1)
    found = env.param(_PROMPT_BS, "MAX")
    plan = _fit_graphs(
        read_trace(raw.strip()),
        lim,
        exp_graphs if budget is None else budget,
        found[1] if found else 1,
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


# ------------------------------------------------------------------------------- bucket file


def _file_error(path: str, line_no: int, line: str, problem: str) -> EnvError:
    return EnvError(
        f"{VLLM_BUCKETING_FROM_FILE}={path!r}, line {line_no} ({line.strip()!r}): {problem}. "
        "Each line must be (batch_size, query_len, ctx_blocks), each item an integer, a list of "
        "integers or range(start, stop[, step]), e.g. (1, [256, 512], range(0, 8, 2)); fix the "
        "line or unset the variable."
    )


def _file_item(node: ast.expr, fail) -> list[int]:
    def literal(n: ast.expr) -> int:
        try:
            value = ast.literal_eval(n)
        except ValueError:
            raise fail("only integers, lists of integers and range(...) are allowed") from None
        if not isinstance(value, int) or isinstance(value, bool):
            raise fail(f"{value!r} is not an integer")
        return value

    if isinstance(node, ast.List):
        values = [literal(e) for e in node.elts]
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "range":
        if node.keywords or not 1 <= len(node.args) <= 3:
            raise fail("range takes 1 to 3 integer arguments")
        args = [literal(a) for a in node.args]
        if len(args) == 3 and args[2] == 0:
            raise fail("a range step cannot be 0")
        values = list(range(*args))
    else:
        values = [literal(node)]
    if not values:
        raise fail("an item is empty")
    return values


def read_bucket_file(path: str) -> list[tuple[int, int, int]]:
    """Every (batch_size, query_len, ctx_blocks) a bucket file lists; EnvError when unusable."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise EnvError(
            f"{VLLM_BUCKETING_FROM_FILE}={path!r} cannot be read ({exc}); point it at a readable "
            "bucket file or unset it to generate the buckets."
        ) from None
    shapes: list[tuple[int, int, int]] = []
    for line_no, line in enumerate(text.splitlines(), 1):
        source = line.split("#", 1)[0].strip()
        if not source:
            continue

        def fail(problem: str, line_no=line_no, line=line) -> EnvError:
            return _file_error(path, line_no, line, problem)

        try:
            node = ast.parse(source, mode="eval").body
        except SyntaxError:
            raise fail("not a tuple") from None
        if not isinstance(node, ast.Tuple) or len(node.elts) != 3:
            raise fail("not a tuple of three items")
        items = [_file_item(e, fail) for e in node.elts]
        if math.prod(len(i) for i in items) > MAX_BUCKETS_PER_FILE_LINE:
            raise fail(f"expands to more than {MAX_BUCKETS_PER_FILE_LINE} buckets")
        for floor, values, name in zip((1, 1, 0), items, ("batch_size", "query_len", "ctx_blocks")):
            if min(values) < floor:
                raise fail(f"{name} must be >= {floor}")
        shapes.extend((b, q, c) for b, q, c in product(*items))
    return shapes


def _file_buckets(path: str, lim: _Limits) -> tuple[list[Bucket], list[Bucket]]:
    prompt, decode, dropped = [], [], []
    for b, q, c in read_bucket_file(path):
        if q == 1:
            bucket = _decode_bucket(b, c, lim)
            if bucket is None:
                dropped.append((b, q, c))
            else:
                decode.append(bucket)
        elif b * q > lim.max_num_batched_tokens or c > lim.prompt_ctx_max:
            dropped.append((b, q, c))
        else:
            prompt.append(Bucket("prompt", b, q, c))
    if dropped:
        logger.warning(
            "%s: dropped %d bucket(s) no step within the engine limits can use "
            "(batch_size * query_len > max_num_batched_tokens, context beyond max_model_len, "
            "or fewer decode blocks than sequences): %s",
            VLLM_BUCKETING_FROM_FILE,
            len(dropped),
            sorted(set(dropped)),
        )
    for phase, found, example in (
        ("prompt", prompt, "(1, 128, 0)"),
        ("decode", decode, "(1, 1, 4)"),
    ):
        if not found:
            raise EnvError(
                f"{VLLM_BUCKETING_FROM_FILE}={path!r} gives no usable {phase} bucket; add at "
                f"least one line such as {example} (query_len 1 marks a decode bucket)."
            )
    return prompt, decode


# ----------------------------------------------------------------------------------- entry point


def plan_from_env(
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    block_size: int,
    num_kv_blocks: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> BucketPlan:
    """Build the plan from the environment (environ defaults to os.environ).

    Raises EnvError on bad input, naming the variable and the fix.
    ``num_kv_blocks`` (when known, after the KV cache is sized) caps the decode block range at
    3x the physical blocks. Warnings are logged for ignored or deprecated settings.
    """
    lim = _Limits(max_num_seqs, max_num_batched_tokens, max_model_len, block_size, num_kv_blocks)
    env = _Env(os.environ if environ is None else environ)
    env.warn_unknown()
    strategy = _read_strategy(env)
    env.validate_all()
    path = env.raw(VLLM_BUCKETING_FROM_FILE)
    if path is not None:
        prompt, decode = _file_buckets(path.strip(), lim)
        return BucketPlan(FILE_STRATEGY, tuple(prompt), tuple(decode))
    ranges = _ranges(strategy, env, lim)
    prompt = _prompt_grid(ranges[_PROMPT_BS], ranges[_PROMPT_QUERY], ranges[_PROMPT_CTX], lim)
    decode = _decode_grid(ranges[_DECODE_BS], ranges[_DECODE_BLOCK], lim)
    if strategy == FITTED_STRATEGY:
        # Its default budget: the graphs exp warms up (the grid may list a bucket twice).
        return _fitted_from_env(env, lim, exp_graphs=graph_count(prompt, decode))
    for phase, found in (("prompt", prompt), ("decode", decode)):
        if not found:
            raise EnvError(
                f"the VLLM_{phase.upper()}_*_BUCKET_* settings leave no {phase} bucket within the "
                "engine limits (max_num_batched_tokens, max_model_len, max_num_seqs); lower their "
                "MIN values or unset them."
            )
    return BucketPlan(strategy, tuple(prompt), tuple(decode))
