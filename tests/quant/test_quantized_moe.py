"""AWQ, GPTQ (with and without act-order), compressed-tensors WNA16 and compressed-tensors W8A8-FP8
(channel and tensor weight scales, dynamic and static activations) mixture-of-experts layers, on
both backends of the seam (CPU emulation, and seam/gaudi over the Habana stand-in): each expert's
checkpoint tensors, made by the test packers, are loaded through vLLM's own MoE layer
(`FusedMoEFactory`, Mixtral's w1/w2/w3 names) and its expert loader, repacked once (4-bit) or
kept FP8, and the quantized layer must compute what a plain torch MoE computes on the dequantized
weights (softmax top-2 routing, renormalized; SiLU-gated experts). Runs in a fresh process
(vLLM's parallel state is process-wide); no engine.

Tolerance: the kernels reproduce the dequantized weights exactly in float32 (see
test_uint4_kernel.py; FP8 times its scale is exact in float32) and routing reads the same logits,
so only the order of float32 accumulation differs: atol 1e-4, rtol 1e-4 on outputs up to ~3
(about 2e-6 measured). FP8 experts with per-tensor or per-channel weight scales run W8A8: the
reference rounds the tokens and each expert's intermediate to FP8 as Gaudi's FP8 MoE kernel does
(static scales from the checkpoint, or per token); block-scaled ones run W8A16 against the float
reference.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.generation import job_result

LAYERS_JOB = r"""
import json, os, sys, types
import torch
import torch.nn.functional as F
from vllm.config import VllmConfig, set_current_vllm_config
from gaudi_testkit.parallel import single_process_parallel
from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

sys.path.insert(0, __ROOT__)
from tests.quant import fp8_packers as F8
from tests.quant import packers as P
from vllm_gaudi_quant.methods.awq import HpuAwqConfig
from vllm_gaudi_quant.methods.compressed_tensors import HpuCompressedTensorsConfig
from vllm_gaudi_quant.methods.fp8 import HpuFp8Config
from vllm_gaudi_quant.methods.gptq import HpuGptqConfig

EXPERTS, TOPK, HIDDEN, INTER = 4, 2, 128, 192
BUILT = []  # vLLM registers each MoE layer by name: one layer index per layer built

def int4(group, pack, **qargs):
    def make(w, seed):
        qt = P.quantize(w, group, seed=seed, **qargs)
        return pack(qt), P.dequantize(qt)
    return make

CASES = {
    "awq": (HpuAwqConfig, P.awq_config(32), int4(32, P.pack_awq, sym=False)),
    "gptq-asym": (HpuGptqConfig, P.gptq_config(64, sym=False, desc_act=False),
                  int4(64, P.pack_gptq, sym=False, zero_range=(1, 15))),
    "gptq-act-order": (HpuGptqConfig, P.gptq_config(32, sym=True, desc_act=True),
                       int4(32, P.pack_gptq, sym=True, act_order=True)),
    "ct-wna16-sym": (HpuCompressedTensorsConfig, P.ct_wna16_config(32, sym=True),
                     int4(32, lambda qt: P.pack_ct_wna16(qt, sym=True), sym=True)),
    "ct-wna16-asym": (HpuCompressedTensorsConfig, P.ct_wna16_config(64, sym=False),
                      int4(64, lambda qt: P.pack_ct_wna16(qt, sym=False), sym=False)),
    "ct-wna16-channel": (HpuCompressedTensorsConfig, P.ct_wna16_config(None, sym=True),
                         lambda w, seed: int4(w.shape[1], lambda qt: P.pack_ct_wna16(qt, sym=True),
                                              sym=True)(w, seed)),
}

def fp8(per_channel, static):
    def make(w, seed):
        fw = P.quantize_fp8(w, per_channel=per_channel)
        packed = {"weight": fw.weight, "weight_scale": fw.scale}
        if static:  # gate and up share a seed, so their input scales agree as in real checkpoints
            packed["input_scale"] = input_scale(seed)
        return packed, P.dequantize_fp8(fw)
    return make

