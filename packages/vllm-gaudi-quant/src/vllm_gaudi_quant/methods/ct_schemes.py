"""The compressed-tensors schemes that run on Gaudi, which `HpuCompressedTensorsConfig`
(`compressed_tensors.py`, where the checkpoint formats are described) hands vLLM per layer:
W8A8-FP8 linears (`HpuW8A8Fp8`), 4-bit WNA16 linears (`HpuWNA16Uint4`) and MoE experts
(`HpuWNA16MoE`). (MXFP4 linears: `ct_mxfp4.py`.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn import Parameter
from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
    CompressedTensorsScheme,
)
from vllm.model_executor.parameter import (
    BasevLLMParameter,
    ChannelQuantScaleParameter,
    GroupQuantScaleParameter,
    ModelWeightParameter,
    PackedColumnParameter,
    PackedvLLMParameter,
    PerTensorScaleParameter,
)

from vllm_gaudi_quant.methods import fp8
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

SYMMETRIC_ZERO = 8  # the offset compressed-tensors adds to signed 4-bit values when packing


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
