"""Emulated mixture-of-experts kernel (an op-family kernel of vllm-gaudi-ops).

Part of the CPU emulation backend (`emulated.py` re-exports every public name here); mirrors the
Gaudi kernel of the same name wrapped in `gaudi/`, whose semantics the docstring states.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from vllm_gaudi_platform.seam.emulated_graph import kernel
from vllm_gaudi_platform.seam.emulated_quant import (
    MXFP4_BLOCK,
    cast_from_fp8,
    cast_to_fp8_v2,
    dequantize_mxfp4,
    fp8_max,
)

MOE_ACTIVATIONS: tuple[str, ...] = (
    "silu",
    "gelu",
)  # activations the mixture_of_experts kernel accepts


@kernel
def mixture_of_experts(
    hidden_states: torch.Tensor,
    expert_routing_table: torch.Tensor,
    router_weights: torch.Tensor,
    w12: list[torch.Tensor] | tuple[torch.Tensor, ...],
    w3: list[torch.Tensor] | tuple[torch.Tensor, ...],
    permuted_weights: bool,
    activation: str,
    experts_min: int,
    experts_max: int,
) -> torch.Tensor:
    """Gaudi's mixture_of_experts kernel (torch.ops.hpu.mixture_of_experts).

    hidden_states [tokens, hidden]; expert_routing_table [tokens, topk] expert ids; router_weights
    [tokens, topk]. w12[i] / w3[i] belong to expert experts_min + i (experts_min..experts_max,
    inclusive): w12 is the fused gate+up projection (gate rows first), w3 the down projection;
    with permuted_weights they are [out_features, in_features] ([2 * inter, hidden] and
    [hidden, inter]), otherwise transposed. Expert ids outside [experts_min, experts_max] belong
    to other ranks and contribute nothing. out[t] = sum_k router_weights[t, k] *
    w3[e] @ (act(gate) * up), gate/up = halves of w12[e] @ hidden_states[t], e = table[t, k].
    `activation` is "silu" or "gelu" (Gaudi's gelu is the tanh approximation). Per-expert sums
    accumulate in float32; the result has hidden_states' dtype.
    """
    return _moe(
        hidden_states,
        expert_routing_table,
        router_weights,
        w12,
        w3,
        permuted_weights,
        activation,
        experts_min,
        experts_max,
    )


# One expert's output for some of the tokens: (their hidden states [n, hidden], the expert's
# local index) -> [n, hidden].
Expert = Callable[[torch.Tensor, int], torch.Tensor]


def _gated_expert(
    w12: Sequence[torch.Tensor],
    w3: Sequence[torch.Tensor],
    permuted_weights: bool,
    activation: str,
    intermediate: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
) -> Expert:
    """The expert of `mixture_of_experts`: w3 @ (act(gate) * up), gate/up the halves of w12 @ x;
    `intermediate(h, expert)` (FP8 variant) maps each act(gate) * up before the down projection."""

    def run(x: torch.Tensor, expert: int) -> torch.Tensor:
        up_w, down_w = w12[expert], w3[expert]
        gate, up = (x @ (up_w.t() if permuted_weights else up_w)).chunk(2, dim=-1)
        act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
        h = act * up if intermediate is None else intermediate(act * up, expert)
        return h @ (down_w.t() if permuted_weights else down_w)

    return run


def _moe(
    hidden_states: torch.Tensor,
    expert_routing_table: torch.Tensor,
    router_weights: torch.Tensor,
    w12: Sequence[torch.Tensor],
    w3: Sequence[torch.Tensor],
    permuted_weights: bool,
    activation: str,
    experts_min: int,
    experts_max: int,
    intermediate: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The kernel's computation; `intermediate(h, expert)` (FP8 variant) maps each expert's
    act(gate) * up before the down projection."""
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"mixture_of_experts: activation {activation!r} not in {MOE_ACTIVATIONS}")
    num_local = experts_max - experts_min + 1
    if len(w12) != num_local or len(w3) != num_local:
        raise ValueError(
            f"mixture_of_experts: {len(w12)}/{len(w3)} expert weights for experts "
            f"{experts_min}..{experts_max}"
        )
    expert = _gated_expert(w12, w3, permuted_weights, activation, intermediate)
    return _routed(
        hidden_states, expert_routing_table, router_weights, experts_min, num_local, expert
    )


