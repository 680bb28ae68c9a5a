"""Disaggregated prefill/decode behind vLLM's own router (`vllm-router`, the connectors wheel's
`router` extra), as operators deploy it: HPU instances (CPU emulation) with HpuNixlConnector, NIXL
over UCX on loopback, and the router in its prefill/decode mode with the NIXL protocol
(`--vllm-pd-disaggregation --kv-connector nixl`), which is all our connector needs from it: a
prefill request for one token with `kv_transfer_params.do_remote_decode`, then the decode request
with the `kv_transfer_params` the prefill instance answered.

One deployment: two prefill instances and one decode instance; one router in front of the first
prefill instance and the decode instance (1P1D), one in front of all three (2P1D, round robin
over the prefill instances). Both give transformers' greedy tokens; the decode instance pulls
exactly the prompt blocks missing from its prefix cache. Then the first prefill instance is
killed: no request hangs, and once the router's health check has marked it (an instance check
every second), every request is served by the other.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from gaudi_testkit import tinymodels
from tests.connectors import cluster
from tests.integration.generation import assert_close, hf_greedy

pytestmark = pytest.mark.engine

MAX_TOKENS = 8
# Tiny Llama, float32: 2 layers x (key + value) x 128 token slots x 2 KV heads x 32 dims x 4 bytes.
BLOCK_BYTES = 2 * 2 * cluster.BLOCK_SIZE * 2 * 32 * 4
BYTES = "vllm:nixl_bytes_transferred_sum"
FAILED = "vllm:nixl_num_failed_transfers_total"


def _prompts(seed: int, n: int) -> list[list[int]]:
    """Prompts of 40 to 600 tokens; every second one starts with the same 200 tokens."""
    rng = random.Random(seed)
    shared = [rng.randrange(10, 250) for _ in range(200)]
    prompts = []
    for i in range(n):
        own = [rng.randrange(10, 250) for _ in range([40, 300, 600][i % 3])]
        prompts.append((shared + own)[: len(own)] if i % 2 else own)
    return prompts


ONE_PREFILL = _prompts(21, 6)
TWO_PREFILLS = _prompts(22, 6)
AFTER_KILL = _prompts(23, 4)


def _blocks_missing(prompts: list[list[int]]) -> list[int]:
    """Blocks the decode instance pulls per prompt, in order: all of the prompt's blocks but the
    leading full ones an earlier prompt left in its prefix cache."""
    cached: set[tuple[int, ...]] = set()
    missing = []
    for prompt in prompts:
        full = len(prompt) // cluster.BLOCK_SIZE
        prefixes = [tuple(prompt[: (b + 1) * cluster.BLOCK_SIZE]) for b in range(full)]
        hits = 0
        while hits < full and prefixes[hits] in cached:
            hits += 1
        missing.append(math.ceil(len(prompt) / cluster.BLOCK_SIZE) - hits)
        cached.update(prefixes)
    return missing


@dataclass
class Deployment:
    prefill: cluster.Server
    other_prefill: cluster.Server
    decode: cluster.Server
    router_1p1d: cluster.Server
    router_2p1d: cluster.Server
    model: str


@pytest.fixture(scope="module")
def deployment(tmp_path_factory) -> Iterator[Deployment]:
    model = str(tinymodels.build("llama"))
    logs = tmp_path_factory.mktemp("router")

    def instance(name: str, role: str, **kw: object) -> cluster.Server:
        port = str(cluster.free_port())
        return cluster.start_vllm(
            name,
            model,
            logs,
            kv_config=cluster.kv_transfer_config(role, **kw),
            env=cluster.base_env({"VLLM_NIXL_SIDE_CHANNEL_PORT": port}),
            dtype="float32",
        )

    prefill = instance("prefill-a", "kv_producer")
    other = instance("prefill-b", "kv_producer")
    decode = instance("decode", "kv_consumer", kv_load_failure_policy="recompute")
    servers = [prefill, other, decode]
    try:
        cluster.wait_ready(*servers)
        one = cluster.start_router([prefill.url], [decode.url], logs, "router-1p1d")
        servers.append(one)
        two = cluster.start_router([prefill.url, other.url], [decode.url], logs, "router-2p1d")
        servers.append(two)
        cluster.wait_ready(one, two)
        yield Deployment(prefill, other, decode, one, two, model)
    finally:
        for server in servers:
            server.stop()


@dataclass
class Served:
    answers: list[httpx.Response]
    blocks_moved: list[float]


def _serve(router: cluster.Server, decode: cluster.Server, prompts: list[list[int]]) -> Served:
    answers, moved = [], []
    before = cluster.settled_metric(decode.url, BYTES)
    for prompt in prompts:
        answer = cluster.complete(
            router.url, prompt, max_tokens=MAX_TOKENS, logprobs=5, return_tokens_as_token_ids=True
        )
        answers.append(answer)
        after = cluster.settled_metric(decode.url, BYTES)
        moved.append((after - before) / BLOCK_BYTES)
        before = after
    return Served(answers, moved)


@pytest.fixture(scope="module")
def served(deployment) -> dict[str, Served]:
    """1P1D's prompts, then 2P1D's, one after another (the decode instance's prefix cache holds
    the first set's blocks when the second comes)."""
    return {
        "1p1d": _serve(deployment.router_1p1d, deployment.decode, ONE_PREFILL),
        "2p1d": _serve(deployment.router_2p1d, deployment.decode, TWO_PREFILLS),
    }


def _completions(answers: list[httpx.Response]) -> list[dict]:
    """Each answer's tokens and top-5 logprobs per step keyed by token id (the form
    generation.assert_close compares; the requests asked for tokens rendered as ids)."""
    out = []
    for answer in answers:
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        steps = [
            {key.removeprefix("token_id:"): lp for key, lp in top.items()}
            for top in choice["logprobs"]["top_logprobs"]
        ]
        out.append({"tokens": choice["token_ids"], "logprobs": steps})
    return out


@pytest.mark.parametrize(("layout", "prompts"), [("1p1d", ONE_PREFILL), ("2p1d", TWO_PREFILLS)])
def test_behind_the_router_the_tokens_are_transformers(deployment, served, layout, prompts):
    ours = _completions(served[layout].answers)
    reference = hf_greedy(deployment.model, prompts, MAX_TOKENS)
    diverged = assert_close(ours, reference, f"{layout} behind vLLM's router vs transformers")
    assert diverged <= 1, f"{diverged} of {len(prompts)} prompts hit near-ties"


def test_the_decode_instance_pulls_the_prompt_blocks_missing_from_its_cache(deployment, served):
    expected = _blocks_missing(ONE_PREFILL + TWO_PREFILLS)
    moved = served["1p1d"].blocks_moved + served["2p1d"].blocks_moved
    assert moved == expected
    assert cluster.metric_sum(deployment.decode.url, FAILED) == 0
    assert max(expected) > 1 and sum(expected) < sum(
        math.ceil(len(p) / cluster.BLOCK_SIZE) for p in ONE_PREFILL + TWO_PREFILLS
    )


def test_the_2p1d_router_uses_both_prefill_instances(deployment, served):
    # vLLM's server names its answer after the request id the router gave it, which carries the
    # prefill instance's address.
    ids = [answer.json()["id"] for answer in served["2p1d"].answers]
    for server in (deployment.prefill, deployment.other_prefill):
        port = server.url.rsplit(":", 1)[1]
        assert any(f"prefill_addr_127.0.0.1:{port}_" in i for i in ids), (server.name, ids)


def test_a_killed_prefill_instance_is_taken_out_and_nothing_hangs(deployment, served):
    deployment.prefill.stop()
    started = time.monotonic()
    # In flight when the instance died: an answer (an error or, from the other instance, the
    # tokens), never a hang.
    first = cluster.complete(deployment.router_2p1d.url, AFTER_KILL[0], timeout=60)
    assert time.monotonic() - started < 60
    assert first.status_code in (200, 500, 502, 503), first.text
    # Once the router's health check has marked it, every request goes to the other instance.
    time.sleep(cluster.ROUTER_HEALTH_INTERVAL_S * (cluster.ROUTER_HEALTH_FAILURES + 2))
    answers = [
        cluster.complete(deployment.router_2p1d.url, prompt, timeout=60)
        for prompt in AFTER_KILL[1:]
    ]
    assert [a.status_code for a in answers] == [200] * len(answers), [a.text for a in answers]
    port = deployment.other_prefill.url.rsplit(":", 1)[1]
    assert all(f"prefill_addr_127.0.0.1:{port}_" in a.json()["id"] for a in answers)
    reference = hf_greedy(deployment.model, AFTER_KILL[1:], MAX_TOKENS)
    ours = [a.json()["choices"][0]["token_ids"] for a in answers]
    assert sum(o != r["tokens"] for o, r in zip(ours, reference, strict=True)) <= 1
