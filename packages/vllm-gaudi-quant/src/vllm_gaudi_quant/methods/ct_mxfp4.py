"""compressed-tensors MXFP4 linears on HPU (`mxfp4-pack-quantized`, llm-compressor's MXFP4 and
MXFP4A16 schemes): `HpuMxfp4Linear` and `dequantize_mxfp4`.

The checkpoint stores each linear as `weight_packed` uint8 [N, K / 2] (two E2M1 elements per
byte, element 2j in the low nibble) and `weight_scale` uint8 [N, K / 32] (E8M0: the block of 32
values along K is scaled by 2 ** (s - 127); 255 is NaN). Gaudi has no FP4 matmul, so the weights
stay packed in memory (4.25 bits per weight) and every forward dequantizes them to the
activation dtype with elementwise torch ops (no lookup table: an E2M1 code's value follows from
its exponent and mantissa bits), then runs one matmul, as the 4-bit integer formats do.

Activations stay in the model dtype. A checkpoint that also quantizes activations to MXFP4
(the W4A4 `MXFP4` scheme) runs weight-only, as vLLM runs it on GPUs without an FP4 GEMM; this is
logged once at start. MXFP4 weights with FP8 activations are refused with the other unsupported
schemes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy, QuantizationType
from torch.nn import Parameter
from vllm.logger import init_logger
from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
    CompressedTensorsScheme,
)
from vllm.model_executor.parameter import GroupQuantScaleParameter, ModelWeightParameter

logger = init_logger(f"vllm.{__name__}")

BLOCK = 32  # values per E8M0 scale
FORMAT = "mxfp4-pack-quantized"
E8M0_BIAS = 127
E8M0_NAN = 255


def is_mxfp4(weights: QuantizationArgs) -> bool:
    """Static symmetric 4-bit float weights in groups of 32: MXFP4 (E8M0 scales)."""
    return (
        weights.type == QuantizationType.FLOAT
        and weights.num_bits == 4
        and weights.strategy == QuantizationStrategy.GROUP
        and weights.group_size == BLOCK
        and bool(weights.symmetric)
        and not weights.dynamic
    )


def runs_weight_only(inputs: QuantizationArgs | None) -> bool:
    """Activations HPU runs beside MXFP4 weights: none, or MXFP4 ones (then kept in the model
    dtype, logged)."""
    return inputs is None or (
        inputs.type == QuantizationType.FLOAT
        and inputs.num_bits == 4
        and inputs.group_size == BLOCK
        and bool(inputs.dynamic)
    )


def dequantize_mxfp4(
    packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """[N, K] weight in `dtype` from `packed` uint8 [N, K / 2] and `scales` uint8 [N, K / 32]."""
    rows = packed.shape[0]
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(rows, -1, BLOCK)
    exponent = ((codes >> 1) & 0x3).to(torch.float32)
    mantissa = (codes & 0x1).to(torch.float32)
    # E2M1: exponent 0 is subnormal (0 or 0.5); otherwise (1 + m / 2) * 2 ** (e - 1).
    magnitude = torch.where(
        exponent == 0, 0.5 * mantissa, (2.0 + mantissa) * torch.exp2(exponent - 2.0)
    )
    sign = 1.0 - 2.0 * (codes >> 3).to(torch.float32)
    scale = torch.exp2(scales.to(torch.float32) - E8M0_BIAS)
    scale = torch.where(scales == E8M0_NAN, torch.nan, scale)
    return (sign * magnitude * scale.unsqueeze(-1)).reshape(rows, -1).to(dtype)


class HpuMxfp4Linear(CompressedTensorsScheme):
    """MXFP4 weights, activations in the model dtype: dequantize per forward, then matmul."""

    _logged_weight_only = False

    def __init__(self, activations_quantized: bool) -> None:
        if activations_quantized and not HpuMxfp4Linear._logged_weight_only:
            HpuMxfp4Linear._logged_weight_only = True
            logger.info(
                "compressed-tensors MXFP4 checkpoint with MXFP4 activations: HPU has no FP4 "
                "matmul, so activations stay in the model dtype (weight-only MXFP4)."
            )

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
        if input_size_per_partition % BLOCK:
            raise ValueError(
                f"compressed-tensors MXFP4 layer with {input_size_per_partition} inputs per rank: "
                f"not a multiple of the MXFP4 block ({BLOCK}); lower the tensor parallel size."
            )
        n = sum(output_partition_sizes)
        layer.logical_widths = output_partition_sizes
        layer.register_parameter(
            "weight_packed",
            ModelWeightParameter(
                data=torch.empty(n, input_size_per_partition // 2, dtype=torch.uint8),
                input_dim=1,
                output_dim=0,
                weight_loader=weight_loader,
            ),
        )
        layer.register_parameter(
            "weight_scale",
            GroupQuantScaleParameter(
                data=torch.empty(n, input_size_per_partition // BLOCK, dtype=torch.uint8),
                input_dim=1,
                output_dim=0,
                weight_loader=weight_loader,
            ),
        )

    def process_weights_after_loading(self, layer: Any) -> None:
        # Plain parameters: vLLM's loader attributes are not needed after loading.
        for name in ("weight_packed", "weight_scale"):
            data = getattr(layer, name).data
            delattr(layer, name)
            layer.register_parameter(name, Parameter(data, requires_grad=False))

    def apply_weights(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        weight = dequantize_mxfp4(layer.weight_packed, layer.weight_scale, x.dtype)
        return torch.nn.functional.linear(x, weight, bias)
