"""vLLM's GPU worker and routed-experts capture internals HPUWorker relies on."""

from __future__ import annotations

from vllm_gaudi_platform.patches import Patch, Upstream

UPSTREAM: tuple[Upstream, ...] = (
    Upstream(
        "vllm.v1.worker.gpu_worker:Worker._maybe_get_memory_pool_context",
        "HPUWorker: no CUDA sleep-mode memory pool on HPU",
        params=("tag",),
    ),
    Upstream(
        "vllm.model_executor.layers.fused_moe.routed_experts_capturer:RoutedExpertsSink.__init__",
        "routed_experts.capture_routed_experts fills the layer's sink buffer, then calls it",
        params=("moe_config", "capture_fn"),
        mentions=("buffer", "capture_fn"),
    ),
)

PATCH = Patch(
    what="",
    why=(
        "HPUWorker subclasses vLLM's GPU worker and keeps its collective_rpc surface; the "
        "sleep-mode memory pool and the routed-experts sink are private to it."
    ),
    can_go="when vLLM's worker base exposes these as platform hooks.",
    upstream=UPSTREAM,
)
