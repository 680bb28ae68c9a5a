"""AWQ, GPTQ and compressed-tensors (WNA16, W8A8-FP8) on vLLM's own linear layers, on both backends
of the seam (CPU emulation, and seam/gaudi over the Habana stand-in): checkpoint tensors made by
the test packers are loaded through each layer's weight loader (fused q/k/v and gate/up shards
included), repacked once, and the quantized layer must compute what the float layer computes on
the dequantized weights. Runs in a fresh process (vLLM's tensor-parallel state is process-wide);
no engine.

Tolerances. 4-bit: the kernel reproduces the dequantized weights exactly in float32 (see
test_uint4_kernel.py), so only the order of float32 accumulation differs: atol 1e-4, rtol 1e-4 on
outputs of magnitude ~1. W8A8-FP8: the weights are exact too, but activations are rounded to E4M3
(3 mantissa bits, <= 6.25% per value, ~3.6% RMS), which dot products average: relative norm error
of the output <= 5%.
"""

from __future__ import annotations

import pytest

from tests.integration.generation import job_result

LAYERS_JOB = r"""
import json, sys
import torch
from vllm.config import VllmConfig, set_current_vllm_config
from gaudi_testkit.parallel import single_process_parallel
from vllm.model_executor.layers import linear as L

sys.path.insert(0, __ROOT__)
from tests.quant import packers as P
from vllm_gaudi_quant.methods.awq import HpuAwqConfig
from vllm_gaudi_quant.methods.compressed_tensors import HpuCompressedTensorsConfig
from vllm_gaudi_quant.methods.gptq import HpuGptqConfig

def int4(group, pack, **qargs):
    def make(w):
        qt = P.quantize(w, group, **qargs)
        return pack(qt), P.dequantize(qt)
    return make

def fp8(per_channel):
    def make(w):
        fw = P.quantize_fp8(w, per_channel=per_channel)
        return {"weight": fw.weight, "weight_scale": fw.scale,
                "input_scale": torch.tensor([0.02])}, P.dequantize_fp8(fw)
    return make

CASES = {
    "awq": (HpuAwqConfig, P.awq_config(32), int4(32, P.pack_awq, sym=False)),
    "gptq-sym": (HpuGptqConfig, P.gptq_config(32, sym=True, desc_act=False),
                 int4(32, P.pack_gptq, sym=True)),
    "gptq-asym": (HpuGptqConfig, P.gptq_config(64, sym=False, desc_act=False),
                  int4(64, P.pack_gptq, sym=False, zero_range=(1, 15))),
    "gptq-act-order": (HpuGptqConfig, P.gptq_config(32, sym=True, desc_act=True),
                       int4(32, P.pack_gptq, sym=True, act_order=True)),
    "ct-wna16-sym": (HpuCompressedTensorsConfig, P.ct_wna16_config(32, sym=True),
                     int4(32, lambda qt: P.pack_ct_wna16(qt, sym=True), sym=True)),
    "ct-wna16-asym": (HpuCompressedTensorsConfig, P.ct_wna16_config(64, sym=False),
                      int4(64, lambda qt: P.pack_ct_wna16(qt, sym=False), sym=False)),
    "ct-fp8-channel-dynamic": (HpuCompressedTensorsConfig,
                               P.ct_fp8_config(per_channel=True, dynamic=True), fp8(True)),
    "ct-fp8-tensor-static": (HpuCompressedTensorsConfig,
                             P.ct_fp8_config(per_channel=False, dynamic=False), fp8(False)),
}

def float_weight(n, k, seed):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1

def load(param, tensor, *shard):
    param.weight_loader(param, tensor, *shard)

def run(name):
    cls, hf_cfg, make = CASES[name]
    cfg = cls.from_config(hf_cfg)
    layers = {
        "qkv": (L.QKVParallelLinear(128, 32, 4, 2, bias=False, quant_config=cfg,
                                    prefix="model.layers.0.self_attn.qkv_proj"),
                [("q", 128), ("k", 64), ("v", 64)]),
        "up": (L.MergedColumnParallelLinear(128, [96, 96], bias=False, quant_config=cfg,
                                            prefix="model.layers.0.mlp.gate_up_proj"),
               [(0, 96), (1, 96)]),
        "o": (L.RowParallelLinear(128, 64, bias=True, quant_config=cfg,
                                  prefix="model.layers.0.self_attn.o_proj"), [(None, 64)]),
        "rep": (L.ReplicatedLinear(128, 32, bias=False, quant_config=cfg,
                                   prefix="model.layers.0.mlp.extra"), [(None, 32)]),
    }
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(7))
    out = {}
    for li, (lname, (layer, shards)) in enumerate(layers.items()):
        deq = []
        for i, (shard, n) in enumerate(shards):
            tensors, dq = make(float_weight(n, 128, 10 * li + i))
            deq.append(dq)
            for pname, tensor in tensors.items():
                if not hasattr(layer, pname):
                    continue  # e.g. input_scale of a dynamic scheme
                load(getattr(layer, pname), tensor, *(() if shard is None else (shard,)))
        if layer.bias is not None:
            layer.bias.data.copy_(torch.linspace(-1, 1, layer.bias.shape[0]))
        layer.quant_method.process_weights_after_loading(layer)
        with torch.no_grad():
            got = layer(x)[0]
            want = torch.nn.functional.linear(x, torch.cat(deq), layer.bias)
        method = layer.quant_method
        out[lname] = {
            "method": type(getattr(layer, "scheme", method)).__name__,
            "rel_err": float((got - want).norm() / want.norm()),
            "max_err": float((got - want).abs().max()),
            "close": bool(torch.allclose(got, want, atol=1e-4, rtol=1e-4)),
            "scale": float(want.abs().max()),
        }
    return out

with set_current_vllm_config(VllmConfig()):
    single_process_parallel()
    print("RESULT " + json.dumps({name: run(name) for name in CASES}))
"""

