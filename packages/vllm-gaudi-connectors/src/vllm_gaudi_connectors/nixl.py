"""HpuNixlConnector: vLLM's NIXL connector on the HPU platform, and its `hpu_nixl` entry point.

vLLM's `NixlConnector` already moves a packed, block-first KV cache like ours; the platform
supplies the hooks it needs (`HpuPlatform.get_nixl_supported_devices`, `get_nixl_memory_type`,
`insert_blocks_to_device`, `swap_out_blocks_to_host`, `discover_numa_topology`). This subclass
overrides only what differs on HPU:

- the KV cache layout: vLLM's connector asks for LBHNC, which the HPU attention backend does not
  have; it keeps Gaudi's LBNHC (the connector registers caches by storage and stride, so both
  work), instead of vLLM dropping the request with a warning;
- the transfer buffer: host staging (`kv_buffer_device: "cpu"`) by default; device memory
  (`"hpu"`) only with VLLM_NIXL_DEVICE_TO_DEVICE=true. A combination that cannot work is refused
  at start with the setting to change. The KV cache counts as device memory in CPU emulation
  too (where vLLM, seeing device type "cpu", would let NIXL read it directly), so emulation
  stages through host buffers exactly as a Gaudi does;
- the progress thread: NIXL's Python agent starts its UCX progress thread with no wait between
  polls, so every worker keeps a host core busy, idle or not; VLLM_HPU_NIXL_PROGRESS_WAIT_MS
  sets that wait (NIXL's `pthrDelay`) for the agent vLLM's worker creates. Unset or 0 leaves
  NIXL's setting;
- the handshake side channel: vLLM binds VLLM_NIXL_SIDE_CHANNEL_PORT (+ the data-parallel
  index) in a listener thread of the engine process; when the port is taken that thread dies and
  the engine waits for it forever. The scheduler side checks the port first and refuses to start,
  naming the variable.
- the handshake's compatibility check: vLLM compares one hash of its compatibility factors
  (vLLM and connector version, model, dtype, KV heads, head size, layers, attention backend, KV
  cache dtype, hybrid KV manager, transfer mode) and, on a mismatch, names two hashes; with host
  staging it stops at a different block size on a bare assert. Our handshake payload carries the
  factors themselves (and the block size), and the decode side compares them before vLLM's check,
  so the error names each differing field with both values. A peer on another platform (vLLM's
  plain NixlConnector sends no such fields) is checked on what its agent metadata says: its
  block size (with host staging) and bytes per token; a prefill instance on vLLM's CPU backend
  is refused, naming it (its cache holds its kernel's packed blocks). An HPU prefill instance
  serves another platform's decode instance with vLLM's `enable_permute_local_kv`, which makes
  its host buffers head-major (LBHNC).

Start instances with `--kv-transfer-config '{"kv_connector": "HpuNixlConnector", ...}'`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import sys
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import msgspec
import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlBaseConnector,
    NixlConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    GET_META_MSG,
    NIXL_CONNECTOR_VERSION,
    NixlAgentMetadata,
    NixlHandshakePayload,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
    NixlPullConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import zmq_ctx
from vllm.logger import init_logger
from vllm.utils.network_utils import make_zmq_path

from vllm_gaudi_platform import envs

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(f"vllm.{__name__}")

CONNECTOR_NAME = "HpuNixlConnector"
HPU_KV_CACHE_LAYOUT = "LBNHC"  # attention.HPUAttentionBackend.supported_kv_cache_layouts


def check_kv_buffer_device(kv_buffer_device: str, device_to_device: bool) -> None:
    """Refuse a kv_buffer_device that the HPU platform cannot serve, naming the fix."""
    env = envs.VLLM_NIXL_DEVICE_TO_DEVICE
    if kv_buffer_device not in ("cpu", "hpu"):
        raise ValueError(
            f"{CONNECTOR_NAME}: kv_buffer_device={kv_buffer_device!r} is not supported on HPU; "
            'set "kv_buffer_device": "cpu" in --kv-transfer-config (or "hpu" with '
            f"{env}=true)."
        )
    if kv_buffer_device == "hpu" and not device_to_device:
        raise ValueError(
            f'{CONNECTOR_NAME}: kv_buffer_device="hpu" moves KV blocks device to device, which '
            f'must be enabled with {env}=true (or set "kv_buffer_device": "cpu").'
        )
    if kv_buffer_device == "cpu" and device_to_device:
        raise ValueError(
            f"{CONNECTOR_NAME}: {env}=true registers the device KV cache with NIXL, but "
            'kv_buffer_device is "cpu"; set "kv_buffer_device": "hpu" or unset '
            f"{env}."
        )


def uses_host_staging(kv_buffer_device: str) -> bool:
    """Whether KV blocks go through host staging buffers. The HPU KV cache is device memory on
    a Gaudi and in CPU emulation alike, so both stage for kv_buffer_device "cpu" (vLLM would not
    stage for its "cpu" device type, which emulation reports)."""
    return kv_buffer_device == "cpu"


def check_side_channel_port(host: str, port: int) -> None:
    """Refuse a side-channel port that another socket holds (vLLM would hang on it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # As ZeroMQ's listener does: a port whose last connection is in TIME_WAIT is free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host.strip("[]"), port))
        except OSError as exc:
            raise ValueError(
                f"{CONNECTOR_NAME}: the NIXL handshake port {host}:{port} cannot be bound "
                f"({exc.strerror}); set VLLM_NIXL_SIDE_CHANNEL_PORT to a free port (each instance "
                "on a host needs its own, and a data-parallel rank uses the port plus its index)."
            ) from exc


# Factors vLLM's compatibility hash covers (metadata.compute_nixl_compatibility_hash), by name.
HASHED_FIELDS = (
    "vllm_version",
    "nixl_connector_version",
    "model",
    "dtype",
    "num_kv_heads",
    "head_size",
    "num_hidden_layers",
    "attn_backend_name",
    "cache_dtype",
    "is_hma_enabled",
    "transfer_mode",
)
# Not hashed by vLLM: it moves KV between different block sizes when NIXL reads the KV cache
# itself (device to device), but not through host staging buffers (kv_buffer_device "cpu"),
# where it stops on a bare assert.
BLOCK_SIZE_FIELD = "block_size"
HANDSHAKE_TIMEOUT_MS = 5000  # as vLLM's own handshake query


def compatibility_fields(
    vllm_config: VllmConfig, attn_backend_name: str, block_size: int, transfer_mode: str
) -> dict[str, str]:
    """The values two instances must share to exchange KV blocks, as strings by field name."""
    from vllm import __version__ as vllm_version

    model_config = vllm_config.model_config
    return {
        "vllm_version": vllm_version,
        "nixl_connector_version": str(NIXL_CONNECTOR_VERSION),
        "model": str(model_config.model),
        "dtype": str(model_config.dtype),
        "num_kv_heads": str(model_config.get_total_num_kv_heads()),
        "head_size": str(model_config.get_head_size()),
        "num_hidden_layers": str(model_config.get_total_num_hidden_layers()),
        "attn_backend_name": attn_backend_name,
        "cache_dtype": str(vllm_config.cache_config.cache_dtype),
        "is_hma_enabled": str(not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager),
        "transfer_mode": transfer_mode,
        BLOCK_SIZE_FIELD: str(block_size),
    }


def compatibility_differences(
    local: Mapping[str, str], remote: Mapping[str, str], fields: tuple[str, ...]
) -> list[str]:
    """One "field: local X, remote Y" entry per field of `fields` whose values differ (a field one
    side does not report is not compared)."""
    return [
        f"{name}: local {local[name]}, remote {remote[name]}"
        for name in fields
        if name in local and name in remote and local[name] != remote[name]
    ]


def check_handshake_compatibility(
    local: Mapping[str, str], remote: Mapping[str, str], fields: tuple[str, ...], remote_at: str
) -> None:
    """Refuse a handshake whose remote instance differs in one of `fields`, naming both values."""
    differences = compatibility_differences(local, remote, fields)
    if differences:
        raise RuntimeError(
            f"{CONNECTOR_NAME}: NIXL handshake with {remote_at} refused, the two instances' KV "
            f"caches are incompatible: {'; '.join(differences)}. Start the prefill and decode "
            "instances with the same values."
        )


# vLLM's CPU attention backend: its KV cache holds blocks in that kernel's packed, ISA-dependent
# order, which vLLM converts only when a CPU instance receives (CpuPlatform.pack_kv_cache).
CPU_ATTN = "CPU_ATTN"


def check_foreign_peer(
    local: Mapping[str, int], remote: NixlAgentMetadata, host_staging: bool, remote_at: str
) -> None:
    """Refuse a prefill instance of another platform (a plain NixlConnector, which sends no
    compatibility fields) whose blocks this decode instance cannot read, naming what differs.
    Across platforms the attention backends differ, so vLLM's compatibility hash always differs
    and must be switched off (`enforce_handshake_compat: false`); these checks remain."""
    if remote.attn_backend_name == CPU_ATTN:
        raise RuntimeError(
            f"{CONNECTOR_NAME}: NIXL handshake with {remote_at} refused: it runs vLLM's CPU "
            f"attention backend ({CPU_ATTN}), whose KV cache holds that kernel's packed blocks, "
            "which vLLM converts only on a CPU instance that receives them. Make the CPU "
            'instance the decode side ("kv_role": "kv_consumer") and this one the prefill '
            'side, with "enable_permute_local_kv": true in its --kv-transfer-config.'
        )
    differences = []
    if host_staging and remote.block_size != local["block_size"]:
        differences.append(f"block_size: local {local['block_size']}, remote {remote.block_size}")
    # Per token: vLLM moves blocks of different sizes when NIXL reads the cache directly.
    local_bytes = local["block_bytes"] / local["block_size"]
    if remote.block_lens and remote.block_lens[0] / remote.block_size != local_bytes:
        differences.append(
            f"bytes per token and layer (dtype x KV heads x head size x 2): local "
            f"{local_bytes:g}, remote {remote.block_lens[0] / remote.block_size:g}"
        )
    if differences:
        raise RuntimeError(
            f"{CONNECTOR_NAME}: NIXL handshake with {remote_at} ({remote.attn_backend_name}) "
            f"refused, the two instances' KV blocks differ: {'; '.join(differences)}. Start "
            "both with the same model, --dtype, --kv-cache-dtype and --block-size."
        )


@dataclasses.dataclass
class HpuNixlHandshakePayload(NixlHandshakePayload):
    """vLLM's handshake payload plus the compatibility fields themselves. vLLM's decoder ignores
    the extra field, so a plain NixlConnector peer still reads it."""

    compatibility_fields: dict[str, str] | None = None


class HpuNixlConnectorScheduler(NixlPullConnectorScheduler):
    """vLLM's pull scheduler, saving prefilled blocks to host staging whenever the worker
    stages (in CPU emulation too)."""

    def __init__(self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, engine_id, kv_cache_config)
        kv_transfer_config = vllm_config.kv_transfer_config
        assert kv_transfer_config is not None
        self.use_host_buffer = uses_host_staging(kv_transfer_config.kv_buffer_device)


@contextlib.contextmanager
def progress_wait(wait_ms: int) -> Iterator[None]:
    """While the block runs, every NIXL agent created through vLLM's `NixlWrapper` (nixl's
    `nixl_agent`) gets a progress thread that waits up to `wait_ms` for events between polls.

    nixl's `nixl_agent.__init__` builds its agent configuration and sets `pthrDelay` (the
    progress thread's poll timeout, in microseconds) to 0, with no parameter to change it; the
    binding's agent constructor is wrapped for the block to set it before the agent and its UCX
    backend are created. 0 changes nothing. Ledger: patches/nixl_agent.py.
    """
    if wait_ms <= 0:
        yield
        return
    from vllm.distributed.nixl_utils import NixlWrapper

    binding = sys.modules[NixlWrapper.__module__].nixlBind
    create = binding.nixlAgent

    def create_waiting(name: str, config: Any) -> Any:
        config.pthrDelay = wait_ms * 1000
        return create(name, config)

    binding.nixlAgent = create_waiting
    try:
        yield
    finally:
        binding.nixlAgent = create


class HpuNixlConnectorWorker(NixlPullConnectorWorker):
    """vLLM's pull worker that stages through host buffers on the HPU device, emulated or not,
    and whose handshake names each incompatible field with both values."""

    xfer_handshake_metadata: NixlHandshakePayload | None
    compatibility_fields: dict[str, str]

    def __init__(self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: Any) -> None:
        with progress_wait(envs.nixl_progress_wait_ms()):
            super().__init__(vllm_config, engine_id, kv_cache_config)
        self.use_host_buffer = uses_host_staging(self.kv_buffer_device)

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        # vLLM's worker keeps no copy operation for device type "cpu" (emulation); the HPU
        # worker takes the one the model runner hands over (the platform's staging hooks)
        # whenever it stages.
        if self.use_host_buffer:
            self.copy_blocks = copy_operation

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        payload = self.xfer_handshake_metadata
        assert payload is not None
        self.compatibility_fields = compatibility_fields(
            self.vllm_config, self.backend_name, self.block_size, self._TRANSFER_MODE
        )
        self.xfer_handshake_metadata = HpuNixlHandshakePayload(
            compatibility_hash=payload.compatibility_hash,
            agent_metadata_bytes=payload.agent_metadata_bytes,
            compatibility_fields=self.compatibility_fields,
        )

    def _nixl_handshake(
        self,
        host: str,
        port: int,
        remote_tp_size: int,
        expected_engine_id: str,
        remote_dcp_size: int = 1,
        remote_pp_size: int = 1,
        notif_agents_only: bool = False,
    ) -> tuple[dict[tuple[int, int], str], float]:
        self._check_remote_compatibility(host, port, remote_tp_size, remote_dcp_size)
        return super()._nixl_handshake(
            host,
            port,
            remote_tp_size,
            expected_engine_id,
            remote_dcp_size,
            remote_pp_size,
            notif_agents_only,
        )

    def _check_remote_compatibility(
        self, host: str, port: int, remote_tp_size: int, remote_dcp_size: int
    ) -> None:
        """Ask the remote side channel for its payload (one more round trip per remote engine,
        on vLLM's protocol) and compare the fields before vLLM compares the hashes."""
        assert self.transfer_topo is not None
        remote_rank = self.transfer_topo.handshake_target_ranks(remote_tp_size, remote_dcp_size)[0]
        with zmq_ctx(zmq.REQ, make_zmq_path("tcp", host, port)) as sock:
            sock.setsockopt(zmq.RCVTIMEO, HANDSHAKE_TIMEOUT_MS)
            sock.send(msgspec.msgpack.encode((GET_META_MSG, 0, remote_rank)))
            reply = sock.recv_multipart()
        remote = msgspec.msgpack.Decoder(HpuNixlHandshakePayload).decode(reply[0])
        logger.debug(
            "NIXL handshake with %s:%s: local fields %s, remote fields %s",
            host,
            port,
            self.compatibility_fields,
            remote.compatibility_fields,
        )
        remote_at = f"the instance at {host}:{port}"
        if remote.compatibility_fields is None:
            # A peer without HpuNixlConnector (another platform's vLLM): its agent metadata
            # says what its blocks are.
            local = {"block_size": self.block_size, "block_bytes": self.block_len_per_layer[0]}
            meta = msgspec.msgpack.Decoder(NixlAgentMetadata).decode(remote.agent_metadata_bytes)
            check_foreign_peer(local, meta, self.use_host_buffer, remote_at)
            return
        fields: tuple[str, ...] = HASHED_FIELDS if self.enforce_compat_hash else ()
        if self.use_host_buffer:
            fields += (BLOCK_SIZE_FIELD,)
        check_handshake_compatibility(
            self.compatibility_fields,
            remote.compatibility_fields,
            fields,
            remote_at=remote_at,
        )


class HpuNixlConnector(NixlConnector):
    """vLLM's NIXL connector with the HPU KV-cache layout and transfer-buffer checks."""

    def __init__(self, vllm_config: VllmConfig, role: Any, kv_cache_config: Any) -> None:
        kv_transfer_config = vllm_config.kv_transfer_config
        assert kv_transfer_config is not None
        check_kv_buffer_device(
            kv_transfer_config.kv_buffer_device,
            device_to_device=envs.get_bool(envs.VLLM_NIXL_DEVICE_TO_DEVICE),
        )
        envs.nixl_progress_wait_ms()  # a bad value fails here, on both sides, before any agent
        if role == KVConnectorRole.SCHEDULER:
            # The scheduler side is created just before vLLM binds the port (see above).
            from vllm import envs as vllm_envs

            check_side_channel_port(
                vllm_envs.VLLM_NIXL_SIDE_CHANNEL_HOST,
                vllm_envs.VLLM_NIXL_SIDE_CHANNEL_PORT
                + vllm_config.parallel_config.data_parallel_index,
            )
        # NixlConnector.__init__ (vLLM's pull connector) creates its scheduler or worker; this
        # does the same with our worker class (the drift guard checks it still creates these).
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        self.connector_scheduler: NixlPullConnectorScheduler | None
        self.connector_worker: NixlPullConnectorWorker | None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = HpuNixlConnectorScheduler(
                vllm_config, self.engine_id, kv_cache_config
            )
            self.connector_worker = None
        elif role == KVConnectorRole.WORKER:
            self.connector_scheduler = None
            self.connector_worker = HpuNixlConnectorWorker(
                vllm_config, self.engine_id, kv_cache_config
            )

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        if vllm_config.model_config is not None and vllm_config.model_config.use_mla:
            return None
        return HPU_KV_CACHE_LAYOUT
