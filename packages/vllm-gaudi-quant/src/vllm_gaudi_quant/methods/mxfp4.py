"""MXFP4 gpt-oss experts on HPU: `HpuGptOssMxfp4Config` and `HpuMxfp4MoEMethod`.

gpt-oss checkpoints (`"quant_method": "mxfp4"`, which vLLM renames `gpt_oss_mxfp4` for that model
type) store only the experts in MXFP4: two E2M1 values per byte and one E8M0 scale per 32 values
along the input. Every other layer is bf16. The experts stay packed as loaded ([E, out, in / 2]
uint8 with [E, out, in / 32] uint8 scales) and run on Gaudi's MXFP4 mixture-of-experts kernel
(the seam's `mixture_of_experts_mxfp4`), which dequantizes inside the kernel and applies the
expert biases and gpt-oss's clamped SwiGLU (alpha 1.702, limit 7.0) over the interleaved gate/up
rows. vLLM's own method picks CUDA/ROCm/CPU kernels and refuses an HPU at construction.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import Parameter
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase, RoutedExperts
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.layers.quantization.mxfp4 import GptOssMxfp4Config
from vllm.model_executor.utils import set_weight_attrs

from vllm_gaudi_platform.seam import backend
from vllm_gaudi_platform.worker.routed_experts import (
    GATHER_COST_AS_STORED,
    gather_max_tokens,
    select_experts,
)
from vllm_gaudi_quant.methods.fp8_moe import route_to_local_experts

NAME = "gpt_oss_mxfp4"
BLOCK = 32  # values per E8M0 scale
# gpt-oss's clamped SwiGLU (vLLM's swigluoai activation; the model's reference implementation).
SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0


class HpuGptOssMxfp4Config(GptOssMxfp4Config):
    """vLLM's `gpt_oss_mxfp4` (its checkpoint claim, bf16 activations, unquantized linears),
    with the experts on `HpuMxfp4MoEMethod`."""

    def get_quant_method(self, layer: Any, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, LinearBase):
            return UnquantizedLinearMethod()  # gpt-oss quantizes its experts only
        if isinstance(layer, RoutedExperts):
            return HpuMxfp4MoEMethod(layer)
        return None


class HpuMxfp4MoEMethod(FusedMoEMethodBase):
    """gpt-oss MXFP4 experts (biased, swigluoai) on the MXFP4 kernel, weights packed as loaded."""

    def __init__(self, layer: Any) -> None:
        super().__init__(layer.moe_config)
        # gpt-oss's loader hands the packed per-expert tensors to methods of this weight dtype.
        self.weight_dtype = NAME
        moe = layer.moe_config
        problem = None
        if moe.activation != MoEActivation.SWIGLUOAI:
            problem = f"activation {moe.activation.value!r} (the kernel applies swigluoai)"
        elif not moe.has_bias:
            problem = "experts without biases (the kernel's MXFP4 form takes them)"
        elif layer.use_grouped_topk or layer.e_score_correction_bias is not None:
            problem = "grouped or bias-corrected routing"
        elif layer.apply_router_weight_on_input:
            problem = "router weights applied to the input"
        if problem is not None:
            raise ValueError(
                f"{NAME} MoE on HPU does not support {problem}; this MXFP4 checkpoint cannot be "
                "served by vllm-gaudi-quant."
            )
        self._gather_max_tokens: int | None = None

    @property
    def is_monolithic(self) -> bool:
        return True

    def get_fused_moe_quant_config(self, layer: Any) -> None:
        # Only vLLM's modular kernels read this; the HPU method runs its own kernel.
        return None

    def create_weights(
        self,
        layer: Any,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        inter = intermediate_size_per_partition
        for size, what in ((hidden_size, "hidden size"), (inter, "per-rank intermediate size")):
            if size % BLOCK:
                raise ValueError(
                    f"{NAME}: the experts' {what} {size} is not a multiple of the MXFP4 block "
                    f"({BLOCK}); choose a tensor-parallel size that keeps it one."
                )
        rows = self.moe.w13_num_shards * inter
        layer.params_dtype = params_dtype
        layer.num_experts = num_experts
        params = {
            "w13_weight": (num_experts, rows, hidden_size // 2),
            "w13_weight_scale": (num_experts, rows, hidden_size // BLOCK),
            "w2_weight": (num_experts, hidden_size, inter // 2),
            "w2_weight_scale": (num_experts, hidden_size, inter // BLOCK),
        }
        for name, shape in params.items():
            param = Parameter(torch.zeros(shape, dtype=torch.uint8), requires_grad=False)
            layer.register_parameter(name, param)
            block = {"quant_method": "block"} if name.endswith("_scale") else {}
            set_weight_attrs(param, {**extra_weight_attrs, **block})
        # vLLM's format: the biases are bf16 whatever the checkpoint.
        biases = {"w13_bias": (num_experts, rows), "w2_bias": (num_experts, hidden_size)}
        for name, bias_shape in biases.items():
            param = Parameter(torch.zeros(bias_shape, dtype=torch.bfloat16), requires_grad=False)
            layer.register_parameter(name, param)
            set_weight_attrs(param, extra_weight_attrs)

    def process_weights_after_loading(self, layer: Any) -> None:
        # The kernel reads the packed bytes as stored: gathering costs what they weigh.
        self._gather_max_tokens = gather_max_tokens(
            layer.local_num_experts, self.moe.experts_per_token, GATHER_COST_AS_STORED
        )

    def apply_monolithic(
        self,
        layer: Any,
        x: torch.Tensor,
        router_logits: torch.Tensor,
        input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        weights, ids = route_to_local_experts(layer, x, router_logits)
        num_local = layer.local_num_experts
        if self._gather_max_tokens is None:
            self.process_weights_after_loading(layer)
        assert self._gather_max_tokens is not None
        chosen = select_experts(ids, num_local, self._gather_max_tokens)

        def each(name: str) -> list[torch.Tensor]:
            return list(chosen.take(getattr(layer, name).data).unbind(0))

        x2 = x.reshape(-1, x.shape[-1])
        return (
            backend()
            .mixture_of_experts_mxfp4(
                x2,
                chosen.ids.to(torch.int32),  # the MXFP4 kernel's routing table is int32
                weights.to(x.dtype),
                each("w13_weight"),
                each("w2_weight"),
                [b.to(x.dtype) for b in each("w13_bias")],
                [b.to(x.dtype) for b in each("w2_bias")],
                each("w13_weight_scale"),
                each("w2_weight_scale"),
                0,
                chosen.count - 1,
                SWIGLU_ALPHA,
                SWIGLU_LIMIT,
            )
            .reshape(x.shape)
        )

    def apply(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError("HpuMxfp4MoEMethod is monolithic: vLLM calls apply_monolithic")
