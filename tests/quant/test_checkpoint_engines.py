"""Quantized checkpoints end to end, in CPU emulation: AWQ, GPTQ with and without activation
order, compressed-tensors WNA16 (asymmetric, group 64) and W8A8-FP8 (per-channel weights, dynamic
per-token activations), each a tiny Llama quantized by the test packers. Each must be claimed by
the HPU method, run every linear layer through it, and generate greedily what transformers
generates on the dequantized float model (vLLM's top-5 rule at a divergence). The FP8 checkpoint
also rounds activations, so it is made from the softer tiny Llama (see tinymodels: "llama-soft")
whose logits FP8 rounding moves less. One engine process per checkpoint.

Starts engines (slow): .venv/bin/python -m pytest tests/quant
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.generation import ENGINE, assert_close, hf_greedy, make_prompts
from tests.quant import checkpoints

pytestmark = pytest.mark.engine

JOB = Path(__file__).with_name("quant_job.py")
MAX_TOKENS = 12
# checkpoint -> (tiny float model, method vLLM must resolve, what every linear layer runs)
EXPECTED = {
    "awq": ("llama", "awq_hpu", "HpuAwqLinearMethod"),
    "gptq": ("llama", "gptq_hpu", "HpuGptqLinearMethod"),
    "gptq-act-order": ("llama", "gptq_hpu", "HpuGptqLinearMethod"),
    "ct-wna16-asym": ("llama", "compressed-tensors", "HpuWNA16Uint4"),
    "ct-fp8-dynamic": ("llama-soft", "compressed-tensors", "HpuW8A8Fp8"),
}


@pytest.fixture(scope="module", params=sorted(EXPECTED))
def run(request, tmp_path_factory):
    """(name, engine result, transformers on the dequantized weights) for one checkpoint."""
    from vllm_gaudi_platform import tinymodels

    name = request.param
    float_model = tinymodels.build(EXPECTED[name][0])
    qdir, fdir = checkpoints.write(float_model, tmp_path_factory.mktemp("ckpt"), name)
    job = {
        "model": str(qdir),
        "prompts": make_prompts(),
        "max_tokens": MAX_TOKENS,
        "engine": ENGINE,
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.update(VLLM_HPU_EMULATION="cpu", VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    proc = subprocess.run(
        [sys.executable, str(JOB), json.dumps(job)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
            break
    else:
        pytest.fail(f"{name} engine failed:\n{proc.stderr[-6000:]}")
    return name, result, hf_greedy(str(fdir), make_prompts(), max_tokens=MAX_TOKENS)


def test_checkpoint_is_claimed_by_the_hpu_method(run):
    name, result, _ = run
    assert result["quantization"] == EXPECTED[name][1]


def test_every_linear_layer_runs_the_hpu_method(run):
    name, result, _ = run
    assert len(result["linears"]) == 2 * 4
    assert set(result["linears"].values()) == {EXPECTED[name][2]}


def test_generation_follows_the_dequantized_float_model(run):
    name, result, reference = run
    assert_close(result["results"], reference, name)
