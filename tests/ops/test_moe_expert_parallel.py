"""Expert parallelism in the HPU MoE method: each rank holds the experts vLLM's expert map gives
it (`determine_expert_map`, linear or round-robin placement) and computes only their share of
every token; summed over the ranks (what the reduce-scatter after the experts does) the shares
are the whole layer. Likewise for data parallelism without expert parallelism, where every rank
holds a slice of every expert. The reference is a naive float64 loop over tokens and routed
experts.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEParallelConfig,
    RoutingMethodType,
)
from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

from vllm_gaudi_ops.families.moe import HpuUnquantizedFusedMoEMethod

HIDDEN, INTER, TOKENS, TOPK = 32, 48, 10, 2


def _naive_moe(x, w13, w2, weights, ids, experts=None):
    """sum_k weights[t, k] * w2[e] @ (silu(gate) * up), e = ids[t, k], over the routed experts
    (only those in `experts` when given), one token at a time in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if experts is not None and e not in experts:
                continue
            gate, up = (w13[e].double() @ x[t].double()).chunk(2)
            out[t] += float(weights[t, k]) * (w2[e].double() @ (F.silu(gate) * up))
    return out


def _layer_inputs(experts):
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(experts, 2 * INTER, HIDDEN, generator=gen) / 8
    w2 = torch.randn(experts, HIDDEN, INTER, generator=gen) / 10
    x = torch.randn(TOKENS, HIDDEN, generator=gen)
    weights, ids = torch.randn(TOKENS, experts, generator=gen).softmax(-1).topk(TOPK, dim=-1)
    return w13, w2, x, weights / weights.sum(-1, keepdim=True), ids.to(torch.int32)


def _rank_layer(w13, w2, local, expert_map):
    """The attributes of vLLM's RoutedExperts the method reads, holding the experts `local`
    (with `w13` [E, 2 * inter, hidden] and `w2` [E, hidden, inter] of any inter)."""
    inter = w2.shape[-1]
    config = FusedMoEConfig(
        num_experts=w13.shape[0],
        experts_per_token=TOPK,
        hidden_dim=HIDDEN,
        intermediate_size=inter,
        num_local_experts=len(local),
        num_logical_experts=w13.shape[0],
        activation=MoEActivation.SILU,
        device="cpu",
        routing_method=RoutingMethodType.Renormalize,
        moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(),
        in_dtype=torch.float32,
    )
    method = HpuUnquantizedFusedMoEMethod(config)
    layer: Any = torch.nn.Module()  # given RoutedExperts' attributes below
    layer.global_num_experts = w13.shape[0]
    layer.expert_map = expert_map
    layer.apply_router_weight_on_input = False
    layer.custom_routing_function = None
    layer.scoring_func = "softmax"
    method.create_weights(layer, len(local), HIDDEN, inter, torch.float32)
    layer.w13_weight.data.copy_(w13[local])
    layer.w2_weight.data.copy_(w2[local])
    method.process_weights_after_loading(layer)
    return method, layer


@pytest.mark.parametrize("placement", ["linear", "round_robin"])
@pytest.mark.parametrize(("experts", "ranks"), [(8, 2), (6, 4)])
def test_expert_parallel_ranks_sum_to_the_whole_layer(
    emulated, vllm_config, placement, experts, ranks
):
    w13, w2, x, weights, ids = _layer_inputs(experts)

    total = torch.zeros(TOKENS, HIDDEN, dtype=torch.float64)
    held: list[int] = []
    for rank in range(ranks):
        _, expert_map, _ = determine_expert_map(ranks, rank, experts, placement)
        assert expert_map is not None
        local = torch.nonzero(expert_map >= 0).flatten()
        local = local[expert_map[local].argsort()]  # weights in local-slot order
        method, layer = _rank_layer(w13, w2, local, expert_map)

        share = method.forward_oot(layer, x, weights, ids, None, None)

        mine = set(local.tolist())
        expected = _naive_moe(x, w13, w2, weights, ids, experts=mine)
        torch.testing.assert_close(share.double(), expected, atol=1e-5, rtol=1e-5)
        total += share.double()
        held += local.tolist()

    assert sorted(held) == list(range(experts))  # every expert on exactly one rank
    torch.testing.assert_close(total, _naive_moe(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


def test_tensor_parallel_shards_of_every_expert_sum_to_the_whole_layer(emulated, vllm_config):
    # Data parallelism without expert parallelism: vLLM splits every expert's intermediate
    # dimension across the DP ranks (gate and up rows, down columns) and sums the ranks' outputs.
    experts, shards = 4, 2
    w13, w2, x, weights, ids = _layer_inputs(experts)
    gate, up = w13.chunk(2, dim=1)
    every = torch.arange(experts)
    total = torch.zeros(TOKENS, HIDDEN, dtype=torch.float64)
    for rows in torch.arange(INTER).chunk(shards):
        shard_w13 = torch.cat([gate[:, rows], up[:, rows]], dim=1)
        method, layer = _rank_layer(shard_w13, w2[:, :, rows], every, None)
        total += method.forward_oot(layer, x, weights, ids, None, None).double()

    torch.testing.assert_close(total, _naive_moe(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)
