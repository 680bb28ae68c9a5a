"""vLLM's connector and offloading factory registries, read by their private names."""

from __future__ import annotations

from vllm_gaudi_platform.patches import Patch, Upstream

UPSTREAM: tuple[Upstream, ...] = (
    Upstream(
        "vllm.distributed.kv_transfer.kv_connector.factory:KVConnectorFactory._registry",
        "vllm_gaudi_connectors.register",
    ),
    Upstream(
        "vllm.v1.kv_offload.factory:OffloadingSpecFactory._registry",
        "vllm_gaudi_connectors.register",
    ),
)

PATCH = Patch(
    what="",
    why=(
        "registration is idempotent: a name already registered (by vLLM or an earlier load) is "
        "not registered again, which would raise."
    ),
    can_go="when the factories offer an `is_registered(name)`.",
    upstream=UPSTREAM,
)
