"""Low-batch MoE: the routed experts' weights gathered for the kernel (`select_experts`), on both
backends of the seam. A gathered call must hand the kernel tokens * top_k experts and sum exactly
what the dense call over every local expert sums (bit for bit: the same experts, in the same
order, on the same rows), for the kernel path, the plain-ops path and under expert parallelism.
The quantized methods' gather (4-bit, FP8) is checked in tests/quant/test_quantized_moe.py.
"""

from __future__ import annotations

import pytest
import torch
from vllm.model_executor.layers.fused_moe.activation import MoEActivation

from tests.ops.test_moe import _biases, _config, _layer, _routing, _weights
from vllm_gaudi_ops.families.moe import HpuUnquantizedFusedMoEMethod
from vllm_gaudi_platform.envs import EnvError
from vllm_gaudi_platform.worker.routed_experts import (
    GATHER_COST_AS_STORED,
    dequantized_gather_cost,
    gather_max_tokens,
    select_experts,
)


def _kernel_calls(kernels, monkeypatch):
    """Records how many experts each mixture_of_experts call of the backend was handed."""
    handed: list[int] = []
    inner = kernels.mixture_of_experts

    def recording(x, ids, weights, w12, w3, *rest):
        handed.append(len(w12))
        return inner(x, ids, weights, w12, w3, *rest)

    monkeypatch.setattr(kernels, "mixture_of_experts", recording)
    return handed


def _run(monkeypatch, max_tokens, config, w13, w2, x, weights, ids, **layer_kwargs):
    monkeypatch.setenv("VLLM_MOE_GATHER_MAX_TOKENS", str(max_tokens))
    method = HpuUnquantizedFusedMoEMethod(config)
    layer = _layer(method, w13, w2, **layer_kwargs)
    return method.forward_oot(layer, x, weights, ids, None, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "experts", "topk"), [(1, 8, 2), (3, 16, 2), (2, 64, 6)])
def test_gathered_experts_sum_exactly_what_every_expert_sums(
    hpu_backend, vllm_config, monkeypatch, dtype, tokens, experts, topk
):
    handed = _kernel_calls(hpu_backend, monkeypatch)
    config = _config(experts, topk, dtype)
    w13, w2 = _weights(experts, dtype)
    x, weights, ids = _routing(tokens, experts, topk, dtype)

    dense = _run(monkeypatch, 0, config, w13, w2, x, weights, ids)
    gathered = _run(monkeypatch, tokens, config, w13, w2, x, weights, ids)

    assert handed == [experts, tokens * topk]
    assert torch.equal(gathered, dense)


def test_a_step_over_the_threshold_or_with_as_many_slots_as_experts_runs_dense(
    hpu_backend, vllm_config, monkeypatch
):
    handed = _kernel_calls(hpu_backend, monkeypatch)
    w13, w2 = _weights(8, torch.float32)
    config = _config(8, 2, torch.float32)
    for tokens, max_tokens in ((3, 2), (4, 16)):  # over the threshold; 4 x 2 slots = 8 experts
        x, weights, ids = _routing(tokens, 8, 2, torch.float32)
        _run(monkeypatch, max_tokens, config, w13, w2, x, weights, ids)
    assert handed == [8, 8]


def test_gather_under_expert_parallelism_keeps_other_ranks_experts_out(
    hpu_backend, vllm_config, monkeypatch
):
    # Rank 1 of 2, round-robin placement: global experts 1, 3, ..., 15 are its local 0..7.
    experts, topk, tokens = 16, 2, 2
    w13, w2 = _weights(experts, torch.float32)
    local = torch.arange(1, experts, 2)
    expert_map = torch.full((experts,), -1, dtype=torch.int32)
    expert_map[local] = torch.arange(len(local), dtype=torch.int32)
    x, weights, ids = _routing(tokens, experts, topk, torch.float32, seed=5)
    remote = expert_map[ids.long()] < 0
    assert remote.any() and (~remote).any()
    handed = _kernel_calls(hpu_backend, monkeypatch)
    config = _config(len(local), topk, torch.float32)
    args = (config, w13[local], w2[local], x, weights, ids)

    dense = _run(monkeypatch, 0, *args, expert_map=expert_map)
    gathered = _run(monkeypatch, tokens, *args, expert_map=expert_map)

    assert handed == [len(local), tokens * topk]
    assert torch.equal(gathered, dense)


