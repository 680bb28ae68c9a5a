"""INC FP8 on vLLM's own linear layers, in CPU emulation: neural-compressor's CPU path measures and
quantizes QKVParallelLinear, MergedColumnParallelLinear, RowParallelLinear, ColumnParallelLinear
and ReplicatedLinear once they are in its patched-module table. Runs in a fresh process (vLLM's
tensor-parallel state is process-wide); no engine.

Tolerance: FP8 E4M3 keeps 3 mantissa bits (relative rounding error <= 2^-4 per value); after the
dot products the output error, as a norm relative to the float output, stays under 6% (about 4%
measured).
"""

from __future__ import annotations

import pytest

from tests.integration.generation import job_result

LAYERS_JOB = r"""
import json, os, tempfile
import torch
from vllm.config import VllmConfig, set_current_vllm_config
from gaudi_testkit.parallel import single_process_parallel
from vllm.model_executor.layers import linear as L

from vllm_gaudi_quant.methods.inc import HpuIncConfig

work = tempfile.mkdtemp()

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = L.QKVParallelLinear(64, 16, 4, 2, bias=False)
        self.o = L.RowParallelLinear(64, 64, bias=True)
        self.up = L.MergedColumnParallelLinear(64, [96, 96], bias=False)
        self.col = L.ColumnParallelLinear(64, 32, bias=True)
        self.rep = L.ReplicatedLinear(64, 16, bias=False)

    def forward(self, x):
        return {
            "qkv": self.qkv(x)[0], "o": self.o(x)[0], "up": self.up(x)[0],
            "col": self.col(x)[0], "rep": self.rep(x)[0],
        }

def build():
    torch.manual_seed(0)
    block = Block()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return block

def run_config(config):
    path = os.path.join(work, config["mode"] + ".json")
    with open(path, "w") as f:
        json.dump(config, f)
    os.environ["QUANT_CONFIG"] = path
    return HpuIncConfig()

with set_current_vllm_config(VllmConfig()):
    single_process_parallel()
    gen = torch.Generator().manual_seed(1)
    calib = [torch.randn(7, 64, generator=gen) for _ in range(4)]
    test = torch.randn(9, 64, generator=gen)
    base = {"observer": "maxabs", "use_qdq": "True", "dump_stats_path": "stats/m",
            "scale_method": "maxabs_arbitrary", "hp_dtype": "fp32"}

    block = build()
    ref = {k: v.detach() for k, v in block(test).items()}
    measure = run_config({**base, "mode": "MEASURE"})
    block = measure.hpu_after_load_model(block)
    with torch.no_grad():
        measured = block(calib[0])
        for x in calib[1:]:
            block(x)
    measure.hpu_finalize_calibration(block)
    stats = json.load(open(os.path.join(work, "stats", "m_hooks_maxabs_0_1.json")))

    quantize = run_config({**base, "mode": "QUANTIZE"})
    qblock = quantize.hpu_after_load_model(build())
    with torch.no_grad():
        out = qblock(test)
    plain = build()(calib[0])
    print("RESULT " + json.dumps({
        "measured_exact": {k: bool(torch.equal(measured[k], plain[k].detach())) for k in ref},
        "stats_nodes": sorted(stats["Nodes"]),
        "classes": {k: type(getattr(qblock, k)).__name__ for k in ref},
        "weight_dtypes": {k: str(getattr(qblock, k).weight.dtype) for k in ref},
        "rel_err": {k: float((out[k] - ref[k]).norm() / ref[k].norm()) for k in ref},
        "shapes_ok": {k: list(out[k].shape) == list(ref[k].shape) for k in ref},
    }))
"""


@pytest.fixture(scope="module")
def layers_result(run_python, tmp_path_factory):
    proc = run_python(LAYERS_JOB, env={"VLLM_HPU_EMULATION": "cpu"}, timeout=900)
    return job_result(proc, "layer job")


LAYERS = ("qkv", "o", "up", "col", "rep")


@pytest.mark.process
def test_measurement_does_not_change_layer_outputs(layers_result):
    assert layers_result["measured_exact"] == dict.fromkeys(LAYERS, True)


@pytest.mark.process
def test_every_vllm_linear_class_is_measured(layers_result):
    assert layers_result["stats_nodes"] == sorted(LAYERS)


@pytest.mark.process
def test_every_vllm_linear_class_is_patched_by_neural_compressor(layers_result):
    classes = layers_result["classes"]
    assert classes["qkv"] == classes["up"] == classes["col"] == "HpuPatchedColumnParallelLinear"
    assert classes["o"] == "HpuPatchedRowParallelLinear"
    assert classes["rep"] == "HpuPatchedReplicatedLinear"


@pytest.mark.process
def test_quantized_weights_are_stored_in_fp8(layers_result):
    assert set(layers_result["weight_dtypes"].values()) == {"torch.float8_e4m3fn"}


@pytest.mark.process
def test_quantized_layers_stay_within_fp8_error_of_the_float_layers(layers_result):
    assert all(layers_result["shapes_ok"].values())
    for name, err in layers_result["rel_err"].items():
        assert 0.0 < err < 0.06, (name, err)  # quantized (not bit-exact), and close
