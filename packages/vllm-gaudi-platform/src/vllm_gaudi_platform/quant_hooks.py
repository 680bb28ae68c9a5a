"""The hooks a quantization method may offer the HPU platform: the declared interface.

A quantization config (vLLM's `QuantizationConfig` subclass, registered by vllm-gaudi-quant or by
any other plugin) may define any of these methods; the platform calls each one the config has,
at the point named, and never imports a quantization wheel. Each is a Protocol of one method, so
a config offers the hooks it needs and `isinstance(config, Hook)` tells whether it has one.
tests/quant/test_quant_hooks.py checks every config of the quant wheel against them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


@runtime_checkable
class ChecksVllmConfig(Protocol):
    """Called by `HpuPlatform.check_and_update_config`, before any engine starts: refuse settings
    the method cannot run (raise with the setting and the fix), or adjust them."""

    def hpu_check_vllm_config(self, vllm_config: Any) -> None: ...


@runtime_checkable
class TransformsLoadedModel(Protocol):
    """Called once the model is loaded (LoRA layers in place), before warmup: returns the model
    the runner serves (INC FP8 patches its layers for measurement or FP8 here)."""

    def hpu_after_load_model(self, model: torch.nn.Module) -> torch.nn.Module: ...


@runtime_checkable
class FinalizesCalibration(Protocol):
    """Called by `HPUModelRunner.finalize_calibration` (the worker's shutdown and the
    `vllm-gaudi calibrate` command): write what the method measured; idempotent."""

    def hpu_finalize_calibration(self, model: torch.nn.Module) -> None: ...


HOOKS = (ChecksVllmConfig, TransformsLoadedModel, FinalizesCalibration)


@runtime_checkable
class RequantizesWeightUpdates(Protocol):
    """Offered by a LAYER method (not a config), called by the weight-transfer engine "hpu"
    (`distributed/weight_quantized.py`) during an in-place update: `hpu_stage_weight_update`
    gives a host Parameter in the checkpoint's layout and the model's dtype, holding the layer's
    current weight, with the loader the layer had before it was quantized; after the model's
    `load_weights` wrote a round into it, `hpu_commit_weight_update` quantizes it as the method
    did after loading and writes the weight and its scales into the layer's existing storage
    (graphs hold those tensors). A quantized layer whose method lacks them is refused at start."""

    def hpu_stage_weight_update(self, layer: torch.nn.Module) -> torch.nn.Parameter: ...

    def hpu_commit_weight_update(
        self, layer: torch.nn.Module, staged: torch.nn.Parameter
    ) -> None: ...


METHOD_HOOKS = (RequantizesWeightUpdates,)
