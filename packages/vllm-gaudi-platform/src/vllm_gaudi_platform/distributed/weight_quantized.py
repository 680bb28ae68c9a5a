"""Quantized models under in-place weight updates: which methods the HPU weight-transfer engine
takes, why the others are refused, and how a round reaches a method that re-quantizes.

A quantization method replaced the checkpoint's tensors with what it made of them after loading
(FP8 weights transposed for the GEMM with per-channel scales, packed 4-bit integers, ...). A
trainer sends high-precision weights in checkpoint names. A method that re-quantizes on the way
in offers two calls on its LINEAR METHOD (`quant_hooks.RequantizesWeightUpdates`):

- `hpu_stage_weight_update(layer)`: a host Parameter in the checkpoint's layout and the model's
  dtype, holding the layer's current weight (dequantized), with the loader the layer had before
  it was quantized; the model's own `load_weights` writes the round's tensors into it (name
  mapping, fused q/k/v and gate/up shards, tensor-parallel slicing, as at start);
- `hpu_commit_weight_update(layer, staged)`: quantize the staged weight as the method did after
  loading and write the weight and its scales into the layer's existing storage.

Only layers the round wrote are committed. Every other quantized layer kind is refused at start.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from vllm_gaudi_platform.quant_hooks import RequantizesWeightUpdates

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# The methods that re-quantize on the way in (vLLM's quantization names).
REQUANTIZED = ("fp8",)

_UNQUANTIZED_FIX = (
    "Serve the model unquantized (no --quantization and an unquantized checkpoint), or as an "
    "fp8 checkpoint (quant_method 'fp8'), to update its weights in place."
)
# Why each refused method cannot take a trainer's weights, by vLLM's quantization name.
WHY: dict[str, str] = {
    "awq_hpu": (
        "AWQ holds packed 4-bit weights with group scales and zero points chosen by its "
        "activation-aware calibration, which a trainer's round does not carry"
    ),
    "gptq_hpu": (
        "GPTQ holds packed 4-bit weights whose rounding GPTQ chose against calibration data "
        "(error compensation), which a trainer's round does not carry"
    ),
    "inc": (
        "INC FP8 scales every layer from measured activation statistics (QUANT_CONFIG's "
        "measurement run) and patches the layers for them; new weights would run with scales "
        "measured on the old ones"
    ),
    "compressed-tensors": (
        "compressed-tensors' schemes (W8A8-FP8, 4-bit WNA16, MXFP4) each re-lay their weights "
        "after loading in a layout of their own, and none of them re-quantizes on the way in"
    ),
    "gpt_oss_mxfp4": (
        "MXFP4 experts hold packed E2M1 values with E8M0 block scales re-laid for the MoE kernel, "
        "which is not re-quantized on the way in"
    ),
}


def refusal(vllm_config: VllmConfig, backend: str = "hpu") -> str | None:
    """Why the engine cannot update a model quantized as `vllm_config` says, or None."""
    quantization = getattr(vllm_config.model_config, "quantization", None)
    if quantization is None or quantization in REQUANTIZED:
        return None
    why = WHY.get(
        quantization,
        "the method replaced the checkpoint's tensors with what it made of them after loading "
        "and does not re-quantize on the way in",
    )
    return (
        f"weight_transfer_config backend {backend!r} cannot update a model served with "
        f"quantization={quantization!r}: {why}; writing a trainer's high-precision tensors into "
        f"it would be silently wrong. {_UNQUANTIZED_FIX}"
    )


def _quantized_method(module: torch.nn.Module) -> Any:
    """The quantization method of a layer that holds quantized weights, or None."""
    method = getattr(module, "quant_method", None)
    if method is None:
        return None
    from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod

    if isinstance(method, BaseKVCacheMethod) or type(method).__name__.startswith("Unquantized"):
        return None
    if any(base.__name__.startswith("Unquantized") for base in type(method).__mro__):
        return None
    return method


def model_refusal(model: torch.nn.Module, quantization: str | None) -> str | None:
    """Why a loaded model's quantized layers cannot take an update (the first kind found)."""
    for name, module in model.named_modules():
        method = _quantized_method(module)
        if method is not None and not isinstance(method, RequantizesWeightUpdates):
            return (
                f"weight update: layer {name!r} ({type(module).__name__}) runs "
                f"{type(method).__name__} of quantization={quantization!r}, which does not "
                "re-quantize a trainer's weights on the way in (with fp8, the linear layers do; "
                f"FP8 MoE experts do not yet). {_UNQUANTIZED_FIX}"
            )
    return None


@contextmanager
def staged_weights(model: torch.nn.Module) -> Iterator[list[set[str] | None]]:
    """For the body, every re-quantizing layer's `weight` is its staged checkpoint-layout
    Parameter (the model's loader writes a round into it); afterwards the quantized Parameters
    are back, and each layer the loader wrote is re-quantized into their storage. The body puts
    what `load_weights` returned (the names of the parameters it loaded, or None: every staged
    layer is committed) into the yielded list."""
    staged: list[tuple[str, torch.nn.Module, Any, torch.nn.Parameter, torch.nn.Parameter]] = []
    for name, module in model.named_modules():
        method = _quantized_method(module)
        if method is None:
            continue
        quantized = module._parameters["weight"]
        assert quantized is not None
        staged.append((name, module, method, method.hpu_stage_weight_update(module), quantized))
    for _, module, _, param, _ in staged:
        module._parameters["weight"] = param
    loaded: list[set[str] | None] = []
    ok = False
    try:
        yield loaded
        ok = True
    finally:
        for _, module, _, _, quantized in staged:
            module._parameters["weight"] = quantized
    if ok:
        names = loaded[0] if loaded else None
        for name, module, method, param, _ in staged:
            if names is None or f"{name}.weight" in names:
                method.hpu_commit_weight_update(module, param)
