"""End to end: the HPU platform in CPU emulation generates what transformers generates on the
same tiny Llama (vLLM's own CPU backend: test_cpu_backend.py, on this module's outputs), with
static bucketed shapes and no recompiles."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gaudi_testkit import tinymodels
from tests.conftest import REAL_GAUDI_SOFTWARE, STANDIN_ENGINE_ENV
from tests.integration.architectures import CASES, hpu_run
from tests.integration.generation import (
    ENGINE,
    assert_close,
    hf_greedy,
    make_prompts,
    run_engine,
)

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def model() -> str:
    return str(tinymodels.build("llama"))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts()


@pytest.fixture(scope="module")
def hpu(model, prompts) -> dict:
    # Two rounds: the second finds the shared 140-token prefix in the prefix cache. The run is
    # shared with test_cpu_backend.py (which compares it with vLLM's CPU backend).
    case = CASES["llama"]
    assert str(case.build()) == model and case.rounds == 2
    proc, result = hpu_run("llama")
    assert result is not None, proc.stderr[-4000:]
    return result


@pytest.fixture(scope="module")
def reference(model, prompts) -> list[dict]:
    return hf_greedy(model, prompts)


def test_generation_runs_on_the_hpu_platform(hpu):
    assert hpu["platform"] == "HpuPlatform"


def test_every_dense_linear_layer_runs_through_the_seam(hpu, model):
    # q/k/v, o, gate/up and down of each layer (the LM head is an embedding, not a linear layer).
    layers = json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"]
    assert hpu["stats"]["linears_on_seam"] == 4 * layers


def test_greedy_tokens_match_transformers(hpu, reference):
    diverged = assert_close(hpu["rounds"][0], reference, "HPU emulation vs transformers")
    assert diverged <= 2, f"{diverged} of 10 prompts hit near-ties; expected at most 2"


def test_greedy_outputs_with_graphs_and_async_scheduling_equal_a_plain_eager_engine(
    hpu, model, prompts
):
    # The module's engine runs with the defaults: HPU graphs replayed for every warmed bucket and
    # async scheduling (step N's sampled tokens stay on the device as step N+1's input ids). One
    # comparison engine turns both off, so either feature changing a token fails this test.
    assert hpu["stats"]["async_scheduling"] is True and hpu["stats"]["graphs_enabled"]
    proc, plain = run_engine(
        model, prompts, emulate=True, engine={"async_scheduling": False, "enforce_eager": True}
    )
    assert plain is not None, proc.stderr[-4000:]
    assert plain["stats"]["async_scheduling"] is False
    assert not plain["stats"]["graphs_enabled"] and plain["stats"]["num_graphs"] == 0
    fast, eager = hpu["rounds"][0], plain["rounds"][0]
    assert [r["tokens"] for r in fast] == [r["tokens"] for r in eager]
    for a, s in zip(fast, eager):
        for step_a, step_s in zip(a["logprobs"], s["logprobs"]):
            assert step_a.keys() == step_s.keys()
            for token, logprob in step_s.items():
                assert abs(step_a[token] - logprob) < 1e-4


def test_prefix_cache_hits_give_the_same_tokens(hpu):
    assert_close(hpu["rounds"][1], hpu["rounds"][0], "prefix-cached round vs first round")


def test_mixed_lengths_after_warmup_cause_no_recompiles(hpu):
    stats = hpu["stats"]
    assert stats["num_prompt_buckets"] > 0 and stats["num_decode_buckets"] > 0
    assert stats["warmup_seconds"] is not None
    assert stats["recompiles"] == 0, stats["unwarmed_buckets"]


def test_every_warmed_bucket_has_a_graph_replayed_by_serving_steps(hpu):
    stats = hpu["stats"]
    assert stats["graphs_enabled"]
    # Plus the packed-prefill variant of the single-row prompt buckets without context (the
    # one-sequence causal fast path does not serve a packed row).
    assert stats["num_packed_graphs"] > 0
    assert stats["num_graphs"] == (
        stats["num_prompt_buckets"] + stats["num_decode_buckets"] + stats["num_packed_graphs"]
    )
    assert stats["graph_replays"] > 0


def test_mixed_prefill_and_decode_steps_replay_one_graph_per_part(hpu):
    # A step with prefills and decodes runs as a prefill pass and a decode pass, each on a warmed
    # bucket's graph, and a prefill row packing several prompts with cached context replays the
    # bucket's graph too (this Llama has no windowed layer): no serving pass runs without one.
    stats = hpu["stats"]
    assert stats["split_steps"] > 0
    assert stats["eager_steps"] == 0, (stats["variant_misses"], stats["eager_buckets"])


# The same engine on the Gaudi backend: seam/gaudi over the Habana stand-in, every weight, KV block,
# activation, index tensor and sampled id on its torch device "hpu", which refuses ops mixing
# them with host tensors. Lazy mode with HPU graphs; two rounds, the second served from the
# prefix cache; the longest prompts (up to 300 tokens) exceed the 256-token step budget, so their
# prefill runs in chunks across steps.
@pytest.fixture(scope="module")
def on_gaudi(model, prompts) -> dict:
    if REAL_GAUDI_SOFTWARE:
        pytest.skip("the stand-in does not load beside a real Gaudi stack (the tests run there)")
    env = {**STANDIN_ENGINE_ENV, "PT_HPU_LAZY_MODE": "1"}
    proc, result = run_engine(model, prompts, emulate=True, rounds=2, env=env)
    assert result is not None, proc.stderr[-6000:]
    return result


def test_gaudi_py_on_the_device_generates_the_emulations_tokens(on_gaudi, hpu):
    assert on_gaudi["stats"]["seam"] == "gaudi" and hpu["stats"]["seam"] == "emulated on cpu"
    assert on_gaudi["stats"]["kv_cache_devices"] == ["hpu"]
    for n, (gaudi, emulated) in enumerate(zip(on_gaudi["rounds"], hpu["rounds"], strict=True)):
        diverged = assert_close(gaudi, emulated, f"round {n}: seam/gaudi vs emulation")
        assert diverged <= 1, f"round {n}: {diverged} of 10 prompts hit near-ties"


def test_gaudi_py_on_the_device_serves_prefix_cache_hits_and_chunked_prefills(on_gaudi, prompts):
    assert max(len(p) for p in prompts) > ENGINE["max_num_batched_tokens"]  # chunked
    first, second = on_gaudi["cached_tokens"]
    assert sum(second) > sum(first), on_gaudi["cached_tokens"]
    assert_close(on_gaudi["rounds"][1], on_gaudi["rounds"][0], "prefix-cached round (seam/gaudi)")
    stats = on_gaudi["stats"]
    assert stats["graphs_enabled"] and stats["graph_replays"] > 0
    assert stats["recompiles"] == 0, stats["unwarmed_buckets"]
    assert stats["eager_steps"] == 0, (stats["variant_misses"], stats["eager_buckets"])


def test_graph_replay_refuses_an_input_buffer_reallocated_after_capture(model, prompts):
    # In-process engine: the injected bug and the runner's error stay in this job's process.
    proc, result = run_engine(
        model,
        prompts[:1],
        emulate=True,
        max_tokens=2,
        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
        extra={"reallocate_input_ids": True},
    )
    assert result is not None, proc.stderr[-4000:]
    error = result["after_reallocation"]
    assert error.startswith("GraphInputError"), error
    assert "input_ids is a different buffer than at capture" in error
