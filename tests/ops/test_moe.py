"""The MoE family: UnquantizedFusedMoEMethod (its routing, and its experts through the seam's
mixture_of_experts kernel) and grouped top-k, against vLLM's own CPU implementations, on both
backends of the seam (`hpu_backend`: the emulation, and seam/gaudi over the Habana stand-in).

The MoE reference is vLLM's CPU fused-MoE kernel (`cpu_fused_moe` on prepacked weights, what
vLLM's CPU platform runs for unquantized experts); it rounds differently from the emulated
kernel's float32 accumulation, so the tolerance is looser than conftest TOLERANCES: 1e-4
absolute in float32, 3e-2 absolute in bfloat16 (outputs are of magnitude ~1).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from vllm._custom_ops import cpu_fused_moe, cpu_prepack_moe_weight
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEParallelConfig,
    RoutingMethodType,
)
from vllm.model_executor.layers.fused_moe.router import cpu_router, grouped_topk_router

from tests.vllm_build import needs_vllm_cpu_backend
from vllm_gaudi_ops import stats
from vllm_gaudi_ops.families.moe import HpuGroupedTopk, HpuUnquantizedFusedMoEMethod, route

HIDDEN, INTER = 64, 96
MOE_TOLERANCE = {torch.float32: {"atol": 1e-4, "rtol": 1e-4}, torch.bfloat16: {"atol": 3e-2}}


def _config(experts, topk, dtype, activation=MoEActivation.SILU, has_bias=False):
    return FusedMoEConfig(
        num_experts=experts,
        experts_per_token=topk,
        hidden_dim=HIDDEN,
        intermediate_size=INTER,
        num_local_experts=experts,
        num_logical_experts=experts,
        activation=activation,
        device="cpu",
        routing_method=RoutingMethodType.Renormalize,
        moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(),
        in_dtype=dtype,
        has_bias=has_bias,
    )


def _weights(experts, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(experts, 2 * INTER, HIDDEN, generator=gen) / 8).to(dtype)
    w2 = (torch.randn(experts, HIDDEN, INTER, generator=gen) / 10).to(dtype)
    return w13, w2


def _routed_experts(topk=2, experts=16, **routing):
    """The attributes of vLLM's RoutedExperts that the method reads (routing: plain softmax)."""
    layer = torch.nn.Module()
    layer.global_num_experts = experts
    layer.top_k = topk
    layer.renormalize = True
    layer.use_grouped_topk = False
    layer.num_expert_group = None
    layer.topk_group = None
    layer.custom_routing_function = None
    layer.scoring_func = "softmax"
    layer.routed_scaling_factor = 1.0
    layer.e_score_correction_bias = None
    layer.expert_map = None
    layer.apply_router_weight_on_input = False
    for name, value in routing.items():
        setattr(layer, name, value)
    return layer


def _layer(method, w13, w2, *, expert_map=None, on_input=False, biases=None, **routing):
    layer = _routed_experts(
        experts=w13.shape[0],
        expert_map=expert_map,
        apply_router_weight_on_input=on_input,
        **routing,
    )
    method.create_weights(layer, w13.shape[0], HIDDEN, INTER, w13.dtype)
    layer.w13_weight.data.copy_(w13)
    layer.w2_weight.data.copy_(w2)
    if biases is not None:
        layer.w13_bias.data.copy_(biases[0])
        layer.w2_bias.data.copy_(biases[1])
    method.process_weights_after_loading(layer)
    return layer


def _biases(experts, dtype, seed=3):
    # Large enough that some gate/up values pass swigluoai's clamp at 7.
    gen = torch.Generator().manual_seed(seed)
    return (
        (torch.randn(experts, 2 * INTER, generator=gen) * 3).to(dtype),
        (torch.randn(experts, HIDDEN, generator=gen) / 2).to(dtype),
    )


