"""compressed-tensors checkpoints on the HPU platform (vLLM's `compressed-tensors` method).

vLLM's CompressedTensorsConfig parses the checkpoint (config groups, targets, ignore lists, KV
cache scheme); this subclass only swaps the per-layer schemes for ones that run on Gaudi:

- W8A8-FP8 (`float-quantized` / `naive-quantized`, 8-bit float weights and activations), weight
  strategy `channel` or `tensor`, activations static per tensor or dynamic per token: FP8 weights
  kept, forward through `methods.fp8.apply_fp8_linear` (Gaudi's `fp8_gemm_v2`). Per-tensor scales
  of fused shards (q/k/v, gate/up) become one scale per output channel: no requantization.
- WNA16 with 4-bit integer weights (`pack-quantized`), symmetric or not, `group` or `channel`
  strategy: repacked once into `convert_from_uint4`'s layout (see `methods/uint4.py`).
  compressed-tensors packs eight values along the INPUT dim ([N, K/8]) in offset form (stored =
  signed value + 8, zero points too), so the stored values subtract exactly like unsigned ones
  and a symmetric layer's zero point is 8.
- MXFP4 (`mxfp4-pack-quantized`, E2M1 weights with E8M0 scales per 32 inputs): kept packed,
  dequantized per forward (`methods/ct_mxfp4.py`); activations stay in the model dtype.

MoE layers (`HpuWNA16MoE`): experts in the same 4-bit WNA16 scheme load stacked per projection
(w13 = gate and up, w2 = down), are repacked the same way and run through
`methods.uint4.Uint4MoEMethod` (dequantize, then the bf16 mixture_of_experts kernel). Experts
in the W8A8-FP8 scheme (channel or tensor weight scales, static or dynamic activations) carry the
tensor names of vLLM's `fp8` format (`w13_weight`, `w13_weight_scale` [E, 2] per tensor or
[E, rows, 1] per channel, `w13_input_scale` [E] when static; w2 alike) and run through
`methods.fp8.HpuFp8MoEMethod`: W8A8 on Gaudi's FP8 mixture_of_experts kernel, with the
checkpoint's static activation scales or per-token ones.

Any other scheme is refused when the model is built, naming the layer and what runs on HPU (FP8
experts with block weight scales among them, for now).

KV cache: a checkpoint with a `kv_cache_scheme` (8-bit float, symmetric, one scale per tensor)
stores its KV cache in FP8 with the checkpoint's k/v scales: `hpu_check_vllm_config` turns
kv_cache_dtype "auto" into "fp8_inc" (Gaudi's FP8 E4M3 cache) before any engine starts (an
explicit kv_cache_dtype wins, as in vLLM), and vLLM's compressed-tensors KV method loads
`k_scale`/`v_scale` into the attention layers, whose HPU backend quantizes with them.
"""

from __future__ import annotations

from typing import Any

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy, QuantizationType
from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe import RoutedExperts, UnquantizedFusedMoEMethod
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
    CompressedTensorsConfig,
)
from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
    CompressedTensorsScheme,
)
from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod

from vllm_gaudi_quant.methods import ct_mxfp4, fp8
from vllm_gaudi_quant.methods.ct_schemes import HpuW8A8Fp8, HpuWNA16MoE, HpuWNA16Uint4
from vllm_gaudi_quant.methods.fp8_checkpoint import kv_range_factor

logger = init_logger(f"vllm.{__name__}")

NAME = "compressed-tensors"
SUPPORTED_MOE = (
    "W8A8-FP8 (channel or tensor weight scales, static or dynamic activations) and "
    "4-bit WNA16 pack-quantized (group or channel, symmetric or not)"
)
SUPPORTED = (
    "W8A8-FP8 (channel or tensor weight scales, static or dynamic activations), 4-bit WNA16 "
    "pack-quantized (group or channel, symmetric or not) and MXFP4 mxfp4-pack-quantized "
    "(activations unquantized or MXFP4, run weight-only)"
)
# The KV cache dtype a kv_cache_scheme selects: FP8 E4M3 with per-layer scales (vLLM's table maps
# "fp8_inc" to torch.float8_e4m3fn, "fp8" to uint8 storage meant for CUDA kernels).
FP8_KV_CACHE_DTYPE = "fp8_inc"


