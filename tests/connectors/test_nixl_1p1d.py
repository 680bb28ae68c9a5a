"""Disaggregated prefill/decode on the HPU platform (CPU emulation) with real NIXL over loopback.

One deployment for the module: a prefill instance and a decode instance (vLLM servers with
HpuNixlConnector; NIXL's UCX backend moves their host-memory KV blocks) behind `vllm-gaudi
proxy`. A single instance without a connector starts beside them, answers the reference prompts
and is stopped before the pair is used. A second decode instance with another KV cache dtype
(fp8_inc) starts with them too, for the refused-handshake test against the same prefill instance
(one deployment instead of a second module starting its own pair). Prompts are token ids, so their
lengths (and the number of 128-token blocks they fill) are exact. The tests run in file order: the
last ones kill the prefill instance.
"""

from __future__ import annotations

import math
import random
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.connectors import cluster
from vllm_gaudi_platform.testing import tinymodels

pytestmark = pytest.mark.engine

MAX_TOKENS = 8
# How long a prefill instance keeps blocks that no decode instance has read (vLLM 0.32's
# kv_connector_extra_config.kv_lease_duration; a waiting decode instance renews it).
LEASE_S = 10
PROXY_TIMEOUT_S = 60
# float32, not bfloat16: the decode instance recomputes the last prompt token over the
# transferred KV (a 1-token step with context) where the single instance computes the whole
# prompt at once; in bfloat16 that rounding difference flips near-tied greedy tokens.
DTYPE = "float32"
# Tiny Llama: 2 layers x (key + value) x 128 token slots x 2 KV heads x 32 dims x 4 bytes.
BLOCK_BYTES = 2 * 2 * cluster.BLOCK_SIZE * 2 * 32 * 4
BYTES = "vllm:nixl_bytes_transferred_sum"
# The mismatched decode instance's KV cache dtype; the prefill instance keeps vLLM's default.
MISMATCHED_KV_CACHE_DTYPE = "fp8_inc"
FAILED = "vllm:nixl_num_failed_transfers_total"


def _random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 250) for _ in range(n)]


def _prompts() -> list[list[int]]:
    """16 prompts of 40 to 700 tokens; every second one starts with the same 200 tokens, so
    several share their first block and four are identical."""
    rng = random.Random(7)
    shared = _random_tokens(rng, 200)
    prompts = []
    for i in range(16):
        length = [40, 130, 300, 700][i % 4]
        own = _random_tokens(rng, length)
        prompts.append((shared + own)[:length] if i % 2 else own)
    return prompts


PROMPTS = _prompts()
# Fresh prompts for the prefill-killed test: nothing of them is cached on the decode side.
ORPHAN = _random_tokens(random.Random(11), 600)
AFTER = _random_tokens(random.Random(12), 300)


def _blocks_missing_on_decode(prompts: list[list[int]]) -> list[int]:
    """Blocks the decode instance must pull per prompt, in order: all of the prompt's blocks
    but the leading full ones an earlier prompt left in its prefix cache."""
    cached: set[tuple[int, ...]] = set()
    missing = []
    for prompt in prompts:
        blocks = math.ceil(len(prompt) / cluster.BLOCK_SIZE)
        full = len(prompt) // cluster.BLOCK_SIZE
        prefixes = [tuple(prompt[: (b + 1) * cluster.BLOCK_SIZE]) for b in range(full)]
        hits = 0
        while hits < full and prefixes[hits] in cached:
            hits += 1
        missing.append(blocks - hits)
        cached.update(prefixes)
    return missing


def _complete(url: str, prompt: list[int], timeout: float = 120, **extra: object) -> httpx.Response:
    body = {
        "model": "m",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
        **extra,
    }
    return httpx.post(url + "/v1/completions", json=body, timeout=timeout, trust_env=False)


def _token_ids(answer: httpx.Response) -> list[int]:
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["token_ids"]


