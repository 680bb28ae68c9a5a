"""HpuNixlConnector: vLLM's NIXL connector on the HPU platform, and its `hpu_nixl` entry point.

vLLM's `NixlConnector` already moves a packed, block-first KV cache like ours; the platform
supplies the hooks it needs (`HpuPlatform.get_nixl_supported_devices`, `get_nixl_memory_type`,
`insert_blocks_to_device`, `swap_out_blocks_to_host`, `discover_numa_topology`). This subclass
overrides only what differs on HPU:

- the KV cache layout: vLLM's connector asks for LBHNC, which the HPU attention backend does not
  have; it keeps Gaudi's LBNHC (the connector registers caches by storage and stride, so both
  work), instead of vLLM dropping the request with a warning;
- the transfer buffer: host staging (`kv_buffer_device: "cpu"`) by default; Gaudi device memory
  (`"hpu"`) only with VLLM_NIXL_DEVICE_TO_DEVICE=true on a real Gaudi. A combination that cannot
  work is refused at start with the setting to change;
- the handshake side channel: vLLM binds VLLM_NIXL_SIDE_CHANNEL_PORT (+ the data-parallel
  index) in a listener thread of the engine process; when the port is taken that thread dies and
  the engine waits for it forever. The scheduler side checks the port first and refuses to start,
  naming the variable.

Start instances with `--kv-transfer-config '{"kv_connector": "HpuNixlConnector", ...}'`.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector
from vllm.logger import init_logger

from vllm_gaudi_platform import envs

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(f"vllm.{__name__}")

CONNECTOR_NAME = "HpuNixlConnector"
HPU_KV_CACHE_LAYOUT = "LBNHC"  # attention.HPUAttentionBackend.supported_kv_cache_layouts


def check_kv_buffer_device(kv_buffer_device: str, emulated: bool, device_to_device: bool) -> None:
    """Refuse a kv_buffer_device that the HPU platform cannot serve, naming the fix."""
    env = envs.VLLM_NIXL_DEVICE_TO_DEVICE
    if kv_buffer_device not in ("cpu", "hpu"):
        raise ValueError(
            f"{CONNECTOR_NAME}: kv_buffer_device={kv_buffer_device!r} is not supported on HPU; "
            'set "kv_buffer_device": "cpu" in --kv-transfer-config (or "hpu" with '
            f"{env}=true on a Gaudi)."
        )
    if kv_buffer_device == "hpu" and emulated:
        raise ValueError(
            f'{CONNECTOR_NAME}: kv_buffer_device="hpu" needs a Gaudi; in CPU emulation the KV '
            'cache is host memory already: set "kv_buffer_device": "cpu".'
        )
    if kv_buffer_device == "hpu" and not device_to_device:
        raise ValueError(
            f'{CONNECTOR_NAME}: kv_buffer_device="hpu" moves KV blocks device to device, which '
            f'must be enabled with {env}=true (or set "kv_buffer_device": "cpu").'
        )
    if kv_buffer_device == "cpu" and device_to_device and not emulated:
        raise ValueError(
            f"{CONNECTOR_NAME}: {env}=true registers Gaudi memory with NIXL, but "
            'kv_buffer_device is "cpu"; set "kv_buffer_device": "hpu" or unset '
            f"{env}."
        )


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


class HpuNixlConnector(NixlConnector):
    """vLLM's NIXL connector with the HPU KV-cache layout and transfer-buffer checks."""

    def __init__(self, vllm_config: VllmConfig, role: Any, kv_cache_config: Any) -> None:
        from vllm.platforms import current_platform

        kv_transfer_config = vllm_config.kv_transfer_config
        assert kv_transfer_config is not None
        check_kv_buffer_device(
            kv_transfer_config.kv_buffer_device,
            emulated=bool(getattr(current_platform, "is_emulated", lambda: False)()),
            device_to_device=envs.get_bool(envs.VLLM_NIXL_DEVICE_TO_DEVICE),
        )
        if role == KVConnectorRole.SCHEDULER:
            # The scheduler side is created just before vLLM binds the port (see above).
            from vllm import envs as vllm_envs

            check_side_channel_port(
                vllm_envs.VLLM_NIXL_SIDE_CHANNEL_HOST,
                vllm_envs.VLLM_NIXL_SIDE_CHANNEL_PORT
                + vllm_config.parallel_config.data_parallel_index,
            )
        super().__init__(vllm_config, role, kv_cache_config)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        if vllm_config.model_config is not None and vllm_config.model_config.use_mla:
            return None
        return HPU_KV_CACHE_LAYOUT