def _routed(
    hidden_states: torch.Tensor,
    expert_routing_table: torch.Tensor,
    router_weights: torch.Tensor,
    experts_min: int,
    num_local: int,
    expert: Expert,
    expert_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """out[t] = sum_k router_weights[t, k] * expert(hidden_states[t], table[t, k] - experts_min)
    over the slots routed to a local expert, summed in float32, in hidden_states' dtype; each
    expert's output is kept in `expert_dtype` (default: hidden_states')."""
    tokens, hidden = hidden_states.shape
    topk = expert_routing_table.shape[-1]
    local = expert_routing_table.reshape(-1).long() - experts_min
    # Slots routed to other ranks sort last, under the id num_local, and are dropped.
    local = torch.where((local >= 0) & (local < num_local), local, num_local)
    if torch.compiler.is_compiling():
        # Under torch.compile: every local expert over every token, weighted by its routing
        # weight (zero where not routed), so no shape depends on the routing.
        return _dense_experts(
            hidden_states, local.view(tokens, topk), router_weights, num_local, expert
        )
    counts = torch.bincount(local, minlength=num_local + 1)[:num_local].tolist()
    order = torch.argsort(local, stable=True)[: sum(counts)]
    rows = order // topk
    # The routed slots' inputs are gathered once, grouped by expert, and each selected expert
    # runs on its span of rows; router weights and the scatter back to the tokens then apply to
    # all slots at once. Per-expert gathers and scatters cost about as much as the matmuls on
    # small models, and at decode sizes (a few rows per expert) are a measurable share too.
    x = hidden_states.index_select(0, rows)
    y = torch.empty_like(x, dtype=expert_dtype)
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        span = slice(start, start + count)
        start += count
        y[span] = expert(x[span], e)
    weights = router_weights.reshape(-1)[order].float().unsqueeze(-1)
    out = torch.zeros(tokens, hidden, dtype=torch.float32, device=hidden_states.device)
    out.index_add_(0, rows, y.float() * weights)
    return out.to(hidden_states.dtype)


def _dense_experts(
    hidden_states: torch.Tensor,
    local: torch.Tensor,
    router_weights: torch.Tensor,
    num_local: int,
    expert: Expert,
) -> torch.Tensor:
    """`_routed` with static shapes: each expert's output for every token, times the token's
    routing weight for it ([tokens, topk] local ids; id num_local: another rank's)."""
    tokens, hidden = hidden_states.shape
    weights = torch.zeros(tokens, num_local + 1, dtype=torch.float32, device=hidden_states.device)
    weights.scatter_add_(1, local, router_weights.reshape(tokens, -1).float())
    out = torch.zeros(tokens, hidden, dtype=torch.float32, device=hidden_states.device)
    for e in range(num_local):
        y = expert(hidden_states, e)
        out += y.float() * weights[:, e : e + 1]
    return out.to(hidden_states.dtype)


@kernel
def mixture_of_experts_fp8(
    hidden_states: torch.Tensor,
    expert_routing_table: torch.Tensor,
    router_weights: torch.Tensor,
    w12: list[torch.Tensor] | tuple[torch.Tensor, ...],
    w3: list[torch.Tensor] | tuple[torch.Tensor, ...],
    d_scale_hidden_states: torch.Tensor,
    d_scale_intermediate_hidden_states: list[torch.Tensor] | None,
    d_scale_w12: list[torch.Tensor] | tuple[torch.Tensor, ...],
    d_scale_w3: list[torch.Tensor] | tuple[torch.Tensor, ...],
    permuted_weights: bool,
    activation: str,
    experts_min: int,
    experts_max: int,
) -> torch.Tensor:
    """Gaudi's FP8 overload of mixture_of_experts (W8A8): FP8 activations and FP8 expert weights.

    `hidden_states` FP8 [tokens, hidden] with its dequantization scale `d_scale_hidden_states`
    (0-d per tensor, or [tokens, 1] per token); `w12` / `w3` FP8 expert weights as in
    `mixture_of_experts`, with `d_scale_w12` / `d_scale_w3` per local expert: 0-d (per tensor)
    or 1-D with one scale per output row of the [out, in] weight. Each expert's intermediate
    act(gate) * up is quantized to FP8 before the down projection: with its expert's static
    scale (`d_scale_intermediate_hidden_states`, 0-d per expert) or, when that is None, with one
    scale per token (its largest magnitude over the FP8 maximum). Products accumulate in float32;
    the result has router_weights' dtype (the model's)."""
    if not hidden_states.dtype.is_floating_point or hidden_states.element_size() != 1:
        raise ValueError(
            f"mixture_of_experts (FP8): hidden_states are {hidden_states.dtype}, not FP8"
        )
    num_local = experts_max - experts_min + 1
    lists = {"d_scale_w12": d_scale_w12, "d_scale_w3": d_scale_w3}
    if d_scale_intermediate_hidden_states is not None:
        lists["d_scale_intermediate_hidden_states"] = d_scale_intermediate_hidden_states
    for name, scales in lists.items():
        if len(scales) != num_local:
            raise ValueError(
                f"mixture_of_experts (FP8): {len(scales)} {name} for experts "
                f"{experts_min}..{experts_max}"
            )
    out_dtype = router_weights.dtype
    scale_shape = tuple(d_scale_hidden_states.shape)
    if d_scale_hidden_states.numel() != 1 and scale_shape != (hidden_states.shape[0], 1):
        raise ValueError(
            f"mixture_of_experts (FP8): d_scale_hidden_states of shape {scale_shape}; the kernel "
            f"takes one scale (per tensor) or [{hidden_states.shape[0]}, 1] (per token)"
        )
    x = cast_from_fp8(hidden_states, d_scale_hidden_states, torch.float32).to(out_dtype)

    def weight(w: torch.Tensor, scale: torch.Tensor, what: str) -> torch.Tensor:
        if w.element_size() != 1:
            raise ValueError(f"mixture_of_experts (FP8): {what} is {w.dtype}, not FP8")
        rows = w.shape[0] if permuted_weights else w.shape[1]
        if scale.numel() == 1:
            s = scale.reshape(()).float()
        elif scale.dim() == 1 and scale.shape[0] == rows:
            # One scale per output row of the [out, in] weight (per column when transposed).
            s = scale.float().reshape(-1, 1) if permuted_weights else scale.float()
        else:
            raise ValueError(
                f"mixture_of_experts (FP8): {what} scale of shape {tuple(scale.shape)}; expected "
                f"0-d or [{rows}] (one per output row)"
            )
        return (w.float() * s).to(out_dtype)

    up = [weight(w, s, "w12") for w, s in zip(w12, d_scale_w12)]
    down = [weight(w, s, "w3") for w, s in zip(w3, d_scale_w3)]
    static = d_scale_intermediate_hidden_states

    def quantize(h: torch.Tensor, expert: int) -> torch.Tensor:
        if static is not None:
            scale = static[expert]
            if scale.numel() != 1:
                raise ValueError(
                    "mixture_of_experts (FP8): an intermediate scale per expert is 0-d, not "
                    f"{tuple(scale.shape)}"
                )
            scale = scale.reshape(()).float()
        else:
            amax = h.abs().amax(dim=-1, keepdim=True).float()
            scale = (amax / fp8_max(hidden_states.dtype)).clamp(min=1e-12)
        hq, _ = cast_to_fp8_v2(h, 1.0 / scale, False, False, hidden_states.dtype)
        return cast_from_fp8(hq, scale, torch.float32).to(h.dtype)

    return _moe(
        x,
        expert_routing_table,
        router_weights,
        up,
        down,
        permuted_weights,
        activation,
        experts_min,
        experts_max,
        intermediate=quantize,
    )


@kernel
def mixture_of_experts_mxfp4(
    hidden_states: torch.Tensor,
    expert_routing_table: torch.Tensor,
    router_weights: torch.Tensor,
    w12: list[torch.Tensor] | tuple[torch.Tensor, ...],
    w3: list[torch.Tensor] | tuple[torch.Tensor, ...],
    w12_bias: list[torch.Tensor] | tuple[torch.Tensor, ...],
    w3_bias: list[torch.Tensor] | tuple[torch.Tensor, ...],
    d_scale_w12: list[torch.Tensor] | tuple[torch.Tensor, ...],
    d_scale_w3: list[torch.Tensor] | tuple[torch.Tensor, ...],
    experts_min: int,
    experts_max: int,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    """Gaudi's MXFP4 mixture of experts with biases and gpt-oss's clamped SwiGLU
    (torch.ops.hpu.mixture_of_experts.bias_mxfp4_fused_weights).

    `expert_routing_table` int32 [tokens, topk]; router_weights [tokens, topk] in
    hidden_states' dtype. Per local expert (experts_min..experts_max): `w12` uint8
    [2 * inter, hidden / 2] and `w3` uint8 [hidden, inter / 2], MXFP4 [out, in] weights whose
    E8M0 scales are `d_scale_w12` [2 * inter, hidden / 32] and `d_scale_w3` [hidden, inter / 32]
    (see `dequantize_mxfp4`); `w12_bias` [2 * inter] and `w3_bias` [hidden]. The rows of w12
    interleave gate and up (row 2j gate j, row 2j + 1 up j), as gpt-oss stores them:
    g = min(gate, limit), u = clamp(up, -limit, limit), h = (u + 1) * g * sigmoid(alpha * g),
    expert(x) = w3 @ h + w3_bias. Weights dequantize exactly; products accumulate in float32;
    the result has hidden_states' dtype."""
    if expert_routing_table.dtype != torch.int32:
        raise ValueError(
            f"mixture_of_experts (MXFP4): expert_routing_table is {expert_routing_table.dtype}, "
            "not int32"
        )
    if router_weights.dtype != hidden_states.dtype:
        raise ValueError(
            f"mixture_of_experts (MXFP4): router_weights {router_weights.dtype} vs hidden_states "
            f"{hidden_states.dtype}"
        )
    num_local = experts_max - experts_min + 1
    lists = {
        "w12": w12,
        "w3": w3,
        "w12_bias": w12_bias,
        "w3_bias": w3_bias,
        "d_scale_w12": d_scale_w12,
        "d_scale_w3": d_scale_w3,
    }
    for name, tensors in lists.items():
        if len(tensors) != num_local:
            raise ValueError(
                f"mixture_of_experts (MXFP4): {len(tensors)} {name} for experts "
                f"{experts_min}..{experts_max}"
            )
    hidden = hidden_states.shape[-1]
    if w12[0].shape[-1] * 2 != hidden or hidden % MXFP4_BLOCK:
        raise ValueError(
            f"mixture_of_experts (MXFP4): w12 of shape {tuple(w12[0].shape)} for hidden size "
            f"{hidden} (two values per byte, {MXFP4_BLOCK}-value blocks)"
        )

    def run(x: torch.Tensor, e: int) -> torch.Tensor:
        up_w = dequantize_mxfp4(w12[e], d_scale_w12[e], torch.float32)
        down_w = dequantize_mxfp4(w3[e], d_scale_w3[e], torch.float32)
        gate_up = x.float() @ up_w.t() + w12_bias[e].float()
        gate = gate_up[:, 0::2].clamp(max=limit)
        up = gate_up[:, 1::2].clamp(-limit, limit)
        h = (up + 1) * gate * torch.sigmoid(alpha * gate)
        return h @ down_w.t() + w3_bias[e].float()

    return _routed(
        hidden_states,
        expert_routing_table,
        router_weights,
        experts_min,
        num_local,
        run,
        expert_dtype=torch.float32,
    )
