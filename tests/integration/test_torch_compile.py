"""torch.compile as a Gaudi runs it by default (PT_HPU_LAZY_MODE=0): whole engines compile their
forward pass once per warmed bucket and nothing after, trace without a graph break, and give the
eager engine's greedy tokens with its logprobs to 1e-4. One job process runs every case twice
(compiled, then enforce_eager=True); dynamo runs with the emulation's backend (`eager`, see
seam/emulated.py for why not aot_eager).
"""

from __future__ import annotations

import json

import pytest

from tests.integration.generation import ENGINE, make_prompts, named_job_outputs, run_job

pytestmark = pytest.mark.engine

MAX_TOKENS = 6
ARCHITECTURES = (
    "llama",
    "qwen3",
    "mixtral",
    "gemma2",
    "gemma3",
    "mistral",
    "gpt-oss",
    "deepseek-v2",
)
CASES = (*ARCHITECTURES, "ct-fp8-dynamic")
LOGPROB_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    from pathlib import Path

    from tests.quant import checkpoints
    from vllm_gaudi_platform.testing import tinymodels

    models = {name: str(tinymodels.build(name)) for name in ARCHITECTURES}
    qdir, _ = checkpoints.write(
        tinymodels.build("llama-soft"),
        tmp_path_factory.mktemp("ct-fp8-dynamic"),
        "ct-fp8-dynamic",
        calibration=make_prompts(seed=1),
    )
    models["ct-fp8-dynamic"] = str(qdir)
    job = {
        "cases": {name: {"model": models[name]} for name in CASES},
        # Prompts of one to three blocks and a shared prefix: prefill buckets with and without
        # cached context, and decode buckets of several batch sizes.
        "prompts": make_prompts()[:6],
        "max_tokens": MAX_TOKENS,
        "engine": ENGINE,
    }
    script = Path(__file__).with_name("compile_job.py")
    proc = run_job(script, json.dumps(job), {"PT_HPU_LAZY_MODE": "0"}, timeout=240 * len(CASES))
    outputs = named_job_outputs(proc)
    return {
        name: outputs.get(name, {"error": f"job ended first:\n{proc.stderr[-6000:]}"})
        for name in CASES
    }


@pytest.mark.parametrize("name", CASES)
def test_compiled_engine_equals_eager(runs, name):
    result = runs[name]
    assert "error" not in result, result.get("error")
    compiled, eager = result["compiled"], result["eager"]
    assert compiled["stats"]["compiled"] is True
    assert eager["stats"]["compiled"] is False  # enforce_eager=True keeps the eager path
    for i, (c, e) in enumerate(zip(compiled["outputs"], eager["outputs"], strict=True)):
        assert c["tokens"] == e["tokens"], f"{name}: prompt {i}: compiled {c} vs eager {e}"
        for pos, (c_top, e_top) in enumerate(zip(c["logprobs"], e["logprobs"], strict=True)):
            token = str(c["tokens"][pos])
            assert abs(c_top[token] - e_top[token]) <= LOGPROB_TOLERANCE, (
                f"{name}: prompt {i} token {pos}: logprob {c_top[token]} vs eager {e_top[token]}"
            )


@pytest.mark.parametrize("name", CASES)
def test_compiles_once_per_bucket_and_never_after_warmup(runs, name):
    result = runs[name]
    assert "error" not in result, result.get("error")
    stats = result["compiled"]["stats"]
    assert stats["graph_breaks"] == {"warmup": [], "serving": []}
    assert stats["compiled_graphs"]["serving"] == 0, stats["recompiled_buckets"]
    assert stats["compile_recompiles"] == 0
    assert stats["recompiles"] == 0  # and every step's shape was a warmed bucket
    by_bucket = stats["compiles_by_bucket"]
    assert all(n == 1 for n in by_bucket.values()), by_bucket
    plain = [label for label in by_bucket if "packed" not in label]
    assert len(plain) == stats["num_prompt_buckets"] + stats["num_decode_buckets"], by_bucket
    assert sum(by_bucket.values()) == stats["compiled_graphs"]["warmup"]
    assert stats["bucket_hits"].get("prompt", 0) > 0 and stats["bucket_hits"].get("decode", 0) > 0
