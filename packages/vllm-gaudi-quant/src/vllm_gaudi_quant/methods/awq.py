"""AWQ (4-bit) checkpoints on the HPU platform, as quantization method `awq_hpu`.

A checkpoint whose `quantization_config` says `"quant_method": "awq"` is claimed on HPU (vLLM
probes registered custom methods before its own), parsed by vLLM's AutoAWQ config, and its linear
weights are repacked once after loading: AWQ interleaves the columns inside each int32 word
(`AWQ_ORDER`); Gaudi's `convert_from_uint4` reads them in plain order. Zero points are stored as
is (AWQ keeps the real zero point), scales [G, N] unchanged.

MoE layers (Mixtral...): each expert's qweight/qzeros/scales load stacked per projection (w13 =
gate and up, w2 = down), are repacked the same way once, and run through `Uint4MoEMethod`.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe import RoutedExperts, UnquantizedFusedMoEMethod
from vllm.model_executor.layers.linear import (
    LinearBase,
    UnquantizedLinearMethod,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.layers.quantization.auto_awq import AutoAWQConfig, BaseAWQLinearMethod
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped

from vllm_gaudi_quant.methods.uint4 import (
    GROUP,
    PACK,
    REPLICATED,
    Uint4Config,
    Uint4Experts,
    Uint4LinearMethod,
    Uint4MoEMethod,
    awq_to_plain,
    check_expert_sizes,
    per_expert,
    replace_parameter,
)

logger = init_logger(f"vllm.{__name__}")

NAME = "awq_hpu"


class HpuAwqConfig(Uint4Config, AutoAWQConfig):
    """AWQ on HPU: vLLM's AutoAWQ parsing, Gaudi's 4-bit kernel."""

    hpu_name = NAME
    checkpoint_marker = "awq"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not self.zero_point:
            raise ValueError(
                "AWQ checkpoint with zero_point=false: only AWQ with zero points (the AutoAWQ "
                "GEMM format) runs on HPU; set 'zero_point': true in quantization_config only if "
                "the checkpoint stores qzeros."
            )

    def get_quant_method(self, layer: Any, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, LinearBase):
            return UnquantizedLinearMethod() if self._skipped(prefix) else HpuAwqLinearMethod(self)
        if isinstance(layer, RoutedExperts):
            if self._skipped(prefix):
                return UnquantizedFusedMoEMethod(layer.moe_config)
            return HpuAwqMoEMethod(self, layer)
        return None

    def _skipped(self, prefix: str) -> bool:
        return is_layer_skipped(
            prefix,
            self.modules_to_not_convert,
            self.packed_modules_mapping,
            match_mode="substring",
        )


# Its parameters are vLLM parameter classes, which shard themselves (weight_loader_v2).
@register_weight_loader_v2_supported_method
class HpuAwqLinearMethod(BaseAWQLinearMethod, Uint4LinearMethod):
    """AWQ linear: vLLM's AWQ parameters, repacked once for `convert_from_uint4`."""

    def process_weights_after_loading(self, layer: Any) -> None:
        replace_parameter(layer, "qweight", awq_to_plain(layer.qweight.data))
        replace_parameter(layer, "qzeros", awq_to_plain(layer.qzeros.data))
        replace_parameter(layer, "scales", layer.scales.data)

    apply = Uint4LinearMethod.apply


class HpuAwqMoEMethod(Uint4MoEMethod):
    """AWQ experts: each expert's tensors as AWQ stores them (qweight [K, N/8] in AWQ's column
    order, qzeros [G, N/8], scales [G, N]), stacked per projection, repacked once."""

    label = "AWQ"

    def __init__(self, quant_config: HpuAwqConfig, layer: Any) -> None:
        super().__init__(layer)
        self.quant_config = quant_config

    def create_weights(
        self,
        layer: Any,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        group = self.quant_config.group_size
        hidden, inter = hidden_size, intermediate_size_per_partition
        check_expert_sizes(self.label, hidden, inter, group)
        n13 = self.moe.w13_num_shards * inter
        g13 = hidden // group if group != -1 else 1
        # One group over a row-parallel shard of w2: every rank keeps it whole.
        g2 = inter // group if group != -1 else 1
        # AWQ stores [K, N]: vLLM's expert loader splits the other dim (is_transposed).
        attrs = {**extra_weight_attrs, "is_transposed": True, "quant_method": GROUP}
        w2_scale_attrs = {**attrs, "quant_method": GROUP if group != -1 else REPLICATED}
        e, i32 = num_experts, torch.int32
        self.add_parameter(
            layer, "w13_qweight", torch.empty(e, hidden, n13 // PACK, dtype=i32), attrs
        )
        self.add_parameter(layer, "w13_qzeros", torch.empty(e, g13, n13 // PACK, dtype=i32), attrs)
        self.add_parameter(layer, "w13_scales", torch.empty(e, g13, n13, dtype=params_dtype), attrs)
        self.add_parameter(
            layer, "w2_qweight", torch.empty(e, inter, hidden // PACK, dtype=i32), attrs
        )
        self.add_parameter(
            layer, "w2_qzeros", torch.empty(e, g2, hidden // PACK, dtype=i32), w2_scale_attrs
        )
        self.add_parameter(
            layer, "w2_scales", torch.empty(e, g2, hidden, dtype=params_dtype), w2_scale_attrs
        )

    def repack(self, layer: Any) -> dict[str, Uint4Experts]:
        return {
            proj: Uint4Experts(
                qweight=per_expert(awq_to_plain, getattr(layer, f"{proj}_qweight").data),
                qzeros=per_expert(awq_to_plain, getattr(layer, f"{proj}_qzeros").data),
                scales=getattr(layer, f"{proj}_scales").data,
            )
            for proj in ("w13", "w2")
        }
