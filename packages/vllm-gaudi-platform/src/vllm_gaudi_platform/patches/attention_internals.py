"""vLLM attention names the HPU attention backend registers with or reads."""

from __future__ import annotations

from vllm_gaudi_platform.patches import Patch, Upstream

UPSTREAM: tuple[Upstream, ...] = (
    Upstream(
        "vllm.model_executor.layers.attention.attention:set_default_quant_scales",
        "HPUAttentionImpl reads layer._k_scale/_v_scale for the FP8 KV cache",
        mentions=("_k_scale", "_v_scale"),
    ),
    Upstream(
        "vllm.v1.attention.backends.registry:register_backend",
        "platform.py registers the HPU backend as AttentionBackendEnum.CUSTOM",
        params=("backend", "class_path"),
    ),
    Upstream("vllm.v1.attention.backends.registry:AttentionBackendEnum.CUSTOM", "platform.py"),
    Upstream(
        "vllm.v1.attention.backend:AttentionBackend.supports_sink",
        "HPUAttentionBackend.supports_sink (vLLM refuses backends without it for sink models)",
    ),
    Upstream(
        "vllm.model_executor.layers.attention.attention:Attention.__init__",
        "HPUAttentionImpl takes the layer's sink logits as its `sinks` keyword (extra_impl_args)",
        mentions=("extra_impl_args", "sinks"),
    ),
)

PATCH = Patch(
    what="",
    why=(
        "the HPU backend registers under vLLM's CUSTOM slot and reads layer attributes vLLM "
        "keeps on every attention layer."
    ),
    can_go="when these are part of vLLM's documented backend API.",
    upstream=UPSTREAM,
)
