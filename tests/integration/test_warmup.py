"""Warmup and recompile tracking on the HPU platform in emulation: shapes outside the warmed
buckets are counted, are an error under VLLM_FULL_WARMUP=true, and bad bucketing settings stop
startup with the variable's name."""

from __future__ import annotations

import pytest

from tests.integration.generation import run_engine
from vllm_gaudi_platform import tinymodels

pytestmark = pytest.mark.engine

# Linear buckets capped at 128 query tokens: a 200-token prompt has no warmed bucket.
NARROW = {"VLLM_BUCKETING_STRATEGY": "lin", "VLLM_PROMPT_QUERY_BUCKET_MAX": "128"}
LONG_PROMPT = [[(7 * i) % 500 + 3 for i in range(200)]]


@pytest.fixture(scope="module")
def model() -> str:
    return str(tinymodels.build("llama"))


def test_shape_outside_the_warmed_buckets_is_counted_as_a_recompile(model):
    proc, result = run_engine(model, LONG_PROMPT, emulate=True, max_tokens=4, env=NARROW)
    assert result is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
    stats = result["stats"]
    assert stats["recompiles"] >= 1
    unwarmed = stats["unwarmed_buckets"][0]
    assert unwarmed["phase"] == "prompt" and unwarmed["query_len"] > 128
    assert "Recompile #1" in proc.stdout + proc.stderr


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
