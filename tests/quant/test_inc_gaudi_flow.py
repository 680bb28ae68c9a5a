"""INC FP8 on neural-compressor's HPU flow, the one a Gaudi runs, over the Habana stand-in.

In CPU emulation neural-compressor takes its CPU path (quantize-dequantize, arbitrary scales).
Here the stand-in plays the Gaudi (`HABANA_STANDIN_TORCH_DEVICE=1`: a torch device "hpu"
holding CPU memory, `torch.hpu`, `habana_frameworks.torch.utils.experimental`), so the same
`HpuIncConfig` hooks run neural-compressor's HPU code: it patches vLLM's linear classes with
its own HPU modules, moves them to "hpu", measures there, and in QUANTIZE stores FP8 weights
with hardware-aligned scales (`maxabs_hw`, the Gaudi default) and runs every layer through
`hpu::cast_to_fp8_v2` and `hpu::fp8_gemm_v2`. One process per Gaudi generation; no engine.

What a wrong flow would fail:
- scales: Gaudi 2 multiplies FP8 products by its hardware scales only ({16, 1, 1/16, 1/256}),
  Gaudi 3 by powers of two (2^-55 .. 2^7): every input and weight scale must be one of them;
- values: each layer's output equals an independent reference (the input divided by the
  layer's input scale and rounded to E4M3 with the generation's saturation, 240 or 448, times
  the stored FP8 weight, times both scales, plus the bias) to one bf16 rounding; the stored
  weights equal the float weights divided by their scale and rounded to E4M3;
- no float matmul runs in a quantized layer.
"""

from __future__ import annotations

import pytest

from tests.conftest import REAL_GAUDI_SOFTWARE, standin_process_env
from tests.integration.generation import job_result

# Not marked `gaudi`: the stand-in runs in the job processes, not in this one (the seam/gaudi
# coverage test reruns the `gaudi` tests in-process).
GAUDI2_SCALES = {16.0, 1.0, 1 / 16, 1 / 256}

