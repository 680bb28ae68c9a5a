"""A float16 checkpoint runs on the HPU platform in bfloat16, Gaudi's native type, with a warning
that says so (as Intel's plugin does), whether the dtype is "auto" or an explicit "float16";
float32 stays available."""

from __future__ import annotations

import subprocess

import pytest

from tests.integration import architectures
from tests.integration.generation import assert_close, hf_greedy

RESOLVE_DTYPES = """
from vllm.engine.arg_utils import EngineArgs
if __name__ == "__main__":
    for dtype in ("auto", "float16", "float32"):
        config = EngineArgs(model={model!r}, dtype=dtype, max_model_len=256).create_engine_config()
        print("DTYPE", dtype, config.model_config.dtype, flush=True)
"""
OURS = "not a native Gaudi type"


@pytest.fixture(scope="module")
def fp16_model() -> str:
    """The tiny Llama saved as a float16 checkpoint (weights and config.json's torch_dtype)."""
    return str(architectures.fp16_checkpoint())


@pytest.fixture(scope="module")
def resolution(fp16_model, run_python) -> subprocess.CompletedProcess[str]:
    """A process that builds the engine config for the fp16 checkpoint with each dtype."""
    return run_python(RESOLVE_DTYPES.format(model=fp16_model), env={"VLLM_HPU_EMULATION": "cpu"})


@pytest.mark.process
def test_float16_resolves_to_bfloat16_and_float32_stays(resolution):
    proc = resolution
    resolved = dict(
        line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("DTYPE")
    )
    assert resolved == {
        "auto": "torch.bfloat16",
        "float16": "torch.bfloat16",
        "float32": "torch.float32",
    }, proc.stderr[-3000:]


@pytest.mark.process
def test_auto_and_float16_each_log_our_one_warning_and_float32_none(resolution):
    proc = resolution
    # vLLM logs to stdout, in order with the DTYPE lines: a config's log lines come before its
    # DTYPE line.
    ours: dict[str, list[str]] = {}
    pending: list[str] = []
    for line in proc.stdout.splitlines():
        if line.startswith("DTYPE"):
            ours[line.split()[1]], pending = pending, []
        elif OURS in line:
            pending.append(line)
    assert {dtype: len(lines) for dtype, lines in ours.items()} == {
        "auto": 1,
        "float16": 1,
        "float32": 0,
    }, proc.stdout[-3000:]
    for line in ours["auto"] + ours["float16"]:
        assert "WARNING" in line and "bfloat16" in line, line


@pytest.mark.engine
def test_float16_checkpoint_generates_like_transformers(fp16_model):
    # Shared with test_cpu_backend.py: the same run is compared with vLLM's CPU backend.
    prompts = architectures.prompts("llama-fp16")
    assert architectures.CASES["llama-fp16"].hpu_engine == {"dtype": "float16"}
    proc, result = architectures.hpu_run("llama-fp16")
    assert result is not None, proc.stderr[-4000:]
    assert OURS in proc.stdout + proc.stderr
    # The reference runs the same weights in bfloat16 too; the two sides still round differently
    # (kernel order), so a near-tie may flip, which the top-5 rule of assert_close allows.
    reference = hf_greedy(fp16_model, prompts, dtype="bfloat16")
    diverged = assert_close(result["rounds"][0], reference, "fp16 checkpoint run in bf16")
    assert diverged <= len(prompts) // 2, f"{diverged} of {len(prompts)} prompts diverged"
    assert result["stats"]["recompiles"] == 0
