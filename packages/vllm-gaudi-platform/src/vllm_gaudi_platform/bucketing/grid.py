"""The buckets of a generated plan: every combination of the dimensions' values, less those no
legal step within the engine limits can need (rules: the package docstring,
``bucketing/__init__.py``)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from itertools import product

from vllm_gaudi_platform.bucketing.buckets import Bucket, BucketPlan
from vllm_gaudi_platform.bucketing.limits import Limits
from vllm_gaudi_platform.bucketing.settings import (
    DECODE_BLOCK,
    DECODE_BS,
    PROMPT_BS,
    PROMPT_CTX,
    PROMPT_QUERY,
    Dim,
)
from vllm_gaudi_platform.envs import EnvError


def _with_lowest(values: list[int], floor: int) -> Iterator[tuple[int, int]]:
    """(lowest real value that rounds up to v, v) for each value v."""
    lowest = floor
    for v in values:
        yield lowest, v
        lowest = v + 1


def _min_context_tokens(blocks: int, block_size: int) -> int:
    return 0 if blocks == 0 else (blocks - 1) * block_size + 1


def prompt_grid(bs: list[int], query: list[int], ctx: list[int], lim: Limits) -> list[Bucket]:
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


def decode_bucket(b: int, c: int, lim: Limits) -> Bucket | None:
    if c < b:
        return None  # every sequence holds at least one block
    return Bucket("decode", b, 1, min(c, b * lim.blocks_per_seq))


def decode_grid(bs: list[int], blocks: list[int], lim: Limits) -> list[Bucket]:
    buckets = []
    for (b_lo, b), c in product(_with_lowest(bs, 1), blocks):
        if b_lo <= lim.max_num_seqs and (bucket := decode_bucket(b, c, lim)):
            buckets.append(bucket)
    return buckets


def grids(ranges: Mapping[Dim, list[int]], lim: Limits) -> tuple[list[Bucket], list[Bucket]]:
    """The prompt and decode buckets of each dimension's values (``ranges``)."""
    prompt = prompt_grid(ranges[PROMPT_BS], ranges[PROMPT_QUERY], ranges[PROMPT_CTX], lim)
    decode = decode_grid(ranges[DECODE_BS], ranges[DECODE_BLOCK], lim)
    return prompt, decode


def grid_plan(strategy: str, ranges: Mapping[Dim, list[int]], lim: Limits) -> BucketPlan:
    """The plan of a strategy that generates each dimension's values; EnvError when a phase has
    no bucket left within the engine limits."""
    prompt, decode = grids(ranges, lim)
    for phase, found in (("prompt", prompt), ("decode", decode)):
        if not found:
            raise EnvError(
                f"the VLLM_{phase.upper()}_*_BUCKET_* settings leave no {phase} bucket within the "
                "engine limits (max_num_batched_tokens, max_model_len, max_num_seqs); lower their "
                "MIN values or unset them."
            )
    return BucketPlan(strategy, tuple(prompt), tuple(decode))
