"""vLLM's `fp8` checkpoints end to end, in CPU emulation: a tiny Llama with static activation
scales (per-tensor attention, per-channel MLP) and with block-scaled weights and dynamic per-token
activations; a tiny Mixtral with per-tensor expert scales and static expert activation scales,
and with block-scaled experts (see fp8_checkpoints.FORMATS). Each must be claimed by the HPU
`fp8` method, run every quantized linear and MoE layer through it (the Mixtral attention, listed
in `ignored_layers`, stays float), and generate greedily what transformers generates on the
dequantized float model (vLLM's top-5 rule at a divergence).

All engines run one after the other in ONE process (quant_job.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.generation import (
    ENGINE,
    assert_close,
    hf_greedy,
    make_prompts,
    named_job_outputs,
    run_job,
)
from tests.quant import fp8_checkpoints

pytestmark = pytest.mark.engine

JOB = Path(__file__).with_name("quant_job.py")
MAX_TOKENS = 12
LAYERS = 2  # decoder layers of every tiny model


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[dict, list[dict]]]:
    """name -> (engine result, transformers on the dequantized weights), every checkpoint's
    engine run in one job process."""
    prompts = make_prompts()
    dirs = {
        name: fp8_checkpoints.write(name, tmp_path_factory.mktemp(name), prompts)
        for name in fp8_checkpoints.FORMATS
    }
    job = {
        "checkpoints": {name: str(qdir) for name, (qdir, _) in dirs.items()},
        "prompts": prompts,
        "max_tokens": MAX_TOKENS,
        "engine": ENGINE,
    }
    env = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = run_job(JOB, json.dumps(job), env, timeout=300 * len(dirs))
    results = named_job_outputs(proc)
    return {
        name: (
            results.get(name, {"error": f"job ended first:\n{proc.stderr[-6000:]}"}),
            hf_greedy(str(fdir), prompts, max_tokens=MAX_TOKENS),
        )
        for name, (_, fdir) in dirs.items()
    }


@pytest.fixture(params=sorted(fp8_checkpoints.FORMATS))
def run(request, runs) -> tuple[str, dict, list[dict]]:
    """One checkpoint's (name, engine result, reference)."""
    name = request.param
    result, reference = runs[name]
    if "error" in result:
        pytest.fail(f"{name} engine failed:\n{result['error'][-6000:]}")
    return name, result, reference


def test_checkpoint_is_claimed_by_the_hpu_fp8_method(run):
    _, result, _ = run
    assert result["quantization"] == "fp8"


def test_every_quantized_linear_runs_the_hpu_fp8_method(run):
    name, result, _ = run
    if fp8_checkpoints.FORMATS[name].attention is None:
        # Mixtral: qkv and o are in ignored_layers.
        assert len(result["linears"]) == LAYERS * 2
        assert set(result["linears"].values()) == {"UnquantizedLinearMethod"}
    else:
        assert len(result["linears"]) == LAYERS * 4
        assert set(result["linears"].values()) == {"HpuFp8LinearMethod"}


def test_every_moe_layer_runs_the_hpu_fp8_moe_method(run):
    name, result, _ = run
    if fp8_checkpoints.FORMATS[name].model.startswith("mixtral"):
        assert len(result["experts"]) == LAYERS
        assert set(result["experts"].values()) == {"HpuFp8MoEMethod"}
    else:
        assert result["experts"] == {}


def test_generation_follows_the_dequantized_float_model(run):
    name, result, reference = run
    # Within vLLM's top-5 rule; FP8 accuracy itself: test_trained_model.py (DIVERGED_PER_10).
    diverged = assert_close(result["results"], reference, name)
    print(f"{name}: {diverged} of {len(reference)} prompts diverged")
