"""torch._dynamo's settings the compiled runner writes."""

from __future__ import annotations

from vllm_gaudi_platform.patches import Patch, Upstream

UPSTREAM: tuple[Upstream, ...] = (
    Upstream("torch._dynamo:config.disable", "compiled.configure_dynamo (lazy mode)"),
    Upstream("torch._dynamo:config.recompile_limit", "compiled.CompiledModel raises it"),
    Upstream(
        "torch._dynamo:config.accumulated_recompile_limit", "compiled.CompiledModel raises it"
    ),
)

PATCH = Patch(
    what=(
        "`torch._dynamo.config.disable` (lazy mode: torch.compile off), `recompile_limit` and "
        "`accumulated_recompile_limit` raised to at least the number of buckets."
    ),
    why=(
        "each bucket is one compiled graph of the same code object: dynamo's default limit (8) "
        "would fall back to eager after eight buckets."
    ),
    can_go="when torch.compile takes a per-call recompile limit.",
    sites=(
        "vllm_gaudi_platform.worker.compiled:configure_dynamo",
        "vllm_gaudi_platform.worker.compiled:CompiledModel.__init__",
    ),
    scope="process",
    upstream=UPSTREAM,
)
