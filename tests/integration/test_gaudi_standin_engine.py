"""Whole engines on the Gaudi backend: seam/gaudi.py over the Habana stand-in (its device is CPU
memory; tests/habana_standin/engine/sitecustomize.py makes it the process's "Gaudi"), in lazy
mode with HPU graphs, against the same engines in emulation: a tiny Llama, a tiny Mixtral (the
MoE kernel), an FP8 compressed-tensors checkpoint (per-token activation scales, FP8 GEMM) and a
4-bit checkpoint with an FP8 KV cache. Greedy tokens must agree (near-ties allowed, as
everywhere) and each engine must resolve the same methods. Every rule the stand-in enforces
holds on these paths, or the Gaudi job fails.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import REAL_GAUDI_SOFTWARE, STANDIN_PATH
from tests.integration.generation import (
    ENGINE,
    assert_close,
    make_prompts,
    named_job_outputs,
    run_job,
)
from tests.quant import checkpoints
from tests.quant.test_checkpoint_engines import JOB

pytestmark = [pytest.mark.engine, pytest.mark.gaudi]

MAX_TOKENS = 8
MODELS = ("llama", "mixtral", "ct-fp8-dynamic", "ct-wna16-kv-fp8")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict[str, dict]]:
    if REAL_GAUDI_SOFTWARE:
        pytest.skip(
            "the stand-in does not load beside a real Gaudi stack (the engine tests run there)"
        )
    from vllm_gaudi_platform.testing import tinymodels

    paths = {"llama": tinymodels.build("llama"), "mixtral": tinymodels.build("mixtral")}
    for fmt in ("ct-fp8-dynamic", "ct-wna16-kv-fp8"):
        out = tmp_path_factory.mktemp(fmt)
        qdir, _ = checkpoints.write(
            tinymodels.build("llama-soft"), out, fmt, calibration=make_prompts(seed=1)
        )
        paths[fmt] = qdir
    job = json.dumps(
        {
            "checkpoints": {name: str(paths[name]) for name in MODELS},
            "prompts": make_prompts()[:6],
            "max_tokens": MAX_TOKENS,
            "engine": ENGINE,
        }
    )
    common = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "PT_HPU_LAZY_MODE": "1"}
    gaudi_env = {
        **common,
        "VLLM_HPU_EMULATION": None,
        "PYTHONPATH": os.pathsep.join(
            [os.path.join(STANDIN_PATH, "engine"), os.environ.get("PYTHONPATH", "")]
        ),
        "HABANA_STANDIN_MEMORY_GB": "4",
    }
    results = {}
    for backend, env in (("gaudi", gaudi_env), ("emulated", common)):
        proc = run_job(JOB, job, env, timeout=300 * len(MODELS))
        outputs = named_job_outputs(proc)
        results[backend] = {
            name: outputs.get(name, {"error": f"job ended first:\n{proc.stderr[-6000:]}"})
            for name in MODELS
        }
    return results


@pytest.mark.parametrize("name", MODELS)
def test_the_engine_runs_on_gaudi_py_over_the_stand_in(runs, name):
    gaudi = runs["gaudi"][name]
    assert "error" not in gaudi, gaudi.get("error")
    assert gaudi["seam"] == "gaudi"
    assert runs["emulated"][name]["seam"] == "emulated on cpu"


@pytest.mark.parametrize("name", MODELS)
def test_gaudi_and_emulated_engines_generate_the_same_tokens(runs, name):
    gaudi, emulated = runs["gaudi"][name], runs["emulated"][name]
    assert "error" not in gaudi and "error" not in emulated, (gaudi, emulated)
    for key in ("quantization", "kv_cache_dtype", "linears", "experts"):
        assert gaudi[key] == emulated[key], key
    diverged = assert_close(gaudi["results"], emulated["results"], f"{name}: gaudi vs emulated")
    assert diverged <= 1, f"{diverged} of 6 prompts hit near-ties"