def _settled(url: str, name: str) -> float:
    """A metric once two reads in a row agree (the engine reports transfer stats a step late)."""
    value = cluster.metric_sum(url, name)
    while True:
        time.sleep(0.3)
        again = cluster.metric_sum(url, name)
        if again == value:
            return value
        value = again


def _prefill_only(prefill: cluster.Server, prompt: list[int]) -> dict:
    """What the proxy's first leg does: prefill `prompt`, keep its blocks for a remote decode."""
    answer = _complete(
        prefill.url, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )
    assert answer.status_code == 200, answer.text
    params = answer.json()["kv_transfer_params"]
    assert params and params["remote_block_ids"], answer.text
    return params


@dataclass
class Deployment:
    prefill: cluster.Server
    decode: cluster.Server
    proxy: cluster.Server
    mismatched: cluster.Server  # decode instance whose KV cache dtype differs from prefill's
    reference: list[list[int]]  # the single instance's greedy token ids for PROMPTS
    reference_orphan: list[int]
    reference_after: list[int]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory) -> Iterator[Deployment]:
    model = str(tinymodels.build("llama"))
    logs = tmp_path_factory.mktemp("1p1d")
    extra = {"kv_connector_extra_config": {"kv_lease_duration": LEASE_S}}
    single = cluster.start_vllm("single", model, logs, dtype=DTYPE)
    prefill = cluster.start_vllm(
        "prefill",
        model,
        logs,
        kv_config=cluster.kv_transfer_config("kv_producer", **extra),
        env=cluster.base_env({"VLLM_NIXL_SIDE_CHANNEL_PORT": str(cluster.free_port())}),
        dtype=DTYPE,
    )
    decode = cluster.start_vllm(
        "decode",
        model,
        logs,
        kv_config=cluster.kv_transfer_config(
            "kv_consumer", kv_load_failure_policy="recompute", **extra
        ),
        env=cluster.base_env({"VLLM_NIXL_SIDE_CHANNEL_PORT": str(cluster.free_port())}),
        dtype=DTYPE,
    )
    # vLLM's default kv_load_failure_policy ("fail"): a refused handshake fails the request.
    mismatched = cluster.start_vllm(
        "mismatched-decode",
        model,
        logs,
        kv_config=cluster.kv_transfer_config("kv_consumer"),
        env=cluster.base_env({"VLLM_NIXL_SIDE_CHANNEL_PORT": str(cluster.free_port())}),
        dtype=DTYPE,
        extra_args=["--kv-cache-dtype", MISMATCHED_KV_CACHE_DTYPE],
    )
    proxy = cluster.start_proxy([prefill.url], [decode.url], logs, PROXY_TIMEOUT_S)
    servers = [single, prefill, decode, mismatched, proxy]
    try:
        # The reference is taken while the pair is still starting, and the single instance is
        # stopped before the pair serves.
        cluster.wait_ready(single)
        reference = [_token_ids(_complete(single.url, p)) for p in [*PROMPTS, ORPHAN, AFTER]]
        single.stop()
        cluster.wait_ready(prefill, decode, proxy, mismatched)
        yield Deployment(prefill, decode, proxy, mismatched, reference[:-2], *reference[-2:])
    finally:
        for server in servers:
            server.stop()


@dataclass
class Run:
    outputs: list[list[int]]
    blocks_moved: list[float]  # per prompt, from the decode instance's NIXL byte count
    failed_transfers: float


@pytest.fixture(scope="module")
def disaggregated(deployment: Deployment) -> Run:
    """The 16 prompts through the proxy, one after another."""
    decode = deployment.decode
    outputs, moved = [], []
    before = _settled(decode.url, BYTES)
    for prompt in PROMPTS:
        outputs.append(_token_ids(_complete(deployment.proxy.url, prompt)))
        after = _settled(decode.url, BYTES)
        moved.append((after - before) / BLOCK_BYTES)
        before = after
    return Run(outputs, moved, cluster.metric_sum(decode.url, FAILED))


