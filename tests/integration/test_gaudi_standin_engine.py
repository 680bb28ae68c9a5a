"""Whole engines on the Gaudi backend: seam/gaudi over the Habana stand-in
(tests/habana_standin/engine/sitecustomize.py makes it the process's "Gaudi"), every weight, KV
block, activation and index tensor on its torch device "hpu", which refuses ops mixing them with
host tensors as a Gaudi does; in lazy mode with HPU graphs, against the same engines in
emulation: a tiny Llama, a tiny 16-expert Mixtral (the MoE kernel; decode steps of one or two
sequences gather their routed experts), a tiny DeepSeek-V3 (MLA, sigmoid grouped top-k routing
with a correction bias, a shared expert), an FP8 compressed-tensors checkpoint (per-token
activation scales, FP8 GEMM), a 4-bit checkpoint with an FP8 KV cache, an MXFP4
compressed-tensors checkpoint (weights dequantized per forward) and a tiny Mamba2 hybrid
(GraniteMoeHybrid: the Mamba mixer's state slots and padded rows under HPU graphs). Greedy
tokens must agree (near-ties allowed, as everywhere) and each engine must resolve the same
methods. Every rule the stand-in enforces holds on these paths, or the Gaudi job fails. The
hybrid's KV cache is sized by its profile run on both backends (the others set
kv_cache_memory_bytes): the profile's peak, with the Mamba kernels run, and the HPU graphs'
memory bounded in it from a few sampled graphs, are checked against what warmup's graphs hold.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REAL_GAUDI_SOFTWARE, STANDIN_ENGINE_ENV
from tests.integration.compile_job import (
    assert_compiled_only_in_warmup,
    assert_matches_eager,
    fitted_plan_env,
)
from tests.integration.generation import (
    COMPILE_ENGINE,
    assert_close,
    make_prompts,
    named_job_outputs,
    run_job,
)
from tests.quant import checkpoints
from tests.quant.test_checkpoint_engines import JOB

pytestmark = [pytest.mark.engine, pytest.mark.gaudi]

MAX_TOKENS = 8
# Compiled (aot_eager over the stand-in) against the same backend eager: logprobs of the sampled
# tokens, float32.
LOGPROB_TOLERANCE = 1e-4
MODELS = (
    "llama",
    "mixtral-16",
    "deepseek-v3",
    "ct-fp8-dynamic",
    "ct-wna16-kv-fp8",
    "ct-mxfp4",
    "granitemoehybrid",
)
# A share of the stand-in's 4 GiB (and the emulation's 8 GiB) that holds the hybrid's weights,
# profile peak, the HPU graphs of its 16-run plan (~81 MB on the stand-in) and a KV cache.
HYBRID_MEMORY_UTILIZATION = 0.05
# The job process's "Gaudi": seam/gaudi over the stand-in instead of the emulation.
GAUDI_ENV = STANDIN_ENGINE_ENV


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict[str, dict]]:
    if REAL_GAUDI_SOFTWARE:
        pytest.skip(
            "the stand-in does not load beside a real Gaudi stack (the engine tests run there)"
        )
    from gaudi_testkit import tinymodels

    built = ("llama", "mixtral-16", "deepseek-v3", "granitemoehybrid")
    paths = {name: tinymodels.build(name) for name in built}
    for fmt in ("ct-fp8-dynamic", "ct-wna16-kv-fp8"):
        out = tmp_path_factory.mktemp(fmt)
        qdir, _ = checkpoints.write(
            tinymodels.build("llama-soft"), out, fmt, calibration=make_prompts(seed=1)
        )
        paths[fmt] = qdir
    out = tmp_path_factory.mktemp("ct-mxfp4")
    paths["ct-mxfp4"], _ = checkpoints.write(tinymodels.build("llama"), out, "ct-mxfp4")
    job = json.dumps(
        {
            "checkpoints": {name: str(paths[name]) for name in MODELS},
            "prompts": make_prompts()[:6],
            "max_tokens": MAX_TOKENS,
            "engine": COMPILE_ENGINE,
            # The hybrid's KV cache sized by its profile run (no kv_cache_memory_bytes).
            "engine_overrides": {
                "granitemoehybrid": {
                    "kv_cache_memory_bytes": None,
                    "gpu_memory_utilization": HYBRID_MEMORY_UTILIZATION,
                }
            },
            "stats": True,
        }
    )
    common = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "PT_HPU_LAZY_MODE": "1"}
    gaudi_env = {**common, **GAUDI_ENV}
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
    # The Gaudi engine's weights and KV cache live on the stand-in's device, as on a Gaudi.
    assert gaudi["devices"] == ["hpu"], gaudi["devices"]
    assert runs["emulated"][name]["devices"] == ["cpu"]


@pytest.mark.parametrize("name", MODELS)
def test_gaudi_and_emulated_engines_generate_the_same_tokens(runs, name):
    gaudi, emulated = runs["gaudi"][name], runs["emulated"][name]
    assert "error" not in gaudi and "error" not in emulated, (gaudi, emulated)
    for key in ("quantization", "kv_cache_dtype", "linears", "experts"):
        assert gaudi[key] == emulated[key], key
    diverged = assert_close(gaudi["results"], emulated["results"], f"{name}: gaudi vs emulated")
    assert diverged <= 1, f"{diverged} of 6 prompts hit near-ties"


@pytest.mark.parametrize("backend", ["gaudi", "emulated"])
def test_the_hybrids_prompts_beyond_its_rows_run_in_passes_of_warmed_graphs(runs, backend):
    # Steps of up to four prompts whose rows no single bucket within the 256-token budget holds
    # (two-row buckets of 128 at most): each runs as several passes, each replaying its graph.
    stats = runs[backend]["granitemoehybrid"]["stats"]
    assert stats["split_steps"] > 0 and stats["packed_prefills"] == 0
    assert stats["recompiles"] == 0, stats["unwarmed_buckets"]
    assert stats["eager_steps"] == 0 and stats["graph_replays"] > 0, stats["eager_buckets"]


@pytest.mark.parametrize("backend", ["gaudi", "emulated"])
def test_the_hybrids_kv_cache_is_sized_from_a_profile_peak_that_ran_its_state_kernels(
    runs, backend
):
    memory = runs[backend]["granitemoehybrid"]["stats"]["memory"]
    # The profile pass (its largest prompt bucket, with metadata) handed every Mamba layer its
    # prefill state metadata, so their conv + scan kernels ran and their intermediates count.
    assert memory["state_layers"] == 2 == memory["state_layers_profiled"], memory
    # The activations are read at the peak, above what stays allocated after the profile run.
    assert memory["peak"] > memory["after"], memory
    if backend == "gaudi":
        # The stand-in's device counts its tensors exactly: the profile run keeps only the
        # decode kernel's scratch buffer (sized by the largest decode graph it sampled; serving
        # keeps it too), so reading after it would have counted few of the activations.
        transient = memory["peak"] - memory["after"]
        assert memory["after"] - memory["before"] < transient / 4, memory
        assert memory["before"] >= memory["weights"]
    # The KV cache, attention pages and state slots, holds no more than the profile left it.
    assert 0 < memory["kv_cache_allocated"] <= memory["kv_budget"], memory
    # The HPU graphs: a few sampled in the profile run (the least and the most work of each
    # phase), the plan's bounded from them and kept back from the KV cache; warmup's graphs
    # (one per run of the plan) then hold no more than that.
    stats = runs[backend]["granitemoehybrid"]["stats"]
    assert len(memory["graph_samples"]) == 4 and memory["graph_runs"] == stats["num_graphs"]
    assert memory["graph_reserve"] >= memory["graphs_estimate"], memory
    assert 0 < memory["graphs_held"] <= memory["graphs_estimate"], memory
    if backend == "gaudi":
        # Exact device counts (the stand-in keeps every tensor a recording made): the bound is
        # close, and the graphs hold more than VLLM_GRAPH_RESERVED_MEM's default share (10% of
        # the usable memory), all the reserve there was before the samples.
        assert memory["graphs_estimate"] <= 1.5 * memory["graphs_held"], memory
        assert memory["graphs_held"] > 0.1 * (memory["kv_budget"] + memory["graph_reserve"])


# torch.compile on the Gaudi backend (eager mode, the Gaudi default): the stand-in's hpu_backend
# is dynamo's aot_eager, so these traces also pass through AOTAutograd, with Habana's ops as
# custom ops (their fake implementations give the shapes). The FP8 Mixtral's experts run on the
# FP8 overload of mixture_of_experts (W8A8, static scales).
COMPILED = ("llama", "mixtral-fp8-static", "ct-fp8-dynamic")


@pytest.fixture(scope="module")
def compiled_runs(tmp_path_factory) -> dict[str, dict]:
    if REAL_GAUDI_SOFTWARE:
        pytest.skip(
            "the stand-in does not load beside a real Gaudi stack (the engine tests run there)"
        )
    from gaudi_testkit import tinymodels
    from tests.quant import fp8_checkpoints

    paths = {"llama": tinymodels.build("llama")}
    qdir, _ = checkpoints.write(
        tinymodels.build("llama-soft"),
        tmp_path_factory.mktemp("ct-fp8-dynamic"),
        "ct-fp8-dynamic",
        calibration=make_prompts(seed=1),
    )
    paths["ct-fp8-dynamic"] = qdir
    paths["mixtral-fp8-static"], _ = fp8_checkpoints.write(
        "mixtral-fp8-static", tmp_path_factory.mktemp("mixtral-fp8"), make_prompts()
    )
    fitted = fitted_plan_env()
    job = json.dumps(
        {
            # The buckets of test_torch_compile.py's cases (compile_job.fitted_plan_env): the
            # lazy-mode engines above warm exp's whole plan on the same backend.
            "cases": {name: {"model": str(paths[name]), "env": fitted} for name in COMPILED},
            "prompts": make_prompts()[:6],
            "max_tokens": MAX_TOKENS,
            "engine": COMPILE_ENGINE,
        }
    )
    env = {"PT_HPU_LAZY_MODE": "0", **GAUDI_ENV}
    script = Path(__file__).with_name("compile_job.py")
    proc = run_job(script, job, env, timeout=300 * len(COMPILED))
    outputs = named_job_outputs(proc)
    return {
        name: outputs.get(name, {"error": f"job ended first:\n{proc.stderr[-6000:]}"})
        for name in COMPILED
    }


@pytest.mark.parametrize("name", COMPILED)
def test_gaudi_py_compiles_once_per_bucket_and_equals_its_eager_engine(compiled_runs, name):
    result = compiled_runs[name]
    stats = assert_matches_eager(name, result, LOGPROB_TOLERANCE)
    assert stats["graphs_enabled"] is False  # no HPUGraph outside lazy mode
    assert stats["bucket_plan"].startswith("bucketing strategy fitted"), stats["bucket_plan"]
    assert_compiled_only_in_warmup(stats)
