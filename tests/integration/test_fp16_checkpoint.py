"""A float16 checkpoint runs on the HPU platform in bfloat16, Gaudi's native type, with a warning
that says so (as Intel's plugin does), whether the dtype is "auto" or an explicit "float16";
float32 stays available."""

from __future__ import annotations

import pytest

from tests.integration import architectures
from tests.integration.generation import assert_close, hf_greedy

RESOLVE_DTYPES = """
from vllm.engine.arg_utils import EngineArgs
if __name__ == "__main__":
    for dtype in ("auto", "float16", "float32"):
        config = EngineArgs(model={model!r}, dtype=dtype, max_model_len=256).create_engine_config()
        print("DTYPE", dtype, config.model_config.dtype)
"""


@pytest.fixture(scope="module")
def fp16_model() -> str:
    """The tiny Llama saved as a float16 checkpoint (weights and config.json's torch_dtype)."""
    return str(architectures.fp16_checkpoint())


def test_float16_resolves_to_bfloat16_and_float32_stays(fp16_model, run_python):
    proc = run_python(RESOLVE_DTYPES.format(model=fp16_model), env={"VLLM_HPU_EMULATION": "cpu"})
    resolved = dict(
        line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("DTYPE")
    )
    assert resolved == {
        "auto": "torch.bfloat16",
        "float16": "torch.bfloat16",
        "float32": "torch.float32",
    }, proc.stderr[-3000:]
    output = (proc.stdout + proc.stderr).splitlines()  # vLLM logs to stdout by default
    ours = [line for line in output if "not a native Gaudi type" in line]
    assert len(ours) == 1, "one WARNING, for the explicit float16 (vLLM itself warns for auto)"
    assert "WARNING" in ours[0] and "bfloat16" in ours[0]


@pytest.mark.engine
def test_float16_checkpoint_generates_like_transformers(fp16_model):
    # Shared with test_cpu_backend.py: the same run is compared with vLLM's CPU backend.
    prompts = architectures.prompts("llama-fp16")
    assert architectures.CASES["llama-fp16"].hpu_engine == {"dtype": "float16"}
    proc, result = architectures.hpu_run("llama-fp16")
    assert result is not None, proc.stderr[-4000:]
    assert "not a native Gaudi type" in proc.stdout + proc.stderr
    # The reference runs the same weights in bfloat16 too; the two sides still round differently
    # (kernel order), so a near-tie may flip, which the top-5 rule of assert_close allows.
    reference = hf_greedy(fp16_model, prompts, dtype="bfloat16")
    diverged = assert_close(result["rounds"][0], reference, "fp16 checkpoint run in bf16")
    assert diverged <= len(prompts) // 2, f"{diverged} of {len(prompts)} prompts diverged"
    assert result["stats"]["recompiles"] == 0