LAYERS_JOB = r"""
import json, math, os, tempfile
from collections import Counter
import torch
from torch.utils._python_dispatch import TorchDispatchMode
import habana_frameworks.torch  # noqa: F401 - the stand-in, with its torch device "hpu"
from habana_frameworks.torch import _device
from vllm.config import VllmConfig, set_current_vllm_config
from gaudi_testkit.parallel import single_process_parallel
from vllm.model_executor.layers import linear as L
from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

from vllm_gaudi_platform.seam import backend
from vllm_gaudi_quant.methods.inc import HpuIncConfig

work = tempfile.mkdtemp()
LAYERS = ("qkv", "o", "up", "col", "rep")
MOES = []  # vLLM registers each MoE layer by name: one index per layer built


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = L.QKVParallelLinear(64, 16, 4, 2, bias=False)
        self.o = L.RowParallelLinear(64, 64, bias=True)
        self.up = L.MergedColumnParallelLinear(64, [96, 96], bias=False)
        self.col = L.ColumnParallelLinear(64, 32, bias=True)
        self.rep = L.ReplicatedLinear(64, 16, bias=False)
        # MoE experts: built, not run (see test_moe_experts_are_left_in_high_precision_and_named).
        MOES.append(len(MOES))
        self.moe = FusedMoEFactory(
            num_experts=4, top_k=2, hidden_size=64, intermediate_size=32,
            params_dtype=torch.bfloat16, renormalize=True, quant_config=None,
            prefix=f"model.layers.{len(MOES)}.block_sparse_moe.experts",
            ckpt_names=("w1", "w2", "w3"),
        ).routed_experts

    def forward(self, x):
        return {name: getattr(self, name)(x)[0] for name in LAYERS}


def build():
    torch.manual_seed(0)
    block = Block().to(torch.bfloat16)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    with torch.no_grad():
        block.up.weight[0, 0] = 30.0  # one outlier weight: saturates unless its scale covers it
    return block


def hooks(config):
    path = os.path.join(work, config["mode"] + ".json")
    with open(path, "w") as f:
        json.dump(config, f)
    os.environ["QUANT_CONFIG"] = path
    return HpuIncConfig()


class Tape(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func._schema.name] += 1
        return func(*args, **(kwargs or {}))


def f(t):
    return t.detach().cpu().float()


with set_current_vllm_config(VllmConfig()):
    single_process_parallel()
    gen = torch.Generator().manual_seed(1)
    calib = [torch.randn(7, 64, generator=gen).to(torch.bfloat16).to("hpu") for _ in range(4)]
    test = (torch.randn(9, 64, generator=gen) * 3).to(torch.bfloat16).to("hpu")
    base = {"observer": "maxabs", "dump_stats_path": "stats/m"}

    float_block = build()
    ref = {k: f(v) for k, v in float_block.to("hpu")(test).items()}

    measure = hooks({**base, "mode": "MEASURE"})
    block = measure.hpu_after_load_model(build().to("hpu"))
    with torch.no_grad():
        for x in calib:
            block(x)
    measure.hpu_finalize_calibration(block)
    stats = json.load(open(os.path.join(work, "stats", "m_hooks_maxabs_0_1.json")))

    fp8_max = 240.0 if _device.generation() == 2 else 448.0
    weights = {k: f(getattr(float_block, k).weight) for k in LAYERS}

    def check(qblock, out):
        # Scales, classes, storage, and each output against the independent FP8 reference.
        found = {"ref_err": {}, "weight_err": {}, "scales": {}, "classes": {}, "weights": {}}
        for k in LAYERS:
            m = getattr(qblock, k)
            s_in, s_w = float(m.scale_input), float(m.scale_weight)
            found["scales"][k] = [s_in, s_w]
            found["classes"][k] = type(m).__name__
            found["weights"][k] = [str(m.weight.dtype), m.weight.device.type]
            stored = m.weight.detach().cpu()  # FP8 [in, out]: neural-compressor keeps it so
            x8 = (f(test) / s_in).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn)
            expect = (x8.float() @ stored.float()) * s_in * s_w
            if getattr(m, "bias", None) is not None:
                expect = expect + f(m.bias)
            found["ref_err"][k] = float((expect - out[k]).abs().max() / out[k].abs().max())
            w8 = (weights[k] / s_w).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn)
            found["weight_err"][k] = float((w8.float().t() - stored.float()).abs().max())
        return found

    quantize = hooks({**base, "mode": "QUANTIZE"})  # maxabs_hw, the Gaudi default
    qblock = quantize.hpu_after_load_model(build().to("hpu"))
    with torch.no_grad(), Tape() as tape:
        out = {k: f(v) for k, v in qblock(test).items()}
    report = check(qblock, out)

    pow2 = hooks({**base, "mode": "QUANTIZE", "scale_method": "maxabs_pow2"})
    pblock = pow2.hpu_after_load_model(build().to("hpu"))
    with torch.no_grad():
        report["pow2"] = check(pblock, {k: f(v) for k, v in pblock(test).items()})
    report.update(
        generation=_device.generation(),
        backend=backend().NAME,
        stats_nodes=sorted(stats["Nodes"]),
        ops=dict(tape.ops),
        rel_err={k: float((out[k] - ref[k]).norm() / ref[k].norm()) for k in LAYERS},
        outlier=[float(qblock.up.weight.detach().cpu().float().max()), report["scales"]["up"][1]],
        experts=[type(qblock.moe).__name__, str(qblock.moe.w13_weight.dtype),
                 quantize.unquantized_experts],
    )
    print("RESULT " + json.dumps(report))
"""


@pytest.fixture(scope="module", params=[2, 3], ids=["gaudi2", "gaudi3"])
def flow(request, run_python) -> dict:
    if REAL_GAUDI_SOFTWARE:
        pytest.skip("runs over the Habana stand-in, which does not load beside a real Gaudi stack")
    env = standin_process_env(request.param, HABANA_STANDIN_TORCH_DEVICE="1")
    return job_result(run_python(LAYERS_JOB, env=env, timeout=900), "INC HPU flow job")


