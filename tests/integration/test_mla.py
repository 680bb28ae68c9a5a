"""DeepSeek's multi-head latent attention and MoE routing end to end: a tiny DeepSeek-V2 (latent
KV cache, q LoRA, a dense layer and a grouped top-k softmax MoE layer with a shared expert) and a
tiny DeepSeek-V3 (sigmoid scores, selection by score plus a random correction bias within the
best groups, normalized and scaled weights, a 32 + 16 query/key split with interleaved rotary)
generate on the HPU platform what transformers generates, over mixed-length prompts longer than
one 128-token block (the longest prefilled in chunks, so later chunks read the latent cache),
again with the prompts' prefixes cached, and with no recompile after warmup. One engine job per
model. (vLLM's CPU backend cannot cross-check the V3 shape: its MLA takes no head of 48.)"""

from __future__ import annotations

import time

import pytest

from gaudi_testkit import tinymodels
from tests.integration.generation import assert_close, hf_greedy, make_prompts, run_engine

pytestmark = pytest.mark.engine

MODELS = ("deepseek-v2", "deepseek-v3")


@pytest.fixture(scope="module", params=MODELS)
def deepseek(request) -> tuple[str, dict, list[dict], float]:
    model = str(tinymodels.build(request.param))
    prompts = make_prompts()
    start = time.perf_counter()
    # Round 2 submits the same prompts again: their prefixes come from the prefix cache.
    proc, result = run_engine(model, prompts, emulate=True, rounds=2)
    seconds = time.perf_counter() - start
    assert result is not None, proc.stderr[-6000:]
    return request.param, result, hf_greedy(model, prompts), seconds


def test_deepseek_runs_on_hpu(deepseek):
    name, result, _, seconds = deepseek
    assert result["platform"] == "HpuPlatform"
    assert max(len(p) for p in make_prompts()) > 2 * 128
    print(f"{name} engine job: {seconds:.1f} s")


def test_deepseek_greedy_tokens_match_transformers(deepseek):
    name, result, reference, _ = deepseek
    diverged = assert_close(result["rounds"][0], reference, f"{name} on HPU vs transformers")
    assert diverged <= 2, f"{diverged} of 10 prompts hit near-ties; expected at most 2"


def test_deepseek_prefix_cached_round_matches_transformers(deepseek):
    name, result, reference, _ = deepseek
    diverged = assert_close(result["rounds"][1], reference, f"{name}, prefix-cached round")
    assert diverged <= 2, f"{diverged} of 10 prompts hit near-ties; expected at most 2"


def test_deepseek_no_recompiles_after_warmup(deepseek):
    _, result, _, _ = deepseek
    assert result["stats"]["recompiles"] == 0, result["stats"]["unwarmed_buckets"]
    assert result["stats"]["graphs_enabled"] and result["stats"]["num_graphs"] > 0


def test_deepseek_serving_steps_all_replay_warmed_graphs(deepseek):
    # As test_generation asserts for the tiny Llama: mixed steps split into warmed parts, and
    # no serving step runs without its bucket's graph (MLA layers have no window, so packed
    # prefill rows with cached context replay the one-sequence graph).
    name, result, _, _ = deepseek
    stats = result["stats"]
    print(name, {k: stats[k] for k in ("eager_steps", "variant_misses", "split_steps")})
    assert stats["split_steps"] > 0
    assert stats["eager_steps"] == 0, (stats["variant_misses"], stats["eager_buckets"])


def test_deepseek_v3_routing_needs_the_correction_bias_and_sigmoid_scores():
    # The tiny V3's routing is not a trivial one: its saved correction bias is non-zero (so
    # selection by score + bias differs from selection by score) and its config names sigmoid
    # scoring (vLLM's default would be softmax).
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    path = Path(tinymodels.build("deepseek-v3"))
    config = json.loads((path / "config.json").read_text())
    assert config["scoring_func"] == "sigmoid" and config["topk_method"] == "noaux_tc"
    weights = load_file(str(path / "model.safetensors"))
    biases = [w for k, w in weights.items() if k.endswith("e_score_correction_bias")]
    assert biases and all(b.abs().max() > 0.05 for b in biases)
