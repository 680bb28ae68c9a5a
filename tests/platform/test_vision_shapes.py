"""The vision encoder's shapes (worker/vision.py): what counts as one shape, one item per encoder
pass, the recompile count of encoder passes, and VLLM_HPU_VISION_WARMUP's parsing."""

from __future__ import annotations

import pytest
import torch

from vllm_gaudi_platform import envs
from vllm_gaudi_platform.worker import vision
from vllm_gaudi_platform.worker.recompiles import RecompileError, RecompileTracker


def _batch(grid: list[int], patches: int, fill: float = 0.0) -> dict:
    return {
        "pixel_values": torch.full((patches, 12), fill),
        "image_grid_thw": torch.tensor([grid]),
    }


def test_a_shape_is_the_tensor_shapes_and_the_small_integer_values():
    assert vision.encoder_signature(_batch([1, 4, 4], 16)) == vision.encoder_signature(
        _batch([1, 4, 4], 16, fill=3.0)  # pixel values do not change shapes
    )
    # The same tensor shapes with another grid (2x8 patches instead of 4x4): another shape.
    assert vision.encoder_signature(_batch([1, 2, 8], 16)) != vision.encoder_signature(
        _batch([1, 4, 4], 16)
    )
    assert vision.describe(_batch([1, 4, 4], 16)) == (
        "image_grid_thw [1, 3]=[1, 4, 4], pixel_values [16, 12]"
    )


def test_one_item_per_pass_hands_vllm_each_item_alone_and_restores_its_batching(monkeypatch):
    from vllm.v1.worker import gpu_model_runner

    calls = []

    def batching(mm_kwargs, *, device=None, pin_memory=False):
        calls.append([name for _, name in mm_kwargs])
        yield "image", len(mm_kwargs), {"items": len(mm_kwargs)}

    monkeypatch.setattr(gpu_model_runner, "group_and_batch_mm_kwargs", batching)
    items = [("image", "a"), ("image", "b"), ("image", "c")]
    with vision.one_item_per_pass():
        batches = list(gpu_model_runner.group_and_batch_mm_kwargs(items, device="cpu"))
    assert calls == [["a"], ["b"], ["c"]]
    assert [n for _, n, _ in batches] == [1, 1, 1]
    assert gpu_model_runner.group_and_batch_mm_kwargs is batching


def test_encoder_passes_count_as_recompiles_only_after_warmup_and_once_per_shape():
    tracker = RecompileTracker(strict=False)
    warmed = vision.encoder_signature(_batch([1, 4, 4], 16))
    tracker.record_encoder(warmed, lambda: "warmed")
    tracker.warmup_done = True
    tracker.record_encoder(warmed, lambda: "warmed")
    assert tracker.count == 0
    other = vision.encoder_signature(_batch([1, 8, 8], 64))
    tracker.record_encoder(other, lambda: "8x8")
    tracker.record_encoder(other, lambda: "8x8")  # compiled once, then reused
    assert tracker.count == 1 and tracker.encoder_seen == ["8x8"]


def test_strict_warmup_refuses_an_unwarmed_encoder_shape_and_names_the_setting():
    tracker = RecompileTracker(strict=True)
    tracker.warmup_done = True
    with pytest.raises(RecompileError, match=envs.VLLM_HPU_VISION_WARMUP):
        tracker.record_encoder(("x",), lambda: "pixel_values [16, 12]")


def test_vision_warmup_sizes_parse_heights_by_widths(monkeypatch):
    monkeypatch.delenv(envs.VLLM_HPU_VISION_WARMUP, raising=False)
    assert envs.vision_warmup_sizes() is None
    monkeypatch.setenv(envs.VLLM_HPU_VISION_WARMUP, "224x224, 448X336")
    assert envs.vision_warmup_sizes() == [(224, 224), (448, 336)]


@pytest.mark.parametrize("raw", ["224", "224x", "0x224", "ax224", "224x224,,"])
def test_a_bad_vision_warmup_size_is_refused_with_the_fix(monkeypatch, raw):
    monkeypatch.setenv(envs.VLLM_HPU_VISION_WARMUP, raw)
    with pytest.raises(envs.EnvError, match="HEIGHTxWIDTH"):
        envs.vision_warmup_sizes()
