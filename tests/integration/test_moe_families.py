"""The MoE families Gaudi users serve beside the gated delta net hybrids, each a tiny model
checked against transformers' greedy tokens (vLLM's top-5 rule at a divergence):

- Qwen3-MoE: every layer 8 experts, top 2, renormalized;
- GLM-4.5 MoE: partial rotary, a dense first layer, sigmoid routing with the correction bias, a
  shared expert, a routed scaling factor;
- Llama 4 text: top-1 experts with the router weight on the input, a shared expert, a NoPE layer
  after a rotary one with chunked local attention (a chunk of 64: most prompts span several);
  also against vLLM's CPU backend, whose chunked attention splits requests per chunk where the
  HPU masks (transformers' Llama 4 differs from both by near-ties on a few prompts);
- Gemma 4 text: sliding and full attention layers, per-layer inputs.

Each runs with HPU graphs (lazy mode) and with torch.compile (every graph compiled in warmup,
none after: Llama 4's chunked local layers and Gemma 4's sliding layers get metadata objects of
their own beside the full-attention layers', in warmup as in serving), each on the emulation and
on seam/gaudi over the Habana stand-in (its device "hpu"; compiled, its hpu_backend is dynamo's
aot_eager: Llama 4 and Gemma 4 only); every engine of one kind shares one process. 0 recompiles
after warmup everywhere. With HPU graphs the KV cache is sized by the profile run, whose sampled
graphs must bound what warmup's graphs hold.
"""

from __future__ import annotations

import json
from functools import cache

import pytest

from tests.conftest import REAL_GAUDI_SOFTWARE, STANDIN_ENGINE_ENV
from tests.integration.architectures import SEQUENTIAL_JOB
from tests.integration.compile_job import assert_compiled_only_in_warmup, fitted_plan_env
from tests.integration.generation import (
    COMPILE_ENGINE,
    ENGINE,
    assert_close,
    hf_greedy,
    make_prompts,
    named_job_outputs,
    run_job,
)
from tests.vllm_build import needs_vllm_cpu_backend

pytestmark = [pytest.mark.engine]

MODELS = ("qwen3-moe", "glm4-moe", "llama4-text", "gemma4-text")
MAX_TOKENS = 8
# With HPU graphs, the KV cache is sized by the profile run (no kv_cache_memory_bytes), as an
# operator's engine is: what is left of a share of the device after the weights, the profile's
# peak and the HPU graphs' bound from the graphs it sampled. The stand-in's device (4 GiB) keeps
# every tensor a graph recorded (Gemma 4's 26 graphs hold ~0.6 GB); the emulation's 8 GiB.
PROFILED = {"kv_cache_memory_bytes": None}
KINDS: dict[str, dict] = {
    "emulated, HPU graphs": {
        "env": {"PT_HPU_LAZY_MODE": "1"},
        "models": MODELS,
        "engine": {**PROFILED, "gpu_memory_utilization": 0.06},
    },
    "emulated, torch.compile": {"env": {"PT_HPU_LAZY_MODE": "0"}, "models": MODELS},
    "gaudi over the stand-in, HPU graphs": {
        "env": {"PT_HPU_LAZY_MODE": "1", **STANDIN_ENGINE_ENV},
        "models": MODELS,
        "engine": {**PROFILED, "gpu_memory_utilization": 0.3},
    },
    # The two whose layers read metadata of more than one attention group, on the buckets of
    # the compile tests (compile_job.fitted_plan_env): aot_eager's traces are the slow part.
    "gaudi over the stand-in, torch.compile": {
        "env": {"PT_HPU_LAZY_MODE": "0", **STANDIN_ENGINE_ENV, **fitted_plan_env()},
        "models": ("llama4-text", "gemma4-text"),
    },
}
CASES = [(kind, name) for kind, spec in KINDS.items() for name in spec["models"]]


def prompts() -> list[list[int]]:
    return make_prompts()[:6]


@cache
def path(name: str) -> str:
    from gaudi_testkit import tinymodels

    return str(tinymodels.build(name))