def input_scale(seed):
    return torch.tensor([0.01 * (1 + seed % 7)])

for strategy in ("channel", "tensor"):
    for activations in ("dynamic", "static"):
        ct = P.ct_fp8_config(per_channel=strategy == "channel", dynamic=activations == "dynamic")
        if activations == "static":  # static activations are per tensor
            ct["config_groups"]["group_0"]["input_activations"]["strategy"] = "tensor"
        CASES[f"ct-fp8-{strategy}-{activations}"] = (
            HpuCompressedTensorsConfig, ct, fp8(strategy == "channel", activations == "static"))

def fp8_format(scheme, block=None, static=False):
    def make(w, seed):
        packed = F8.quantize(w, scheme, block)
        if static:
            packed["input_scale"] = input_scale(seed).reshape(())
        return packed, F8.dequantize(packed, block)
    return make

# vLLM's own fp8 format through the same method, for comparison.
CASES["fp8-tensor-static"] = (HpuFp8Config, F8.fp8_config("static"),
                              fp8_format("tensor", static=True))
CASES["fp8-block"] = (HpuFp8Config, F8.fp8_config("dynamic", (64, 64)),
                      fp8_format("block", (64, 64)))

def float_weight(n, k, seed):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1

def build(cfg):
    BUILT.append(cfg)
    prefix = f"model.layers.{len(BUILT)}.block_sparse_moe.experts"
    return FusedMoEFactory(num_experts=EXPERTS, top_k=TOPK, hidden_size=HIDDEN,
                           intermediate_size=INTER, params_dtype=torch.float32,
                           renormalize=True, quant_config=cfg, prefix=prefix,
                           ckpt_names=("w1", "w2", "w3")).routed_experts

def load(layer, make, w3_seed_offset=0):
    # Gate (w1) and up (w3) read the same input: one activation order (seed) for both, as real
    # GPTQ checkpoints have, unless w3_seed_offset says otherwise.
    tensors, deq = [], {}
    for e in range(EXPERTS):
        for proj, (n, k) in (("w1", (INTER, HIDDEN)), ("w3", (INTER, HIDDEN)),
                             ("w2", (HIDDEN, INTER))):
            seed = 10 * e + (1 if proj == "w2" else 0) + (w3_seed_offset if proj == "w3" else 0)
            packed, dq = make(float_weight(n, k, 100 * e + len(proj) + ord(proj[1])), seed)
            deq[e, proj] = dq
            tensors += [(f"{e}.{proj}.{key}", value) for key, value in packed.items()]
    loaded = set(layer.load_weights(tensors))
    return deq, loaded

def reference(x, logits, deq):
    weights, ids = logits.softmax(-1).topk(TOPK, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], ids[t].tolist()):
            h = F.silu(x[t] @ deq[e, "w1"].t()) * (x[t] @ deq[e, "w3"].t())
            out[t] += w * (h @ deq[e, "w2"].t())
    return out

def fp8_round(v, scale, limit):
    # v rounded to the FP8 grid under `scale` (saturating at the device's limit), in float32.
    return (v / scale).clamp(-limit, limit).to(torch.float8_e4m3fn).float() * scale

def reference_w8a8(x, logits, deq, limit, x_scale, inter_scales):
    # What Gaudi's FP8 MoE kernel computes: FP8 tokens (x_scale: static 0-d, or None: one scale
    # per token), each expert's intermediate rounded to FP8 (its static scale, or per token).
    xs = x_scale if x_scale is not None else x.abs().amax(-1, keepdim=True) / limit
    xq = fp8_round(x, xs, limit)
    weights, ids = logits.softmax(-1).topk(TOPK, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], ids[t].tolist()):
            h = F.silu(xq[t] @ deq[e, "w1"].t()) * (xq[t] @ deq[e, "w3"].t())
            hs = inter_scales[e] if inter_scales is not None else h.abs().amax() / limit
            out[t] += w * (fp8_round(h, hs, limit) @ deq[e, "w2"].t())
    return out

