"""Routed-experts capture for the HPU mixture-of-experts methods (ops and quant wheels).

When a caller asks vLLM for the experts each token was routed to, vLLM binds a sink to every MoE
layer (`routing_sink`: a buffer sized for the largest batch, and a callback). vLLM's own
monolithic kernels fill it with each step's top-k expert ids; a monolithic HPU method does the
same through `capture_routed_experts`, right after routing and before the experts run.
"""

from __future__ import annotations

from typing import Any

import torch


def capture_routed_experts(layer: Any, expert_ids: torch.Tensor) -> None:
    """Hand this step's expert ids [tokens, top_k] to the layer's routing sink, if vLLM bound
    one (global expert ids, before any expert-parallel remapping); otherwise do nothing."""
    sink = getattr(layer, "routing_sink", None)
    if sink is None:
        return
    captured = sink.buffer[: expert_ids.shape[0]]
    captured.copy_(expert_ids)
    sink.capture_fn(captured)