def _routing(tokens, experts, topk, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    logits = torch.randn(tokens, experts, generator=gen)
    weights, ids = logits.softmax(-1).topk(topk, dim=-1)
    return x, (weights / weights.sum(-1, keepdim=True)), ids.to(torch.int32)


def _vllm_cpu_moe(x, w13, w2, weights, ids, activation="silu"):
    out = torch.empty_like(x)
    w13p, w2p = cpu_prepack_moe_weight(w13, "vec"), cpu_prepack_moe_weight(w2, "vec")
    cpu_fused_moe(out, x, w13p, w2p, None, None, weights, ids, activation, "vec")
    return out


@needs_vllm_cpu_backend
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "experts", "topk"), [(1, 4, 1), (16, 8, 2), (33, 16, 4)])
def test_unquantized_moe_matches_vllm_cpu_kernel(
    hpu_backend, vllm_config, assert_matches, dtype, tokens, experts, topk
):
    method = HpuUnquantizedFusedMoEMethod(_config(experts, topk, dtype))
    w13, w2 = _weights(experts, dtype)
    layer = _layer(method, w13, w2)
    x, weights, ids = _routing(tokens, experts, topk, dtype)

    out = method.forward_oot(layer, x, weights, ids, None, None)

    expected = _vllm_cpu_moe(x, w13, w2, weights, ids)
    assert_matches(out, expected, **MOE_TOLERANCE[dtype])


def test_unquantized_moe_apply_calls_forward_oot_with_vllms_arguments(hpu_backend, vllm_config):
    # vLLM's runner calls apply(), which calls forward() with keyword arguments; on HPU the
    # dispatched forward is forward_oot, so its parameter names must match.
    method = HpuUnquantizedFusedMoEMethod(_config(4, 2, torch.float32))
    layer = _layer(method, *_weights(4, torch.float32))
    x, weights, ids = _routing(3, 4, 2, torch.float32)
    method._forward_method = method.forward_oot  # what dispatch picks on an OOT platform
    before = stats.COUNTS.get("moe", 0)

    out = method.apply(layer, x, weights, ids, None, None)

    assert stats.COUNTS["moe"] == before + 1
    torch.testing.assert_close(out, method.forward_oot(layer, x, weights, ids, None, None))


def test_expert_parallel_rank_sums_only_its_own_experts(hpu_backend, vllm_config, assert_matches):
    # Rank 1 of 2 with round-robin placement: it holds global experts 1, 3, 5, 7.
    experts, topk = 8, 2
    w13, w2 = _weights(experts, torch.float32)
    local = torch.tensor([1, 3, 5, 7])
    expert_map = torch.full((experts,), -1, dtype=torch.int32)
    expert_map[local] = torch.arange(4, dtype=torch.int32)
    method = HpuUnquantizedFusedMoEMethod(_config(4, topk, torch.float32))
    layer = _layer(method, w13[local], w2[local], expert_map=expert_map)
    x, weights, ids = _routing(12, experts, topk, torch.float32)

    out = method.forward_oot(layer, x, weights, ids, None, None)

    # The same routing on all 8 experts, with the other rank's slots weighted 0.
    remote = expert_map[ids.long()] < 0
    assert remote.any() and (~remote).any()
    expected = _float64_moe(x, w13, w2, weights.masked_fill(remote, 0.0), ids)
    assert_matches(out, expected, **PLAIN_TOLERANCE[torch.float32])


def test_router_weight_on_input_scales_the_input_instead_of_the_output(
    hpu_backend, vllm_config, assert_matches
):
    # Llama 4 style (top-1): expert(w * x), not w * expert(x); they differ for a nonlinear MLP.
    method = HpuUnquantizedFusedMoEMethod(_config(4, 1, torch.float32))
    w13, w2 = _weights(4, torch.float32)
    layer = _layer(method, w13, w2, on_input=True)
    x, weights, ids = _routing(6, 4, 1, torch.float32)
    weights = weights * torch.rand(6, 1, generator=torch.Generator().manual_seed(2))

    out = method.forward_oot(layer, x, weights, ids, None, None)

    expected = _float64_moe(x * weights, w13, w2, torch.ones_like(weights), ids)
    assert_matches(out, expected, **PLAIN_TOLERANCE[torch.float32])
    scaled_output = _float64_moe(x, w13, w2, weights, ids)
    assert not torch.allclose(out, scaled_output, atol=1e-3)


