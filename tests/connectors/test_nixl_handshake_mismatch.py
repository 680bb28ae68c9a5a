"""A decode instance whose prefill instance has another KV cache dtype (CPU emulation, real NIXL).

vLLM refuses the handshake naming two compatibility hashes; HpuNixlConnector compares the fields
first and names the differing one with both values. The request fails (the decode instance runs
vLLM's default kv_load_failure_policy, "fail") with an HTTP 500 instead of hanging, and the
decode instance keeps serving.
"""

from __future__ import annotations

import random
import time

import httpx
import pytest

from tests.connectors import cluster
from vllm_gaudi_platform import tinymodels

pytestmark = pytest.mark.engine

PREFILL_KV_CACHE_DTYPE = "fp8_inc"
PROMPT = [random.Random(5).randrange(10, 250) for _ in range(200)]
DIFFERENCE = f"cache_dtype: local auto, remote {PREFILL_KV_CACHE_DTYPE}"


def _complete(url: str, **extra: object) -> httpx.Response:
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, **extra}
    return httpx.post(url + "/v1/completions", json=body, timeout=120, trust_env=False)


def test_handshake_with_another_kv_cache_dtype_is_refused_naming_both_values(tmp_path):
    model = str(tinymodels.build("llama"))
    prefill = cluster.start_vllm(
        "prefill",
        model,
        tmp_path,
        kv_config=cluster.kv_transfer_config("kv_producer"),
        env=cluster.base_env({"VLLM_NIXL_SIDE_CHANNEL_PORT": str(cluster.free_port())}),
        extra_args=["--kv-cache-dtype", PREFILL_KV_CACHE_DTYPE],
    )
    decode = cluster.start_vllm(
        "decode",
        model,
        tmp_path,
        kv_config=cluster.kv_transfer_config("kv_consumer"),
        env=cluster.base_env({"VLLM_NIXL_SIDE_CHANNEL_PORT": str(cluster.free_port())}),
    )
    try:
        cluster.wait_ready(prefill, decode)
        first = _complete(prefill.url, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        assert first.status_code == 200, first.text
        params = first.json()["kv_transfer_params"]

        started = time.monotonic()
        answer = _complete(decode.url, kv_transfer_params=params)
        elapsed = time.monotonic() - started

        assert answer.status_code == 500, answer.text
        assert elapsed < 30
        log = decode.log.read_text(errors="replace")
        assert "NIXL handshake with the instance at" in log, decode.log_tail()
        assert DIFFERENCE in log, decode.log_tail()
        assert _complete(decode.url).status_code == 200  # still serving
    finally:
        decode.stop()
        prefill.stop()
