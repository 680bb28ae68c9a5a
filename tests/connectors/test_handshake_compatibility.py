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
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlHandshakePayload

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
    return worker


def _payload(fields: dict[str, str] | None) -> NixlHandshakePayload:
    if fields is None:
        return NixlHandshakePayload("hash", b"agent")
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


def test_a_peer_without_compatibility_fields_is_left_to_vllms_hash_check():
    with _vllm_listener(_payload(None)) as port:
        _worker()._check_remote_compatibility("127.0.0.1", port, 1, 1)
