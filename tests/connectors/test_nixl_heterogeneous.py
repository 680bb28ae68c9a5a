"""Prefill on the HPU platform, decode on vLLM's own CPU backend, through NIXL (real NIXL over
loopback, UCX backend), and the reverse refused by name.

Two instances, each both producer and consumer (`kv_both`), float32, 128-token blocks:
- `hpu`: the HPU platform in CPU emulation with `HpuNixlConnector`, host staging
  (`kv_buffer_device` "cpu") and vLLM's `enable_permute_local_kv`, which makes its staging buffers
  head-major (LBHNC): the order the CPU backend's KV cache takes its blocks in, so NIXL moves
  them as they are. `kv_load_failure_policy` "recompute".
- `cpu`: vLLM's CPU platform (no `VLLM_HPU_EMULATION`: the HPU platform plugin stands aside) with
  vLLM's `NixlConnector`, which reads the blocks straight into its KV cache and converts them to
  its attention kernel's order (vLLM's heterogeneous-attention post-processing). The two
  platforms' attention backends differ, so vLLM's compatibility hash does too and is switched off
  (`enforce_handshake_compat: false`); the checks that remain are the layout and block bytes
  (vLLM's, on the CPU side) and ours on the HPU side.

HPU prefill with CPU decode generates what transformers does, with every prompt block moved by
NIXL (after one warm-up request, sent again if it met vLLM's 5 s handshake deadline, which a
loaded 2-core machine can miss). CPU prefill with HPU decode cannot work (the CPU backend's
cache holds its kernel's packed blocks, which vLLM converts only on receipt by a CPU instance):
the HPU instance refuses the handshake naming the CPU backend, and recomputes the prompts, with
the same tokens.
"""

from __future__ import annotations

import json
import math
import random
import signal
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from gaudi_testkit import tinymodels
from tests.connectors import cluster
from tests.integration.generation import hf_greedy
from tests.vllm_build import needs_vllm_cpu_backend

pytestmark = [pytest.mark.engine, needs_vllm_cpu_backend]

MAX_TOKENS = 8
DTYPE = "float32"  # as the 1P1D module: bf16 rounding flips near-tied greedy tokens
# Tiny Llama: 2 layers x (key + value) x 128 token slots x 2 KV heads x 32 dims x 4 bytes.
BLOCK_BYTES = 2 * 2 * cluster.BLOCK_SIZE * 2 * 32 * 4
BYTES = "vllm:nixl_bytes_transferred_sum"
STAGED = "vllm:hpu_kv_staged_bytes_total"


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 250) for _ in range(n)] for n in (40, 130, 300, 700)]


HPU_TO_CPU = _prompts(0)
CPU_TO_HPU = _prompts(1)


