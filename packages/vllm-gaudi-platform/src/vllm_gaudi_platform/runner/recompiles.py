"""The recompile count: forward-pass shapes run after warmup that warmup did not run.

`HPUModelRunner` records every serving step's layout here (and `spec_decode.DraftBucketing` every
drafting pass); with VLLM_FULL_WARMUP=true an unwarmed shape raises `RecompileError`.
"""

from __future__ import annotations

from vllm.logger import init_logger

from vllm_gaudi_platform import envs
from vllm_gaudi_platform.attention import step_layout
from vllm_gaudi_platform.bucketing import Bucket

logger = init_logger(f"vllm.{__name__}")


class RecompileError(RuntimeError):
    """A forward pass ran a shape that warmup did not cover while VLLM_FULL_WARMUP=true."""


class RecompileTracker:
    """Counts forward-pass shapes run after warmup that warmup did not run, and the buckets run
    after warmup per phase (prompt, decode, verify)."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.warmed: set[Bucket] = set()
        self.warmup_done = False
        self.count = 0
        self.seen: list[Bucket] = []
        self.hits: dict[str, int] = {}

    def record(self, layout: step_layout.StepLayout) -> None:
        if not self.warmup_done:
            return
        for bucket in layout.buckets:
            self.hits[bucket.phase] = self.hits.get(bucket.phase, 0) + 1
            if bucket in self.warmed:
                continue
            self.count += 1
            self.seen.append(bucket)
            logger.warning(
                "Recompile #%d: %s bucket bs=%d query=%d ctx_blocks=%d was not warmed up",
                self.count,
                bucket.phase,
                bucket.batch_size,
                bucket.query_len,
                bucket.ctx_blocks,
            )
            if self.strict:
                raise RecompileError(
                    f"{bucket} was not warmed up and {envs.VLLM_FULL_WARMUP}=true forbids "
                    "recompiles after warmup; widen the bucket ranges (VLLM_*_BUCKET_MAX) or "
                    "unset VLLM_FULL_WARMUP."
                )
            self.warmed.add(bucket)  # compiled once now; later runs reuse it
