"""Emulated mixture-of-experts kernel (an op-family kernel of vllm-gaudi-ops).

Part of the CPU emulation backend (`emulated.py` re-exports every public name here); mirrors the
Gaudi kernel of the same name wrapped in `gaudi.py`, whose semantics the docstring states.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from vllm_gaudi_platform.seam.emulated_graph import kernel

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
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"mixture_of_experts: activation {activation!r} not in {MOE_ACTIVATIONS}")
    num_local = experts_max - experts_min + 1
    if len(w12) != num_local or len(w3) != num_local:
        raise ValueError(
            f"mixture_of_experts: {len(w12)}/{len(w3)} expert weights for experts "
            f"{experts_min}..{experts_max}"
        )
    tokens, hidden = hidden_states.shape
    topk = expert_routing_table.shape[-1]
    local = expert_routing_table.reshape(-1).long() - experts_min
    # Slots routed to other ranks sort last, under the id num_local, and are dropped.
    local = torch.where((local >= 0) & (local < num_local), local, num_local)
    if torch.compiler.is_compiling():
        # Under torch.compile: every local expert over every token, weighted by its routing
        # weight (zero where not routed), so no shape depends on the routing.
        return _dense_experts(
            hidden_states,
            local.view(tokens, topk),
            router_weights,
            w12,
            w3,
            permuted_weights,
            activation,
            num_local,
        )
    counts = torch.bincount(local, minlength=num_local + 1)[:num_local].tolist()
    order = torch.argsort(local, stable=True)[: sum(counts)]
    rows = order // topk
    # The routed slots' inputs are gathered once, grouped by expert, and each selected expert
    # runs on its span of rows; router weights and the scatter back to the tokens then apply to
    # all slots at once. Per-expert gathers and scatters cost about as much as the matmuls on
    # small models, and at decode sizes (a few rows per expert) are a measurable share too.
    x = hidden_states.index_select(0, rows)
    y = torch.empty_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        span = slice(start, start + count)
        start += count
        up_w, down_w = w12[expert], w3[expert]
        gate_up = x[span] @ (up_w.t() if permuted_weights else up_w)
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
        torch.mm(act * up, down_w.t() if permuted_weights else down_w, out=y[span])
    weights = router_weights.reshape(-1)[order].float().unsqueeze(-1)
    out = torch.zeros(tokens, hidden, dtype=torch.float32, device=hidden_states.device)
    out.index_add_(0, rows, y.float() * weights)
    return out.to(hidden_states.dtype)


def _dense_experts(
    hidden_states: torch.Tensor,
    local: torch.Tensor,
    router_weights: torch.Tensor,
    w12: Sequence[torch.Tensor],
    w3: Sequence[torch.Tensor],
    permuted_weights: bool,
    activation: str,
    num_local: int,
) -> torch.Tensor:
    """`mixture_of_experts` with static shapes: each expert's output for every token, times the
    token's routing weight for it ([tokens, topk] local ids; id num_local: another rank's)."""
    tokens, hidden = hidden_states.shape
    weights = torch.zeros(tokens, num_local + 1, dtype=torch.float32, device=hidden_states.device)
    weights.scatter_add_(1, local, router_weights.reshape(tokens, -1).float())
    out = torch.zeros(tokens, hidden, dtype=torch.float32, device=hidden_states.device)
    for expert in range(num_local):
        up_w, down_w = w12[expert], w3[expert]
        gate_up = hidden_states @ (up_w.t() if permuted_weights else up_w)
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
        y = (act * up) @ (down_w.t() if permuted_weights else down_w)
        out += y.float() * weights[:, expert : expert + 1]
    return out.to(hidden_states.dtype)