def _kv_scales_in_device_range(method: BaseKVCacheMethod) -> None:
    """After vLLM's KV method has set a layer's k/v scales from the checkpoint, move them into the
    device's E4M3 range (checkpoint scales are written for 448; Gaudi 2 saturates at 240)."""
    process = method.process_weights_after_loading

    def process_in_device_range(layer: Any) -> None:
        from_checkpoint = hasattr(layer, "k_scale") and bool(
            (layer.k_scale > 0.0).any() or (layer.v_scale > 0.0).any()
        )
        process(layer)
        factor = kv_range_factor()
        if not from_checkpoint or factor == 1.0:
            return
        for name in ("_k_scale", "_v_scale"):
            getattr(layer, name).mul_(factor)
            setattr(layer, f"{name}_float", float(getattr(layer, name)))

    method.process_weights_after_loading = process_in_device_range  # type: ignore[method-assign]


class HpuCompressedTensorsConfig(CompressedTensorsConfig):
    """compressed-tensors on HPU: vLLM's parsing, Gaudi's kernels."""

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # a CUDA notion; Gaudi has none

    @staticmethod
    def _check_scheme_supported(
        min_capability: int, error: bool = True, match_exact: bool = False
    ) -> bool:
        return True  # the schemes below are Gaudi's; CUDA compute capability does not apply

    def get_quant_method(self, layer: Any, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, RoutedExperts):
            return self._moe_method(layer, prefix)
        method = super().get_quant_method(layer, prefix)
        if isinstance(method, BaseKVCacheMethod):
            _kv_scales_in_device_range(method)
        return method

    def _moe_method(self, layer: Any, prefix: str) -> QuantizeMethodBase:
        # Checkpoint configs target "Linear"; the experts are that scheme's linears, fused.
        self._add_fused_moe_to_target_scheme_map()
        projections = (
            layer.ckpt_gate_proj_name,
            layer.ckpt_up_proj_name,
            layer.ckpt_down_proj_name,
        )
        schemes = [self.get_scheme_dict(layer, f"{prefix}.0.{p}") for p in projections if p]
        if any(scheme != schemes[0] for scheme in schemes):
            raise ValueError(
                f"compressed-tensors checkpoint: the experts of MoE layer {prefix!r} are "
                "quantized with different schemes per projection; HPU runs them only when "
                "gate, up and down share one scheme."
            )
        if schemes[0] is None:  # the experts are in the ignore list
            return UnquantizedFusedMoEMethod(layer.moe_config)
        weights, inputs = schemes[0].get("weights"), schemes[0].get("input_activations")
        format = schemes[0].get("format") or self.quant_format
        if (
            isinstance(weights, QuantizationArgs)
            and inputs is None
            and format == "pack-quantized"
            and _is_wna16_int4(weights)
        ):
            group = weights.group_size
            return HpuWNA16MoE(
                layer,
                group_size=-1 if weights.strategy == QuantizationStrategy.CHANNEL else group,
                symmetric=bool(weights.symmetric),
            )
        if (
            isinstance(weights, QuantizationArgs)
            and isinstance(inputs, QuantizationArgs)
            and schemes[0].get("output_activations") is None
            and _is_fp8_w8a8(weights, inputs)
        ):
            return fp8.HpuFp8MoEMethod(
                layer,
                per_channel=weights.strategy == QuantizationStrategy.CHANNEL,
                static_input=not inputs.dynamic,
                label=NAME,
            )
        described = _describe(weights if isinstance(weights, QuantizationArgs) else None)
        raise ValueError(
            f"compressed-tensors checkpoint: MoE layer {prefix!r} uses a scheme HPU does not run "
            f"for experts (weights {described}, activations "
            f"{_describe(inputs if isinstance(inputs, QuantizationArgs) else None)}, format "
            f"{format}); supported on HPU for MoE: {SUPPORTED_MOE}."
        )

    def hpu_check_vllm_config(self, vllm_config: Any) -> None:
        """A `kv_cache_scheme` means an FP8 KV cache with the checkpoint's k/v scales: check the
        scheme is one HPU runs and select the FP8 cache, while vLLM is still building its config
        (before any engine starts). An explicit kv_cache_dtype is kept, as vLLM does."""
        scheme = self.kv_cache_scheme
        if scheme is None:
            return
        kind = (scheme.get("type"), scheme.get("num_bits"), scheme.get("strategy"))
        if kind != ("float", 8, "tensor") or not scheme.get("symmetric", True):
            raise ValueError(
                f"compressed-tensors checkpoint: kv_cache_scheme {scheme} is not one HPU runs; "
                "its FP8 KV cache takes 8-bit float, symmetric, one scale per tensor (strategy "
                "'tensor'). Re-export the checkpoint with that kv_cache_scheme, or without one."
            )
        cache_config = vllm_config.cache_config
        if cache_config.cache_dtype == "auto":
            # Gaudi's name for the E4M3 cache; vLLM's "fp8" is stored as uint8 bytes.
            cache_config.cache_dtype = FP8_KV_CACHE_DTYPE
            logger.info(
                "compressed-tensors checkpoint with a kv_cache_scheme: KV cache stored in FP8 "
                "with the checkpoint's k/v scales."
            )

    def _get_scheme_from_parts(  # type: ignore[override]
        self,
        weight_quant: QuantizationArgs,
        input_quant: QuantizationArgs | None,
        output_quant: QuantizationArgs | None = None,
        format: str | None = None,
        layer_name: str | None = None,
    ) -> CompressedTensorsScheme:
        format = format if format is not None else self.quant_format
        if output_quant is None and _is_fp8_w8a8(weight_quant, input_quant):
            return HpuW8A8Fp8(
                per_channel=weight_quant.strategy == QuantizationStrategy.CHANNEL,
                static_input=not input_quant.dynamic,  # type: ignore[union-attr]
            )
        if (
            output_quant is None
            and format == "pack-quantized"
            and input_quant is None
            and _is_wna16_int4(weight_quant)
        ):
            group = weight_quant.group_size
            return HpuWNA16Uint4(
                group_size=-1 if weight_quant.strategy == QuantizationStrategy.CHANNEL else group,
                symmetric=bool(weight_quant.symmetric),
            )
        if (
            output_quant is None
            and format == ct_mxfp4.FORMAT
            and ct_mxfp4.is_mxfp4(weight_quant)
            and ct_mxfp4.runs_weight_only(input_quant)
        ):
            return ct_mxfp4.HpuMxfp4Linear(activations_quantized=input_quant is not None)
        raise ValueError(
            f"compressed-tensors checkpoint: layer {layer_name!r} uses a scheme HPU does not run "
            f"(weights {_describe(weight_quant)}, activations {_describe(input_quant)}, format "
            f"{format}); supported on HPU: {SUPPORTED}."
        )


