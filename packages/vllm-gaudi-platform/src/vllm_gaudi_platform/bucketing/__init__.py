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
    ``graph_count``, packed-prefill variants included). Coverage first: for each prefill batch size
    up to ``VLLM_PROMPT_BS_BUCKET_MAX`` the largest prompt bucket within the token budget (batch
    size 1 with ``PACKED_CONTEXT_FACTOR`` times the context and the whole budget as its query, for
    packed prefills), and the largest decode bucket, so every legal step has a bucket, traced or
    not. Then, for prefills unlike the traced ones, a context ladder: per prefill batch size its
    largest query at contexts ``1, R, R**2, ...`` below its largest context
    (``R = FIT_CONTEXT_LADDER``, 4; ``R**2``, then no ladder, when it would take more than
    ``1/FIT_LADDER_SHARE`` of the budget left). Then, among candidate buckets (the traced shapes,
    rounded up to ``FIT_BITS`` significant bits per dimension; per batch size the bucket holding
    all shapes of that batch size or less; every combination of traced coordinates when a phase
    has few), a lazy greedy adds the one that lowers the traced padding most until the budget is
    spent, single swaps improve the choice while ``FIT_SWAP_WORK`` allows, and each bucket is
    lowered to the largest traced shape it serves. Padding is priced per column: the fit
    minimises the sum over the four columns (padded / traced prompt tokens, prompt context
    blocks, decode batch slots, decode blocks) of the column's padding ratio on the trace divided
    by ``exp``'s ratio of that column on the same trace (at least ``FIT_REFERENCE_FLOOR``), so
    that no column is given up for the others. One balancing round follows: the columns whose
    relative padding is above the mean of the four get their price raised by the square root of
    the excess, and that fit replaces the first if its worst column is lower. The plan keeps its
    prices (``BucketPlan.prices``) and its lookups return the cheapest bucket that fits by them.
    The ``VLLM_*_BUCKET_{MIN,STEP,MAX}`` ranges are ignored, except ``VLLM_PROMPT_BS_BUCKET_MAX``.
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
The runner adds the buckets of packed prefill rows to a generated plan
(``step_layout.with_packed_context``): more context per row, and, with a token budget above
``max_model_len``, longer single-row queries that only packed rows fill.

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

Layout
------
One module per strategy, the plan and its settings; each imports only the ones listed before it:

- ``buckets.py``: ``Bucket``, ``BucketPlan`` (the lookups), ``graph_count``, ``can_pack``,
  ``PACKED_CONTEXT_FACTOR``;
- ``limits.py``: the engine limits and the largest values a step can have within them;
- ``settings.py``: reading the variables (strategy, ranges and their lin/pad defaults,
  ``prefill_batch_max``);
- ``grid.py``: a generated plan's buckets (all combinations, less those no legal step needs);
- ``exp.py``, ``lin.py``, ``pad.py``, ``fitted.py``: one strategy each (``FIT_*`` tuning in
  ``fitted.py``); ``file.py``: the bucket file;
- ``plan.py``: ``plan_from_env`` and ``STRATEGY_PLANS``, the strategy name -> plan function table.

A new strategy is a module with a ``(Env, Limits) -> BucketPlan`` function and one line in
``STRATEGY_PLANS``. This module re-exports the public names.
"""

from vllm_gaudi_platform.bucketing.buckets import (
    PACKED_CONTEXT_FACTOR,
    Bucket,
    BucketPlan,
    can_pack,
    graph_count,
)
from vllm_gaudi_platform.bucketing.exp import exponential_range
from vllm_gaudi_platform.bucketing.file import FILE_STRATEGY, read_bucket_file
from vllm_gaudi_platform.bucketing.fitted import (
    FITTED_STRATEGY,
    fit_buckets,
    padding_ratios,
    trace_padding,
)
from vllm_gaudi_platform.bucketing.lin import linear_range
from vllm_gaudi_platform.bucketing.pad import padding_aware_range
from vllm_gaudi_platform.bucketing.plan import STRATEGIES, STRATEGY_PLANS, plan_from_env
from vllm_gaudi_platform.bucketing.settings import DEFAULT_STRATEGY, prefill_batch_max
from vllm_gaudi_platform.envs import BUCKET_VARIABLES

__all__ = [
    "BUCKET_VARIABLES",
    "DEFAULT_STRATEGY",
    "FILE_STRATEGY",
    "FITTED_STRATEGY",
    "PACKED_CONTEXT_FACTOR",
    "STRATEGIES",
    "STRATEGY_PLANS",
    "Bucket",
    "BucketPlan",
    "can_pack",
    "exponential_range",
    "fit_buckets",
    "graph_count",
    "linear_range",
    "padding_aware_range",
    "padding_ratios",
    "plan_from_env",
    "prefill_batch_max",
    "read_bucket_file",
    "trace_padding",
]
