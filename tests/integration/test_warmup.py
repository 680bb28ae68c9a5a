"""Warmup and recompile tracking on the HPU platform in emulation: shapes outside the warmed
buckets are counted, are an error under VLLM_FULL_WARMUP=true, and bad bucketing settings stop
startup with the variable's name."""

from __future__ import annotations

import pytest

from gaudi_testkit import tinymodels
from tests.integration.generation import assert_close, hf_greedy, run_engine
from vllm_gaudi_platform.observability.step_trace import TracedShape, read_trace

pytestmark = pytest.mark.engine

# Linear buckets capped at 128 query tokens: a 200-token prompt has no warmed bucket.
NARROW = {"VLLM_BUCKETING_STRATEGY": "lin", "VLLM_PROMPT_QUERY_BUCKET_MAX": "128"}
LONG_PROMPT = [[(7 * i) % 500 + 3 for i in range(200)]]


@pytest.fixture(scope="module")
def model() -> str:
    return str(tinymodels.build("llama"))


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    return tmp_path_factory.mktemp("trace") / "steps.txt"


@pytest.fixture(scope="module")
def narrow_run(model, trace_file):
    # No kv_cache_memory_bytes: the worker profiles memory on a 1 GiB emulated HPU.
    env = {
        **NARROW,
        "VLLM_HPU_EMULATION_MEMORY_GB": "1",
        "VLLM_BUCKETING_RECORD_TRACE": str(trace_file),
    }
    engine = {"kv_cache_memory_bytes": None, "gpu_memory_utilization": 0.5}
    proc, result = run_engine(
        model, LONG_PROMPT, emulate=True, max_tokens=4, env=env, engine=engine
    )
    assert result is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, result


def test_kv_cache_size_is_profiled_from_the_emulated_device_memory(narrow_run):
    proc, _ = narrow_run
    logs = proc.stdout + proc.stderr
    line = next(x for x in logs.splitlines() if "KV cache:" in x and "total" in x)
    assert "total 1.00 GiB" in line and "at least VLLM_GRAPH_RESERVED_MEM=0.1" in line
    assert "graphs bounded from 4 sampled" in line  # the least and most work of each phase
    kv_gib = float(line.split("KV cache:")[1].split("GiB")[0])
    # 1 GiB x 0.5 utilization - weights - activations, less the graphs' (at least 10%)
    assert 0.1 < kv_gib < 0.45


def test_shape_outside_the_warmed_buckets_is_counted_as_a_recompile(narrow_run):
    proc, result = narrow_run
    stats = result["stats"]
    assert stats["recompiles"] >= 1
    unwarmed = stats["unwarmed_buckets"][0]
    assert unwarmed["phase"] == "prompt" and unwarmed["query_len"] > 128
    assert "Recompile #1" in proc.stdout + proc.stderr


def test_runner_records_every_serving_step_shape_to_the_trace_file(narrow_run, trace_file):
    # One 200-token prefill, then 3 decode steps of one sequence holding 2 blocks of 128.
    assert read_trace(str(trace_file)) == {
        TracedShape("prompt", 1, 200, 0): 1,
        TracedShape("decode", 1, 1, 2): 3,
    }


def test_a_packed_prefill_longer_than_max_model_len_runs_a_warmed_bucket(model):
    """A token budget above max_model_len: five 100-token prompts are admitted in one step and
    packed into one prefill row of 500 new tokens, more than one sequence can hold. Warmup
    covers such rows (single-row query buckets up to the budget, warmed as packed rows only), so
    even under VLLM_FULL_WARMUP=true the step runs, on a captured graph, and generates what
    transformers does."""
    prompts = [[(11 * i + 5 * p) % 500 + 3 for i in range(100)] for p in range(5)]
    engine = {"max_model_len": 128, "max_num_batched_tokens": 512}
    env = {"VLLM_FULL_WARMUP": "true"}
    proc, result = run_engine(model, prompts, emulate=True, max_tokens=8, env=env, engine=engine)
    assert result is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
    stats = result["stats"]
    assert stats["recompiles"] == 0 and stats["unwarmed_buckets"] == [], stats
    assert stats["eager_steps"] == 0 and stats["graph_replays"] > 0, stats
    assert "query_len [128, 256, 512]" in stats["bucket_plan"], stats["bucket_plan"]
    assert stats["step_metrics"]["prompt_tokens_real"] == 500, stats["step_metrics"]
    ref = hf_greedy(model, prompts, max_tokens=8)
    assert assert_close(result["rounds"][0], ref, "packed prefill") == 0


def test_full_warmup_turns_a_recompile_into_an_error(model):
    env = {**NARROW, "VLLM_FULL_WARMUP": "true"}
    proc, result = run_engine(model, LONG_PROMPT, emulate=True, max_tokens=4, env=env)
    assert result is None
    assert proc.returncode != 0
    assert "VLLM_FULL_WARMUP=true forbids recompiles" in proc.stdout + proc.stderr


def test_invalid_bucketing_setting_stops_startup_naming_the_variable(model):
    env = {"VLLM_BUCKETING_STRATEGY": "lin", "VLLM_DECODE_BS_BUCKET_STEP": "many"}
    proc, result = run_engine(model, LONG_PROMPT, emulate=True, max_tokens=4, env=env)
    assert result is None
    assert "VLLM_DECODE_BS_BUCKET_STEP" in proc.stderr


def test_malformed_trace_stops_startup_naming_the_variable_and_the_file(model, tmp_path):
    trace = tmp_path / "steps.txt"
    trace.write_text("decode 4\n")
    env = {"VLLM_BUCKETING_STRATEGY": "fitted", "VLLM_BUCKETING_TRACE": str(trace)}
    proc, result = run_engine(model, LONG_PROMPT, emulate=True, max_tokens=4, env=env)
    assert result is None
    assert f"VLLM_BUCKETING_TRACE={str(trace)!r}, line 1" in proc.stderr
