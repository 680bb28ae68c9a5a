"""Disaggregated prefill/decode on the HPU platform (CPU emulation) with real NIXL over loopback.

One deployment for the module: a prefill instance and a decode instance (vLLM servers with
HpuNixlConnector; NIXL's UCX backend moves their KV blocks) behind `vllm-gaudi proxy`. Both take
the path a Gaudi takes with kv_buffer_device "cpu": the emulated KV cache is device memory, the
prefill side copies prefilled blocks out of it into host staging buffers
(`swap_out_blocks_to_host`), NIXL moves the staging buffers, and the decode side copies the
received blocks into its KV cache (`insert_blocks_to_device`); the platform counts the bytes each
hook copied (`vllm:hpu_kv_staged_bytes_total`).

A single instance without a connector starts beside them, answers the reference prompts and is
stopped before the pair is used. A second pair runs an FP8 KV cache (fp8_inc) with 64-token
blocks: its decode instance also serves the refused-handshake test against the first prefill
instance, whose cache dtype and block size both differ (one deployment instead of more modules
starting their own pairs). A third pair moves blocks device to device (kv_buffer_device "hpu"),
the other path vLLM offers a Gaudi. Prompts are token ids, so their lengths (and the number of
blocks they fill) are exact. The tests run in file order: the last ones kill the prefill
instance.
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

from gaudi_testkit import tinymodels
from tests.connectors import cluster

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
# The second pair: an FP8 KV cache (1 byte per element) in 64-token blocks. Its decode instance
# is also the mismatched one for the first prefill instance (vLLM's defaults: auto, 128).
FP8_KV_CACHE_DTYPE = "fp8_inc"
FP8_BLOCK_SIZE = 64
FP8_BLOCK_BYTES = 2 * 2 * FP8_BLOCK_SIZE * 2 * 32 * 1
FAILED = "vllm:nixl_num_failed_transfers_total"
STAGED = "vllm:hpu_kv_staged_bytes_total"
USAGE = "vllm:kv_cache_usage_perc"
EXPIRED = "vllm:nixl_num_kv_expired_reqs_total"
RUNNING = "vllm:num_requests_running"
GENERATED = "vllm:generation_tokens_total"
LONG_ANSWER = 800  # tokens asked of the answer a client leaves after its first chunk


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


def _fp8_prompts() -> list[list[int]]:
    """Prompts of 64 k + 1 tokens for the FP8 pair: the decode instance computes the last prompt
    token over the k transferred full blocks, exactly as the prefill instance does when it
    answers the prompt again from its prefix cache. The second shares the first's first block."""
    rng = random.Random(13)
    first = _random_tokens(rng, FP8_BLOCK_SIZE + 1)
    second = first[:FP8_BLOCK_SIZE] + _random_tokens(rng, 2 * FP8_BLOCK_SIZE + 1)
    return [first, second, _random_tokens(rng, 5 * FP8_BLOCK_SIZE + 1)]


FP8_PROMPTS = _fp8_prompts()


def _prompt_blocks(prompts: list[list[int]], block_size: int = cluster.BLOCK_SIZE) -> list[int]:
    return [math.ceil(len(prompt) / block_size) for prompt in prompts]


def _blocks_missing(prompts: list[list[int]], block_size: int = cluster.BLOCK_SIZE) -> list[int]:
    """Blocks an instance must fill per prompt, in order (the prefill instance by computing
    them, the decode instance by pulling them): all of the prompt's blocks but the leading full
    ones an earlier prompt left in its prefix cache."""
    cached: set[tuple[int, ...]] = set()
    missing = []
    for prompt in prompts:
        blocks = math.ceil(len(prompt) / block_size)
        full = len(prompt) // block_size
        prefixes = [tuple(prompt[: (b + 1) * block_size]) for b in range(full)]
        hits = 0
        while hits < full and prefixes[hits] in cached:
            hits += 1
        missing.append(blocks - hits)
        cached.update(prefixes)
    return missing


