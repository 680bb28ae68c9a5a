"""The `vllm.general_plugins` entry points of the connectors, one attribute per entry point (the
same shape as `vllm_gaudi_ops.register` and `vllm_gaudi_quant.register`):
`hpu_nixl = "vllm_gaudi_connectors.register:nixl"` registers `HpuNixlConnector` by name with
vLLM's connector factory; `hpu_offload = "vllm_gaudi_connectors.register:offload"` registers
`HpuCPUOffloadingSpec` (host memory) and `HpuTieringOffloadingSpec` (host memory in front of
vLLM's secondary tiers, such as block files on disk) with vLLM's offloading-spec factory, for
`OffloadingConnector` with `"spec_name"` set to either. Loading an entry point imports neither
torch nor vLLM.
"""

from __future__ import annotations

from vllm_gaudi_platform import plugins

NIXL_CONNECTOR = ("HpuNixlConnector", "vllm_gaudi_connectors.nixl", "HpuNixlConnector")
OFFLOAD_SPECS = tuple(
    (name, "vllm_gaudi_connectors.offload", name)
    for name in ("HpuCPUOffloadingSpec", "HpuTieringOffloadingSpec")
)


@plugins.general_plugin("hpu_nixl")
def nixl() -> None:
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
def offload() -> None:
    """Register the HPU offloading specs with vLLM's OffloadingSpecFactory (each kept if
    present). The factory imports offload.py (torch, vLLM's offloading modules) only when a spec
    is built: this runs in every process."""
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    for name, module, cls in OFFLOAD_SPECS:
        if name not in OffloadingSpecFactory._registry:
            OffloadingSpecFactory.register_spec(name, module, cls)