def test_plain_path_gathers_weights_and_biases_of_the_routed_experts(
    hpu_backend, vllm_config, monkeypatch
):
    # Biased swigluoai experts (gpt-oss) run as plain matmuls, one expert at a time: gathered,
    # they loop over tokens * top_k experts instead of all of them.
    experts, topk, tokens = 16, 2, 3
    config = _config(experts, topk, torch.float32, MoEActivation.SWIGLUOAI, has_bias=True)
    w13, w2 = _weights(experts, torch.float32)
    biases = _biases(experts, torch.float32)
    x, weights, ids = _routing(tokens, experts, topk, torch.float32)
    linear_calls: list[int] = []
    inner = hpu_backend.linear

    def counting(*args):
        linear_calls.append(1)
        return inner(*args)

    monkeypatch.setattr(hpu_backend, "linear", counting)

    dense = _run(monkeypatch, 0, config, w13, w2, x * 4, weights, ids, biases=biases)
    dense_calls = len(linear_calls)
    gathered = _run(monkeypatch, tokens, config, w13, w2, x * 4, weights, ids, biases=biases)

    assert dense_calls == 2 * experts
    assert len(linear_calls) - dense_calls == 2 * tokens * topk
    assert torch.equal(gathered, dense)


def test_select_experts_renumbers_each_slot_to_its_gathered_expert():
    num_local = 10
    # Token 0: experts 7 and 2; token 1: 2 and another rank's expert (num_local); token 2: 9, 0.
    ids = torch.tensor([[7, 2], [2, num_local], [9, 0]])

    chosen = select_experts(ids, num_local, max_tokens=4)

    assert chosen.gathered and chosen.count == 6
    index = chosen.index.tolist()
    assert index == sorted(index) and len(set(index)) == 6
    assert {0, 2, 7, 9} <= set(index)
    local = ids.clone()
    routed = ids < num_local
    assert torch.equal(chosen.ids[~routed], torch.full_like(ids[~routed], chosen.count))
    assert torch.equal(chosen.index[chosen.ids[routed]], local[routed])
    assert torch.equal(chosen.take(torch.arange(num_local) * 10), torch.tensor(index) * 10)


def test_select_experts_keeps_every_expert_when_gathering_cannot_help():
    ids = torch.tensor([[1, 2], [3, 0]])
    for num_local, max_tokens in ((4, 8), (16, 1), (16, 0)):
        chosen = select_experts(ids, num_local, max_tokens)
        assert not chosen.gathered and chosen.count == num_local and chosen.ids is ids


def test_select_experts_traces_into_one_graph_with_no_break():
    # Decode graphs and torch.compile must not break or sync on the host for the gather.
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()

    @torch.compile(backend=counter, fullgraph=True)
    def renumbered(ids, table):
        chosen = select_experts(ids, 32, max_tokens=8)
        return chosen.ids, chosen.take(table)

    table = torch.arange(32.0)
    for seed in range(3):
        ids = torch.randint(0, 32, (4, 2), generator=torch.Generator().manual_seed(seed))
        got_ids, got_rows = renumbered(ids, table)
        assert torch.equal(got_rows[got_ids], ids.float())
    assert counter.frame_count == 1


def test_the_automatic_threshold_gathers_while_it_moves_fewer_bytes(monkeypatch):
    monkeypatch.delenv("VLLM_MOE_GATHER_MAX_TOKENS", raising=False)
    # Weights read as stored: a gathered expert costs 3 (read, write, read the copy).
    assert gather_max_tokens(64, 6, GATHER_COST_AS_STORED) == 3  # 3 x 6 x 3 = 54 < 64
    assert gather_max_tokens(128, 8, GATHER_COST_AS_STORED) == 5  # 5 x 8 x 3 = 120 < 128
    assert gather_max_tokens(8, 2, GATHER_COST_AS_STORED) == 1  # Mixtral: batch 1 only
    assert gather_max_tokens(4, 2, GATHER_COST_AS_STORED) == 0
    # 4-bit experts dequantized to bf16 per call: (3 x 0.5 + 4) / (0.5 + 4) = 1.22 per expert.
    cost = dequantized_gather_cost(0.5, 2)
    assert cost == pytest.approx(5.5 / 4.5)
    assert gather_max_tokens(8, 2, cost) == 3  # 3 x 2 x 1.22 = 7.3 < 8


def test_the_threshold_setting_overrides_and_a_bad_value_names_itself(monkeypatch):
    monkeypatch.setenv("VLLM_MOE_GATHER_MAX_TOKENS", "16")
    assert gather_max_tokens(4, 2, GATHER_COST_AS_STORED) == 16
    monkeypatch.setenv("VLLM_MOE_GATHER_MAX_TOKENS", "0")
    assert gather_max_tokens(128, 1, GATHER_COST_AS_STORED) == 0
    for bad in ("-1", "few"):
        monkeypatch.setenv("VLLM_MOE_GATHER_MAX_TOKENS", bad)
        with pytest.raises(EnvError, match="VLLM_MOE_GATHER_MAX_TOKENS") as error:
            gather_max_tokens(8, 2, GATHER_COST_AS_STORED)
        assert "unset it" in str(error.value)
