"""Unquantized mixture-of-experts on Gaudi's mixture_of_experts kernel, and grouped routing.

vLLM 0.32 has no FusedMoE CustomOp: the hook is UnquantizedFusedMoEMethod, the layer's
quantization method (a CustomOp too). vLLM's MoE runner either routes with its own router and
calls `apply` (a "modular" method), or hands the router logits to `apply_monolithic`. vLLM's
routers call top-k kernels compiled for CUDA/ROCm/CPU (vllm._moe_C), which an out-of-tree
platform does not have, so this method is monolithic: it routes in torch (`route`), then calls
`apply`, whose CustomOp dispatch runs `forward_oot` and the kernel.

Gaudi's kernel has no expert biases and only SiLU and tanh-GELU gates. Experts with biases, or
with gpt-oss's clamped "swigluoai" gate, run through `plain_experts` instead: ordinary torch
matmuls and elementwise ops, on Gaudi as on the emulation, not a fused kernel.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig
from vllm.model_executor.layers.fused_moe.router.grouped_topk_router import GroupedTopk
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
    UnquantizedFusedMoEMethod,
)

from vllm_gaudi_ops import stats
from vllm_gaudi_platform.seam import backend
from vllm_gaudi_platform.worker.routed_experts import (
    GATHER_COST_AS_STORED,
    capture_routed_experts,
    gather_max_tokens,
    local_expert_ids,
    select_experts,
)

FAMILY = "moe"

# vLLM's MoE activations and the kernel's names for them (Gaudi's "gelu" is the tanh form).
KERNEL_ACTIVATIONS = {MoEActivation.SILU: "silu", MoEActivation.GELU_TANH: "gelu"}
# Activations `plain_experts` computes: the kernel's, and gpt-oss's swigluoai.
PLAIN_ACTIVATIONS = (MoEActivation.SILU, MoEActivation.GELU_TANH, MoEActivation.SWIGLUOAI)
# swigluoai's constants: vLLM's kernels for MoEActivation.SWIGLUOAI use these fixed values (the
# config's swiglu_* fields only reach its "swigluoai_uninterleave" variant), as gpt-oss does.
SWIGLUOAI_ALPHA = 1.702
SWIGLUOAI_LIMIT = 7.0
SCORING_FUNCS = ("softmax", "sigmoid")


def _unsupported(moe: FusedMoEConfig) -> str | None:
    """What in the layer neither the kernel nor the plain-ops path computes, or None."""
    if moe.activation not in PLAIN_ACTIVATIONS:
        names = ", ".join(a.value for a in KERNEL_ACTIVATIONS)
        return (
            f"activation {moe.activation.value!r} (the kernel supports {names}; "
            f"vllm-gaudi's plain-ops path adds {MoEActivation.SWIGLUOAI.value})"
        )
    if moe.has_hash_routing:
        return "hash routing"
    return None


def _needs_plain_path(moe: FusedMoEConfig) -> bool:
    """Whether the layer has what Gaudi's kernel lacks: expert biases or a swigluoai gate."""
    return moe.has_bias or moe.activation not in KERNEL_ACTIVATIONS


def swigluoai(gate_up: torch.Tensor) -> torch.Tensor:
    """gpt-oss's gate: gate and up INTERLEAVED in the last dim ([g0, u0, g1, u1, ...], as vLLM
    loads gpt-oss's w13), gate clamped above at 7, up to [-7, 7]; (up + 1) * gate *
    sigmoid(1.702 * gate)."""
    gate = gate_up[..., ::2].clamp(max=SWIGLUOAI_LIMIT)
    up = gate_up[..., 1::2].clamp(min=-SWIGLUOAI_LIMIT, max=SWIGLUOAI_LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * SWIGLUOAI_ALPHA))


def _gated(gate_up: torch.Tensor, activation: MoEActivation) -> torch.Tensor:
    if activation == MoEActivation.SWIGLUOAI:
        return swigluoai(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)  # vLLM's other gates: gate rows first, then up rows
    if activation == MoEActivation.SILU:
        return F.silu(gate) * up
    return F.gelu(gate, approximate="tanh") * up