def _complete(url: str, prompt: list[int], timeout: float = 120, **extra: object) -> httpx.Response:
    return cluster.complete(url, prompt, timeout=timeout, **{"max_tokens": MAX_TOKENS, **extra})


def _token_ids(answer: httpx.Response) -> list[int]:
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["token_ids"]


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
    fp8_prefill: cluster.Server  # FP8 KV cache, 64-token blocks
    fp8_decode: cluster.Server  # the same; its cache dtype and block size differ from prefill's
    direct_prefill: cluster.Server  # device to device: NIXL reads the KV cache itself
    direct_decode: cluster.Server
    reference: list[list[int]]  # the single instance's greedy token ids for PROMPTS
    reference_orphan: list[int]
    reference_after: list[int]


def _fp8_args() -> list[str]:
    return ["--kv-cache-dtype", FP8_KV_CACHE_DTYPE, "--block-size", str(FP8_BLOCK_SIZE)]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory) -> Iterator[Deployment]:
    model = str(tinymodels.build("llama"))
    logs = tmp_path_factory.mktemp("1p1d")
    extra = {"kv_connector_extra_config": {"kv_lease_duration": LEASE_S}}

    def instance(name: str, role: str, env: dict[str, str] | None = None, **kw) -> cluster.Server:
        """A vLLM server with HpuNixlConnector as `role`, on its own side-channel port; `kw`:
        --kv-transfer-config fields, and `extra_args` for the command line."""
        args = kw.pop("extra_args", None)
        return cluster.start_vllm(
            name,
            model,
            logs,
            kv_config=cluster.kv_transfer_config(role, **kw),
            env=cluster.base_env(
                {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(cluster.free_port()), **(env or {})}
            ),
            dtype=DTYPE,
            extra_args=args,
        )

    single = cluster.start_vllm("single", model, logs, dtype=DTYPE)
    prefill = instance("prefill", "kv_producer", **extra)
    decode = instance("decode", "kv_consumer", kv_load_failure_policy="recompute", **extra)
    fp8_prefill = instance("fp8-prefill", "kv_producer", extra_args=_fp8_args())
    # vLLM's default kv_load_failure_policy ("fail"): a refused handshake fails the request.
    fp8_decode = instance("fp8-decode", "kv_consumer", extra_args=_fp8_args())
    direct = {"VLLM_NIXL_DEVICE_TO_DEVICE": "true"}
    direct_prefill = instance("direct-prefill", "kv_producer", direct, kv_buffer_device="hpu")
    direct_decode = instance("direct-decode", "kv_consumer", direct, kv_buffer_device="hpu")
    proxy = cluster.start_proxy([prefill.url], [decode.url], logs, PROXY_TIMEOUT_S)
    pairs = [prefill, decode, fp8_prefill, fp8_decode, direct_prefill, direct_decode]
    servers = [single, *pairs, proxy]
    try:
        # The reference is taken while the pairs are still starting, and the single instance is
        # stopped before the pairs serve.
        cluster.wait_ready(single)
        reference = [_token_ids(_complete(single.url, p)) for p in [*PROMPTS, ORPHAN, AFTER]]
        single.stop()
        cluster.wait_ready(*pairs, proxy)
        yield Deployment(
            prefill,
            decode,
            proxy,
            fp8_prefill,
            fp8_decode,
            direct_prefill,
            direct_decode,
            reference[:-2],
            *reference[-2:],
        )
    finally:
        for server in servers:
            server.stop()


@dataclass
class Run:
    outputs: list[list[int]]
    blocks_moved: list[float]  # per prompt, from the decode instance's NIXL byte count
    blocks_staged_out: list[float]  # per prompt, copied out of the prefill instance's KV cache
    blocks_staged_in: list[float]  # per prompt, copied into the decode instance's KV cache
    failed_transfers: float