def _is_wna16_int4(weights: QuantizationArgs) -> bool:
    """4-bit integer weights with static group or channel scales and no activation order."""
    return (
        weights.type == QuantizationType.INT
        and weights.num_bits == 4
        and not weights.dynamic
        and weights.actorder in (None, "static")
        and weights.strategy in (QuantizationStrategy.GROUP, QuantizationStrategy.CHANNEL)
    )


def _describe(args: QuantizationArgs | None) -> str:
    if args is None:
        return "not quantized"
    return f"{args.type} {args.num_bits}-bit {args.strategy}" + (" dynamic" if args.dynamic else "")


def _is_fp8_w8a8(weight: QuantizationArgs, inputs: QuantizationArgs | None) -> bool:
    if inputs is None or weight.type != QuantizationType.FLOAT or weight.num_bits != 8:
        return False
    if inputs.type != QuantizationType.FLOAT or inputs.num_bits != 8 or not weight.symmetric:
        return False
    if weight.dynamic or weight.strategy not in (
        QuantizationStrategy.CHANNEL,
        QuantizationStrategy.TENSOR,
    ):
        return False
    if inputs.dynamic:
        return inputs.strategy in (QuantizationStrategy.TOKEN, QuantizationStrategy.TENSOR)
    return bool(inputs.symmetric) and inputs.strategy == QuantizationStrategy.TENSOR
