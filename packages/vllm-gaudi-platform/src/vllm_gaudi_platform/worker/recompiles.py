"""The recompile count: forward-pass shapes run after warmup that warmup did not run.

`HPUModelRunner` records every serving step's layout here (and `spec_decode.DraftBucketing` every
drafting pass); with VLLM_FULL_WARMUP=true an unwarmed shape raises `RecompileError`.
"""

from __future__ import annotations

from collections.abc import Callable

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
        # Shapes run so far: a bucket, and whether it ran as its packed-prefill variant where
        # that is a shape of its own (`distinct_packed`; the runner's HPU graphs decide it).
        self.warmed: set[tuple[Bucket, bool]] = set()
        self.distinct_packed: Callable[[Bucket], bool] = lambda bucket: False
        self.warmup_done = False
        self.count = 0
        self.seen: list[dict] = []
        self.hits: dict[str, int] = {}
        # Serving steps with several prompts in one prefill row (packed; for a model with
        # state-space layers only where no bucket holds them, even in passes).
        self.packed_prefills = 0
        # Vision-encoder passes (worker/vision.py): the shapes warmed, those met after warmup.
        self.warmed_encoder: set[tuple] = set()
        self.encoder_seen: list[str] = []

    def shape(self, bucket: Bucket, packed: bool) -> tuple[Bucket, bool]:
        """The shape a pass on `bucket` runs: its packed variant only where that differs."""
        return bucket, packed and bucket.phase == "prompt" and self.distinct_packed(bucket)

    def record(self, layout: step_layout.StepLayout) -> None:
        if not self.warmup_done:
            return
        one_pass = [p.layout for p in layout.parts.passes] if layout.parts else [layout]
        # (a DP rank's padding-only prefill part has no rows)
        packed = [
            p.prefill is not None and max(map(len, p.prefill.row_members), default=0) > 1
            for p in one_pass
        ]
        if any(packed):
            self.packed_prefills += 1
        for part, part_packed in zip(one_pass, packed):
            for bucket in part.buckets:
                self._record_bucket(bucket, part_packed)

    def _record_bucket(self, bucket: Bucket, packed: bool) -> None:
        self.hits[bucket.phase] = self.hits.get(bucket.phase, 0) + 1
        shape = self.shape(bucket, packed)
        if shape in self.warmed:
            return
        self.count += 1
        self.seen.append({**vars(bucket), "packed": shape[1]})
        variant = " (packed-prefill variant)" if shape[1] else ""
        logger.warning(
            "Recompile #%d: %s bucket bs=%d query=%d ctx_blocks=%d%s was not warmed up",
            self.count,
            bucket.phase,
            bucket.batch_size,
            bucket.query_len,
            bucket.ctx_blocks,
            variant,
        )
        if self.strict:
            raise RecompileError(
                f"{bucket}{variant} was not warmed up and {envs.VLLM_FULL_WARMUP}=true forbids "
                "recompiles after warmup; widen the bucket ranges (VLLM_*_BUCKET_MAX) or "
                "unset VLLM_FULL_WARMUP."
            )
        self.warmed.add(shape)  # compiled once now; later runs reuse it

    def record_encoder(self, signature: tuple, describe: Callable[[], str]) -> None:
        """One vision-encoder pass on `signature` (worker/vision.py); `describe` names its
        shapes for the log."""
        if signature in self.warmed_encoder:
            return
        self.warmed_encoder.add(signature)  # compiled once now; later passes reuse it
        if not self.warmup_done:
            return
        self.count += 1
        shapes = describe()
        self.encoder_seen.append(shapes)
        logger.warning(
            "Recompile #%d: a vision-encoder pass on %s was not warmed up (add its image size "
            "to %s)",
            self.count,
            shapes,
            envs.VLLM_HPU_VISION_WARMUP,
        )
        if self.strict:
            raise RecompileError(
                f"a vision-encoder pass on {shapes} was not warmed up and "
                f"{envs.VLLM_FULL_WARMUP}=true forbids recompiles after warmup; add the image "
                f"size to {envs.VLLM_HPU_VISION_WARMUP} or unset {envs.VLLM_FULL_WARMUP}."
            )