@cache
def reference(name: str) -> list[dict]:
    return hf_greedy(path(name), prompts(), max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def runs() -> dict[str, dict[str, dict]]:
    """Every model's engine, per kind of run: one process per kind."""
    results: dict[str, dict[str, dict]] = {}
    for kind, spec in KINDS.items():
        if "stand-in" in kind and REAL_GAUDI_SOFTWARE:
            continue  # the stand-in does not load beside a real Gaudi stack
        jobs = {
            name: {
                "model": path(name),
                "prompts": prompts(),
                "max_tokens": MAX_TOKENS,
                "engine": {**COMPILE_ENGINE, **spec.get("engine", {})},
                "rounds": 1,
                "stats": True,
            }
            for name in KINDS[kind]["models"]
        }
        proc = run_job(SEQUENTIAL_JOB, json.dumps(jobs), spec["env"], timeout=300 * len(jobs))
        outputs = named_job_outputs(proc)
        results[kind] = {
            name: outputs.get(name, {"error": f"job ended first:\n{proc.stderr[-6000:]}"})
            for name in jobs
        }
    return results


def _run(runs: dict, kind: str, name: str) -> dict:
    if kind not in runs:
        pytest.skip("the stand-in does not load beside a real Gaudi stack (no Gaudi here to skip)")
    result = runs[kind][name]
    assert "error" not in result, result["error"]
    return result


@pytest.mark.parametrize(("kind", "name"), CASES)
def test_greedy_tokens_match_transformers(runs, kind, name):
    result = _run(runs, kind, name)

    diverged = assert_close(result["rounds"][0], reference(name), f"{name} ({kind})")
    assert diverged <= 1, f"{name} ({kind}): {diverged} of 6 prompts diverged (near-ties)"


@pytest.mark.parametrize(("kind", "name"), CASES)
def test_serving_runs_warmed_shapes_only(runs, kind, name):
    stats = _run(runs, kind, name)["stats"]

    assert stats["recompiles"] == 0
    if "torch.compile" in kind:
        assert_compiled_only_in_warmup(stats)
    else:
        assert stats["graphs_enabled"] and stats["num_graphs"] > 0


@pytest.mark.parametrize(("kind", "name"), [c for c in CASES if "graphs" in c[0]])
def test_the_kv_cache_left_room_for_the_graphs_warmup_captured(runs, kind, name):
    stats = _run(runs, kind, name)["stats"]
    memory = stats["memory"]
    # The profile run sampled the least and the most work of each phase (prompt, decode) and
    # bounded the plan's graphs, every one warmup captured, from them.
    assert len(memory["graph_samples"]) == 4 and memory["graph_runs"] == stats["num_graphs"]
    assert 0 < memory["kv_cache_allocated"] <= memory["kv_budget"], memory
    assert memory["graphs_held"] <= memory["graph_reserve"], memory
    if "stand-in" in kind:
        # Exact device counts: the bound holds and is close.
        assert memory["graphs_held"] <= memory["graphs_estimate"], memory
        assert memory["graphs_estimate"] <= 1.5 * memory["graphs_held"], memory


@needs_vllm_cpu_backend
def test_llama4_chunked_attention_equals_vllm_cpu_backend(runs):
    """vLLM's CPU backend computes chunked local attention its own way (one virtual request per
    chunk; it needs a chunk of whole KV blocks, so it runs with 64-token blocks). Measured: the
    same tokens and logprobs on every prompt."""
    ours = _run(runs, "emulated, HPU graphs", "llama4-text")["rounds"][0]
    job = {
        "model": path("llama4-text"),
        "prompts": prompts(),
        "max_tokens": MAX_TOKENS,
        "engine": {**ENGINE, "block_size": 64},
        "rounds": 1,
    }
    proc = run_job(SEQUENTIAL_JOB, json.dumps({"cpu": job}), emulate=False, timeout=300)
    cpu = named_job_outputs(proc).get("cpu", {"error": proc.stderr[-6000:]})
    assert "error" not in cpu, cpu["error"]
    assert any(len(p) > 2 * 64 for p in prompts())  # some prompt spans three chunks
    diverged = assert_close(ours, cpu["rounds"][0], "llama4-text: HPU vs vLLM CPU backend")
    assert diverged == 0, f"{diverged} of {len(ours)} prompts diverged from vLLM's CPU backend"
