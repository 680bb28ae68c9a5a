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

from collections.abc import Callable
from typing import Any

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy, QuantizationType
from torch.nn import Parameter
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
from vllm.model_executor.parameter import (
    BasevLLMParameter,
    ChannelQuantScaleParameter,
    GroupQuantScaleParameter,
    ModelWeightParameter,
    PackedColumnParameter,
    PackedvLLMParameter,
    PerTensorScaleParameter,
)

from vllm_gaudi_quant.methods import ct_mxfp4, fp8
from vllm_gaudi_quant.methods.fp8_checkpoint import kv_range_factor
from vllm_gaudi_quant.methods.uint4 import (
    GROUP,
    PACK,
    REPLICATED,
    Uint4Experts,
    Uint4MoEMethod,
    check_expert_sizes,
    dequantize,
    pack_cols,
    per_expert,
    replace_parameter,
    unpack_cols,
    unpack_rows,
)

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
SYMMETRIC_ZERO = 8  # the offset compressed-tensors adds to signed 4-bit values when packing


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


class HpuW8A8Fp8(CompressedTensorsScheme):
    """FP8 weights and activations through Gaudi's FP8 GEMM (`apply_fp8_linear`)."""

    def __init__(self, per_channel: bool, static_input: bool) -> None:
        self.per_channel = per_channel
        self.static_input = static_input

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    def create_weights(
        self,
        layer: Any,
        output_partition_sizes: list[int],
        input_size_per_partition: int,
        params_dtype: torch.dtype,
        weight_loader: Callable,
        **kwargs: Any,
    ) -> None:
        n = sum(output_partition_sizes)
        layer.logical_widths = output_partition_sizes
        layer.register_parameter(
            "weight",
            ModelWeightParameter(
                data=torch.empty(n, input_size_per_partition, dtype=fp8.FP8_DTYPE),
                input_dim=1,
                output_dim=0,
                weight_loader=weight_loader,
            ),
        )
        if self.per_channel:
            scale: BasevLLMParameter = ChannelQuantScaleParameter(
                data=torch.empty(n, 1, dtype=torch.float32),
                output_dim=0,
                weight_loader=weight_loader,
            )
        else:
            # One scale per fused shard (q/k/v, gate/up), as the checkpoint stores them.
            scale = PerTensorScaleParameter(
                data=torch.full((len(output_partition_sizes),), torch.nan),
                weight_loader=weight_loader,
            )
        layer.register_parameter("weight_scale", scale)
        if self.static_input:
            layer.register_parameter(
                "input_scale",
                PerTensorScaleParameter(
                    data=torch.full((len(output_partition_sizes),), torch.nan),
                    weight_loader=weight_loader,
                ),
            )

    def process_weights_after_loading(self, layer: Any) -> None:
        if self.per_channel:
            scale = layer.weight_scale.data.reshape(-1).float()
        else:
            # Each shard's tensor scale, repeated over that shard's output rows.
            widths = torch.tensor(layer.logical_widths)
            scale = layer.weight_scale.data.float().repeat_interleave(widths)
        weight = layer.weight.data
        factor = fp8._device_range_factor()
        if factor != 1.0:
            # Gaudi 2's E4M3 ends at 240: move the checkpoint's 448-range weights into it.
            weight = (weight.float() / factor).to(fp8.FP8_DTYPE)
            scale = scale * factor
        replace_parameter(layer, "weight", weight.t().contiguous())  # [K, N] for fp8_gemm_v2
        replace_parameter(layer, "weight_scale", scale)
        if self.static_input:
            scales = layer.input_scale.data
            if torch.isnan(scales).any():
                raise ValueError(
                    "compressed-tensors checkpoint with static activations has no input_scale "
                    "for a layer; re-export it with activation scales or use dynamic activations."
                )
            replace_parameter(layer, "input_scale", scales.max().float())
        else:
            layer.input_scale = None

    def apply_weights(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return fp8.apply_fp8_linear(x, layer.weight, layer.weight_scale, layer.input_scale, bias)


class HpuWNA16Uint4(CompressedTensorsScheme):
    """4-bit integer weights, float activations: dequantize with `convert_from_uint4`, matmul."""

    def __init__(self, group_size: int, symmetric: bool) -> None:
        self.group_size = group_size
        self.symmetric = symmetric

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    def create_weights(
        self,
        layer: Any,
        output_size: int,
        input_size: int,
        output_partition_sizes: list[int],
        input_size_per_partition: int,
        params_dtype: torch.dtype,
        weight_loader: Callable,
        **kwargs: Any,
    ) -> None:
        n = sum(output_partition_sizes)
        group_size = self.group_size if self.group_size != -1 else input_size
        if input_size_per_partition % PACK or n % PACK:
            raise ValueError(
                f"compressed-tensors 4-bit layer of {input_size_per_partition} inputs and {n} "
                f"outputs: both must be multiples of {PACK} on HPU; lower the tensor parallel size."
            )
        row_parallel = input_size != input_size_per_partition
        # One group over a row-parallel shard: every rank keeps the whole group's scale.
        replicate = row_parallel and self.group_size == -1
        if not replicate and input_size_per_partition % group_size:
            raise ValueError(
                f"compressed-tensors layer with {input_size_per_partition} inputs per rank is not "
                f"a multiple of its group size {group_size}; lower the tensor parallel size."
            )
        groups = (input_size if replicate else input_size_per_partition) // group_size
        layer.register_parameter(
            "weight_packed",
            PackedvLLMParameter(
                data=torch.empty(n, input_size_per_partition // PACK, dtype=torch.int32),
                input_dim=1,
                output_dim=0,
                packed_dim=1,
                packed_factor=PACK,
                weight_loader=weight_loader,
            ),
        )
        scales = torch.empty(n, groups, dtype=params_dtype)
        zeros = torch.zeros(n // PACK, groups, dtype=torch.int32)
        if replicate:
            layer.register_parameter(
                "weight_scale",
                ChannelQuantScaleParameter(data=scales, output_dim=0, weight_loader=weight_loader),
            )
            zero_param: BasevLLMParameter = PackedColumnParameter(
                data=zeros,
                output_dim=0,
                packed_dim=0,
                packed_factor=PACK,
                weight_loader=weight_loader,
            )
        else:
            layer.register_parameter(
                "weight_scale",
                GroupQuantScaleParameter(
                    data=scales, input_dim=1, output_dim=0, weight_loader=weight_loader
                ),
            )
            zero_param = PackedvLLMParameter(
                data=zeros,
                input_dim=1,
                output_dim=0,
                packed_dim=0,
                packed_factor=PACK,
                weight_loader=weight_loader,
            )
        if not self.symmetric:
            layer.register_parameter("weight_zero_point", zero_param)
        layer.register_parameter(
            "weight_shape",
            BasevLLMParameter(data=torch.empty(2, dtype=torch.int64), weight_loader=weight_loader),
        )

    def process_weights_after_loading(self, layer: Any) -> None:
        # [N, K/8] packed along K -> values [K, N] -> packed along N, [K, N/8].
        values = unpack_cols(layer.weight_packed.data).t()
        scales = layer.weight_scale.data.t().contiguous()  # [G, N]
        if self.symmetric:
            zeros = torch.full(scales.shape, SYMMETRIC_ZERO, dtype=torch.int32)
        else:
            zeros = unpack_rows(layer.weight_zero_point.data).t()  # [N/8, G] along N -> [G, N]
            del layer.weight_zero_point
        for name in ("weight_packed", "weight_scale", "weight_shape"):
            delattr(layer, name)
        layer.register_parameter("qweight", Parameter(pack_cols(values), requires_grad=False))
        layer.register_parameter("qzeros", Parameter(pack_cols(zeros), requires_grad=False))
        layer.register_parameter("scales", Parameter(scales, requires_grad=False))

    def apply_weights(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        weight = dequantize(layer, x.dtype)
        out = torch.matmul(x.reshape(-1, x.shape[-1]), weight)
        if bias is not None:
            out.add_(bias)
        return out.reshape(*x.shape[:-1], weight.shape[1])


class HpuWNA16MoE(Uint4MoEMethod):
    """4-bit WNA16 experts: each expert's tensors as compressed-tensors stores them
    (weight_packed [N, K/8] packed along K, weight_scale [N, G], weight_zero_point [N/8, G] when
    asymmetric, weight_shape), stacked per projection, repacked once."""

    label = "compressed-tensors"

    def __init__(self, layer: Any, group_size: int, symmetric: bool) -> None:
        super().__init__(layer)
        self.group_size = group_size
        self.symmetric = symmetric

    def create_weights(
        self,
        layer: Any,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        group = self.group_size
        hidden, inter = hidden_size, intermediate_size_per_partition
        check_expert_sizes(self.label, hidden, inter, group)
        n13 = self.moe.w13_num_shards * inter
        g13 = hidden // group if group != -1 else 1
        g2 = inter // group if group != -1 else 1
        # Stored [N, K] like vLLM's own weights: the expert loader splits them as they are.
        attrs = {**extra_weight_attrs, "quant_method": GROUP}
        # One group over a row-parallel shard of w2: every rank keeps it whole.
        w2_attrs = {**attrs, "quant_method": GROUP if group != -1 else REPLICATED}
        e, i32 = num_experts, torch.int32
        self.add_parameter(
            layer, "w13_weight_packed", torch.empty(e, n13, hidden // PACK, dtype=i32), attrs
        )
        self.add_parameter(
            layer, "w13_weight_scale", torch.empty(e, n13, g13, dtype=params_dtype), attrs
        )
        self.add_parameter(
            layer, "w2_weight_packed", torch.empty(e, hidden, inter // PACK, dtype=i32), attrs
        )
        self.add_parameter(
            layer, "w2_weight_scale", torch.empty(e, hidden, g2, dtype=params_dtype), w2_attrs
        )
        if not self.symmetric:
            self.add_parameter(
                layer, "w13_weight_zero_point", torch.empty(e, n13 // PACK, g13, dtype=i32), attrs
            )
            self.add_parameter(
                layer,
                "w2_weight_zero_point",
                torch.empty(e, hidden // PACK, g2, dtype=i32),
                w2_attrs,
            )
        for proj in ("w13", "w2"):
            self.add_parameter(
                layer, f"{proj}_weight_shape", torch.empty(e, 2, dtype=torch.int64), attrs
            )

    def repack(self, layer: Any) -> dict[str, Uint4Experts]:
        packed = {}
        for proj in ("w13", "w2"):
            # [N, K/8] packed along K -> values [K, N] -> packed along N, [K, N/8].
            qweight = per_expert(
                lambda w: pack_cols(unpack_cols(w).t()),
                getattr(layer, f"{proj}_weight_packed").data,
            )
            scales = getattr(layer, f"{proj}_weight_scale").data.transpose(1, 2)  # [E, G, N]
            if self.symmetric:
                zeros = torch.full(scales.shape, SYMMETRIC_ZERO, dtype=torch.int32)
            else:
                # [N/8, G] packed along N -> [G, N]
                zeros = per_expert(
                    lambda z: unpack_rows(z).t(), getattr(layer, f"{proj}_weight_zero_point").data
                )
            packed[proj] = Uint4Experts(
                qweight=qweight, qzeros=per_expert(pack_cols, zeros), scales=scales
            )
        return packed
