"""vLLM's multi-head latent attention internals the HPU MLA backend relies on."""

from __future__ import annotations

from vllm_gaudi_platform.patches import Patch, Upstream

MLA = "vllm.model_executor.layers.attention.mla_attention"

UPSTREAM: tuple[Upstream, ...] = (
    Upstream(
        f"{MLA}:MLAAttention.forward_impl",
        "HPUMLAImpl.forward_mha runs the whole step: with num_decode_tokens == 0 the layer passes "
        "every token (cut to num_actual_tokens) to forward_mha and never calls forward_mqa",
        mentions=("num_decode_tokens", "num_decodes", "num_prefills", "num_actual_tokens"),
    ),
    Upstream(
        f"{MLA}:MLAAttention.bind_kv_cache",
        "HPUMLAImpl reads the layer's cache as [num_blocks, block_size, latent] (no head axis)",
        mentions=("squeeze",),
    ),
    Upstream(
        f"{MLA}:MLAAttention.process_weights_after_loading",
        "HPUMLAImpl.process_weights_after_loading splits kv_b_proj into W_UK / W_UV",
        mentions=("self.impl.process_weights_after_loading",),
    ),
    Upstream(
        f"{MLA}:split_kv_b_proj",
        "HPUMLAImpl.process_weights_after_loading",
        params=(
            "kv_b_proj",
            "out_dtype",
            "kv_lora_rank",
            "num_heads",
            "qk_nope_head_dim",
            "v_head_dim",
        ),
    ),
    Upstream(
        "vllm.v1.attention.backend:MLAAttentionImpl.forward_mha",
        "HPUMLAImpl.forward_mha",
        params=("q", "kv_c_normed", "k_pe", "kv_c_and_k_pe_cache", "attn_metadata", "k_scale"),
        keywords=("output",),
    ),
    Upstream(
        "vllm.platforms.interface:Platform.get_mla_prefill_backend_cls",
        "HpuPlatform answers with HPUMLAPrefillBackend (MLA layers ask for one when built)",
        params=("mla_selector_config",),
    ),
)

PATCH = Patch(
    what="",
    why=(
        "the HPU MLA backend reuses vLLM's MLA layer (weight absorption, KV binding) and "
        "replaces its kernels."
    ),
    can_go="when vLLM's MLA layer exposes its prefill and decode as backend hooks only.",
    upstream=UPSTREAM,
)