def gathered_and_dense(method, layer, x, logits):
    # One token routes to TOPK of the EXPERTS experts: with the gather forced on (1) and off (0),
    # how many experts the kernel is handed and whether the outputs are bit-identical.
    from vllm_gaudi_platform.seam import backend
    kernels = backend()
    handed, outputs = [], {}
    saved = {name: getattr(kernels, name) for name in ("mixture_of_experts",
                                                         "mixture_of_experts_fp8")}
    for name, inner in saved.items():
        def recording(*args, inner=inner):
            handed.append(len(args[3]))
            return inner(*args)
        setattr(kernels, name, recording)
    try:
        for setting in ("0", "1"):
            os.environ["VLLM_MOE_GATHER_MAX_TOKENS"] = setting
            method._gather_max_tokens = None  # read the setting again
            outputs[setting] = method.apply_monolithic(layer, x, logits)
    finally:
        del os.environ["VLLM_MOE_GATHER_MAX_TOKENS"]
        for name, inner in saved.items():
            setattr(kernels, name, inner)
    return {"handed": handed, "equal": bool(torch.equal(outputs["0"], outputs["1"]))}

def run(name):
    cls, hf_cfg, make = CASES[name]
    layer = build(cls.from_config(hf_cfg))
    method = layer.quant_method
    deq, loaded = load(layer, make)
    created = {n for n, _ in layer.named_parameters()}
    method.process_weights_after_loading(layer)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(9, HIDDEN, generator=gen)
    logits = torch.randn(9, EXPERTS, generator=gen)
    # vLLM's routed-experts capture: a sink bound to the layer, filled by a monolithic method.
    captures = []
    layer.routing_sink = types.SimpleNamespace(
        buffer=torch.full((16, TOPK), -1, dtype=torch.int16), capture_fn=captures.append
    )
    w8a8 = getattr(method, "block", "n/a") is None  # FP8 experts with per-row weight scales
    with torch.no_grad():
        got = method.apply_monolithic(layer, x, logits)
        captured = [c.long().sort(-1).values.tolist() for c in captures]
        gather = gathered_and_dense(method, layer, x[:1], logits[:1])
        want = w8a16 = reference(x, logits, deq)
        if w8a8:
            from vllm_gaudi_platform.seam import backend
            limit = backend().fp8_max(torch.float8_e4m3fn)
            # Checkpoint scales are for E4M3's 448; Gaudi 2 (240) doubles them (a power of two,
            # so the halved FP8 weights stay exact).
            factor = 1.0 if limit >= 448.0 else 2.0
            x_scale = inter = None
            if method.static_input:
                x_scale = max(input_scale(10 * e) for e in range(EXPERTS)).reshape(()) * factor
                inter = [input_scale(10 * e + 1).reshape(()) * factor for e in range(EXPERTS)]
            want = reference_w8a8(x, logits, deq, limit, x_scale, inter)
    routed = logits.softmax(-1).topk(TOPK, dim=-1).indices
    static = {}
    if getattr(layer, "w13_input_scale", None) is not None:
        # What each expert's checkpoint input scales were (load() seeds: 10 * e, 10 * e + 1).
        # Brought into the device's FP8 range like the weight scales (x 2 on Gaudi 2).
        from vllm_gaudi_platform.seam import backend
        factor = 1.0 if backend().fp8_max(torch.float8_e4m3fn) >= 448.0 else 2.0
        static = {
            "w13": [layer.w13_input_scale[e].item() for e in range(EXPERTS)],
            "w2": [layer.w2_input_scale[e].item() for e in range(EXPERTS)],
            "want_w13": [input_scale(10 * e).item() * factor for e in range(EXPERTS)],
            "want_w2": [input_scale(10 * e + 1).item() * factor for e in range(EXPERTS)],
        }
    return {
        "static_input_scales": static,
        "method": type(method).__name__,
        "unloaded": sorted(created - loaded),
        "params": {n: [str(p.dtype), list(p.shape)] for n, p in layer.named_parameters()},
        "max_err": float((got - want).abs().max()),
        "scale": float(want.abs().max()),
        "close": bool(torch.allclose(got, want, atol=1e-4, rtol=1e-4)),
        "w8a8": w8a8,
        "w8a16_err": float((got - w8a16).abs().max()),
        "captured": captured,
        "routed": routed.sort(-1).values.tolist(),
        "gather": gather,
    }

