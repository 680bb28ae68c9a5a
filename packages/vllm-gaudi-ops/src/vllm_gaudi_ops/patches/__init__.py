"""The ops wheel's ledger: the private vLLM names the op families rely on (one module per entry,
`PATCH`), and what the override check must know of its vLLM subclasses (`SUBCLASSES`). The shape
and the rules are the platform's: see `vllm_gaudi_platform.patches`."""

from __future__ import annotations

from vllm_gaudi_platform.patches import Subclass

SUBCLASSES: tuple[Subclass, ...] = (
    Subclass(
        "vllm_gaudi_ops.families.mamba:HpuMambaMixer2",
        frozenset({"_split_conv_out", "_prefill", "_decode"}),
    ),
    Subclass(
        "vllm_gaudi_ops.families.encoder_attention:HpuMMEncoderAttention", frozenset({"_attend"})
    ),
    Subclass(
        "vllm_gaudi_ops.families.gdn:HpuQwenGatedDeltaNetAttention",
        frozenset(
            {"_project", "_conv_delta_rule", "_conv_weight", "_split_heads", "_prefill", "_decode"}
        ),
    ),
    Subclass("vllm_gaudi_ops.families.rotary:HpuMRotaryEmbedding", frozenset({"_channel_axes"})),
    Subclass(
        "vllm_gaudi_ops.families.rotary:HpuErnie4_5_VLRotaryEmbedding", frozenset({"_channel_axes"})
    ),
)