def test_disaggregated_outputs_equal_a_single_instance(deployment, disaggregated):
    differ = [
        (i, ours, ref)
        for i, (ours, ref) in enumerate(zip(disaggregated.outputs, deployment.reference))
        if ours != ref
    ]
    assert not differ, f"(prompt, 1P1D tokens, single-instance tokens): {differ}"


def test_blocks_moved_are_the_prompt_blocks_missing_from_the_decode_prefix_cache(disaggregated):
    expected = _blocks_missing_on_decode(PROMPTS)

    assert disaggregated.failed_transfers == 0
    assert disaggregated.blocks_moved == expected
    # The prompts did exercise both cases: blocks found locally, and prompts over one block.
    assert sum(expected) < sum(math.ceil(len(p) / cluster.BLOCK_SIZE) for p in PROMPTS)
    assert max(expected) > 1


def test_prefill_frees_blocks_no_decode_reads_after_the_lease(deployment):
    prefill = deployment.prefill
    expired = cluster.metric_sum(prefill.url, "vllm:nixl_num_kv_expired_reqs_total")
    _prefill_only(prefill, _random_tokens(random.Random(3), 500))
    assert cluster.metric_sum(prefill.url, "vllm:kv_cache_usage_perc") > 0

    deadline = time.monotonic() + LEASE_S + 20
    while cluster.metric_sum(prefill.url, "vllm:kv_cache_usage_perc") > 0:
        assert time.monotonic() < deadline, "prefill blocks still held long after the lease"
        time.sleep(0.5)
    assert cluster.metric_sum(prefill.url, "vllm:nixl_num_kv_expired_reqs_total") == expired + 1


def test_handshake_with_another_kv_cache_dtype_is_refused_naming_both_values(deployment):
    """vLLM refuses the handshake naming two compatibility hashes; HpuNixlConnector compares the
    fields first and names the differing one with both values. The request fails (the instance
    runs vLLM's default kv_load_failure_policy, "fail") with an HTTP 500 instead of hanging, and
    the instance keeps serving."""
    mismatched = deployment.mismatched
    prompt = _random_tokens(random.Random(5), 200)
    params = _prefill_only(deployment.prefill, prompt)

    started = time.monotonic()
    answer = _complete(mismatched.url, prompt, kv_transfer_params=params)
    elapsed = time.monotonic() - started

    assert answer.status_code == 500, answer.text
    assert elapsed < 30
    log = mismatched.log.read_text(errors="replace")
    assert "NIXL handshake with the instance at" in log, mismatched.log_tail()
    difference = f"cache_dtype: local {MISMATCHED_KV_CACHE_DTYPE}, remote auto"
    assert difference in log, mismatched.log_tail()
    assert _complete(mismatched.url, prompt).status_code == 200  # still serving


def test_decode_recomputes_a_request_whose_prefill_instance_died(deployment):
    """Kills the prefill instance (later tests rely on it): the decode instance, configured with
    kv_load_failure_policy=recompute, computes the orphaned prompt itself within a bounded time,
    gives the single instance's answer, and then serves a new request."""
    prefill, decode = deployment.prefill, deployment.decode
    params = _prefill_only(prefill, ORPHAN)
    failed = cluster.metric_sum(decode.url, FAILED)
    prefill.stop(signal.SIGKILL)

    started = time.monotonic()
    orphan = _complete(decode.url, ORPHAN, timeout=LEASE_S + 60, kv_transfer_params=params)
    elapsed = time.monotonic() - started

    assert _token_ids(orphan) == deployment.reference_orphan
    assert elapsed < 30
    assert _settled(decode.url, FAILED) > failed  # the blocks were not read: recomputed
    assert _token_ids(_complete(decode.url, AFTER)) == deployment.reference_after


def test_proxy_answers_502_when_the_prefill_instance_is_gone(deployment):
    started = time.monotonic()
    answer = _complete(deployment.proxy.url, PROMPTS[0])

    assert answer.status_code == 502
    assert "prefill instance" in answer.json()["error"]["message"]
    assert time.monotonic() - started < PROXY_TIMEOUT_S
