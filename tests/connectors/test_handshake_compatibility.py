"""HpuNixlConnector's handshake compatibility check: which fields it compares, what it says.

The worker-side check runs against vLLM's own handshake listener (its side-channel thread), so the
query follows vLLM's protocol; no engine is started.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import msgspec
import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import (
    NixlBaseConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlAgentMetadata,
    NixlHandshakePayload,
)

from tests.connectors import cluster
from vllm_gaudi_connectors.nixl import (
    BLOCK_SIZE_FIELD,
    HASHED_FIELDS,
    HpuNixlConnectorWorker,
    HpuNixlHandshakePayload,
    check_handshake_compatibility,
    compatibility_differences,
)

LOCAL = {
    "vllm_version": "0.32.0",
    "model": "/models/llama",
    "dtype": "torch.bfloat16",
    "cache_dtype": "auto",
    "block_size": "128",
}


def _remote(**changes: str) -> dict[str, str]:
    return {**LOCAL, **changes}


def test_each_differing_field_is_named_with_the_local_and_the_remote_value():
    remote = _remote(cache_dtype="fp8_inc", block_size="64", dtype="torch.float32")

    differences = compatibility_differences(LOCAL, remote, (*HASHED_FIELDS, BLOCK_SIZE_FIELD))

    assert differences == [
        "dtype: local torch.bfloat16, remote torch.float32",
        "cache_dtype: local auto, remote fp8_inc",
        "block_size: local 128, remote 64",
    ]


def test_fields_outside_the_compared_set_or_missing_on_one_side_are_not_compared():
    remote = _remote(block_size="64")
    del remote["model"]
    local = {**LOCAL, "model": "/models/other"}

    assert compatibility_differences(local, remote, HASHED_FIELDS) == []


def test_a_mismatch_is_refused_with_the_remote_address_and_both_values():
    with pytest.raises(RuntimeError) as refused:
        check_handshake_compatibility(
            LOCAL, _remote(model="/models/mistral"), HASHED_FIELDS, "the instance at h:1"
        )

    message = str(refused.value)
    assert "NIXL handshake with the instance at h:1 refused" in message
    assert "model: local /models/llama, remote /models/mistral" in message


def test_identical_fields_pass():
    check_handshake_compatibility(LOCAL, dict(LOCAL), HASHED_FIELDS, "the instance at h:1")


def test_our_payload_still_decodes_as_vllms_and_a_plain_one_has_no_fields():
    ours = HpuNixlHandshakePayload("hash", b"agent", compatibility_fields=dict(LOCAL))
    plain = NixlHandshakePayload("hash", b"agent")

    as_vllm = msgspec.msgpack.Decoder(NixlHandshakePayload).decode(msgspec.msgpack.encode(ours))
    as_ours = msgspec.msgpack.Decoder(HpuNixlHandshakePayload).decode(msgspec.msgpack.encode(plain))

    assert (as_vllm.compatibility_hash, as_vllm.agent_metadata_bytes) == ("hash", b"agent")
    assert as_ours.compatibility_fields is None


@contextmanager
def _vllm_listener(payload: NixlHandshakePayload) -> Iterator[int]:
    """vLLM's handshake listener thread serving `payload` for (pp 0, tp 0); yields its port."""
    port = cluster.free_port()
    ready, stop = threading.Event(), threading.Event()
    encoded = {(0, 0): msgspec.msgpack.encode(payload)}
    thread = threading.Thread(
        target=NixlBaseConnectorScheduler._nixl_handshake_listener,
        args=(encoded, ready, stop, "127.0.0.1", port),
        daemon=True,
    )
    thread.start()
    ready.wait(10)
    try:
        yield port
    finally:
        stop.set()
        thread.join(10)


class _Topology:
    def handshake_target_ranks(self, remote_tp_size: int, remote_dcp_size: int = 1) -> list[int]:
        return [0]


def _worker(enforce_compat_hash: bool = True, use_host_buffer: bool = False):
    # The check reads only these attributes; a real worker needs NIXL agents and a KV cache.
    worker = object.__new__(HpuNixlConnectorWorker)
    worker.transfer_topo = _Topology()  # type: ignore[assignment]
    worker.compatibility_fields = dict(LOCAL)
    worker.enforce_compat_hash = enforce_compat_hash
    worker.use_host_buffer = use_host_buffer
    worker.block_size = 128
    worker.block_len_per_layer = [BLOCK_BYTES, BLOCK_BYTES]
    return worker