@dataclass
class Pair:
    hpu: cluster.Server
    cpu: cluster.Server
    hpu_to_cpu: cluster.Server  # proxy: prefill on hpu, decode on cpu
    cpu_to_hpu: cluster.Server  # proxy: prefill on cpu, decode on hpu
    reference: list[list[int]]  # transformers' greedy tokens, HPU_TO_CPU then CPU_TO_HPU


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Iterator[Pair]:
    model = str(tinymodels.build("llama"))
    logs = tmp_path_factory.mktemp("hetero")
    hpu_config = cluster.kv_transfer_config(
        "kv_both", enable_permute_local_kv=True, kv_load_failure_policy="recompute"
    )
    cpu_config = json.dumps(
        {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_both",
            "kv_buffer_device": "cpu",
            "kv_connector_extra_config": {"enforce_handshake_compat": False},
        }
    )
    side_channel = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(cluster.free_port())}
    # One unbound OpenMP thread that sleeps when idle: vLLM's CPU backend otherwise binds its
    # threads to the cores and spins on them, and on a 2-core machine the HPU instance's
    # handshake listener then misses the CPU instance's 5 s handshake deadline.
    cpu_env = cluster.base_env(
        {
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(cluster.free_port()),
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": "1",
            "OMP_WAIT_POLICY": "PASSIVE",
        }
    )
    del cpu_env["VLLM_HPU_EMULATION"]
    hpu = cluster.start_vllm(
        "hpu", model, logs, kv_config=hpu_config, env=cluster.base_env(side_channel), dtype=DTYPE
    )
    cpu = cluster.start_vllm(
        "cpu",
        model,
        logs,
        kv_config=cpu_config,
        env=cpu_env,
        dtype=DTYPE,
        # Eager: vLLM's CPU backend would compile the model at start (half a minute here).
        extra_args=["--block-size", str(cluster.BLOCK_SIZE), "--enforce-eager"],
        # vLLM's NixlConnector keeps NIXL's progress thread polling without pause (the HPU
        # instance's wait setting is ours): lowered, that thread takes only what the other test
        # worker leaves idle.
        nice=10,
    )
    proxies = []
    for name, prefill, decode in (("hpu-to-cpu", hpu, cpu), ("cpu-to-hpu", cpu, hpu)):
        (logs / name).mkdir()
        proxies.append(cluster.start_proxy([prefill.url], [decode.url], logs / name, 60))
    servers = [hpu, cpu, *proxies]
    try:
        # transformers' tokens while the servers start
        reference = hf_greedy(model, HPU_TO_CPU + CPU_TO_HPU, MAX_TOKENS)
        cluster.wait_ready(*servers)
        yield Pair(hpu, cpu, *proxies, reference=[r["tokens"] for r in reference])
    finally:
        for server in servers:
            server.stop(signal.SIGKILL)  # nothing to shut down gracefully


def _answer(proxy: cluster.Server, prompt: list[int]) -> httpx.Response:
    return cluster.complete(proxy.url, prompt, max_tokens=MAX_TOKENS, timeout=180)


def _generate(proxy: cluster.Server, prompts: list[list[int]]) -> list[list[int]]:
    tokens = []
    for prompt in prompts:
        answer = _answer(proxy, prompt)
        assert answer.status_code == 200, answer.text
        tokens.append(answer.json()["choices"][0]["token_ids"])
    return tokens


# A first request hands the pair's first blocks over, and makes the decode side handshake.
WARMUP = [7] * 40
WARMUP_ATTEMPTS = 3


def _handshake(proxy: cluster.Server, decode: cluster.Server) -> None:
    """Answer WARMUP through the pair, again if vLLM's handshake deadline passed: the decode side
    gives its prefill peer 5 s (hard-coded in vLLM) to answer the handshake, which a loaded
    2-core machine can miss; the next request handshakes again."""
    for _ in range(WARMUP_ATTEMPTS):
        answer = _answer(proxy, WARMUP)
        if answer.status_code == 200:
            return
    pytest.fail(f"no answer through the pair: {answer.text}\n{decode.log_tail()}")


def test_hpu_prefill_with_cpu_backend_decode_generates_what_transformers_does(pair):
    _handshake(pair.hpu_to_cpu, pair.cpu)
    read = cluster.settled_metric(pair.cpu.url, BYTES)
    staged = cluster.settled_metric(pair.hpu.url, STAGED, direction="to_host")
    assert _generate(pair.hpu_to_cpu, HPU_TO_CPU) == pair.reference[: len(HPU_TO_CPU)]
    # Every block of every prompt staged out of the HPU cache and read by the CPU instance.
    moved = sum(math.ceil(len(p) / cluster.BLOCK_SIZE) for p in HPU_TO_CPU) * BLOCK_BYTES
    assert cluster.settled_metric(pair.cpu.url, BYTES) - read == moved
    assert cluster.settled_metric(pair.hpu.url, STAGED, direction="to_host") - staged == moved


def test_cpu_backend_prefill_is_refused_by_name_and_the_hpu_recomputes(pair):
    assert _generate(pair.cpu_to_hpu, CPU_TO_HPU) == pair.reference[len(HPU_TO_CPU) :]
    log = pair.hpu.log_tail(200_000)
    assert "refused: it runs vLLM's CPU attention backend (CPU_ATTN)" in log
    # Nothing was read from the CPU instance.
    assert cluster.settled_metric(pair.hpu.url, BYTES) == 0
    assert cluster.settled_metric(pair.hpu.url, STAGED, direction="to_device") == 0
