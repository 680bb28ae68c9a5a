"""vLLM's `fp8` checkpoints end to end, in CPU emulation: a tiny Llama and a tiny Mixtral, each
with per-tensor/per-channel weights and static activation scales, and with block-scaled weights
and dynamic activations (see fp8_checkpoints.FORMATS). Each must be claimed by the HPU `fp8`
method, keep every quantized layer's weights in FP8, and generate greedily what transformers
generates on the dequantized float model (vLLM's top-5 rule at a divergence). One engine process
per checkpoint runs all of that checkpoint's checks.

Run under the engine lock: flock /tmp/vllm-engine.lock .venv/bin/python -m pytest tests/quant
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.generation import ENGINE, assert_close, hf_greedy, make_prompts
from tests.quant import fp8_checkpoints

pytestmark = pytest.mark.engine

JOB = Path(__file__).with_name("fp8_job.py")
MAX_TOKENS = 12
# quantized layers per checkpoint: 2 decoder layers x (qkv, o, and gate_up + down or experts)
LAYER_COUNT = {"llama": 2 * 4, "mixtral": 2 * 3}


@pytest.fixture(scope="module", params=sorted(fp8_checkpoints.FORMATS))
def run(request, tmp_path_factory):
    """(name, engine result, transformers on the dequantized weights) for one checkpoint."""
    name = request.param
    prompts = make_prompts()
    qdir, fdir = fp8_checkpoints.write(name, tmp_path_factory.mktemp("fp8"), prompts)
    job = {"model": str(qdir), "prompts": prompts, "max_tokens": MAX_TOKENS, "engine": ENGINE}
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.update(
        VLLM_HPU_EMULATION="cpu", VLLM_ALLOW_INSECURE_SERIALIZATION="1", VLLM_CPU_KVCACHE_SPACE="1"
    )
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
    return name, result, hf_greedy(str(fdir), prompts, max_tokens=MAX_TOKENS)


def test_checkpoint_is_claimed_by_the_hpu_fp8_method(run):
    _, result, _ = run
    assert result["quantization"] == "fp8"


def test_every_quantized_layer_runs_the_hpu_fp8_method_on_fp8_weights(run):
    name, result, _ = run
    layers = result["layers"]
    assert len(layers) == LAYER_COUNT[fp8_checkpoints.FORMATS[name].model], layers
    expected = {"HpuFp8LinearMethod", "HpuFp8MoEMethod"}
    assert {layer["method"] for layer in layers.values()} <= expected, layers
    assert {layer["dtype"] for layer in layers.values()} == {"torch.float8_e4m3fn"}, layers


def test_generation_follows_the_dequantized_float_model(run):
    name, result, reference = run
    assert_close(result["results"], reference, name)