def _counters(prefill: cluster.Server, decode: cluster.Server) -> tuple[float, float, float]:
    """Bytes so far: NIXL moved to the decode instance, staged out of the prefill instance's KV
    cache, staged into the decode instance's."""
    return (
        cluster.settled_metric(decode.url, BYTES),
        cluster.settled_metric(prefill.url, STAGED, direction="to_host"),
        cluster.settled_metric(decode.url, STAGED, direction="to_device"),
    )


def _blocks(before: tuple[float, ...], after: tuple[float, ...], block_bytes: int) -> list[float]:
    """Each counter's growth from `before` to `after`, in KV blocks."""
    return [(a - b) / block_bytes for b, a in zip(before, after)]


@pytest.fixture(scope="module")
def disaggregated(deployment: Deployment) -> Run:
    """The 16 prompts through the proxy, one after another."""
    prefill, decode = deployment.prefill, deployment.decode
    outputs, moved, staged_out, staged_in = [], [], [], []
    before = _counters(prefill, decode)
    for prompt in PROMPTS:
        outputs.append(_token_ids(_complete(deployment.proxy.url, prompt)))
        after = _counters(prefill, decode)
        for blocks, total in zip(
            _blocks(before, after, BLOCK_BYTES), (moved, staged_out, staged_in)
        ):
            total.append(blocks)
        before = after
    return Run(outputs, moved, staged_out, staged_in, cluster.metric_sum(decode.url, FAILED))


def test_disaggregated_outputs_equal_a_single_instance(deployment, disaggregated):
    differ = [
        (i, ours, ref)
        for i, (ours, ref) in enumerate(zip(disaggregated.outputs, deployment.reference))
        if ours != ref
    ]
    assert not differ, f"(prompt, 1P1D tokens, single-instance tokens): {differ}"


def test_blocks_moved_are_the_prompt_blocks_missing_from_the_decode_prefix_cache(disaggregated):
    expected = _blocks_missing(PROMPTS)

    assert disaggregated.failed_transfers == 0
    assert disaggregated.blocks_moved == expected
    # The prompts did exercise both cases: blocks found locally, and prompts over one block.
    assert sum(expected) < sum(math.ceil(len(p) / cluster.BLOCK_SIZE) for p in PROMPTS)
    assert max(expected) > 1


def test_host_staging_copied_exactly_the_transferred_blocks_both_ways(deployment, disaggregated):
    """The prefill instance copied each prompt's blocks out of its KV cache into the staging
    buffers (all of them: vLLM saves every block of a new request, the prefix-cached ones
    again too), and the decode instance copied exactly the blocks NIXL brought into its KV
    cache; neither side staged anything else."""
    assert disaggregated.blocks_staged_out == _prompt_blocks(PROMPTS)
    assert disaggregated.blocks_staged_in == _blocks_missing(PROMPTS)
    assert cluster.metric_sum(deployment.prefill.url, STAGED, direction="to_device") == 0
    assert cluster.metric_sum(deployment.decode.url, STAGED, direction="to_host") == 0
    for server in (deployment.prefill, deployment.decode):
        assert "use_host_buffer: True" in server.log.read_text(errors="replace")


def _logprobs(answer: httpx.Response) -> list[float]:
    return answer.json()["choices"][0]["logprobs"]["token_logprobs"]


