"""A Mamba2 hybrid served: the tiny GraniteMoeHybrid behind vLLM's OpenAI-compatible server on the
HPU platform (CPU emulation), with the settings the platform README advises for Mamba hybrids and
vLLM's default async scheduling. The 10 prompts sent as one batched completions request give
transformers' greedy tokens, and serving them compiles nothing after warmup. Sent again, they are
served from the prefix cache (Mamba state cached at block boundaries) with the same tokens: each
prompt hits up to its last whole block before its final token."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.connectors import cluster
from tests.integration import openai_server
from tests.integration.architectures import CASES, HYBRID_ENGINE, prompts
from tests.integration.generation import ENGINE, assert_close, hf_greedy
from tests.integration.openai_server import as_result, post

pytestmark = pytest.mark.engine

NAME = "granitemoehybrid"
MAX_TOKENS = 12
BLOCK = 128  # the tiny hybrid's attention block (its Mamba page fits one)
HITS = "vllm:prefix_cache_hits_total"
_REFERENCE: list[dict] = []


def reference() -> list[dict]:
    if not _REFERENCE:
        _REFERENCE.extend(hf_greedy(str(CASES[NAME].build()), prompts(NAME), MAX_TOKENS))
    return _REFERENCE


@pytest.fixture(scope="module")
def client(clean_env, tmp_path_factory) -> Iterator[httpx.Client]:
    log = tmp_path_factory.mktemp("serve-hybrid") / "server.log"
    args = openai_server.engine_args(str(CASES[NAME].build()), {**ENGINE, **HYBRID_ENGINE})
    env = openai_server.server_env(clean_env())
    with (
        openai_server.running(args, env, log) as base,
        httpx.Client(base_url=base, timeout=120, trust_env=False) as c,
    ):
        yield c


@pytest.fixture(scope="module")
def completions(client) -> list[dict]:
    body = post(client, "/v1/completions", openai_server.completion_body(prompts(NAME), MAX_TOKENS))
    return sorted(body["choices"], key=lambda c: c["index"])


@pytest.fixture(scope="module")
def second_round(client, completions) -> tuple[list[dict], float]:
    """The same request again, after the first: (its choices, prefix-cache hits it added)."""
    url = str(client.base_url).rstrip("/")
    before = cluster.settled_metric(url, HITS)
    body = post(client, "/v1/completions", openai_server.completion_body(prompts(NAME), MAX_TOKENS))
    hits = cluster.settled_metric(url, HITS) - before
    return sorted(body["choices"], key=lambda c: c["index"]), hits


def test_served_completions_match_transformers(completions):
    ours = [as_result(c) for c in completions]
    diverged = assert_close(ours, reference(), "served GraniteMoeHybrid vs transformers")
    assert diverged == 0, f"{diverged} of {len(ours)} prompts diverge (float32)"


def test_serving_the_hybrid_compiles_nothing_after_warmup(client, completions, second_round):
    stats = post(client, "/collective_rpc", {"method": "get_recompile_stats"})["results"][0]
    assert stats["async_scheduling"] is True
    assert stats["recompiles"] == 0, stats["unwarmed_buckets"]
    assert stats["graph_replays"] > 0


def test_a_second_round_is_served_from_cached_mamba_state(second_round):
    choices, hits = second_round
    assert hits == sum((len(p) - 1) // BLOCK * BLOCK for p in prompts(NAME))
    ours = [as_result(c) for c in choices]
    diverged = assert_close(ours, reference(), "served GraniteMoeHybrid, second round")
    assert diverged == 0, f"{diverged} of {len(ours)} prompts diverge (float32)"
