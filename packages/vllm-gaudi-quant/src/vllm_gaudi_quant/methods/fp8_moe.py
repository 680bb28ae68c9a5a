"""FP8 mixture of experts on HPU: `HpuFp8MoEMethod` and vLLM's plain top-k routing.

Mixture of experts: expert weights stay FP8 [E, out, in] with their checkpoint scales (one per
output row, or the block scales as loaded); each call dequantizes the local experts (per row with
`cast_from_fp8`, per block tile by tile) and runs the bf16 `mixture_of_experts` kernel (W8A16:
activation scales of MoE layers are not applied). Block-scaled experts are therefore not
requantized: they compute with exactly the checkpoint's weights. This keeps the FP8 memory
footprint but not the FP8 compute; Gaudi's `mixture_of_experts.fp8_fused_weights*` overloads are
the faster path left for later. compressed-tensors W8A8-FP8 experts (per-tensor or per-channel
`weight_scale`) run through the same `HpuFp8MoEMethod`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import Parameter
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.utils import set_weight_attrs

from vllm_gaudi_platform.runner.routed_experts import capture_routed_experts
from vllm_gaudi_platform.seam import backend
from vllm_gaudi_quant.methods.fp8_checkpoint import NAME, _device_range_factor, _wrap_weight_loader
from vllm_gaudi_quant.methods.fp8_linear import FP8_DTYPE, dequantize_blocks

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


class HpuFp8MoEMethod(FusedMoEMethodBase):
    """FP8 experts: FP8 storage with per-row or block scales, dequantized per call for the bf16
    kernel.

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
        # Static activation scales load (checkpoints carry them) but the bf16 kernel does not
        # use them: see the module docstring.
        if self.static_input:
            for name in ("w13_input_scale", "w2_input_scale"):
                param = Parameter(torch.ones(num_experts), requires_grad=False)
                layer.register_parameter(name, param)
                set_weight_attrs(param, {**extra_weight_attrs, "weight_loader": weight_loader})

    def process_weights_after_loading(self, layer: Any) -> None:
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

    def _dequantized(self, layer: Any, name: str, dtype: torch.dtype) -> list[torch.Tensor]:
        """The local experts' `name` weights ("w13" or "w2") as float `dtype`, one per expert."""
        weight = getattr(layer, f"{name}_weight")
        if self.block is not None:
            scale = getattr(layer, f"{name}_weight_scale_inv")
            return list(dequantize_blocks(weight, scale, self.block).to(dtype).unbind(0))
        kernels = backend()
        scale = getattr(layer, f"{name}_weight_scale")
        # One scale per output row of each expert's [rows, cols] weight: a [rows, 1] column, since
        # cast_from_fp8 applies a 1-D scale along the last axis (per column).
        return [
            kernels.cast_from_fp8(w, s.reshape(-1, 1) if s.numel() > 1 else s, dtype)
            for w, s in zip(weight.unbind(0), scale.unbind(0))
        ]

    def apply_monolithic(
        self,
        layer: Any,
        x: torch.Tensor,
        router_logits: torch.Tensor,
        input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        weights, ids = route_topk(layer, x, router_logits)
        capture_routed_experts(layer, ids)
        dtype = x.dtype
        w13 = self._dequantized(layer, "w13", dtype)
        w2 = self._dequantized(layer, "w2", dtype)
        first = layer.moe_config.ep_rank * layer.local_num_experts
        return backend().mixture_of_experts(
            x,
            ids,
            weights.to(dtype),
            w13,
            w2,
            True,
            self.kernel_activation,
            first,
            first + layer.local_num_experts - 1,
        )

    def apply(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError("HpuFp8MoEMethod is monolithic: vLLM calls apply_monolithic")


def _moe_scale_loader(weight_loader):
    """vLLM's expert weight loader for scales, with checkpoint scales brought into the device's
    FP8 range (the weights were divided by the same factor)."""

    def load(param: Parameter, loaded_weight: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        scaled = loaded_weight.float() * _device_range_factor()
        return weight_loader(param, scaled, *args, **kwargs)

    return load
