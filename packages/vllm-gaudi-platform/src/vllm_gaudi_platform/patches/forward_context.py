"""Fields of vLLM's forward context, set for each forward pass the runner splits or replays."""

from __future__ import annotations

from vllm_gaudi_platform.patches import Patch, Upstream

UPSTREAM: tuple[Upstream, ...] = (
    Upstream(
        "vllm.forward_context:ForwardContext",
        "mixed_steps.forward_in_parts, HPUModelRunner._graph_forward, CompiledModel.run",
        mentions=("attn_metadata", "slot_mapping", "is_padding"),
    ),
)

PATCH = Patch(
    what=(
        "`ForwardContext.attn_metadata`, `slot_mapping` and `is_padding` written for each part "
        "of a step run in several passes, for each graph replay, and in the compiled pass "
        "(bucket-shaped metadata, no per-layer slot mappings)."
    ),
    why=(
        "the layers read their metadata from the forward context; a step the HPU runs as "
        "several warmed passes needs each pass's own."
    ),
    can_go="when vLLM's forward context is built per pass by a platform hook.",
    sites=(
        "vllm_gaudi_platform.worker.mixed_steps:forward_in_parts",
        "vllm_gaudi_platform.worker.hpu_graphs:graph_forward",
        "vllm_gaudi_platform.worker.compiled:CompiledModel.run",
    ),
    scope="call",
    upstream=UPSTREAM,
)