def test_an_fp8_kv_cache_goes_through_host_staging_unchanged(deployment):
    """The FP8 pair: its 1-byte KV blocks are staged out, moved and staged in block for block,
    and the decode instance, computing the last prompt token over the received blocks, answers
    what the prefill instance answers over its own cached blocks: the same tokens and
    log-probabilities (a staged block with a wrong byte would change them)."""
    prefill, decode = deployment.fp8_prefill, deployment.fp8_decode
    expected = _blocks_missing(FP8_PROMPTS, FP8_BLOCK_SIZE)
    moved, out, into, differ = [], [], [], []
    before = _counters(prefill, decode)
    for prompt in FP8_PROMPTS:
        params = _prefill_only(prefill, prompt)
        ours = _complete(decode.url, prompt, kv_transfer_params=params, logprobs=1)
        after = _counters(prefill, decode)
        for blocks, total in zip(_blocks(before, after, FP8_BLOCK_BYTES), (moved, out, into)):
            total.append(blocks)
        before = after
        reference = _complete(prefill.url, prompt, logprobs=1)
        if _token_ids(ours) != _token_ids(reference) or not all(
            math.isclose(a, b, abs_tol=1e-4) for a, b in zip(_logprobs(ours), _logprobs(reference))
        ):
            differ.append((len(prompt), _token_ids(ours), _token_ids(reference)))

    assert (moved, into) == (expected, expected)
    assert out == _prompt_blocks(FP8_PROMPTS, FP8_BLOCK_SIZE)
    assert not differ, f"(prompt length, 1P1D tokens, prefill instance tokens): {differ}"
    assert cluster.metric_sum(decode.url, FAILED) == 0


HANDSHAKE_TIMEOUT = "handshake_setup_failed"  # vLLM's log of a handshake without an answer


def _disaggregated_once_more_after_a_handshake_timeout(
    prefill: cluster.Server, decode: cluster.Server, prompt: list[int]
) -> httpx.Response:
    """Prefill `prompt` on `prefill`, then complete it on `decode` from the transferred blocks.

    vLLM waits 5 s (fixed) for a remote instance's handshake answer; once in three runs on a
    2-core machine serving eight instances, the device-to-device pair's first handshake got none
    in time and the request failed (nothing was moved). That one case is tried once more, after
    a fresh prefill; anything else fails the test."""
    log_before = len(decode.log.read_text(errors="replace"))
    params = _prefill_only(prefill, prompt)
    answer = _complete(decode.url, prompt, kv_transfer_params=params)
    if (
        answer.status_code == 500
        and HANDSHAKE_TIMEOUT in decode.log.read_text(errors="replace")[log_before:]
    ):
        params = _prefill_only(prefill, prompt)
        answer = _complete(decode.url, prompt, kv_transfer_params=params)
    return answer


def test_device_to_device_moves_the_kv_cache_without_staging(deployment):
    """kv_buffer_device "hpu" with VLLM_NIXL_DEVICE_TO_DEVICE=true, the path vLLM offers a Gaudi
    besides host staging: NIXL reads the prefill instance's KV cache straight into the decode
    instance's (registered as host DRAM in emulation, Gaudi HBM on a Gaudi). The same blocks
    move, nothing is staged, and the answers are the single instance's."""
    prefill, decode = deployment.direct_prefill, deployment.direct_decode
    prompts = PROMPTS[:4]
    outputs, moved = [], []
    before = cluster.settled_metric(decode.url, BYTES)
    for prompt in prompts:
        outputs.append(
            _token_ids(_disaggregated_once_more_after_a_handshake_timeout(prefill, decode, prompt))
        )
        after = cluster.settled_metric(decode.url, BYTES)
        moved.append((after - before) / BLOCK_BYTES)
        before = after

    assert outputs == deployment.reference[: len(prompts)]
    assert moved == _blocks_missing(prompts)
    assert cluster.metric_sum(prefill.url, STAGED) == 0
    assert cluster.metric_sum(decode.url, STAGED) == 0
    for server in (prefill, decode):
        assert "use_host_buffer: False" in server.log.read_text(errors="replace")


def test_prefill_frees_blocks_no_decode_reads_after_the_lease(deployment):
    prefill = deployment.prefill
    expired = cluster.metric_sum(prefill.url, EXPIRED)
    _prefill_only(prefill, _random_tokens(random.Random(3), 500))
    # Held for the decode instance: seen well inside the lease.
    cluster.metric_reaches(prefill.url, USAGE, lambda usage: usage > 0, within=LEASE_S / 2)
    # Freed once the lease runs out, with no decode instance reading them.
    cluster.metric_reaches(prefill.url, USAGE, lambda usage: usage == 0, within=LEASE_S + 20)
    cluster.metric_reaches(prefill.url, EXPIRED, lambda count: count == expired + 1, within=5)


