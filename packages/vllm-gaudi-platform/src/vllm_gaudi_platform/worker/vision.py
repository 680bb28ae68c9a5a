"""The vision encoder's shapes: one image per encoder pass, warmed per image size.

On a Gaudi every new input shape of the vision tower compiles (a graph recipe in lazy mode, its
ops' kernels in eager mode). vLLM's runner batches the images a step needs into one encoder pass,
so its shapes would depend on how many images of which sizes meet in a step. Here:

- each multimodal item is encoded in a pass of its own (`one_item_per_pass`, around vLLM's
  `_execute_mm_encoder`), so an image's encoder shapes depend on its size alone;
- warmup runs the encoder on one image of each size in VLLM_HPU_VISION_WARMUP (unset: the
  largest image the model's processor makes, the one vLLM profiles) and records the shapes;
- every encoder pass is checked (`track_encoder`, around the model's `embed_multimodal`): shapes
  not warmed count as a recompile (`RecompileTracker.record_encoder`), are logged with the
  image's shapes, and still run.

A shape is the shape and dtype of every tensor the pass takes, plus the values of small integer
tensors (an image grid such as Qwen2-VL's t/h/w patches decides shapes inside the tower).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from vllm.logger import init_logger

from vllm_gaudi_platform import envs

logger = init_logger(f"vllm.{__name__}")

_SMALL_INT_TENSOR = 64  # integer tensors up to this many elements are part of a shape by value


def _shape_of(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        by_value = not value.is_floating_point() and value.numel() <= _SMALL_INT_TENSOR
        values = tuple(value.flatten().tolist()) if by_value else None
        return (tuple(value.shape), str(value.dtype).removeprefix("torch."), values)
    if isinstance(value, list | tuple):
        return tuple(_shape_of(v) for v in value)
    return None  # flags and other non-tensors do not change shapes


def encoder_signature(batch: Mapping[str, Any]) -> tuple:
    """The shapes one encoder pass takes, as a hashable value."""
    return tuple((key, _shape_of(batch[key])) for key in sorted(batch))


def describe(batch: Mapping[str, Any]) -> str:
    parts = []
    for key in sorted(batch):
        value = batch[key]
        if isinstance(value, torch.Tensor):
            shape = _shape_of(value)
            parts.append(f"{key} {list(shape[0])}" + (f"={list(shape[2])}" if shape[2] else ""))
    return ", ".join(parts) or "no tensors"


@contextlib.contextmanager
def one_item_per_pass() -> Iterator[None]:
    """vLLM's `_execute_mm_encoder` batches consecutive items of one modality into a pass
    (`group_and_batch_mm_kwargs`, looked up in its module); within this context every item is
    a batch of its own, in the same order, so the outputs map to the items as before."""
    from vllm.v1.worker import gpu_model_runner

    batched = gpu_model_runner.group_and_batch_mm_kwargs

    def one_by_one(mm_kwargs: list, **kwargs: Any) -> Iterator[tuple[str, int, Any]]:
        for item in mm_kwargs:
            yield from batched([item], **kwargs)

    gpu_model_runner.group_and_batch_mm_kwargs = one_by_one
    try:
        yield
    finally:
        gpu_model_runner.group_and_batch_mm_kwargs = batched


def track_encoder(runner: Any) -> None:
    """Route the model's `embed_multimodal` through the runner's recompile tracker."""
    model = runner.model
    embed = getattr(model, "embed_multimodal", None)
    if embed is None or getattr(embed, "_hpu_tracked", False):
        return

    def tracked(**batch: Any) -> Any:
        runner.recompiles.record_encoder(encoder_signature(batch), lambda: describe(batch))
        return embed(**batch)

    tracked._hpu_tracked = True  # type: ignore[attr-defined]
    model.embed_multimodal = tracked


def _dummy_item(runner: Any, size: tuple[int, int] | None) -> Any:
    """One image's encoder inputs as vLLM's processor makes them for a dummy image of `size`
    (height, width in pixels), or of the largest size the processor makes."""
    from vllm.multimodal.processing.context import TimingContext

    processor = runner.mm_budget.processor
    if size is None:
        return processor.get_dummy_mm_inputs({"image": 1})["mm_kwargs"]["image"][0]
    from vllm.config.multimodal import ImageDummyOptions

    height, width = size
    inputs = processor.get_dummy_inputs(
        seq_len=runner.model_config.max_model_len,
        mm_counts={"image": 1},
        mm_options={"image": ImageDummyOptions(count=1, width=width, height=height)},
    )
    mm = processor.apply(inputs, timing_ctx=TimingContext(enabled=False))
    return mm["mm_kwargs"]["image"][0]


def warm(runner: Any) -> None:
    """Run the vision encoder once per image size to warm (VLLM_HPU_VISION_WARMUP)."""
    if not runner.supports_mm_inputs or runner.mm_budget is None:
        return
    if "image" not in runner.mm_budget.mm_max_toks_per_item:
        logger.info("HPU vision warmup: the model takes no images; nothing to warm")
        return
    from vllm.multimodal.utils import group_and_batch_mm_kwargs

    asked = envs.vision_warmup_sizes()
    sizes: list[tuple[int, int] | None] = list(asked) if asked else [None]
    start = time.perf_counter()
    shapes = []
    for size in sizes:
        item = _dummy_item(runner, size)
        batches = group_and_batch_mm_kwargs(
            [("image", item)], device=runner.device, pin_memory=False
        )
        for _, _, batch in batches:
            with torch.inference_mode():
                runner.model.embed_multimodal(**batch)
            shapes.append(describe(batch))
    runner.seam.synchronize()
    logger.info(
        "HPU vision warmup: %d image size(s) in %.2f s (%s)",
        len(sizes),
        time.perf_counter() - start,
        "; ".join(
            f"{'largest' if size is None else f'{size[0]}x{size[1]}'}: {shape}"
            for size, shape in zip(sizes, shapes, strict=True)
        ),
    )
