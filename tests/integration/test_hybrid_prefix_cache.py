"""Prefix caching of Mamba2 hybrids' state (vLLM's mamba_cache_mode "align"), end to end.

With prefix caching on (vLLM's default), the scheduler ends a hybrid's prefill chunks at block
boundaries, vLLM's runner copies each request's conv and SSM states into the block of its last
token before a step (through the platform's stand-in for its Triton memcpy,
`worker/cuda_stand_ins/mamba_state_copies.py`), and the HPU mixer reads and writes that block.
A later prompt that
shares a prefix starts from the state cached at the prefix's last block boundary, and must still
generate what transformers generates from scratch: a state copied from the wrong block, or not
copied at all, changes its tokens.

Prompts share a 300-token prefix (blocks of 128 tokens); the second round serves every prompt
again, so each must hit the cache up to its last whole block before its final token, as vLLM's
attention prefix cache does. Tiny GraniteMoeHybrid and Nemotron-H run in emulation, GraniteMoeHybrid
also on seam/gaudi over the Habana stand-in (same tokens, same hits).
"""

from __future__ import annotations

import json
import random

import pytest

from tests.conftest import REAL_GAUDI_SOFTWARE, STANDIN_ENGINE_ENV
from tests.integration.architectures import CASES, HYBRID_ENGINE, SEQUENTIAL_JOB
from tests.integration.generation import ENGINE, assert_close, hf_greedy, named_job_outputs, run_job

pytestmark = pytest.mark.engine

NAMES = ("granitemoehybrid", "nemotron-h")
BLOCK = 128  # the tiny hybrids' attention block (their Mamba page fits one)
MAX_TOKENS = 10
# The platform README's advice for hybrids: at most 4 prompts per step, each in its own prefill
# row, of at most 128 new tokens (one block).
ENGINE_ARGS = {**ENGINE, **HYBRID_ENGINE}


def shared_prefix_prompts() -> list[list[int]]:
    rng = random.Random(7)
    prefix = [rng.randrange(3, 500) for _ in range(300)]
    tail = lambda n: [rng.randrange(3, 500) for _ in range(n)]  # noqa: E731
    return [
        prefix + tail(5),  # 305 tokens: cached up to 256
        prefix[:256] + tail(84),  # 340: the same 256
        prefix[:140] + tail(3),  # 143: one block
        prefix[:128],  # exactly one block: cached up to 0 (its last token is computed)
        tail(30),  # unrelated
    ]


def expected_hits(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BLOCK * BLOCK


def _job(name: str) -> dict:
    return {
        "model": str(CASES[name].build()),
        "prompts": shared_prefix_prompts(),
        "max_tokens": MAX_TOKENS,
        "engine": ENGINE_ARGS,
        "rounds": 2,
        "stats": True,
    }


@pytest.fixture(scope="module")
def emulated() -> dict[str, dict]:
    jobs = {name: _job(name) for name in NAMES}
    proc = run_job(SEQUENTIAL_JOB, json.dumps(jobs), emulate=True, timeout=900)
    results = named_job_outputs(proc)
    for name in NAMES:
        assert name in results and "error" not in results[name], proc.stderr[-4000:]
    return results


@pytest.fixture(scope="module")
def gaudi() -> dict:
    if REAL_GAUDI_SOFTWARE:
        pytest.skip("the stand-in does not load beside a real Gaudi stack")
    env = {"PT_HPU_LAZY_MODE": "1", **STANDIN_ENGINE_ENV}
    jobs = {NAMES[0]: _job(NAMES[0])}
    proc = run_job(SEQUENTIAL_JOB, json.dumps(jobs), env, timeout=900)
    result = named_job_outputs(proc).get(NAMES[0])
    assert result is not None and "error" not in result, proc.stderr[-4000:]
    return result


@pytest.mark.parametrize("name", NAMES)
def test_prompts_served_from_cached_mamba_state_match_transformers(emulated, name):
    result = emulated[name]
    reference = hf_greedy(str(CASES[name].build()), shared_prefix_prompts(), MAX_TOKENS)
    for number, outputs in enumerate(result["rounds"], 1):
        diverged = assert_close(outputs, reference, f"{name}, round {number}")
        assert diverged == 0, f"round {number}: {diverged} prompts diverge from transformers"


@pytest.mark.parametrize("name", NAMES)
def test_the_second_round_hits_up_to_the_last_whole_block(emulated, name):
    hits = emulated[name]["cached_tokens"][1]
    assert hits == [expected_hits(p) for p in shared_prefix_prompts()]


@pytest.mark.parametrize("name", NAMES)
def test_cached_prefixes_need_no_recompiles_after_warmup(emulated, name):
    stats = emulated[name]["stats"]
    assert stats["recompiles"] == 0, stats["unwarmed_buckets"]
    assert stats["eager_steps"] == 0, stats["eager_buckets"]


@pytest.mark.gaudi
def test_gaudi_py_over_the_stand_in_serves_the_same_tokens_and_hits(emulated, gaudi):
    ours = emulated[NAMES[0]]
    assert gaudi["cached_tokens"] == ours["cached_tokens"]
    for number, (on_gaudi, emulation) in enumerate(zip(gaudi["rounds"], ours["rounds"]), 1):
        diverged = assert_close(on_gaudi, emulation, f"round {number}: gaudi vs emulated")
        assert diverged == 0
