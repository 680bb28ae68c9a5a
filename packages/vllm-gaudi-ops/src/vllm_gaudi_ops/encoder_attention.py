"""`hpu_ops_encoder_attention`: multimodal encoder attention (vllm.general_plugins entry point)."""

from __future__ import annotations

from vllm_gaudi_platform.plugins import general_plugin


@general_plugin("hpu_ops_encoder_attention")
def register() -> None:
    """Replace vLLM's MMEncoderAttention (vision encoders) with Gaudi's fused SDPA kernel.

    Does nothing but log one line when vLLM's active platform is not HPU (real or emulated),
    and warns instead when the installed vLLM is outside the supported range. Idempotent.
    """
    from vllm_gaudi_ops.layers import encoder_attention
    from vllm_gaudi_ops.replacement import replace_ops

    replace_ops(encoder_attention.REPLACEMENTS)
