"""Which quantization methods the HPU platform accepts, checked the way vLLM checks them at
startup (ModelConfig's quantization verification, which calls HpuPlatform.verify_quantization;
vLLM 0.32 itself no longer knows GGUF or bitsandbytes as --quantization names),
without starting an engine: `supported_quantization` lists exactly the methods whose
vllm-gaudi-quant entry point registered in this process, checkpoints are resolved to the HPU
methods, and anything else is refused with one sentence naming the method and the supported ones.
Each case runs in a fresh process (vLLM resolves its platform and plugins once per process).
"""

from __future__ import annotations

import pytest

from tests.integration.generation import job_result

JOB = r"""
import json, sys
sys.path.insert(0, __ROOT__)
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.config import ModelConfig
from vllm.platforms import current_platform
from gaudi_testkit import tinymodels
from tests.quant import checkpoints

out = {"supported": list(current_platform.supported_quantization), "cases": {}}
model = tinymodels.build("llama")
qdir, _ = checkpoints.write(model, __TMP__, "awq")
for label, kwargs in [
    ("awq-checkpoint", {"model": str(qdir)}),
    ("experts_int8", {"model": str(model), "quantization": "experts_int8"}),
    ("mxfp4", {"model": str(model), "quantization": "mxfp4"}),
]:
    try:
        out["cases"][label] = {"ok": ModelConfig(**kwargs).quantization}
    except Exception as exc:
        out["cases"][label] = {"error": f"{type(exc).__name__}: {exc}"}
print("RESULT " + json.dumps(out))
"""

ALL_METHODS = ["inc", "fp8", "awq_hpu", "gptq_hpu", "compressed-tensors", "gpt_oss_mxfp4"]


def _run(run_python, tmp_path, env: dict[str, str]) -> dict:
    from pathlib import Path

    root = repr(str(Path(__file__).resolve().parents[2]))
    code = JOB.replace("__ROOT__", root).replace(
        "__TMP__", f"__import__('pathlib').Path({str(tmp_path)!r})"
    )
    proc = run_python(code, env={"VLLM_HPU_EMULATION": "cpu", **env}, timeout=900)
    return job_result(proc, "verification job")


@pytest.fixture(scope="module")
def every_method(run_python, tmp_path_factory):
    return _run(run_python, tmp_path_factory.mktemp("all"), {})


@pytest.fixture(scope="module")
def without_awq(run_python, tmp_path_factory):
    plugins = "hpu," + ",".join(
        f"hpu_quant_{m}" for m in ("inc", "fp8", "gptq", "compressed_tensors", "mxfp4")
    )
    return _run(run_python, tmp_path_factory.mktemp("trimmed"), {"VLLM_PLUGINS": plugins})


@pytest.mark.process
def test_supported_quantization_lists_every_registered_method(every_method):
    assert every_method["supported"] == ALL_METHODS


@pytest.mark.process
def test_an_awq_checkpoint_resolves_to_the_hpu_awq_method(every_method):
    assert every_method["cases"]["awq-checkpoint"] == {"ok": "awq_hpu"}


@pytest.mark.process
@pytest.mark.parametrize("method", ["experts_int8", "mxfp4"])
def test_a_method_hpu_cannot_run_is_refused_naming_it_and_the_supported_ones(every_method, method):
    error = every_method["cases"][method]["error"]
    assert f"Quantization method '{method}' is not supported on HPU" in error
    assert ", ".join(ALL_METHODS) in error


@pytest.mark.process
def test_a_trimmed_entry_point_drops_its_method_from_the_supported_list(without_awq):
    assert without_awq["supported"] == [
        "inc",
        "fp8",
        "gptq_hpu",
        "compressed-tensors",
        "gpt_oss_mxfp4",
    ]


@pytest.mark.process
def test_an_awq_checkpoint_without_the_awq_entry_point_is_refused(without_awq):
    # vLLM's own AWQ method (CUDA kernels) would take it: refused, naming it and what HPU runs.
    error = without_awq["cases"]["awq-checkpoint"]["error"]
    assert "is not supported on HPU" in error and "gptq_hpu" in error and "awq_hpu" not in error
