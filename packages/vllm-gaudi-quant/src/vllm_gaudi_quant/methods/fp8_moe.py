"""FP8 mixture of experts on HPU: `HpuFp8MoEMethod` and vLLM's plain top-k routing.

Expert weights stay FP8 [E, out, in] with their checkpoint scales. Per-tensor and per-channel
experts run W8A8 on Gaudi's FP8 `mixture_of_experts` overload (the seam's
`mixture_of_experts_fp8`): the tokens are cast to FP8 with the checkpoint's static input scale
(the largest of the layer's experts, as the kernel takes one scale for all of them) or one scale
per token (dynamic), and each expert's intermediate activations with its own static
`w2_input_scale`, or per token inside the kernel (dynamic). Per-tensor weight scales are spread
over the output rows: the kernel takes one scale per output channel.

Block-scaled experts (`weight_block_size`) run W8A16: the kernel takes no block scales, so each
call dequantizes the local experts tile by tile (exactly the checkpoint's weights) for the bf16
kernel; this is logged once. compressed-tensors W8A8-FP8 experts (per-tensor or per-channel
`weight_scale`) run through the same `HpuFp8MoEMethod`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.nn import Parameter
from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.utils import set_weight_attrs

from vllm_gaudi_platform.seam import backend
from vllm_gaudi_platform.worker.routed_experts import (
    GATHER_COST_AS_STORED,
    ExpertSelection,
    capture_routed_experts,
    dequantized_gather_cost,
    gather_max_tokens,
    local_expert_ids,
    select_experts,
)
from vllm_gaudi_quant.methods.fp8_checkpoint import NAME, _device_range_factor, _wrap_weight_loader
from vllm_gaudi_quant.methods.fp8_linear import (
    FP8_DTYPE,
    dequantize_blocks,
    quantize_activations,
)

logger = init_logger(f"vllm.{__name__}")

_KERNEL_ACTIVATIONS = {MoEActivation.SILU: "silu", MoEActivation.GELU_TANH: "gelu"}


def route_topk(
    layer: Any, x: torch.Tensor, router_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(router weights float32 [T, k], expert ids int64 [T, k]) as vLLM's plain top-k router
    picks them: softmax scores, top k, renormalized when the layer asks; or the layer's custom
    routing function. Grouped routing and score-correction biases are refused by the method."""
    if layer.custom_routing_function is not None:
        weights, ids = layer.custom_routing_function(
            hidden_states=x,
            gating_output=router_logits,
            topk=layer.top_k,
            renormalize=layer.renormalize,
        )
        return weights.float(), ids.long()
    scores = router_logits.float()
    scores = scores.softmax(dim=-1) if layer.scoring_func == "softmax" else scores.sigmoid()
    weights, ids = scores.topk(layer.top_k, dim=-1)
    if layer.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def route_to_local_experts(
    layer: Any, x: torch.Tensor, router_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`route_topk`'s (router weights float32 [T, k], expert ids), the ids handed to vLLM's
    routing sink (global numbers) and returned as this rank's expert numbers (int64; other
    ranks' experts as `layer.local_num_experts`): the routing every HPU quantized MoE method
    starts with."""
    weights, ids = route_topk(layer, x, router_logits)
    capture_routed_experts(layer, ids)
    return weights, local_expert_ids(ids, layer.expert_map, layer.local_num_experts)


class HpuFp8MoEMethod(FusedMoEMethodBase):
    """FP8 experts: W8A8 on the FP8 kernel with per-row weight scales, W8A16 with block scales
    (see the module docstring).

    The checkpoint's weight scales are `block` scales (`w*_weight_scale_inv`), or `w*_weight_scale`
    per tensor (one per expert and gate/up shard, vLLM's `fp8` format and compressed-tensors'
    `tensor` strategy) or, with `per_channel`, one per output row ([E, rows, 1], compressed-tensors'
    `channel` strategy). `static_input` registers the `w*_input_scale` the checkpoint carries.
    `label` names the checkpoint format in errors."""

    def __init__(
        self,
        layer: Any,
        *,
        block: tuple[int, int] | None = None,
        per_channel: bool = False,
        static_input: bool = False,
        label: str = NAME,
    ) -> None:
        super().__init__(layer.moe_config)
        if block is not None and per_channel:
            raise ValueError(f"{label} MoE: block and per-channel weight scales exclude each other")
        self.block = block
        self.per_channel = per_channel
        self.static_input = static_input
        self.label = label
        moe = layer.moe_config
        problem = None
        if moe.activation not in _KERNEL_ACTIVATIONS:
            problem = f"activation {moe.activation.value!r}"
        elif moe.has_bias:
            problem = "expert biases"
        elif layer.use_grouped_topk or layer.e_score_correction_bias is not None:
            problem = "grouped or bias-corrected routing"
        elif layer.custom_routing_function is None and layer.scoring_func not in (
            "softmax",
            "sigmoid",
        ):
            problem = f"scoring function {layer.scoring_func!r}"
        if problem is not None:
            raise ValueError(
                f"{label} MoE on HPU does not support {problem} yet; this model's FP8 "
                "checkpoint cannot be served by vllm-gaudi-quant."
            )
        self.kernel_activation = _KERNEL_ACTIVATIONS[moe.activation]
        self._gather_max_tokens: int | None = None  # resolved at the first call

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
        from vllm.model_executor.layers.fused_moe import FusedMoeWeightScaleSupported

        inter = intermediate_size_per_partition
        shards = self.moe.w13_num_shards
        weight_loader = extra_weight_attrs.pop("weight_loader")
        attrs = {**extra_weight_attrs, "weight_loader": _wrap_weight_loader(weight_loader)}
        for name, shape in (
            ("w13_weight", (num_experts, shards * inter, hidden_size)),
            ("w2_weight", (num_experts, hidden_size, inter)),
        ):
            param = Parameter(torch.empty(shape, dtype=FP8_DTYPE), requires_grad=False)
            layer.register_parameter(name, param)
            set_weight_attrs(param, attrs)

        scale_loader = _moe_scale_loader(weight_loader)
        if self.per_channel:
            # One scale per output row of each expert, as compressed-tensors stores them.
            kind = FusedMoeWeightScaleSupported.CHANNEL.value
            w13_scale = torch.ones(num_experts, shards * inter, 1)
            w2_scale = torch.ones(num_experts, hidden_size, 1)
            suffix = "weight_scale"
        elif self.block is None:
            kind = FusedMoeWeightScaleSupported.TENSOR.value
            w13_scale = torch.ones(num_experts, shards)
            w2_scale = torch.ones(num_experts)
            suffix = "weight_scale"
        else:
            bn, bk = self.block
            if inter % bn or hidden_size % bn:
                raise ValueError(
                    f"{self.label} MoE checkpoint: weight_block_size {list(self.block)} does not "
                    f"divide the expert sizes (intermediate {inter}, hidden {hidden_size})."
                )
            kind = FusedMoeWeightScaleSupported.BLOCK.value
            w13_scale = torch.ones(num_experts, shards * inter // bn, -(-hidden_size // bk))
            w2_scale = torch.ones(num_experts, hidden_size // bn, -(-inter // bk))
            suffix = "weight_scale_inv"
        for name, data in ((f"w13_{suffix}", w13_scale), (f"w2_{suffix}", w2_scale)):
            param = Parameter(data, requires_grad=False)
            layer.register_parameter(name, param)
            set_weight_attrs(
                param, {**extra_weight_attrs, "quant_method": kind, "weight_loader": scale_loader}
            )
        # Static activation scales, one per expert (brought into the device's FP8 range like the
        # weight scales). Block-scaled experts run W8A16 and do not read them.
        if self.static_input:
            for name in ("w13_input_scale", "w2_input_scale"):
                param = Parameter(torch.ones(num_experts), requires_grad=False)
                layer.register_parameter(name, param)
                set_weight_attrs(param, {**extra_weight_attrs, "weight_loader": scale_loader})

    def process_weights_after_loading(self, layer: Any) -> None:
        self._resolve_gather(layer)
        if self.block is not None:
            # Block scales stay as loaded ([E, rows / bn, cols / bk], already in the device's
            # range): each call dequantizes tile by tile, exactly the checkpoint's weights.
            return
        w13, w2 = layer.w13_weight.data, layer.w2_weight.data
        if self.per_channel:
            # [E, rows, 1] -> [E, rows]: already one scale per row.
            w13_scale = layer.w13_weight_scale.data.reshape(w13.shape[0], -1)
            w2_scale = layer.w2_weight_scale.data.reshape(w2.shape[0], -1)
        else:
            # Per-tensor scales per expert (and per gate/up shard) spread over the rows.
            inter = w13.shape[1] // layer.w13_weight_scale.shape[1]
            w13_scale = layer.w13_weight_scale.data.repeat_interleave(inter, dim=1)
            w2_scale = layer.w2_weight_scale.data[:, None].expand(-1, w2.shape[1]).contiguous()
        del layer.w13_weight_scale, layer.w2_weight_scale
        layer.w13_weight_scale = Parameter(w13_scale.float(), requires_grad=False)
        layer.w2_weight_scale = Parameter(w2_scale.float(), requires_grad=False)

    def _dequantized(
        self, layer: Any, name: str, dtype: torch.dtype, chosen: ExpertSelection
    ) -> list[torch.Tensor]:
        """The chosen block-scaled experts' `name` weights ("w13" or "w2") as float `dtype`, one
        per expert (gathered before dequantizing)."""
        weight = chosen.take(getattr(layer, f"{name}_weight"))
        scale = chosen.take(getattr(layer, f"{name}_weight_scale_inv"))
        assert self.block is not None
        return list(dequantize_blocks(weight, scale, self.block).to(dtype).unbind(0))

    def _resolve_gather(self, layer: Any) -> None:
        if self.block is None:
            cost = GATHER_COST_AS_STORED  # the FP8 kernel reads the FP8 weights as stored
        else:
            # Block-scaled experts are dequantized per call, from one byte per weight.
            computed = torch.empty((), dtype=layer.moe_config.in_dtype).element_size()
            cost = dequantized_gather_cost(1, computed)
        self._gather_max_tokens = gather_max_tokens(
            layer.local_num_experts, self.moe.experts_per_token, cost
        )

    def apply_monolithic(
        self,
        layer: Any,
        x: torch.Tensor,
        router_logits: torch.Tensor,
        input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        weights, ids = route_to_local_experts(layer, x, router_logits)
        dtype = x.dtype
        if layer.apply_router_weight_on_input:
            # Llama 4 (top-1): the router weight scales the input (before it is quantized), not
            # the expert output.
            x = x * weights.to(dtype)
            weights = torch.ones_like(weights)
        num_local = layer.local_num_experts
        if self._gather_max_tokens is None:
            self._resolve_gather(layer)
        assert self._gather_max_tokens is not None
        chosen = select_experts(ids, num_local, self._gather_max_tokens)
        last = chosen.count - 1
        kernels = backend()
        if self.block is not None:
            _log_w8a16_once(self.label, self.block)
            return kernels.mixture_of_experts(
                x,
                chosen.ids,
                weights.to(dtype),
                self._dequantized(layer, "w13", dtype, chosen),
                self._dequantized(layer, "w2", dtype, chosen),
                True,
                self.kernel_activation,
                0,
                last,
            )
        x2 = x.reshape(-1, x.shape[-1])
        if self.static_input:
            # The kernel takes one input scale for all experts: the layer's largest (over every
            # local expert, gathered or not, so a step's rounding does not depend on routing).
            xq, x_scale = quantize_activations(x2, layer.w13_input_scale.max())
            intermediate = list(chosen.take(layer.w2_input_scale.data).unbind(0))
        else:
            xq, x_scale = quantize_activations(x2, None)
            intermediate = None
        return kernels.mixture_of_experts_fp8(
            xq,
            chosen.ids,
            weights.to(dtype),
            list(chosen.take(layer.w13_weight.data).unbind(0)),
            list(chosen.take(layer.w2_weight.data).unbind(0)),
            x_scale,
            intermediate,
            list(chosen.take(layer.w13_weight_scale.data).unbind(0)),
            list(chosen.take(layer.w2_weight_scale.data).unbind(0)),
            True,
            self.kernel_activation,
            0,
            last,
        ).reshape(x.shape)

    def apply(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError("HpuFp8MoEMethod is monolithic: vLLM calls apply_monolithic")


@functools.cache
def _log_w8a16_once(label: str, block: tuple[int, int]) -> None:
    logger.info(
        "%s MoE: block-scaled experts (weight_block_size %s) run W8A16 on HPU: Gaudi's FP8 "
        "mixture_of_experts kernel takes per-tensor or per-channel weight scales only, so each "
        "call dequantizes the experts for the bf16 kernel.",
        label,
        list(block),
    )


def _moe_scale_loader(weight_loader):
    """vLLM's expert weight loader for scales, with checkpoint scales brought into the device's
    FP8 range (the weights were divided by the same factor)."""

    def load(param: Parameter, loaded_weight: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        scaled = loaded_weight.float() * _device_range_factor()
        return weight_loader(param, scaled, *args, **kwargs)

    return load
