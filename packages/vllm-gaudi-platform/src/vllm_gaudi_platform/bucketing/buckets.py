"""A bucket, and the plan of buckets the runner warms up and pads every step to.

``Bucket`` is one warmed shape; ``BucketPlan`` holds a strategy's buckets and the lookups
(``find_prompt``, ``find_decode``) that pick the bucket a step is padded to. The rules are in the
package docstring (``bucketing/__init__.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

# A packed prefill row holds the context of all its requests; generated plans cover rows with up
# to this many times one sequence's largest context (step_layout.with_packed_context).
PACKED_CONTEXT_FACTOR = 4


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
    # Whether prompts that fit no bucket row by row may share one row (packed prefill). Off for
    # models with state-space layers, which scan each row as one sequence.
    pack_prefills: bool = True

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
