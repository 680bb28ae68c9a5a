"""Routed experts for the HPU mixture-of-experts methods (ops and quant wheels): the capture of
each step's routing for vLLM, and the low-batch gather of the routed experts' weights.

When a caller asks vLLM for the experts each token was routed to, vLLM binds a sink to every MoE
layer (`routing_sink`: a buffer sized for the largest batch, and a callback). vLLM's own
monolithic kernels fill it with each step's top-k expert ids; a monolithic HPU method does the
same through `capture_routed_experts`, right after routing and before the experts run.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from vllm_gaudi_platform import selftest_defaults

logger = logging.getLogger(f"vllm.{__name__}")


def capture_routed_experts(layer: Any, expert_ids: torch.Tensor) -> None:
    """Hand this step's expert ids [tokens, top_k] to the layer's routing sink, if vLLM bound
    one (global expert ids, before any expert-parallel remapping); otherwise do nothing."""
    sink = getattr(layer, "routing_sink", None)
    if sink is None:
        return
    captured = sink.buffer[: expert_ids.shape[0]]
    captured.copy_(expert_ids)
    sink.capture_fn(captured)


# ----------------------------------------------------------------------------- low-batch gather
# A decode step of a few tokens routes to a few experts, but the dense MoE pass hands the kernel
# every local expert, and on a Gaudi the kernel streams all their weights from HBM each step. The
# gather pass copies only the routed experts' weights into G = tokens * top_k slots on the
# device (no host sync, a shape fixed by the bucket: one graph per bucket as before), renumbers
# the routing table to the slots and hands the kernel those G experts.
#
# Its cost per gathered expert, in units of what the dense pass moves per expert: a weight read
# by the kernel as stored costs 3 (the gather reads and writes it, the kernel reads the copy);
# a weight the method dequantizes per call (4-bit, block-scaled FP8) costs
# (3 * stored + 2 * computed) / (stored + 2 * computed) bytes per element, since the dense pass
# already reads the stored and writes and reads the dequantized weights of every expert.
GATHER_COST_AS_STORED = 3.0


def dequantized_gather_cost(stored_bytes: float, computed_bytes: float) -> float:
    """The gather's cost per expert for weights dequantized per call: bytes per weight element
    stored (0.5 for 4-bit) and after dequantization (2 for bf16)."""
    return (3 * stored_bytes + 2 * computed_bytes) / (stored_bytes + 2 * computed_bytes)


def gather_max_tokens(num_local: int, top_k: int, cost: float) -> int:
    """Most tokens a step may have for the layer to gather its routed experts:
    VLLM_MOE_GATHER_MAX_TOKENS when set, else the value a selftest report decided
    (VLLM_HPU_SELFTEST_REPORT), else the largest count whose G = tokens * top_k gathered
    experts cost less than the dense pass over `num_local` experts."""
    setting, source = selftest_defaults.moe_gather_max_tokens()
    if setting is None:
        value = max(0, math.ceil(num_local / (top_k * cost)) - 1)
    else:
        value = setting
    _log_threshold(num_local, top_k, round(cost, 2), value, source)
    return value


@functools.cache
def _log_threshold(num_local: int, top_k: int, cost: float, value: int, source: str) -> None:
    if value == 0:
        what = "never gather their routed experts"
    else:
        what = f"gather their routed experts in steps of up to {value} tokens"
    logger.info(
        "MoE layers of %d local experts, top-%d (gather cost %.2f per expert): %s (%s)",
        num_local,
        top_k,
        cost,
        what,
        source,
    )


def local_expert_ids(
    ids: torch.Tensor, expert_map: torch.Tensor | None, num_local: int
) -> torch.Tensor:
    """Routed ids [tokens, top_k] as this rank's expert numbers (int64): under expert
    parallelism through vLLM's expert map, other ranks' experts as `num_local` (past the local
    range, skipped by the kernels)."""
    ids = ids.long()
    if expert_map is None:
        return ids
    local = expert_map[ids].long()
    return torch.where(local < 0, num_local, local)


@dataclass(frozen=True)
class ExpertSelection:
    """The experts a MoE call hands the kernel: `count` of them, numbered 0..count-1 in `ids`
    (an id of `count`: not among them, contributes nothing); `index` [count] the local experts
    they are, ascending, or None for all local experts in order."""

    ids: torch.Tensor
    count: int
    index: torch.Tensor | None = None

    @property
    def gathered(self) -> bool:
        return self.index is not None

    def take(self, per_expert: torch.Tensor) -> torch.Tensor:
        """`per_expert` [local experts, ...] restricted to the selected experts."""
        if self.index is None:
            return per_expert
        if per_expert.element_size() == 1 and per_expert.is_floating_point():
            # FP8: gathered as bytes (some torch builds lack index_select for float8 on CPU).
            return per_expert.view(torch.uint8).index_select(0, self.index).view(per_expert.dtype)
        return per_expert.index_select(0, self.index)


def select_experts(local_ids: torch.Tensor, num_local: int, max_tokens: int) -> ExpertSelection:
    """All local experts, or, for a step of at most `max_tokens` tokens whose tokens * top_k
    slots are fewer than the local experts, the routed ones gathered into tokens * top_k slots.

    local_ids [tokens, top_k] (int64, `num_local` for other ranks' experts). Experts are chosen
    by their hit count (every routed expert has one; slots left over take unrouted experts,
    which no token reads), kept in ascending order, so each token's experts keep their relative
    order and the kernel sums exactly what the dense pass sums, in the same order.
    """
    tokens, top_k = local_ids.shape
    slots = tokens * top_k
    if tokens == 0 or tokens > max_tokens or slots >= num_local:
        return ExpertSelection(local_ids, num_local)
    device = local_ids.device
    hits = torch.zeros(num_local + 1, dtype=torch.float32, device=device)
    hits.index_add_(0, local_ids.reshape(-1), torch.ones(slots, dtype=hits.dtype, device=device))
    index = hits[:num_local].topk(slots, sorted=False).indices.sort().values
    renumber = torch.full((num_local + 1,), slots, dtype=torch.int64, device=device)
    renumber.scatter_(0, index, torch.arange(slots, device=device))
    return ExpertSelection(renumber[local_ids], slots, index)