def test_gelu_tanh_experts_use_the_tanh_approximation(hpu_backend, vllm_config, assert_matches):
    method = HpuUnquantizedFusedMoEMethod(
        _config(4, 2, torch.float32, activation=MoEActivation.GELU_TANH)
    )
    w13, w2 = _weights(4, torch.float32)
    layer = _layer(method, w13, w2)
    x, weights, ids = _routing(5, 4, 2, torch.float32)

    out = method.forward_oot(layer, x, weights, ids, None, None)

    expected = torch.zeros_like(x)
    for t in range(5):
        for k in range(2):
            gate, up = (w13[ids[t, k]] @ x[t]).chunk(2)
            expected[t] += weights[t, k] * (w2[ids[t, k]] @ (F.gelu(gate, approximate="tanh") * up))
    assert_matches(out, expected, **MOE_TOLERANCE[torch.float32])


def test_an_activation_neither_path_computes_fails_at_construction_naming_it(
    hpu_backend, vllm_config
):
    with pytest.raises(ValueError, match=r"'swiglustep'.*kernel supports silu, gelu_tanh"):
        HpuUnquantizedFusedMoEMethod(
            _config(4, 2, torch.float32, activation=MoEActivation.SWIGLUSTEP)
        )


def test_hash_routing_fails_at_construction(hpu_backend, vllm_config):
    config = _config(4, 2, torch.float32)
    config.has_hash_routing = True
    with pytest.raises(ValueError, match="hash routing"):
        HpuUnquantizedFusedMoEMethod(config)


def _float64_experts(x, w13, w2, b13, b2, weights, ids, gate):
    """The naive reference: one token and one routed expert at a time, in float64."""
    x, w13, w2, b13, b2 = (t.double() for t in (x, w13, w2, b13, b2))
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = gate(w13[e] @ x[t] + b13[e])
            out[t] += float(weights[t, k]) * (w2[e] @ h + b2[e])
    return out


def _float64_moe(x, w13, w2, weights, ids):
    """SiLU experts without biases, in float64, returned in x's dtype (the tests whose subject
    is the routing or the expert placement, not the kernel: they run on both vLLM builds)."""
    zeros13, zeros2 = w13.new_zeros(w13.shape[:2]), w2.new_zeros(w2.shape[:2])
    return _float64_experts(x, w13, w2, zeros13, zeros2, weights, ids, _silu64).to(x.dtype)


def _swigluoai64(h):
    # gpt-oss: gate and up interleaved; alpha 1.702, limit 7.
    gate, up = h[0::2].clamp(max=7.0), h[1::2].clamp(min=-7.0, max=7.0)
    return (up + 1) * gate * torch.sigmoid(1.702 * gate)


def _silu64(h):
    gate, up = h.chunk(2)
    return F.silu(gate) * up


# Errors against float64 measured when written, on outputs up to ~40: float32 1e-5, bfloat16
# 0.2 (0.6% of the largest output: gate/up are rounded to bfloat16 before the activation).
PLAIN_TOLERANCE = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 1e-1, "rtol": 2e-2},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "experts", "topk"), [(1, 4, 1), (16, 8, 2), (33, 16, 4)])
def test_biased_swigluoai_experts_match_a_float64_reference(
    hpu_backend, vllm_config, dtype, tokens, experts, topk
):
    config = _config(experts, topk, dtype, activation=MoEActivation.SWIGLUOAI, has_bias=True)
    method = HpuUnquantizedFusedMoEMethod(config)
    w13, w2 = _weights(experts, dtype)
    b13, b2 = _biases(experts, dtype)
    layer = _layer(method, w13, w2, biases=(b13, b2))
    x, weights, ids = _routing(tokens, experts, topk, dtype)
    x = x * 4  # wide gate/up values: the clamps at +-7 take part

    out = method.forward_oot(layer, x, weights, ids, None, None)

    expected = _float64_experts(x, w13, w2, b13, b2, weights, ids, _swigluoai64)
    gate_up = torch.einsum("th,eih->tei", x.double(), w13.double()) + b13.double()
    assert (gate_up.abs() > 7).any(), "the test should exercise swigluoai's clamp"
    error = (out.double() - expected).abs().max().item()
    scale = expected.abs().max().item()
    shape = f"{tokens}x{experts}x{topk}"
    print(f"swigluoai experts {dtype} {shape}: max |error| {error:.1e} (|out| {scale:.0f})")
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, **PLAIN_TOLERANCE[dtype])