def test_an_oversize_prompt_gets_the_instances_own_400_through_the_proxy(deployment):
    # A client's mistake reads as one: the prefill instance's status and message, not an outage,
    # and neither instance holds a block for it.
    answer = _complete(deployment.proxy.url, _random_tokens(random.Random(4), 1100))

    assert answer.status_code == 400, answer.text
    assert "1100" in answer.text  # vLLM names the prompt's length
    for server in (deployment.prefill, deployment.decode):
        cluster.metric_reaches(server.url, USAGE, lambda usage: usage == 0, within=5)


def test_a_client_that_leaves_mid_stream_leaves_no_block_held(deployment):
    """A streamed answer through the proxy, dropped by its client after the first chunk: the
    proxy closes its decode request, the decode instance aborts it, and every block on both
    instances is free again (the prefill instance's once the decode instance read them)."""
    decode = deployment.decode
    generated = cluster.metric_sum(decode.url, GENERATED)
    body = {
        "model": "m",
        "prompt": _random_tokens(random.Random(5), 200),
        "max_tokens": LONG_ANSWER,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(trust_env=False, timeout=60) as client,
        client.stream("POST", deployment.proxy.url + "/v1/completions", json=body) as stream,
    ):
        assert stream.status_code == 200
        first = next(stream.iter_bytes())
        assert first.startswith(b"data:"), first
    cluster.metric_reaches(decode.url, RUNNING, lambda running: running == 0, within=30)
    for server in (deployment.prefill, decode):
        cluster.metric_reaches(server.url, USAGE, lambda usage: usage == 0, within=LEASE_S + 20)
    # Stopped, not run to its end: the decode instance generated far fewer than it was asked.
    assert cluster.settled_metric(decode.url, GENERATED) - generated < LONG_ANSWER / 2


def test_handshake_with_another_cache_dtype_and_block_size_is_refused_naming_both(deployment):
    """vLLM refuses a different KV cache dtype naming two compatibility hashes, and a different
    block size through host staging on a bare assert; HpuNixlConnector compares the fields
    first and names each differing one with both values. The request fails (the instance runs
    vLLM's default kv_load_failure_policy, "fail") with an HTTP 500 instead of hanging, and the
    instance keeps serving."""
    mismatched = deployment.fp8_decode
    prompt = _random_tokens(random.Random(5), 200)
    params = _prefill_only(deployment.prefill, prompt)

    started = time.monotonic()
    answer = _complete(mismatched.url, prompt, kv_transfer_params=params)
    elapsed = time.monotonic() - started

    assert answer.status_code == 500, answer.text
    assert elapsed < 30
    log = mismatched.log.read_text(errors="replace")
    assert "NIXL handshake with the instance at" in log, mismatched.log_tail()
    for difference in (
        f"cache_dtype: local {FP8_KV_CACHE_DTYPE}, remote auto",
        f"block_size: local {FP8_BLOCK_SIZE}, remote {cluster.BLOCK_SIZE}",
    ):
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
    assert (
        cluster.settled_metric(decode.url, FAILED) > failed
    )  # the blocks were not read: recomputed
    assert _token_ids(_complete(decode.url, AFTER)) == deployment.reference_after


def test_proxy_answers_502_when_the_prefill_instance_is_gone(deployment):
    started = time.monotonic()
    answer = _complete(deployment.proxy.url, PROMPTS[0])

    assert answer.status_code == 502
    assert "prefill instance" in answer.json()["error"]["message"]
    assert time.monotonic() - started < PROXY_TIMEOUT_S
