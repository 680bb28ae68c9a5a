"""The engine limits a plan is built for, and the largest values a step can have within them."""

from __future__ import annotations

import math
from dataclasses import dataclass

# Headroom Intel keeps over the physical KV blocks for decode block references (prefix caching).
KV_BLOCK_REFERENCE_HEADROOM = 3


@dataclass(frozen=True)
class Limits:
    """The engine limits ``plan_from_env`` is given, checked; derived maxima as properties."""

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