def test_biased_silu_experts_match_a_float64_reference(hpu_backend, vllm_config):
    method = HpuUnquantizedFusedMoEMethod(_config(8, 2, torch.float32, has_bias=True))
    w13, w2 = _weights(8, torch.float32)
    b13, b2 = _biases(8, torch.float32)
    layer = _layer(method, w13, w2, biases=(b13, b2))
    x, weights, ids = _routing(12, 8, 2, torch.float32)

    out = method.forward_oot(layer, x, weights, ids, None, None)

    expected = _float64_experts(x, w13, w2, b13, b2, weights, ids, _silu64)
    torch.testing.assert_close(out.double(), expected, **PLAIN_TOLERANCE[torch.float32])


def test_swigluoai_experts_equal_transformers_gpt_oss_experts_on_vllms_weight_layout(
    hpu_backend, vllm_config
):
    # transformers keeps gate_up_proj [experts, hidden, 2 * inter] (gate/up interleaved in the
    # last dim) and down_proj [experts, inter, hidden]; vLLM's gpt-oss loader stores their
    # transposes as w13 / w2. Same routing, same output.
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    experts, topk = 4, 2
    hf_config = GptOssConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=experts)
    hf = GptOssExperts(hf_config).double()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param, scale in zip(hf.parameters(), (0.15, 3.0, 0.1, 0.5), strict=True):
            param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float64) * scale)
    method = HpuUnquantizedFusedMoEMethod(
        _config(experts, topk, torch.float64, activation=MoEActivation.SWIGLUOAI, has_bias=True)
    )
    layer = _layer(
        method,
        hf.gate_up_proj.detach().transpose(1, 2),
        hf.down_proj.detach().transpose(1, 2),
        biases=(hf.gate_up_proj_bias.detach(), hf.down_proj_bias.detach()),
    )
    x, weights, ids = _routing(10, experts, topk, torch.float64)
    x = x * 4

    out = method.forward_oot(layer, x, weights.double(), ids, None, None)

    with torch.no_grad():
        expected = hf(x, ids.long(), weights.double())
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-10)


@needs_vllm_cpu_backend
def test_biased_swigluoai_experts_match_vllms_cpu_kernel(hpu_backend, vllm_config, assert_matches):
    # vLLM's CPU backend runs gpt-oss's experts with this kernel (same weight layout).
    config = _config(8, 2, torch.float32, activation=MoEActivation.SWIGLUOAI, has_bias=True)
    method = HpuUnquantizedFusedMoEMethod(config)
    w13, w2 = _weights(8, torch.float32)
    b13, b2 = _biases(8, torch.float32)
    layer = _layer(method, w13, w2, biases=(b13, b2))
    x, weights, ids = _routing(16, 8, 2, torch.float32)

    out = method.forward_oot(layer, x, weights, ids, None, None)

    expected = torch.empty_like(x)
    w13p, w2p = cpu_prepack_moe_weight(w13, "vec"), cpu_prepack_moe_weight(w2, "vec")
    cpu_fused_moe(expected, x, w13p, w2p, b13, b2, weights, ids, "swigluoai", "vec")
    assert_matches(out, expected, **MOE_TOLERANCE[torch.float32])


def test_plain_path_expert_parallel_rank_sums_only_its_own_experts(hpu_backend, vllm_config):
    experts, topk = 8, 2
    w13, w2 = _weights(experts, torch.float32)
    b13, b2 = _biases(experts, torch.float32)
    local = torch.tensor([1, 3, 5, 7])
    expert_map = torch.full((experts,), -1, dtype=torch.int32)
    expert_map[local] = torch.arange(4, dtype=torch.int32)
    config = _config(4, topk, torch.float32, activation=MoEActivation.SWIGLUOAI, has_bias=True)
    method = HpuUnquantizedFusedMoEMethod(config)
    layer = _layer(
        method, w13[local], w2[local], expert_map=expert_map, biases=(b13[local], b2[local])
    )
    x, weights, ids = _routing(12, experts, topk, torch.float32)

    out = method.forward_oot(layer, x, weights, ids, None, None)

    remote = expert_map[ids.long()] < 0
    assert remote.any() and (~remote).any()
    expected = _float64_experts(
        x, w13, w2, b13, b2, weights.masked_fill(remote, 0.0), ids, _swigluoai64
    )
    torch.testing.assert_close(out.double(), expected, **PLAIN_TOLERANCE[torch.float32])


