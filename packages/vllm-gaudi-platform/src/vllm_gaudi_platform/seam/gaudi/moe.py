"""Gaudi's mixture-of-experts kernels (`torch.ops.hpu.mixture_of_experts` and its FP8 and MXFP4
overloads)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vllm_gaudi_platform.envs import lazy_mode
from vllm_gaudi_platform.seam.gaudi.runtime import COMPILE_BACKEND

MOE_ACTIVATIONS: tuple[str, ...] = ("silu", "gelu")


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
    return torch.ops.hpu.mixture_of_experts(
        hidden_states=hidden_states,
        # The kernel is built for int64 expert ids (Intel casts the top-k ids before the call);
        # expert-parallel routing tables come out int32.
        expert_routing_table=expert_routing_table.to(torch.int64),
        router_weights=router_weights.to(hidden_states.dtype),
        w12=list(w12),
        w3=list(w3),
        permuted_weights=permuted_weights,
        activation=activation,
        experts_min=experts_min,
        experts_max=experts_max,
    )


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
    # The FP8 overload of the same op, picked by its scale arguments; without intermediate
    # scales the kernel scales the intermediate activations itself.
    intermediate = (
        {}
        if d_scale_intermediate_hidden_states is None
        else {"d_scale_intermediate_hidden_states": list(d_scale_intermediate_hidden_states)}
    )
    return torch.ops.hpu.mixture_of_experts(
        hidden_states=hidden_states,
        expert_routing_table=expert_routing_table.to(torch.int64),
        router_weights=router_weights,
        w12=list(w12),
        w3=list(w3),
        d_scale_hidden_states=d_scale_hidden_states,
        d_scale_w12=list(d_scale_w12),
        d_scale_w3=list(d_scale_w3),
        permuted_weights=permuted_weights,
        activation=activation,
        experts_min=experts_min,
        experts_max=experts_max,
        **intermediate,
    )


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
    args = (
        hidden_states,
        # Intel: the MXFP4 overloads take an int32 routing table.
        expert_routing_table.to(torch.int32),
        router_weights.to(hidden_states.dtype),
        list(w12),
        list(w3),
        list(w12_bias),
        list(w3_bias),
        list(d_scale_w12),
        list(d_scale_w3),
    )
    flags: dict[str, Any] = {
        "experts_min": experts_min,
        "experts_max": experts_max,
        "alpha": alpha,
        "limit": limit,
    }
    if _eager_frontend():
        # The MXFP4 overloads are blocklisted in the eager frontend (Intel: "frontend_blocklist:
        # [eager]"): outside lazy mode and outside a compiled graph, a graph of their own.
        return _compiled_mxfp4_moe()(*args, **flags)
    return _mxfp4_moe(*args, **flags)


def _mxfp4_moe(*args: Any, experts_min: int, experts_max: int, alpha: float, limit: float):
    # Intel's call: 32-value blocks, [out, in] ("permuted") weights, FP4 (not FP8) elements.
    return torch.ops.hpu.mixture_of_experts.bias_mxfp4_fused_weights(
        *args,
        block_size=32,
        permuted_weights=True,
        experts_min=experts_min,
        experts_max=experts_max,
        is_fp4=True,
        chunk_size=0,
        total_experts=0,
        alpha=alpha,
        limit=limit,
    )


def _eager_frontend() -> bool:
    return not lazy_mode() and not torch.compiler.is_compiling()


_COMPILED: dict[str, Callable[..., Any]] = {}


def _compiled_mxfp4_moe() -> Callable[..., Any]:
    if "mxfp4" not in _COMPILED:
        _COMPILED["mxfp4"] = torch.compile(_mxfp4_moe, backend=COMPILE_BACKEND, dynamic=False)
    return _COMPILED["mxfp4"]