ON_INPUT = ("awq", "fp8-tensor-static", "ct-fp8-channel-dynamic")

def on_input(name):
    # Llama 4's top-1 routing: each token is scaled by its router weight before its expert, whose
    # output is not weighted again. The same experts with renormalized top-1 routing (weight 1)
    # on the pre-scaled tokens must give the same result, bit for bit; weighting the output
    # instead (ignoring the setting) gives expert(x) * w, which the SiLU gate makes different.
    cls, hf_cfg, make = CASES[name]
    outs = []
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(5, HIDDEN, generator=gen)
    logits = torch.randn(5, EXPERTS, generator=gen)
    weight = logits.softmax(-1).max(-1, keepdim=True).values
    layers = {}
    for scaled_input in (True, False):
        BUILT.append(name)
        layer = FusedMoEFactory(
            num_experts=EXPERTS, top_k=1, hidden_size=HIDDEN, intermediate_size=INTER,
            params_dtype=torch.float32, renormalize=not scaled_input,
            quant_config=cls.from_config(hf_cfg),
            prefix=f"model.layers.{len(BUILT)}.block_sparse_moe.experts",
            ckpt_names=("w1", "w2", "w3"), apply_router_weight_on_input=scaled_input,
        ).routed_experts
        load(layer, make)
        layer.quant_method.process_weights_after_loading(layer)
        layers[scaled_input] = layer
    with torch.no_grad():
        run_ = lambda layer, inputs: layer.quant_method.apply_monolithic(layer, inputs, logits)
        got = run_(layers[True], x)
        want = run_(layers[False], x * weight)
        weighted_output = run_(layers[False], x) * weight
    return {
        "equal": bool(torch.equal(got, want)),
        "gap_to_weighted_output": float((got - weighted_output).abs().max()),
    }

def error_of(fn):
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return None

def mismatched_act_order():
    cls, hf_cfg, make = CASES["gptq-act-order"]
    layer = build(cls.from_config(hf_cfg))
    load(layer, make, w3_seed_offset=1)
    layer.quant_method.process_weights_after_loading(layer)

def fp8_block_experts():
    ct = P.ct_fp8_config(per_channel=True, dynamic=True)
    group = ct["config_groups"]["group_0"]
    group["weights"].update(strategy="block", block_structure=[64, 64])
    group["input_activations"].update(strategy="group", group_size=64)
    build(HpuCompressedTensorsConfig.from_config(ct))

with set_current_vllm_config(VllmConfig()):
    single_process_parallel()
    result = {name: run(name) for name in CASES}
    # FP8 experts as a Gaudi 2 runs them (E4M3 saturates at 240).
    set_generation(2)
    result.update({f"gaudi2:{name}": run(name) for name in CASES if "fp8" in name})
    set_generation(3)
    result["on_input"] = {name: on_input(name) for name in ON_INPUT}
    result["errors"] = {
        "gptq-act-order-mismatch": error_of(mismatched_act_order),
        "ct-fp8-block-experts": error_of(fp8_block_experts),
    }
    print("RESULT " + json.dumps(result))