def test_unbiased_silu_experts_still_use_the_kernel(hpu_backend, vllm_config, monkeypatch):
    method = HpuUnquantizedFusedMoEMethod(_config(4, 2, torch.float32))
    layer = _layer(method, *_weights(4, torch.float32))
    x, weights, ids = _routing(3, 4, 2, torch.float32)
    calls = []
    kernel = hpu_backend.mixture_of_experts

    def recording_kernel(*args):
        calls.append(args[6])  # the activation
        return kernel(*args)

    monkeypatch.setattr(hpu_backend, "mixture_of_experts", recording_kernel)

    method.forward_oot(layer, x, weights, ids, None, None)

    assert calls == ["silu"]


def test_unquantized_moe_is_always_enabled_and_routes_by_itself(vllm_config):
    method = HpuUnquantizedFusedMoEMethod(_config(4, 2, torch.float32))

    assert HpuUnquantizedFusedMoEMethod.enabled()
    assert method.is_monolithic is True
    assert method.supports_eplb is False


def test_an_unsupported_scoring_function_fails_when_the_layer_is_built(hpu_backend, vllm_config):
    method = HpuUnquantizedFusedMoEMethod(_config(4, 2, torch.float32))
    with pytest.raises(ValueError, match="sqrtsoftplus"):
        _layer(method, *_weights(4, torch.float32), scoring_func="sqrtsoftplus")


# Routing schemes of vLLM's routers (as layer attributes), checked against vLLM's CPU router.
ROUTINGS = {
    "softmax": {},
    "softmax_no_renormalize": {"renormalize": False},
    "grouped_softmax": {"use_grouped_topk": True, "num_expert_group": 4, "topk_group": 2},
    "grouped_sigmoid_bias_scaled": {
        "use_grouped_topk": True,
        "num_expert_group": 4,
        "topk_group": 2,
        "scoring_func": "sigmoid",
        "routed_scaling_factor": 2.5,
        "e_score_correction_bias": torch.linspace(-0.2, 0.2, 16),
    },
}


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
def test_routing_matches_vllms_cpu_router(hpu_backend, vllm_config, assert_matches, routing):
    layer = _routed_experts(topk=4, **ROUTINGS[routing])
    gen = torch.Generator().manual_seed(7)
    hidden, logits = torch.randn(10, HIDDEN, generator=gen), torch.randn(10, 16, generator=gen)

    weights, ids = route(layer, hidden, logits)

    expected_weights, expected_ids = cpu_router.select_experts(
        hidden, logits, layer.top_k, layer.use_grouped_topk, layer.renormalize,
        layer.topk_group, layer.num_expert_group, None, layer.scoring_func,
        layer.routed_scaling_factor, layer.e_score_correction_bias,
    )  # fmt: skip
    weights, ids = _sorted_by_expert(weights, ids)
    expected_weights, expected_ids = _sorted_by_expert(expected_weights, expected_ids)
    assert torch.equal(ids, expected_ids)
    assert_matches(weights, expected_weights.float())


def test_routing_calls_a_custom_routing_function_as_vllm_does(hpu_backend, vllm_config):
    calls = []

    def top1_sigmoid(hidden_states, gating_output, topk, renormalize):
        calls.append((topk, renormalize))
        weights, ids = gating_output.topk(topk, dim=-1)
        return weights.sigmoid(), ids

    layer = _routed_experts(
        topk=1, experts=8, custom_routing_function=top1_sigmoid, renormalize=False
    )
    logits = torch.randn(5, 8)

    weights, ids = route(layer, torch.randn(5, HIDDEN), logits)

    assert calls == [(1, False)]
    assert (weights.dtype, ids.dtype) == (torch.float32, torch.int32)
    assert torch.equal(ids.long(), logits.argmax(-1, keepdim=True))


def test_router_logits_for_experts_the_layer_lacks_are_refused(hpu_backend, vllm_config):
    # LongCat appends "zero experts" to the logits; only vLLM's ZeroExpertRouter handles them.
    layer = _routed_experts(experts=16)
    with pytest.raises(ValueError, match="18 experts but the layer has 16"):
        route(layer, torch.randn(3, HIDDEN), torch.randn(3, 18))


