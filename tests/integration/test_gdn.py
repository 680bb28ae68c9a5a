"""Gated delta net hybrids end to end: a tiny Qwen3.5 (gated delta net layers before a gated full
attention layer), a tiny Qwen3.5-MoE (the same, MoE blocks with a gated shared expert) and a tiny
Qwen3-Next (q/k/v/z projections interleaved per key-head group) generate on the HPU platform what
transformers generates, through the `hpu_ops_gdn` family's layer. vLLM's own layer cannot run on
this platform (Triton kernels), so equal tokens mean the HPU layer ran.

Each engine serves the 10 test prompts (1 to 300 tokens) twice, with prefix caching on (vLLM's
default) and at most 128 new tokens per prompt and step (architectures.HYBRID_ENGINE): longer
prompts continue from the conv and recurrent states their earlier chunks left in their slot, and
the second round starts each prompt from the state cached at its last whole block. One job
process runs the three in emulation with HPU graphs (lazy mode), Qwen3.5 once more with the test
engine's 16 sequences (more prompts per step than prompt rows: passes of warmed rows), and the
tiny LFM2, whose short-conv layers have no HPU kernels and are refused at load by name. Qwen3.5
and Qwen3.5-MoE also run compiled (PT_HPU_LAZY_MODE=0, the six shorter prompts: every bucket
compiled in warmup, none while serving) and on seam/gaudi over the Habana stand-in (lazy, the same
job as in emulation), the two models one after the other in one process for each. A process
without the `hpu_ops_gdn` entry point (VLLM_PLUGINS trims it) refuses Qwen3.5 naming the entry
point.
"""

from __future__ import annotations

import json

import pytest

from gaudi_testkit import tinymodels
from tests.conftest import REAL_GAUDI_SOFTWARE, STANDIN_ENGINE_ENV
from tests.integration.architectures import HYBRID_ENGINE, SEQUENTIAL_JOB
from tests.integration.compile_job import assert_compiled_only_in_warmup
from tests.integration.generation import (
    COMPILE_ENGINE,
    ENGINE,
    assert_close,
    hf_greedy,
    make_prompts,
    named_job_outputs,
    run_job,
)

pytestmark = pytest.mark.engine

# MoE models first: an engine of a dense model before them in the same process leaves vLLM's
# parallel groups without the expert-parallel group they need.
NAMES = ("qwen3.5-moe", "qwen3-next", "qwen3.5")
QWEN3_5 = ("qwen3.5-moe", "qwen3.5")  # compiled and on the stand-in too (in this order, as above)
BLOCK = 128  # the attention block; with prefix caching, states are cached at its boundaries
MAX_TOKENS = 12
COMPILED_PROMPTS = 6  # make_prompts()[:6]: at most 200 tokens, within COMPILE_ENGINE's 256
_REFERENCES: dict[tuple[str, int], list[dict]] = {}


def reference(name: str, prompts: int = 10) -> list[dict]:
    if (name, prompts) not in _REFERENCES:
        _REFERENCES[name, prompts] = hf_greedy(
            str(tinymodels.build(name)), make_prompts()[:prompts], MAX_TOKENS
        )
    return _REFERENCES[name, prompts]


def _job(name: str, engine: dict, prompts: int = 10) -> dict:
    return {
        "model": str(tinymodels.build(name)),
        "prompts": make_prompts()[:prompts],
        "max_tokens": MAX_TOKENS,
        "engine": {**engine, **HYBRID_ENGINE},
        "rounds": 2,
        "stats": True,
    }


def _results(proc, names) -> dict[str, dict]:
    results = named_job_outputs(proc)
    for name in names:
        assert name in results, proc.stderr[-4000:]
    return results


@pytest.fixture(scope="module")
def emulated() -> dict[str, dict]:
    jobs = {name: _job(name, ENGINE) for name in NAMES}
    # The test engine's own budget and 16 sequences: more prompts per step than the 4 prompt
    # rows, run as passes of warmed rows.
    jobs["passes"] = {**_job("qwen3.5", ENGINE), "engine": ENGINE, "rounds": 1}
    jobs["lfm2"] = {**_job("lfm2", ENGINE), "rounds": 1}
    proc = run_job(SEQUENTIAL_JOB, json.dumps(jobs), emulate=True, timeout=900)
    return _results(proc, jobs)


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    env = {"PT_HPU_LAZY_MODE": "0"}
    jobs = {}
    for name in QWEN3_5:
        job = _job(name, COMPILE_ENGINE, COMPILED_PROMPTS)
        # COMPILE_ENGINE's budget: 13 buckets to compile instead of the hybrid budget's 33.
        job["engine"]["max_num_batched_tokens"] = COMPILE_ENGINE["max_num_batched_tokens"]
        jobs[name] = job
    proc = run_job(SEQUENTIAL_JOB, json.dumps(jobs), env, emulate=True, timeout=900)
    return _results(proc, jobs)