INT4_CASES = ("awq", "gptq-sym", "gptq-asym", "gptq-act-order", "ct-wna16-sym", "ct-wna16-asym")
FP8_CASES = ("ct-fp8-channel-dynamic", "ct-fp8-tensor-static")
METHODS = {"awq": "HpuAwqLinearMethod", "gptq": "HpuGptqLinearMethod", "ct-wna16": "HpuWNA16Uint4"}
FP8_ACTIVATION_TOLERANCE = 0.05  # relative norm error; see the module docstring


@pytest.fixture(scope="module")
def layers_result(run_python, job_backend):
    """The job's results on one backend of the seam (`job_backend`: the emulation, and seam/gaudi
    over the Habana stand-in off Gaudi)."""
    from pathlib import Path

    root = repr(str(Path(__file__).resolve().parents[2]))
    job = job_backend.job(LAYERS_JOB.replace("__ROOT__", root))
    proc = run_python(job, env=job_backend.env, timeout=900)
    return job_result(proc, f"layer job ({job_backend.name})")


@pytest.mark.process
@pytest.mark.parametrize("case", INT4_CASES)
def test_every_vllm_linear_class_runs_the_hpu_4bit_method(layers_result, case):
    expected = next(cls for prefix, cls in METHODS.items() if case.startswith(prefix))
    assert {r["method"] for r in layers_result[case].values()} == {expected}


@pytest.mark.process
@pytest.mark.parametrize("case", INT4_CASES)
def test_4bit_linear_matches_the_float_linear_on_dequantized_weights(layers_result, case):
    for layer, r in layers_result[case].items():
        assert r["close"], f"{case} {layer}: max error {r['max_err']} (outputs up to {r['scale']})"


@pytest.mark.process
@pytest.mark.parametrize("case", FP8_CASES)
def test_every_vllm_linear_class_runs_the_hpu_fp8_scheme(layers_result, case):
    assert {r["method"] for r in layers_result[case].values()} == {"HpuW8A8Fp8"}


@pytest.mark.process
@pytest.mark.parametrize("case", FP8_CASES)
def test_w8a8_fp8_linear_stays_within_activation_rounding_of_the_float_linear(layers_result, case):
    for layer, r in layers_result[case].items():
        assert r["rel_err"] <= FP8_ACTIVATION_TOLERANCE, f"{case} {layer}: {r['rel_err']}"
