"""A gated delta net hybrid with MoE blocks served: the tiny Qwen3.5-MoE (a gated delta net layer
before a gated full attention layer, each followed by an MoE block with a gated shared expert)
behind vLLM's OpenAI-compatible server on the HPU platform (CPU emulation, lazy mode with HPU
graphs, vLLM's default async scheduling and prefix caching), with the settings the platform
README advises for hybrids.

One server serves everything the tests check: the 10 prompts as one batched completions request
(transformers' greedy tokens, vLLM's top-5 rule at a divergence), the same request again (served
from the conv and recurrent states cached at block boundaries, the same tokens), and a chat
request (the model's chat template applied by the server; transformers' tokens on the ids it
sent). The ops wheel's per-family counters (VLLM_HPU_OPS_STATS_FILE, written by the engine-core
process and read once the server has stopped) show that the HPU gated delta net and MoE layers
ran: once per layer in every HPU graph the warmup captured, at least, and every served step
replayed one of those graphs (a replay runs no Python, so serving adds no counts).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from gaudi_testkit import tinymodels
from tests.connectors import cluster
from tests.integration import openai_server
from tests.integration.architectures import HYBRID_ENGINE
from tests.integration.generation import ENGINE, assert_close, hf_greedy, make_prompts
from tests.integration.openai_server import as_result, post

pytestmark = pytest.mark.engine

NAME = "qwen3.5-moe"
MAX_TOKENS = 12
BLOCK = 128  # the attention block; states are cached at its boundaries
HITS = "vllm:prefix_cache_hits_total"
CHAT = [{"role": "user", "content": "Hello world! How are you today?"}]
STATS_ENV = "VLLM_HPU_OPS_STATS_FILE"


@pytest.fixture(scope="module")
def served(clean_env, tmp_path_factory) -> Iterator[dict]:
    """One server's answers, its worker's statistics and, after it stopped, the op counters."""
    model = str(tinymodels.build(NAME))
    folder = tmp_path_factory.mktemp("serve-gdn")
    stats_file = folder / "ops.json"
    args = openai_server.engine_args(model, {**ENGINE, **HYBRID_ENGINE})
    env = {**openai_server.server_env(clean_env()), STATS_ENV: str(stats_file)}
    out: dict = {"model": model}
    prompts = make_prompts()
    with (
        openai_server.running(args, env, folder / "server.log") as base,
        httpx.Client(base_url=base, timeout=120, trust_env=False) as client,
    ):
        body = openai_server.completion_body(prompts, MAX_TOKENS)
        out["first"] = post(client, "/v1/completions", body)["choices"]
        before = cluster.settled_metric(base, HITS)
        out["second"] = post(client, "/v1/completions", body)["choices"]
        out["hits"] = cluster.settled_metric(base, HITS) - before
        chat = openai_server.chat_body(CHAT, MAX_TOKENS)
        out["chat"] = post(client, "/v1/chat/completions", chat)
        rpc = {"method": "get_recompile_stats"}
        out["stats"] = post(client, "/collective_rpc", rpc)["results"][0]
    # The engine core adds its counts to the file as it exits (and while it counts).
    out["counts"] = json.loads(stats_file.read_text()) if stats_file.exists() else {}
    yield out


def _by_index(choices: list[dict]) -> list[dict]:
    return [as_result(c) for c in sorted(choices, key=lambda c: c["index"])]


def test_served_completions_match_transformers_in_both_rounds(served):
    reference = hf_greedy(served["model"], make_prompts(), MAX_TOKENS)
    for round_ in ("first", "second"):
        ours = _by_index(served[round_])
        diverged = assert_close(ours, reference, f"served Qwen3.5-MoE, {round_} round")
        assert diverged == 0, f"{round_} round: {diverged} of 10 prompts diverge (float32)"


def test_the_second_round_starts_from_cached_states(served):
    expected = sum((len(p) - 1) // BLOCK * BLOCK for p in make_prompts())
    assert expected > 0
    assert served["hits"] == expected


def test_served_chat_matches_transformers_on_the_templated_prompt(served):
    from transformers import AutoTokenizer

    body = served["chat"]
    prompt = body["prompt_token_ids"]
    tokenizer = AutoTokenizer.from_pretrained(served["model"])
    templated = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    assert prompt == list(getattr(templated, "input_ids", templated))
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] == "length"
    ours = [openai_server.chat_result(choice)]
    diverged = assert_close(ours, hf_greedy(served["model"], [prompt], MAX_TOKENS), "chat")
    assert diverged == 0


def test_every_step_replayed_a_warmed_graph_and_nothing_recompiled(served):
    stats = served["stats"]
    assert stats["graphs_enabled"] and not stats["compiled"]
    assert stats["recompiles"] == 0, stats["unwarmed_buckets"]
    assert stats["eager_steps"] == 0, stats["eager_buckets"]
    assert stats["graph_replays"] > 0


def test_the_hpu_gdn_and_moe_layers_ran_in_every_captured_graph(served):
    counts, graphs = served["counts"], served["stats"]["num_graphs"]
    config = json.loads((tinymodels.build(NAME) / "config.json").read_text())
    gdn_layers = config["layer_types"].count("linear_attention")
    moe_layers = config["num_hidden_layers"] - len(config.get("mlp_only_layers") or [])
    assert gdn_layers > 0 and moe_layers > 0 and graphs > 0
    assert counts.get("gdn", 0) >= gdn_layers * graphs, (counts, graphs)
    assert counts.get("moe", 0) >= moe_layers * graphs, (counts, graphs)
