"""DeepSeek-V2 multi-head latent attention end to end: a tiny DeepSeek-V2 (latent KV cache, q
LoRA, a dense layer and a grouped top-k MoE layer with a shared expert) generates on the HPU
platform what transformers generates, over mixed-length prompts longer than one 128-token
block (the longest prefilled in chunks, so later chunks read the latent cache), again with the
prompts' prefixes cached, and with no recompile after warmup. One engine job."""

from __future__ import annotations

import time

import pytest

from gaudi_testkit import tinymodels
from tests.integration.generation import assert_close, hf_greedy, make_prompts, run_engine

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def deepseek() -> tuple[dict, list[dict], str, float]:
    model = str(tinymodels.build("deepseek-v2"))
    prompts = make_prompts()
    start = time.perf_counter()
    # Round 2 submits the same prompts again: their prefixes come from the prefix cache.
    proc, result = run_engine(model, prompts, emulate=True, rounds=2)
    seconds = time.perf_counter() - start
    assert result is not None, proc.stderr[-6000:]
    return result, hf_greedy(model, prompts), proc.stderr, seconds


def test_deepseek_v2_runs_on_hpu(deepseek):
    result, _, _, seconds = deepseek
    assert result["platform"] == "HpuPlatform"
    assert max(len(p) for p in make_prompts()) > 2 * 128
    print(f"DeepSeek-V2 engine job: {seconds:.1f} s")


def test_deepseek_v2_greedy_tokens_match_transformers(deepseek):
    result, reference, _, _ = deepseek
    diverged = assert_close(result["rounds"][0], reference, "DeepSeek-V2 on HPU vs transformers")
    assert diverged <= 2, f"{diverged} of 10 prompts hit near-ties; expected at most 2"


def test_deepseek_v2_prefix_cached_round_matches_transformers(deepseek):
    result, reference, _, _ = deepseek
    diverged = assert_close(result["rounds"][1], reference, "DeepSeek-V2, prefix-cached round")
    assert diverged <= 2, f"{diverged} of 10 prompts hit near-ties; expected at most 2"


def test_deepseek_v2_no_recompiles_after_warmup(deepseek):
    result, _, _, _ = deepseek
    assert result["stats"]["recompiles"] == 0, result["stats"]["unwarmed_buckets"]
    assert result["stats"]["graphs_enabled"] and result["stats"]["num_graphs"] > 0


def test_deepseek_v2_serving_steps_all_replay_warmed_graphs(deepseek):
    # As test_generation asserts for the tiny Llama: mixed steps split into warmed parts, and
    # no serving step runs without its bucket's graph (MLA layers have no window, so packed
    # prefill rows with cached context replay the one-sequence graph).
    result, _, _, _ = deepseek
    stats = result["stats"]
    print("DeepSeek-V2", {k: stats[k] for k in ("eager_steps", "variant_misses", "split_steps")})
    assert stats["split_steps"] > 0
    assert stats["eager_steps"] == 0, (stats["variant_misses"], stats["eager_buckets"])
