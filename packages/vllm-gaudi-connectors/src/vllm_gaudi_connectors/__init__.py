"""KV connectors for vLLM on the HPU platform (see the README).

`register_nixl` is the `hpu_nixl` entry point (group `vllm.general_plugins`): it registers
`HpuNixlConnector` by name with vLLM's connector factory. `register_offload` is `hpu_offload`:
it registers `HpuCPUOffloadingSpec` (host memory) and `HpuTieringOffloadingSpec` (host memory in
front of vLLM's secondary tiers, such as block files on disk), both in offload.py, with vLLM's
offloading-spec factory, for `OffloadingConnector` with `"spec_name"` set to either.
"""

from __future__ import annotations

from vllm_gaudi_platform import plugins

NIXL_CONNECTOR = ("HpuNixlConnector", "vllm_gaudi_connectors.nixl", "HpuNixlConnector")
OFFLOAD_SPECS = tuple(
    (name, "vllm_gaudi_connectors.offload", name)
    for name in ("HpuCPUOffloadingSpec", "HpuTieringOffloadingSpec")
)


@plugins.general_plugin("hpu_nixl")
def register_nixl() -> None:
    """Register HpuNixlConnector with vLLM's KVConnectorFactory.

    Does nothing when the platform is not HPU; logs one warning when the `nixl` package is
    missing. The factory raises on a duplicate name and general plugins may run more than once
    per process, so an existing registration is kept.
    """
    plugins.require("nixl", "nixl", "vllm-gaudi-connectors[nixl]")
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    name, module, cls = NIXL_CONNECTOR
    if name not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(name, module, cls)


@plugins.general_plugin("hpu_offload")
def register_offload() -> None:
    """Register the HPU offloading specs with vLLM's OffloadingSpecFactory (each kept if
    present). The factory imports offload.py (torch, vLLM's offloading modules) only when a spec
    is built: this runs in every process."""
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    for name, module, cls in OFFLOAD_SPECS:
        if name not in OffloadingSpecFactory._registry:
            OffloadingSpecFactory.register_spec(name, module, cls)