BLOCK_BYTES = 2 * 128 * 2 * 64 * 4  # keys and values of 128 tokens, 2 heads of 64, float32


def _agent(backend: str = "FLASH_ATTN", block_size: int = 128, block_bytes: int = BLOCK_BYTES):
    """A plain vLLM peer's agent metadata, as another platform's NixlConnector sends it."""
    meta = NixlAgentMetadata(
        engine_id="remote",
        agent_metadata=b"agent",
        kv_caches_base_addr=[0, 0],
        device_id=0,
        num_blocks=16,
        block_lens=[block_bytes, block_bytes],
        block_strides=[block_bytes, block_bytes],
        kv_cache_layout="LBHNC",
        block_size=block_size,
        ssm_sizes=(0, 0),
        attn_backend_name=backend,
        physical_blocks_per_logical_kv_block=1,
    )
    return msgspec.msgpack.encode(meta)


def _payload(fields: dict[str, str] | None, agent: bytes | None = None) -> NixlHandshakePayload:
    if fields is None:
        return NixlHandshakePayload("hash", agent if agent is not None else _agent())
    return HpuNixlHandshakePayload("hash", b"agent", compatibility_fields=fields)


def test_worker_refuses_a_remote_with_another_kv_cache_dtype_before_vllms_hash_check():
    refused = pytest.raises(RuntimeError, match="cache_dtype: local auto, remote fp8_inc")
    with _vllm_listener(_payload(_remote(cache_dtype="fp8_inc"))) as port, refused:
        _worker()._check_remote_compatibility("127.0.0.1", port, 1, 1)


def test_block_size_is_compared_only_with_host_staging_buffers():
    # vLLM itself moves KV between different block sizes when NIXL reads the cache directly.
    with _vllm_listener(_payload(_remote(block_size="64"))) as port:
        _worker(use_host_buffer=False)._check_remote_compatibility("127.0.0.1", port, 1, 1)
        with pytest.raises(RuntimeError, match="block_size: local 128, remote 64"):
            _worker(use_host_buffer=True)._check_remote_compatibility("127.0.0.1", port, 1, 1)


def test_hashed_fields_are_not_compared_when_the_user_disabled_vllms_check():
    with _vllm_listener(_payload(_remote(model="/models/other"))) as port:
        _worker(enforce_compat_hash=False)._check_remote_compatibility("127.0.0.1", port, 1, 1)


def test_another_platforms_peer_with_the_same_blocks_passes():
    # A plain NixlConnector (no compatibility fields): its agent metadata is compared.
    with _vllm_listener(_payload(None)) as port:
        _worker(use_host_buffer=True)._check_remote_compatibility("127.0.0.1", port, 1, 1)


def test_a_cpu_backend_prefill_instance_is_refused_naming_its_backend():
    refused = pytest.raises(RuntimeError, match=r"CPU attention backend \(CPU_ATTN\)")
    with _vllm_listener(_payload(None, _agent("CPU_ATTN"))) as port, refused:
        _worker(use_host_buffer=True)._check_remote_compatibility("127.0.0.1", port, 1, 1)


def test_another_platforms_peer_with_other_blocks_is_refused_field_by_field():
    token_bytes = BLOCK_BYTES // 128
    agent = _agent(block_size=64, block_bytes=BLOCK_BYTES // 4)  # half the bytes per token
    with _vllm_listener(_payload(None, agent)) as port, pytest.raises(RuntimeError) as refused:
        _worker(use_host_buffer=True)._check_remote_compatibility("127.0.0.1", port, 1, 1)
    message = str(refused.value)
    assert "(FLASH_ATTN) refused" in message
    assert "block_size: local 128, remote 64" in message
    assert f"head size x 2): local {token_bytes}, remote {token_bytes // 2}" in message


def test_another_block_size_alone_passes_when_nixl_reads_the_cache_directly():
    # vLLM moves blocks of different sizes device to device; the bytes per token agree.
    agent = _agent(block_size=64, block_bytes=BLOCK_BYTES // 2)
    with _vllm_listener(_payload(None, agent)) as port:
        _worker(use_host_buffer=False)._check_remote_compatibility("127.0.0.1", port, 1, 1)
        with pytest.raises(RuntimeError, match="block_size: local 128, remote 64"):
            _worker(use_host_buffer=True)._check_remote_compatibility("127.0.0.1", port, 1, 1)