def test_apply_monolithic_routes_then_runs_the_experts(hpu_backend, vllm_config, assert_matches):
    # What vLLM's runner calls with the router logits; the op's forward is forward_oot on HPU.
    method = HpuUnquantizedFusedMoEMethod(_config(8, 2, torch.float32))
    method._forward_method = method.forward_oot
    w13, w2 = _weights(8, torch.float32)
    layer = _layer(method, w13, w2)
    gen = torch.Generator().manual_seed(8)
    x, logits = torch.randn(7, HIDDEN, generator=gen), torch.randn(7, 8, generator=gen)

    out = method.apply_monolithic(layer, x, logits)

    weights, ids = cpu_router.select_experts(x, logits, 2, False, True)
    assert_matches(out, _float64_moe(x, w13, w2, weights, ids), **PLAIN_TOLERANCE[torch.float32])


def test_apply_monolithic_hands_the_routed_experts_to_vllms_sink(hpu_backend, vllm_config):
    # vLLM binds a sink (buffer + callback) to each MoE layer when a caller asks which experts
    # every token went to; its own monolithic kernels fill it, and so must the HPU method.
    method = HpuUnquantizedFusedMoEMethod(_config(8, 2, torch.float32))
    method._forward_method = method.forward_oot
    w13, w2 = _weights(8, torch.float32)
    layer = _layer(method, w13, w2)
    captures: list[torch.Tensor] = []
    layer.routing_sink = SimpleNamespace(
        buffer=torch.full((16, 2), -1, dtype=torch.int16), capture_fn=captures.append
    )
    gen = torch.Generator().manual_seed(9)
    x, logits = torch.randn(5, HIDDEN, generator=gen), torch.randn(5, 8, generator=gen)

    method.apply_monolithic(layer, x, logits)

    _, ids = cpu_router.select_experts(x, logits, 2, False, True)
    assert len(captures) == 1 and captures[0].shape == (5, 2)
    assert torch.equal(captures[0].long().sort(-1).values, ids.long().sort(-1).values)


def _sorted_by_expert(weights, ids):
    ids, order = ids.long().sort(dim=-1)
    return weights.gather(1, order), ids


@pytest.mark.parametrize("scoring_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("routed_scaling_factor", [1.0, 2.5])
def test_grouped_topk_matches_native(
    hpu_backend, vllm_config, assert_matches, scoring_func, with_bias, renormalize,
    routed_scaling_factor,
):  # fmt: skip
    layer = HpuGroupedTopk(
        topk=4,
        renormalize=renormalize,
        num_expert_group=8,
        topk_group=3,
        scoring_func=scoring_func,
        routed_scaling_factor=routed_scaling_factor,
    )
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(10, HIDDEN, generator=gen)
    logits = torch.randn(10, 64, generator=gen)
    bias = torch.randn(64, generator=gen) / 10 if with_bias else None
    # vLLM's forward_native is torch.compile'd; compare with the same function, eager.
    native = grouped_topk_router.grouped_topk._torchdynamo_orig_callable

    weights, ids = layer.forward_oot(hidden, logits, bias)

    expected_weights, expected_ids = native(
        hidden, logits, 4, renormalize, 8, 3, scoring_func, routed_scaling_factor, bias
    )
    assert (weights.dtype, ids.dtype) == (expected_weights.dtype, expected_ids.dtype)
    weights, ids = _sorted_by_expert(weights, ids)
    expected_weights, expected_ids = _sorted_by_expert(expected_weights, expected_ids)
    assert torch.equal(ids, expected_ids)
    assert_matches(weights, expected_weights)


def test_grouped_topk_never_picks_an_expert_outside_the_kept_groups(hpu_backend, vllm_config):
    layer = HpuGroupedTopk(topk=2, renormalize=True, num_expert_group=4, topk_group=1)
    logits = torch.full((1, 16), -5.0)
    logits[0, 0] = 5.0  # group 0 has the single best expert...
    logits[0, 12:16] = 4.0  # ...group 3 has the best second and third

    _, ids = layer.forward_oot(torch.zeros(1, HIDDEN), logits)

    assert set(ids[0].tolist()) <= {0, 1, 2, 3}
