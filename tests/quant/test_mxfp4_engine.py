"""gpt-oss in MXFP4 end to end: a tiny gpt-oss whose experts the test packer wrote in gpt-oss's
MXFP4 checkpoint format (blocks, E8M0 scales, bf16 everything else) is claimed by
`hpu_quant_mxfp4` and runs every MoE layer on `HpuMxfp4MoEMethod`, in CPU emulation and on
seam/gaudi over the Habana stand-in (HPU graphs), with no recompile after warmup. In
emulation its greedy tokens equal the HPU platform's on the bf16 checkpoint of the dequantized
experts (the same engine with only the MoE method changed); seam/gaudi's equal the emulation's;
both stay within vLLM's top-5 rule of what transformers generates from the MXFP4 checkpoint
itself (read by its own MXFP4 dequantizer).

Why the transformers comparison bounds no count: vLLM's MXFP4 method takes bf16 activations
only, and this random tiny model's logits are so near-tied that bf16 rounding alone moves
greedy paths. Measured when this test was written, on the first 6 test prompts: transformers in
bf16 and in float32 on the same weights part on 6 of 6; the MXFP4 engine and transformers in
bf16 on 5 of 6; the MXFP4 engine and the engine on the dequantized checkpoint on 0 of 6.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import REAL_GAUDI_SOFTWARE, STANDIN_ENGINE_ENV
from tests.integration.generation import (
    COMPILE_ENGINE,
    assert_close,
    greedy_generate,
    make_prompts,
    named_job_outputs,
    run_job,
)
from tests.quant import mxfp4_packer

pytestmark = pytest.mark.engine

JOB = Path(__file__).with_name("quant_job.py")
REPO = Path(__file__).resolve().parents[2]
MAX_TOKENS = 12
PROMPTS = make_prompts()[:6]  # up to 200 tokens: longer than a block and the 40-token window
ENGINE = {**COMPILE_ENGINE, "dtype": "bfloat16"}
LAYERS = 2
# MXFP4 engine vs the same engine on the dequantized bf16 checkpoint, and seam/gaudi vs the
# emulation: measured 0 of 6; one near-tie allowed (the MXFP4 kernels sum in float32 where the
# bf16 MoE path rounds).
MAX_DIVERGED_FROM_DEQUANTIZED = 1


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    """(the MXFP4 checkpoint, the bf16 checkpoint of its dequantized experts)."""
    from gaudi_testkit import tinymodels

    return mxfp4_packer.write_gpt_oss(
        tinymodels.build("gpt-oss"), tmp_path_factory.mktemp("gpt-oss-mxfp4")
    )


@pytest.fixture(scope="module")
def reference(checkpoints) -> list[dict]:
    """transformers on the MXFP4 checkpoint, dequantized by transformers itself."""
    import torch
    from transformers import AutoModelForCausalLM, Mxfp4Config

    hf = AutoModelForCausalLM.from_pretrained(
        str(checkpoints[0]),
        quantization_config=Mxfp4Config(dequantize=True),
        torch_dtype=torch.bfloat16,
        attn_implementation="eager",  # its implementation with the sink column
    ).eval()
    with torch.no_grad():
        return [
            greedy_generate(hf, MAX_TOKENS, input_ids=torch.tensor([prompt])) for prompt in PROMPTS
        ]


def _run(checkpoints: dict[str, Path], env: dict | None) -> dict:
    """The first checkpoint's engine result, with the others' under their names."""
    job = {
        "checkpoints": {name: str(path) for name, path in checkpoints.items()},
        "prompts": PROMPTS,
        "max_tokens": MAX_TOKENS,
        "engine": ENGINE,
        "stats": True,
    }
    proc = run_job(JOB, json.dumps(job), env, timeout=1200)
    results = named_job_outputs(proc)
    for name in job["checkpoints"]:
        result = results.get(name, {"error": f"job ended first:\n{proc.stderr[-6000:]}"})
        if "error" in result:
            pytest.fail(f"the {name} engine failed:\n{result['error'][-6000:]}")
    first, *others = job["checkpoints"]
    return {**results[first], **{name: results[name] for name in others}}


@pytest.fixture(scope="module")
def emulated_run(checkpoints) -> dict:
    """The MXFP4 engine in emulation, and the same engine on the dequantized checkpoint."""
    return _run({"mxfp4": checkpoints[0], "dequantized": checkpoints[1]}, None)


@pytest.fixture(scope="module")
def gaudi_py_run(checkpoints) -> dict:
    if REAL_GAUDI_SOFTWARE:
        pytest.skip("the stand-in does not load beside a real Gaudi stack (the tests run there)")
    env = {
        **STANDIN_ENGINE_ENV,
        "PYTHONPATH": os.pathsep.join([str(STANDIN_ENGINE_ENV["PYTHONPATH"]), str(REPO)]),
    }
    return _run({"mxfp4": checkpoints[0]}, env)


@pytest.fixture(params=["emulated", "seam/gaudi"])
def run(request) -> dict:
    name = "emulated_run" if request.param == "emulated" else "gaudi_py_run"
    return request.getfixturevalue(name)


def test_the_checkpoint_is_claimed_by_the_hpu_mxfp4_method(run):
    assert run["quantization"] == "gpt_oss_mxfp4"
    assert len(run["experts"]) == LAYERS
    assert set(run["experts"].values()) == {"HpuMxfp4MoEMethod"}
    # gpt-oss quantizes its experts only: attention stays bf16.
    assert set(run["linears"].values()) == {"UnquantizedLinearMethod"}


def test_each_backend_runs_its_own_seam(emulated_run, gaudi_py_run):
    assert emulated_run["seam"] == "emulated on cpu"
    assert gaudi_py_run["seam"] == "gaudi"


def test_greedy_tokens_equal_the_engine_on_the_dequantized_checkpoint(emulated_run):
    dequantized = emulated_run["dequantized"]
    assert set(dequantized["experts"].values()) != {"HpuMxfp4MoEMethod"}
    label = "gpt-oss MXFP4 vs dequantized, emulated"
    diverged = assert_close(emulated_run["results"], dequantized["results"], label)
    print(f"{label}: {diverged} of {len(PROMPTS)} prompts diverged")
    assert diverged <= MAX_DIVERGED_FROM_DEQUANTIZED


def test_gaudi_py_generates_what_the_emulation_generates(emulated_run, gaudi_py_run):
    # The stand-in's MXFP4 kernel and the emulation's compute the same sums in float32.
    label = "gpt-oss MXFP4 on seam/gaudi vs the emulation"
    diverged = assert_close(gaudi_py_run["results"], emulated_run["results"], label)
    print(f"{label}: {diverged} of {len(PROMPTS)} prompts diverged")
    assert diverged <= MAX_DIVERGED_FROM_DEQUANTIZED


def test_greedy_tokens_stay_within_the_top5_rule_of_transformers_on_the_checkpoint(run, reference):
    # Fails when a token leaves the other side's top 5; see the module docstring for why no
    # count of divergences is bounded here.
    diverged = assert_close(run["results"], reference, f"gpt-oss MXFP4 on {run['seam']}")
    print(f"gpt-oss MXFP4 on {run['seam']} vs transformers: {diverged} of {len(PROMPTS)} diverged")


def test_no_recompiles_after_warmup(run):
    stats = run["stats"]
    assert stats["recompiles"] == 0, stats["unwarmed_buckets"]
    assert stats["eager_steps"] == 0, (stats["variant_misses"], stats["eager_buckets"])