def plain_experts(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    activation: MoEActivation,
) -> torch.Tensor:
    """Routed experts in plain torch ops, for what Gaudi's mixture_of_experts kernel cannot do.

    x [tokens, hidden]; expert_ids [tokens, topk] local expert ids, where an id outside
    [0, experts) is another rank's expert and adds nothing; expert_weights [tokens, topk].
    w13 [experts, 2 * inter, hidden] and w2 [experts, hidden, inter] as vLLM loads them, biases
    [experts, 2 * inter] and [experts, hidden] or None. out[t] = sum over k of weight[t, k] *
    (w2[e] @ act(w13[e] @ x[t] + b13[e]) + b2[e]), e = expert_ids[t, k]: the down projection's
    bias is scaled by the router weight too, as in gpt-oss.

    This is NOT a Gaudi kernel: on Gaudi it runs as ordinary matmuls and elementwise ops, which
    the graph compiler fuses as it can. Every expert runs on every token, weighted 0 where the
    token did not pick it, so no shape depends on the routing (no recompiles) at the cost of
    experts / topk times the routed matmul work: fine for a few experts, costly for many.
    Accumulates in float32 (float64 for float64 inputs); the result has x's dtype.
    """
    tokens, hidden = x.shape
    experts = w13.shape[0]
    acc = torch.promote_types(x.dtype, torch.float32)  # float32, or float64 for float64 inputs
    ids = expert_ids.long()
    ids = torch.where((ids >= 0) & (ids < experts), ids, experts)  # other ranks' -> a spare slot
    # dense[t, e]: the router weight of expert e for token t (0 when not picked).
    dense = torch.zeros(tokens, experts + 1, dtype=acc, device=x.device)
    dense.scatter_add_(1, ids, expert_weights.to(acc))
    out = torch.zeros(tokens, hidden, dtype=acc, device=x.device)
    linear = backend().linear  # the MME's matmul (F.linear), or its emulation
    for e in range(experts):
        gate_up = linear(x, w13[e], None if w13_bias is None else w13_bias[e])
        y = linear(_gated(gate_up, activation), w2[e], None if w2_bias is None else w2_bias[e])
        out.addcmul_(dense[:, e : e + 1], y.to(acc))
    return out.to(x.dtype)