"""

CASES = ("awq", "gptq-asym", "gptq-act-order", "ct-wna16-sym", "ct-wna16-asym", "ct-wna16-channel")
METHODS = {"awq": "HpuAwqMoEMethod", "gptq": "HpuGptqMoEMethod", "ct-wna16": "HpuWNA16MoE"}
FP8_CASES = tuple(
    f"ct-fp8-{strategy}-{activations}"
    for strategy in ("channel", "tensor")
    for activations in ("dynamic", "static")
)
FP8_FORMAT_CASES = ("fp8-tensor-static", "fp8-block")  # vLLM's fp8 format, same MoE method


@pytest.fixture(scope="module")
def moe_result(run_python, job_backend):
    """The job's results on one backend of the seam (`job_backend`: the emulation, and seam/gaudi
    over the Habana stand-in off Gaudi)."""
    root = repr(str(Path(__file__).resolve().parents[2]))
    job = job_backend.job(LAYERS_JOB.replace("__ROOT__", root))
    proc = run_python(job, env=job_backend.env, timeout=900)
    return job_result(proc, f"MoE layer job ({job_backend.name})")


@pytest.mark.process
@pytest.mark.parametrize("case", ["awq", "fp8-tensor-static", "ct-fp8-channel-dynamic"])
def test_router_weight_on_the_input_scales_the_tokens_not_the_expert_outputs(moe_result, case):
    # Llama 4 (top-1): equal to renormalized routing over pre-scaled tokens, and not the output
    # weighting an implementation that ignores the setting would give.
    result = moe_result["on_input"][case]
    assert result["equal"] is True
    assert result["gap_to_weighted_output"] > 1e-3


@pytest.mark.process
@pytest.mark.parametrize("case", CASES)
def test_vllm_moe_layer_runs_the_hpu_4bit_moe_method(moe_result, case):
    expected = next(cls for prefix, cls in METHODS.items() if case.startswith(prefix))
    assert moe_result[case]["method"] == expected


@pytest.mark.process
@pytest.mark.parametrize("case", CASES)
def test_every_expert_tensor_of_the_checkpoint_is_loaded(moe_result, case):
    assert moe_result[case]["unloaded"] == []


@pytest.mark.process
@pytest.mark.parametrize("case", CASES)
def test_experts_are_repacked_into_the_uint4_kernel_layout(moe_result, case):
    params = moe_result[case]["params"]
    hidden, inter, experts = 128, 192, 4
    assert params["w13_qweight"] == ["torch.int32", [experts, hidden, 2 * inter // 8]]
    assert params["w2_qweight"] == ["torch.int32", [experts, inter, hidden // 8]]
    assert params["w13_scales"][1][2] == 2 * inter and params["w2_scales"][1][2] == hidden
    assert not any("packed" in name or "g_idx" in name for name in params)


@pytest.mark.process
@pytest.mark.parametrize("case", CASES)
def test_4bit_moe_matches_the_float_moe_on_dequantized_weights(moe_result, case):
    r = moe_result[case]
    assert r["close"], f"{case}: max error {r['max_err']} (outputs up to {r['scale']})"


@pytest.mark.process
@pytest.mark.parametrize("case", CASES + FP8_CASES + FP8_FORMAT_CASES)
def test_the_moe_method_hands_each_tokens_experts_to_vllms_routing_sink(moe_result, case):
    r = moe_result[case]
    assert r["captured"] == [r["routed"]], "one capture per call, the top-k experts of each token"


@pytest.mark.process
def test_act_order_experts_whose_gate_and_up_disagree_are_refused_by_name(moe_result):
    error = moe_result["errors"]["gptq-act-order-mismatch"]
    assert error is not None and "g_idx" in error and "block_sparse_moe.experts" in error


@pytest.mark.process
@pytest.mark.parametrize("case", FP8_CASES + FP8_FORMAT_CASES)
def test_fp8_experts_run_the_hpu_fp8_moe_method(moe_result, case):
    assert moe_result[case]["method"] == "HpuFp8MoEMethod"


@pytest.mark.process
@pytest.mark.parametrize("case", FP8_CASES + FP8_FORMAT_CASES)
def test_every_fp8_expert_tensor_of_the_checkpoint_is_loaded(moe_result, case):
    assert moe_result[case]["unloaded"] == []


@pytest.mark.process
@pytest.mark.parametrize("case", FP8_CASES)
def test_fp8_experts_stay_fp8_with_one_scale_per_output_row(moe_result, case):
    params = moe_result[case]["params"]
    hidden, inter, experts = 128, 192, 4
    assert params["w13_weight"] == ["torch.float8_e4m3fn", [experts, 2 * inter, hidden]]
    assert params["w2_weight"] == ["torch.float8_e4m3fn", [experts, hidden, inter]]
    assert params["w13_weight_scale"] == ["torch.float32", [experts, 2 * inter]]
    assert params["w2_weight_scale"] == ["torch.float32", [experts, hidden]]


@pytest.mark.process
@pytest.mark.parametrize("case", [c for c in FP8_CASES + FP8_FORMAT_CASES if "static" in c])
def test_static_input_scales_of_fp8_experts_load_per_expert(moe_result, case):
    scales = moe_result[case]["static_input_scales"]
    assert scales["w13"] == pytest.approx(scales["want_w13"])
    assert scales["w2"] == pytest.approx(scales["want_w2"])


@pytest.mark.process
@pytest.mark.parametrize("case", FP8_CASES + FP8_FORMAT_CASES)
def test_fp8_moe_matches_the_float_moe_on_dequantized_weights(moe_result, case):
    r = moe_result[case]
    assert r["close"], f"{case}: max error {r['max_err']} (outputs up to {r['scale']})"


W8A8_CASES = tuple(c for c in FP8_CASES + FP8_FORMAT_CASES if "block" not in c)
GAUDI2_CASES = tuple(f"gaudi2:{c}" for c in FP8_CASES + FP8_FORMAT_CASES)


@pytest.mark.process
@pytest.mark.parametrize("case", GAUDI2_CASES)
def test_fp8_moe_on_gaudi2_matches_its_reference(moe_result, case):
    r = moe_result[case]
    assert r["close"], f"{case}: max error {r['max_err']} (outputs up to {r['scale']})"


@pytest.mark.process
@pytest.mark.parametrize("case", W8A8_CASES + tuple(f"gaudi2:{c}" for c in W8A8_CASES))
def test_fp8_experts_quantize_their_activations_w8a8(moe_result, case):
    """The FP8 experts match the W8A8 reference (FP8 tokens and intermediates) and NOT the W8A16
    one: an implementation that dequantized the weights and kept float activations would be
    off by more than ten times the tolerance."""
    r = moe_result[case]
    assert r["w8a8"] is True
    tolerance = 1e-4 + 1e-4 * r["scale"]
    print(f"{case}: W8A8 error {r['max_err']:.2e}, W8A16 error {r['w8a16_err']:.2e}")
    assert r["w8a16_err"] > 10 * tolerance, r


@pytest.mark.process
def test_block_scaled_fp8_experts_run_w8a16(moe_result):
    assert moe_result["fp8-block"]["w8a8"] is False


@pytest.mark.process
def test_block_scaled_fp8_experts_of_a_compressed_tensors_checkpoint_are_refused_by_name(
    moe_result,
):
    error = moe_result["errors"]["ct-fp8-block-experts"]
    assert error is not None and "block_sparse_moe.experts" in error
    assert "block" in error.split("activations")[0].lower() and "W8A8-FP8" in error


@pytest.mark.process
@pytest.mark.parametrize("case", CASES + FP8_CASES + FP8_FORMAT_CASES)
def test_one_token_hands_the_kernel_only_its_routed_experts_with_the_same_result(moe_result, case):
    # 4-bit and block-scaled FP8 experts are gathered before they are dequantized; FP8 experts
    # on the FP8 kernel bring their weight and input scales along.
    gather = moe_result[case]["gather"]
    assert gather["handed"] == [4, 2]  # dense: all 4 experts; gathered: top-2 of one token
    assert gather["equal"]
