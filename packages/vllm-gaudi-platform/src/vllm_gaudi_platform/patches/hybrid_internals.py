"""vLLM's Mamba layer and hybrid-model internals the platform relies on."""

from __future__ import annotations

from vllm_gaudi_platform.patches import Patch, Upstream

UPSTREAM: tuple[Upstream, ...] = (
    Upstream(
        "vllm.model_executor.layers.mamba.abstract:MambaBase.get_kv_cache_spec",
        "HpuMambaMixer2.get_kv_cache_spec (no prefill checkpoint blocks)",
        params=("vllm_config",),
    ),
    Upstream(
        "vllm.model_executor.layers.mamba.abstract:MambaBase.bind_kv_cache",
        "hybrid.state_tensors reads the bound states (MambaBase.kv_cache)",
        mentions=("self.kv_cache",),
    ),
    Upstream(
        "vllm.platforms.interface:Platform._find_non_ssm_backends",
        "HpuPlatform.check_and_update_config aligns a hybrid model's block size",
        params=("vllm_config",),
    ),
    Upstream(
        "vllm.platforms.interface:Platform._align_hybrid_block_size",
        "HpuPlatform.check_and_update_config aligns a hybrid model's block size",
        params=("vllm_config", "backend_cls"),
    ),
)

PATCH = Patch(
    what="",
    why=(
        "the platform sizes the state cache and aligns the hybrid block size with vLLM's own "
        "helpers, and reads the states vLLM binds to each Mamba layer."
    ),
    can_go="when vLLM's platform interface offers the hybrid block-size alignment as public API.",
    upstream=UPSTREAM,
)
