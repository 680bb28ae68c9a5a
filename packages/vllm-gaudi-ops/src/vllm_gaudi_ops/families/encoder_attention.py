"""Multimodal encoder (ViT) attention on Gaudi's fused SDPA kernel."""

from __future__ import annotations

import torch
from vllm.model_executor.layers.attention.mm_encoder_attention import MMEncoderAttention

from vllm_gaudi_ops import stats
from vllm_gaudi_platform.seam import backend

FAMILY = "encoder_attention"


class HpuMMEncoderAttention(MMEncoderAttention):
    """Bidirectional attention without KV cache. With `cu_seqlens`, the sequences packed along
    the sequence axis attend only within themselves (one kernel call per sequence, as vLLM's
    SDPA path does). Grouped-query attention goes to the kernel as it is."""

    def forward_oot(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: torch.Tensor | None = None,
        sequence_lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        stats.count(FAMILY)
        bsz, q_len = query.shape[:2]
        flat_heads = query.dim() != 4
        query, key, value = self.view_qkv_to_4d(query, key, value, bsz, q_len, key.shape[1])
        # [batch, seq, heads, head_size] -> the kernel's [batch, heads, seq, head_size]
        query, key, value = (t.transpose(1, 2) for t in (query, key, value))
        if cu_seqlens is None:
            out = self._attend(query, key, value)
        else:
            lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
            pieces = zip(*(t.split(lengths, dim=2) for t in (query, key, value)))
            out = torch.cat([self._attend(q, k, v) for q, k, v in pieces], dim=2)
        out = out.transpose(1, 2)
        return out.reshape(bsz, q_len, -1) if flat_heads else out.contiguous()

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        # softmax_mode "None": exact softmax ("fast" trades precision for speed on Gaudi).
        return backend().fused_sdpa(query, key, value, None, 0.0, False, self.scale, "None")


REPLACEMENTS: tuple[tuple[type, type], ...] = ((MMEncoderAttention, HpuMMEncoderAttention),)
