"""The connectors wheel's ledger: its writes into vLLM's and nixl's objects and the private names
it relies on (one module per entry, `PATCH`), and what the override check must know of its vLLM
subclasses (`SUBCLASSES`). The shape and the rules are the platform's: see
`vllm_gaudi_platform.patches`."""

from __future__ import annotations

from vllm_gaudi_platform.patches import Subclass

SUBCLASSES: tuple[Subclass, ...] = (
    Subclass(
        "vllm_gaudi_connectors.nixl:HpuNixlConnectorWorker",
        frozenset({"_check_remote_compatibility"}),
    ),
    Subclass(
        "vllm_gaudi_connectors.offload:HpuOffloadingWorker",
        frozenset({"_host_tensor", "_pairs", "_copy"}),
    ),
)