@pytest.fixture(scope="module")
def gaudi() -> dict[str, dict]:
    if REAL_GAUDI_SOFTWARE:
        pytest.skip("the stand-in does not load beside a real Gaudi stack")
    env = {"PT_HPU_LAZY_MODE": "1", **STANDIN_ENGINE_ENV}
    jobs = {name: _job(name, ENGINE) for name in QWEN3_5}
    proc = run_job(SEQUENTIAL_JOB, json.dumps(jobs), env, timeout=900)
    return _results(proc, jobs)


def _served(result: dict) -> dict:
    assert "error" not in result, result.get("error")
    return result


def _expected_hits(prompts: int = 10) -> list[int]:
    return [(len(p) - 1) // BLOCK * BLOCK for p in make_prompts()[:prompts]]


@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_match_transformers_in_both_rounds(emulated, name):
    result = _served(emulated[name])
    assert result["platform"] == "HpuPlatform"
    for number, outputs in enumerate(result["rounds"], 1):
        diverged = assert_close(outputs, reference(name), f"{name}, round {number}")
        assert diverged == 0, f"round {number}: {diverged} of 10 prompts diverge (float32)"


@pytest.mark.parametrize("name", NAMES)
def test_long_prompts_are_chunked_and_the_second_round_starts_from_cached_states(emulated, name):
    result = _served(emulated[name])
    chunk = HYBRID_ENGINE["long_prefill_token_threshold"]
    assert sum(len(p) > chunk for p in make_prompts()) >= 3
    assert result["cached_tokens"][1] == _expected_hits()
    assert sum(_expected_hits()) > 0


@pytest.mark.parametrize("name", NAMES)
def test_hpu_graphs_replay_and_nothing_recompiles_after_warmup(emulated, name):
    stats = _served(emulated[name])["stats"]
    assert stats["recompiles"] == 0, stats["unwarmed_buckets"]
    assert stats["eager_steps"] == 0, stats["eager_buckets"]
    assert stats["graph_replays"] > 0


def test_more_prompts_than_rows_run_in_passes_of_warmed_rows(emulated):
    result = _served(emulated["passes"])
    diverged = assert_close(result["rounds"][0], reference("qwen3.5"), "qwen3.5, in passes")
    assert diverged == 0
    stats = result["stats"]
    assert stats["recompiles"] == 0, stats["unwarmed_buckets"]
    assert stats["split_steps"] > 0 and stats["packed_prefills"] == 0
    assert stats["eager_steps"] == 0, stats["eager_buckets"]


@pytest.mark.parametrize("name", QWEN3_5)
def test_compiled_engine_matches_transformers_and_compiles_only_in_warmup(compiled, name):
    result = _served(compiled[name])
    for number, outputs in enumerate(result["rounds"], 1):
        diverged = assert_close(
            outputs, reference(name, COMPILED_PROMPTS), f"{name} compiled, round {number}"
        )
        assert diverged == 0
    assert result["cached_tokens"][1] == _expected_hits(COMPILED_PROMPTS)
    stats = result["stats"]
    assert stats["recompiles"] == 0, stats["unwarmed_buckets"]
    assert stats["compiled_graphs"]["warmup"] > 0
    assert_compiled_only_in_warmup(stats)


@pytest.mark.gaudi
@pytest.mark.parametrize("name", QWEN3_5)
def test_gaudi_py_over_the_stand_in_serves_transformers_tokens_and_the_same_hits(
    emulated, gaudi, name
):
    ours, theirs = _served(emulated[name]), _served(gaudi[name])
    assert theirs["cached_tokens"] == ours["cached_tokens"]
    for number, outputs in enumerate(theirs["rounds"], 1):
        diverged = assert_close(outputs, reference(name), f"{name} on the stand-in, round {number}")
        assert diverged == 0
    assert theirs["stats"]["eager_steps"] == 0, theirs["stats"]["eager_buckets"]
    assert theirs["stats"]["recompiles"] == 0, theirs["stats"]["unwarmed_buckets"]


def test_a_state_layer_without_hpu_kernels_is_refused_at_load_by_name(emulated):
    error = emulated["lfm2"].get("error", "")
    assert "ShortConv layers have no HPU implementation" in error, emulated["lfm2"]
    assert "short conv" in error


def test_without_the_gdn_entry_point_qwen3_5_is_refused_naming_it():
    plugins = "hpu,hpu_ops_norm,hpu_ops_rotary,hpu_ops_activation,hpu_ops_moe,hpu_ops_mamba"
    env = {"VLLM_PLUGINS": plugins, "VLLM_SKIP_WARMUP": "true"}
    jobs = {"qwen3.5": {**_job("qwen3.5", ENGINE), "rounds": 1, "stats": False}}
    proc = run_job(SEQUENTIAL_JOB, json.dumps(jobs), env, emulate=True, timeout=600)
    error = _results(proc, jobs)["qwen3.5"].get("error", "")
    assert "QwenGatedDeltaNetAttention layers have no HPU implementation" in error, error
    assert "hpu_ops_gdn" in error and "VLLM_PLUGINS" in error
