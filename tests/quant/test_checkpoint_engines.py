"""Quantized checkpoints end to end, in CPU emulation: AWQ, GPTQ with and without activation
order, compressed-tensors WNA16 (asymmetric, group 64), W8A8-FP8 (per-channel weights, dynamic
per-token activations) and MXFP4 (E2M1 weights, E8M0 scales per 32 inputs), each a tiny Llama
quantized by the test packers; AWQ, GPTQ (act-order) and compressed-tensors WNA16 of a tiny
Mixtral, experts included; and a compressed-tensors WNA16 checkpoint with a `kv_cache_scheme`
(FP8 KV cache with calibrated k/v scales). Each must be claimed by the HPU method, run every
linear and MoE layer through it, and generate greedily what transformers generates on the
dequantized float model (vLLM's top-5 rule at a divergence). The checkpoints that also round
activations or the KV cache to FP8 are made from the softer tiny Llama (see tinymodels:
"llama-soft") whose logits FP8 rounding moves less.

All engines run one after the other in ONE process (vLLM imported once).
Starts engines (slow): .venv/bin/python -m pytest tests/quant
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.generation import (
    ENGINE,
    assert_close,
    assert_few_diverged,
    hf_greedy,
    make_prompts,
    named_job_outputs,
    run_job,
)
from tests.quant import checkpoints

pytestmark = pytest.mark.engine

JOB = Path(__file__).with_name("quant_job.py")
MAX_TOKENS = 12
# checkpoint -> (tiny float model, checkpoints.py format, method vLLM must resolve, what every
# linear layer runs, what every MoE layer runs)
CHECKPOINTS = {
    "awq": ("llama", "awq", "awq_hpu", "HpuAwqLinearMethod", None),
    "gptq": ("llama", "gptq", "gptq_hpu", "HpuGptqLinearMethod", None),
    "gptq-act-order": ("llama", "gptq-act-order", "gptq_hpu", "HpuGptqLinearMethod", None),
    "ct-wna16-asym": ("llama", "ct-wna16-asym", "compressed-tensors", "HpuWNA16Uint4", None),
    "ct-fp8-dynamic": ("llama-soft", "ct-fp8-dynamic", "compressed-tensors", "HpuW8A8Fp8", None),
    "ct-mxfp4": ("llama", "ct-mxfp4", "compressed-tensors", "HpuMxfp4Linear", None),
    "awq-mixtral": ("mixtral", "awq", "awq_hpu", "HpuAwqLinearMethod", "HpuAwqMoEMethod"),
    "gptq-act-order-mixtral": (
        "mixtral",
        "gptq-act-order",
        "gptq_hpu",
        "HpuGptqLinearMethod",
        "HpuGptqMoEMethod",
    ),
    "ct-wna16-mixtral": (
        "mixtral",
        "ct-wna16-asym",
        "compressed-tensors",
        "HpuWNA16Uint4",
        "HpuWNA16MoE",
    ),
    "ct-wna16-kv-fp8": (
        "llama-soft",
        "ct-wna16-kv-fp8",
        "compressed-tensors",
        "HpuWNA16Uint4",
        None,
    ),
}
LAYERS = 2  # decoder layers of every tiny model
FP8_KV = ("ct-wna16-kv-fp8",)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[dict, list[dict], Path]]:
    """name -> (engine result, transformers on the dequantized weights, checkpoint dir), every
    checkpoint's engine run in one job process."""
    from gaudi_testkit import tinymodels

    dirs = {}
    for name, (model, fmt, *_) in CHECKPOINTS.items():
        out = tmp_path_factory.mktemp(name)
        dirs[name] = checkpoints.write(
            tinymodels.build(model), out, fmt, calibration=make_prompts(seed=1)
        )
    job = {
        "checkpoints": {name: str(qdir) for name, (qdir, _) in dirs.items()},
        "prompts": make_prompts(),
        "max_tokens": MAX_TOKENS,
        "engine": ENGINE,
    }
    env = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    proc = run_job(JOB, json.dumps(job), env, timeout=300 * len(CHECKPOINTS))
    results = named_job_outputs(proc)
    return {
        name: (
            results.get(name, {"error": f"job ended first:\n{proc.stderr[-6000:]}"}),
            hf_greedy(str(fdir), make_prompts(), max_tokens=MAX_TOKENS),
            qdir,
        )
        for name, (qdir, fdir) in dirs.items()
    }


@pytest.fixture(params=sorted(CHECKPOINTS))
def run(request, runs) -> tuple[str, dict, list[dict], Path]:
    """One checkpoint's (name, engine result, reference, checkpoint dir)."""
    name = request.param
    result, reference, qdir = runs[name]
    if "error" in result:
        pytest.fail(f"{name} engine failed:\n{result['error'][-6000:]}")
    return name, result, reference, qdir


def test_checkpoint_is_claimed_by_the_hpu_method(run):
    name, result, _, _ = run
    assert result["quantization"] == CHECKPOINTS[name][2]


def test_every_linear_layer_runs_the_hpu_method(run):
    name, result, _, _ = run
    per_layer = 2 if CHECKPOINTS[name][4] else 4  # MoE models: qkv and o only
    assert len(result["linears"]) == LAYERS * per_layer
    assert set(result["linears"].values()) == {CHECKPOINTS[name][3]}


def test_every_moe_layer_runs_the_hpu_4bit_moe_method(run):
    name, result, _, _ = run
    expected = CHECKPOINTS[name][4]
    if expected is None:
        assert result["experts"] == {}
    else:
        assert len(result["experts"]) == LAYERS
        assert set(result["experts"].values()) == {expected}


def test_kv_cache_scheme_stores_the_kv_cache_in_fp8_with_the_checkpoint_scales(run):
    from safetensors.torch import load_file

    name, result, _, qdir = run
    if name not in FP8_KV:
        assert result["kv_cache_dtype"] == "auto"
        assert {a["kv_cache_dtype"] for a in result["attention"].values()} == {"auto"}
        return
    assert result["kv_cache_dtype"] == "fp8_inc"  # Gaudi's FP8 E4M3 KV cache
    stored = load_file(str(qdir / "model.safetensors"))
    assert len(result["attention"]) == LAYERS
    for layer, attention in result["attention"].items():
        assert attention["kv_cache_dtype"] == "fp8_inc", layer
        prefix = layer.removesuffix(".attn")
        for kind in ("k_scale", "v_scale"):
            assert attention[kind] == pytest.approx(float(stored[f"{prefix}.{kind}"])), layer


def test_generation_follows_the_dequantized_float_model(run):
    name, result, reference, _ = run
    diverged = assert_close(result["results"], reference, name)
    print(f"{name}: {diverged} of {len(reference)} prompts diverged")
    if "fp8" not in name:  # FP8 activations or an FP8 KV cache: see DIVERGED_PER_10
        assert_few_diverged(diverged, len(reference), "4-bit", name)
