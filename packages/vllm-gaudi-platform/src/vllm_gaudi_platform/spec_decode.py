"""Speculative decoding on HPU: which drafters run, and the bucket shapes of verification steps.

A verification step scores, for each sequence with drafts, its last sampled token plus its k draft
tokens: a query of 1 + k tokens on top of the sequence's cached context. The runner lays such
requests out like prefills with context (one grid row per request, see `step_layout.py`), so they
need buckets `(batch_size, 1 + k, ctx_blocks)` with the batch sizes of decode and the context
(per sequence) of prefill. `with_verify_buckets` adds these to the plan as phase "verify"; warmup
runs them and the recompile tracker counts any verification shape they miss.

Rejection sampling itself is vLLM's, with plain-torch stand-ins for its Triton kernels
(`triton_overrides.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm_gaudi_platform.bucketing import Bucket, BucketPlan

# Drafters that run on HPU today. The n-gram drafter needs no draft model: it looks up the last
# tokens in the prompt and output. Model-based drafters (EAGLE, MTP, draft models) launch further
# Triton kernels (vllm/v1/spec_decode/utils.py) that have no HPU stand-in yet.
SUPPORTED_METHODS = ("ngram",)

VERIFY_PHASE = "verify"


def check_speculative_config(speculative_config: Any) -> None:
    """Refuse, before any engine starts, a speculative method the HPU platform cannot run."""
    if speculative_config is None:
        return
    method = getattr(speculative_config, "method", None)
    if method in SUPPORTED_METHODS:
        return
    raise ValueError(
        f"speculative_config method {method!r} is not supported on HPU; supported: "
        f"{', '.join(SUPPORTED_METHODS)}. Use speculative_config={{'method': 'ngram', "
        "'num_speculative_tokens': k, 'prompt_lookup_max': n, 'prompt_lookup_min': m}, or "
        "drop speculative_config."
    )


def num_speculative_tokens(speculative_config: Any) -> int:
    """k of the config (0 without speculative decoding)."""
    if speculative_config is None:
        return 0
    return int(getattr(speculative_config, "num_speculative_tokens", 0) or 0)


def _doubling(top: int) -> list[int]:
    values, v = {top}, 1
    while v < top:
        values.add(v)
        v *= 2
    return sorted(values)


def verify_buckets(
    plan: BucketPlan,
    *,
    num_speculative_tokens: int,
    max_model_len: int,
    block_size: int,
    max_num_batched_tokens: int,
) -> tuple[Bucket, ...]:
    """The verification buckets for k = `num_speculative_tokens` drafts per sequence.

    Batch sizes: those of the plan's decode buckets (verification replaces decode for sequences
    with drafts), kept where batch * (1 + k) fits the token budget. Context blocks per sequence:
    1, 2, 4, ... up to the most a sequence can hold before its last 1 + k tokens (a sequence being
    verified has at least its prompt in the cache).
    """
    k = num_speculative_tokens
    if k <= 0:
        return ()
    query = 1 + k
    ctx_max = max(1, -(-(max_model_len - query) // block_size))
    batch_sizes = sorted({b.batch_size for b in plan.decode}) or [1]
    return tuple(
        Bucket(VERIFY_PHASE, bs, query, c)
        for bs in batch_sizes
        if bs * query <= max_num_batched_tokens
        for c in _doubling(ctx_max)
    )


def with_verify_buckets(plan: BucketPlan, buckets: tuple[Bucket, ...]) -> BucketPlan:
    """`plan` with the verification buckets among its prefill-shaped buckets.

    They share the prompt lookup: a step's requests with more than one new token take the
    cheapest warmed prefill-shaped bucket that holds them, so a verification step (and a short
    prompt) lands on a verify bucket, and a long prompt on a prompt bucket.
    """
    if not buckets:
        return plan
    return dataclasses.replace(plan, prompt=(*plan.prompt, *buckets))