def route(
    layer: Any, hidden_states: torch.Tensor, router_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts vLLM's router would pick for the layer: (float32 weights, int32 ids).

    A custom routing function is called as vLLM calls it. Otherwise scores are the softmax or
    sigmoid of the logits (in float32); with grouped routing only the best `topk_group` expert
    groups compete; a correction bias changes which experts win but not their weights; weights
    are renormalized when asked, and scaled by routed_scaling_factor where vLLM's grouped and
    biased routers scale them (its plain top-k router does not).
    """
    if router_logits.shape[-1] != layer.global_num_experts:
        # e.g. LongCat's "zero experts", which only vLLM's ZeroExpertRouter handles.
        raise ValueError(
            f"router logits score {router_logits.shape[-1]} experts but the layer has "
            f"{layer.global_num_experts}; this routing scheme is not supported on HPU"
        )
    if layer.custom_routing_function is not None:
        weights, ids = layer.custom_routing_function(
            hidden_states=hidden_states,
            gating_output=router_logits,
            topk=layer.top_k,
            renormalize=layer.renormalize,
        )
        return weights.to(torch.float32), ids.to(torch.int32)
    bias = layer.e_score_correction_bias
    grouped = layer.use_grouped_topk
    return grouped_topk(
        router_logits.float(),
        layer.top_k,
        layer.renormalize,
        num_expert_group=layer.num_expert_group if grouped else 1,
        topk_group=layer.topk_group if grouped else 1,
        scoring_func=layer.scoring_func,
        routed_scaling_factor=layer.routed_scaling_factor if grouped or bias is not None else 1.0,
        e_score_correction_bias=bias,
    )


class HpuUnquantizedFusedMoEMethod(UnquantizedFusedMoEMethod):
    """Routing in torch, experts through the kernel (per-expert weight views taken once), or
    through `plain_experts` for biased or swigluoai experts, which the kernel lacks."""

    def __init__(self, moe: FusedMoEConfig) -> None:
        # Checked first: vLLM's constructor picks its own backend and may refuse the layer with
        # a message that says nothing about Gaudi.
        problem = _unsupported(moe)
        if problem is not None:
            raise ValueError(
                f"Gaudi's mixture_of_experts kernel cannot run this model's MoE layers: "
                f"{problem}. vllm-gaudi cannot serve this model yet."
            )
        super().__init__(moe)
        self.plain = _needs_plain_path(moe)
        self.kernel_activation = KERNEL_ACTIVATIONS.get(moe.activation, "")
        self._expert_weights: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]] | None
        self._expert_weights = None
        self._gather_max_tokens: int | None = None  # resolved at the first call

    @classmethod
    def enabled(cls) -> bool:
        # On an out-of-tree platform vLLM builds no MoE kernel, so forward_native cannot run:
        # this path is the only one, whatever compilation_config.custom_ops says.
        return True

    @property
    def is_monolithic(self) -> bool:
        return True

    @property
    def supports_eplb(self) -> bool:
        # EPLB remaps experts inside vLLM's routers, which this method does not use.
        return False

    def create_weights(self, layer: Any, *args, **kwargs) -> None:
        if layer.custom_routing_function is None and layer.scoring_func not in SCORING_FUNCS:
            raise ValueError(
                f"MoE scoring function {layer.scoring_func!r} is not supported on HPU by "
                f"vllm-gaudi (supported: {', '.join(SCORING_FUNCS)}, or a custom routing "
                "function)."
            )
        super().create_weights(layer, *args, **kwargs)

    def process_weights_after_loading(self, layer: Any) -> None:
        # vLLM's version prepares weights for vLLM's own kernels (none on an out-of-tree
        # platform); the kernel here takes [E, out, in] weights as loaded, one view per expert.
        self._expert_weights = (
            tuple(layer.w13_weight.data.unbind(0)),
            tuple(layer.w2_weight.data.unbind(0)),
        )
        # Resolved here, eagerly, not in a traced forward (it reads the environment and logs).
        num_local = layer.w13_weight.shape[0]
        self._gather_max_tokens = gather_max_tokens(
            num_local, self.moe.experts_per_token, GATHER_COST_AS_STORED
        )

    def apply_monolithic(
        self,
        layer: Any,
        x: torch.Tensor,
        router_logits: torch.Tensor,
        input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        topk_weights, topk_ids = route(layer, x, router_logits)
        capture_routed_experts(layer, topk_ids)
        return self.apply(layer, x, topk_weights, topk_ids, None, None)

    def forward_oot(
        self,
        layer: Any,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts: torch.nn.Module | None = None,
        shared_experts_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # Shared experts: the runner runs them itself, since this method cannot overlap them.
        stats.count(FAMILY)
        if self._expert_weights is None:
            self.process_weights_after_loading(layer)
        assert self._expert_weights is not None
        num_local = len(self._expert_weights[0])
        ids = local_expert_ids(topk_ids, getattr(layer, "expert_map", None), num_local)
        weights = topk_weights.to(x.dtype)
        if layer.apply_router_weight_on_input:
            # Llama 4 (top-1): the router weight scales the input, not the expert output.
            x = x * weights
            weights = torch.ones_like(weights)
        if self._gather_max_tokens is None:
            self.process_weights_after_loading(layer)
        assert self._gather_max_tokens is not None
        chosen = select_experts(ids, num_local, self._gather_max_tokens)
        if self.plain:
            b13, b2 = (getattr(layer, f"{w}_bias", None) for w in ("w13", "w2"))
            return plain_experts(
                x,
                chosen.ids,
                weights,
                chosen.take(layer.w13_weight),
                chosen.take(layer.w2_weight),
                None if b13 is None else chosen.take(b13),
                None if b2 is None else chosen.take(b2),
                self.moe.activation,
            )
        if chosen.gathered:
            w12 = tuple(chosen.take(layer.w13_weight.data).unbind(0))
            w3 = tuple(chosen.take(layer.w2_weight.data).unbind(0))
        else:
            w12, w3 = self._expert_weights
        return backend().mixture_of_experts(
            x, chosen.ids, weights, w12, w3, True, self.kernel_activation, 0, chosen.count - 1
        )


def grouped_topk(
    gating_output: torch.Tensor,
    topk: int,
    renormalize: bool,
    num_expert_group: int,
    topk_group: int,
    scoring_func: str = "softmax",
    routed_scaling_factor: float = 1.0,
    e_score_correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek routing: keep the `topk_group` best expert groups, then the `topk` best experts
    in them. With a correction bias, biased scores select and unbiased scores weigh. Returns
    (float32 weights, int32 ids) [tokens, topk], like vLLM's."""
    if scoring_func == "softmax":
        scores = torch.softmax(gating_output, dim=-1)
    elif scoring_func == "sigmoid":
        scores = gating_output.sigmoid()
    else:
        raise ValueError(f"Unsupported scoring function: {scoring_func}")
    tokens = scores.shape[0]
    selection = scores if e_score_correction_bias is None else scores + e_score_correction_bias
    groups = selection.view(tokens, num_expert_group, -1)
    if e_score_correction_bias is None:
        group_scores = groups.amax(dim=-1)
    else:
        group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)
    best_groups = group_scores.topk(topk_group, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    selection = groups.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens, -1)
    topk_ids = selection.topk(topk, dim=-1).indices
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    if routed_scaling_factor != 1.0:
        topk_weights = topk_weights * routed_scaling_factor
    return topk_weights.to(torch.float32), topk_ids.to(torch.int32)


class HpuGroupedTopk(GroupedTopk):
    """Grouped top-k in eager torch: vLLM's version is torch.compile'd with dynamic shapes,
    which on Gaudi would mean a graph recompile for new token counts."""

    def forward_oot(
        self,
        hidden_states: torch.Tensor,
        gating_output: torch.Tensor,
        e_score_correction_bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        stats.count(FAMILY)
        if hidden_states.shape[0] != gating_output.shape[0]:
            raise ValueError("grouped top-k: hidden_states and gating_output token counts differ")
        return grouped_topk(
            gating_output,
            self.topk,
            self.renormalize,
            self.num_expert_group,
            self.topk_group,
            self.scoring_func,
            self.routed_scaling_factor,
            e_score_correction_bias,
        )


REPLACEMENTS: tuple[tuple[type, type], ...] = (
    (UnquantizedFusedMoEMethod, HpuUnquantizedFusedMoEMethod),
    (GroupedTopk, HpuGroupedTopk),
)
