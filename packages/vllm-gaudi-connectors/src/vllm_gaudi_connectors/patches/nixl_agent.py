"""nixl's agent constructor, wrapped to set its progress thread's delay."""

from __future__ import annotations

from vllm_gaudi_platform.patches import Patch, Upstream

NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"

UPSTREAM: tuple[Upstream, ...] = (
    Upstream(
        f"{NIXL}.base_worker:NixlBaseConnectorWorker.__init__",
        "HpuNixlConnectorWorker sets the agent's progress wait while this creates the agent",
        params=("vllm_config", "engine_id", "kv_cache_config"),
        mentions=("nixl_wrapper_cls", "nixl_agent_config"),
    ),
    Upstream(
        "nixl._api:nixl_agent.__init__",
        "progress_wait (connectors nixl.py) sets pthrDelay on the config this hands the binding",
        params=("agent_name", "nixl_conf"),
        mentions=("nixlBind.nixlAgent", "pthrDelay"),
    ),
)

PATCH = Patch(
    what=(
        "`nixlBind.nixlAgent` (in the module of vLLM's `NixlWrapper`) wrapped while "
        "`HpuNixlConnectorWorker` runs vLLM's worker constructor, only when "
        "VLLM_HPU_NIXL_PROGRESS_WAIT_MS > 0."
    ),
    why=(
        "nixl's `nixl_agent.__init__` sets `pthrDelay` to 0: its UCX progress thread then polls "
        "without pause, a host core per worker."
    ),
    can_go="when nixl's `nixl_agent_config` takes the delay.",
    sites=("vllm_gaudi_connectors.nixl:progress_wait",),
    scope="call",
    upstream=UPSTREAM,
)
