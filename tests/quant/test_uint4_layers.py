"""AWQ and GPTQ on vLLM's own linear layers, in CPU emulation: checkpoint tensors made by the test
packers are loaded through each layer's weight loader (fused q/k/v and gate/up shards included),
repacked once, and the quantized layer must compute what the float layer computes on the
dequantized weights. Runs in a fresh process (vLLM's tensor-parallel state is process-wide); no
engine.

Tolerance: the kernel reproduces the dequantized weights exactly in float32 (see
test_uint4_kernel.py), so the only difference is the order of float32 accumulation:
atol 1e-4, rtol 1e-4 on outputs of magnitude ~1.
"""

from __future__ import annotations

import json

import pytest

LAYERS_JOB = r"""
import json, socket, sys
import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.layers import linear as L

sys.path.insert(0, __ROOT__)
from tests.quant import packers as P
from vllm_gaudi_quant.methods.awq import HpuAwqConfig
from vllm_gaudi_quant.methods.gptq import HpuGptqConfig

CASES = {
    "awq": (P.awq_config(32), dict(sym=False), P.pack_awq, HpuAwqConfig),
    "gptq-sym": (P.gptq_config(32, sym=True, desc_act=False), dict(sym=True), P.pack_gptq,
                 HpuGptqConfig),
    "gptq-asym": (P.gptq_config(64, sym=False, desc_act=False),
                  dict(sym=False, zero_range=(1, 15)), P.pack_gptq, HpuGptqConfig),
    "gptq-act-order": (P.gptq_config(32, sym=True, desc_act=True), dict(sym=True, act_order=True),
                       P.pack_gptq, HpuGptqConfig),
}

def float_weight(n, k, seed):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1

def load(param, tensor, *shard):
    param.weight_loader(param, tensor, *shard)

def run(name):
    hf_cfg, qargs, pack, cls = CASES[name]
    cfg = cls.from_config(hf_cfg)
    group = hf_cfg["group_size"]
    layers = {
        "qkv": (L.QKVParallelLinear(128, 32, 4, 2, bias=False, quant_config=cfg),
                [("q", 128), ("k", 64), ("v", 64)]),
        "up": (L.MergedColumnParallelLinear(128, [96, 96], bias=False, quant_config=cfg),
               [(0, 96), (1, 96)]),
        "o": (L.RowParallelLinear(128, 64, bias=True, quant_config=cfg), [(None, 64)]),
        "rep": (L.ReplicatedLinear(128, 32, bias=False, quant_config=cfg), [(None, 32)]),
    }
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(7))
    out = {}
    for li, (lname, (layer, shards)) in enumerate(layers.items()):
        deq = []
        for i, (shard, n) in enumerate(shards):
            qt = P.quantize(float_weight(n, 128, 10 * li + i), group, **qargs)
            deq.append(P.dequantize(qt))
            for pname, tensor in pack(qt).items():
                load(getattr(layer, pname), tensor, *(() if shard is None else (shard,)))
        if layer.bias is not None:
            layer.bias.data.copy_(torch.linspace(-1, 1, layer.bias.shape[0]))
        layer.quant_method.process_weights_after_loading(layer)
        with torch.no_grad():
            got = layer(x)[0]
            want = torch.nn.functional.linear(x, torch.cat(deq), layer.bias)
        out[lname] = {
            "method": type(layer.quant_method).__name__,
            "max_err": float((got - want).abs().max()),
            "close": bool(torch.allclose(got, want, atol=1e-4, rtol=1e-4)),
            "scale": float(want.abs().max()),
        }
    return out

with set_current_vllm_config(VllmConfig()):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(1, 1)
    print("RESULT " + json.dumps({name: run(name) for name in CASES}))
"""

CASES = ("awq", "gptq-sym", "gptq-asym", "gptq-act-order")
METHODS = {"awq": "HpuAwqLinearMethod"}


@pytest.fixture(scope="module")
def layers_result(run_python):
    from pathlib import Path

    root = repr(str(Path(__file__).resolve().parents[2]))
    proc = run_python(
        LAYERS_JOB.replace("__ROOT__", root), env={"VLLM_HPU_EMULATION": "cpu"}, timeout=300
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    pytest.fail(f"layer job failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


@pytest.mark.parametrize("case", CASES)
def test_every_vllm_linear_class_runs_the_hpu_4bit_method(layers_result, case):
    expected = METHODS.get(case, "HpuGptqLinearMethod")
    assert {r["method"] for r in layers_result[case].values()} == {expected}


@pytest.mark.parametrize("case", CASES)
def test_quantized_linear_matches_the_float_linear_on_dequantized_weights(layers_result, case):
    for layer, r in layers_result[case].items():
        assert r["close"], f"{case} {layer}: max error {r['max_err']} (outputs up to {r['scale']})"