LAYERS = ("qkv", "o", "up", "col", "rep")


@pytest.mark.process
def test_runs_on_the_gaudi_backend_of_the_requested_generation(flow, request):
    assert flow["backend"] == "gaudi"
    assert flow["generation"] == (2 if "gaudi2" in request.node.callspec.id else 3)


@pytest.mark.process
def test_neural_compressor_measures_every_vllm_linear_class_on_the_device(flow):
    assert flow["stats_nodes"] == sorted(LAYERS)


@pytest.mark.process
def test_neural_compressor_patches_vllm_layers_with_its_own_hpu_modules(flow):
    # On the HPU path neural-compressor registers vLLM's classes itself (our CPU-path
    # registrations, Hpu*, are not used).
    classes = flow["classes"]
    assert classes["qkv"] == classes["up"] == classes["col"] == "PatchedColumnParallelLinear"
    assert classes["o"] == "PatchedRowParallelLinear"
    assert classes["rep"] == "PatchedReplicatedLinear"


@pytest.mark.process
def test_weights_are_stored_in_fp8_on_the_device(flow):
    assert set(map(tuple, flow["weights"].values())) == {("torch.float8_e4m3fn", "hpu")}


@pytest.mark.process
def test_scales_are_the_generations_hardware_scales(flow):
    for name, scales in flow["scales"].items():
        for scale in scales:
            if flow["generation"] == 2:
                assert scale in GAUDI2_SCALES, (name, scale)
            else:
                exponent = scale.hex()  # a power of two has mantissa 1.0
                assert exponent.startswith("0x1.0000000000000p"), (name, scale)
                assert -55 <= int(exponent.split("p")[1]) <= 7, (name, scale)


@pytest.mark.process
def test_maxabs_pow2_gives_power_of_two_scales_and_the_same_fp8_arithmetic(flow):
    pow2 = flow["pow2"]
    for name, scales in pow2["scales"].items():
        for scale in scales:
            assert scale.hex().startswith("0x1.0000000000000p"), (name, scale)
    for name, err in pow2["ref_err"].items():
        assert err <= 2**-7, (name, err)
    assert pow2["weight_err"] == dict.fromkeys(LAYERS, 0.0)


@pytest.mark.process
def test_every_layer_runs_gaudis_fp8_kernels_and_no_float_matmul(flow):
    ops = flow["ops"]
    assert ops.get("hpu::cast_to_fp8_v2") == len(LAYERS), ops
    assert ops.get("hpu::fp8_gemm_v2") == len(LAYERS), ops
    assert not {"aten::mm", "aten::addmm", "aten::matmul", "aten::linear"} & set(ops), ops


@pytest.mark.process
def test_outputs_equal_an_independent_fp8_reference(flow):
    for name, err in flow["ref_err"].items():
        assert err <= 2**-7, (name, err)  # one bf16 rounding of the output


@pytest.mark.process
def test_stored_weights_are_the_float_weights_over_their_scale_in_e4m3(flow):
    assert flow["weight_err"] == dict.fromkeys(LAYERS, 0.0)


@pytest.mark.process
def test_an_outlier_weight_is_covered_by_its_scale_not_saturated(flow):
    stored_max, scale = flow["outlier"]
    assert stored_max * scale == pytest.approx(30.0, rel=2**-3)  # E4M3: 3 mantissa bits


@pytest.mark.process
def test_moe_experts_are_left_in_high_precision_and_named(flow):
    # neural-compressor patches vLLM's MoE by the class name FusedMoE, which vLLM 0.32's routed
    # experts do not carry: the experts stay bf16 on a Gaudi too, and the config says which.
    assert flow["experts"] == ["RoutedExperts", "torch.bfloat16", ["moe"]]


@pytest.mark.process
def test_quantized_layers_stay_within_fp8_error_of_the_float_layers(flow):
    for name, err in flow["rel_err"].items():
        assert 0.0 < err < 0.08, (name, err)
