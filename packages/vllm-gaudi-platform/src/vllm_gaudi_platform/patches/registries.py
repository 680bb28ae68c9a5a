"""vLLM's factory registries the platform reads by their private names."""

from __future__ import annotations

from vllm_gaudi_platform.patches import Patch, Upstream

UPSTREAM: tuple[Upstream, ...] = (
    Upstream(
        "vllm.v1.kv_offload.factory:OffloadingSpecFactory._registry",
        "config_checks.hpu_offloading_specs",
    ),
)

PATCH = Patch(
    what="",
    why=(
        "config_checks maps vLLM's offloading specs to the HPU's only if the connectors wheel "
        "registered them; the weight-transfer engine registers once."
    ),
    can_go="when the factories offer an `is_registered(name)`.",
    upstream=UPSTREAM,
)
