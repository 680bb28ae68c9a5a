"""The encoder-attention family: MMEncoderAttention through the seam's fused_sdpa, on both
backends of the seam (`hpu_backend`: the emulation, and seam/gaudi over the Habana stand-in),
against vLLM's forward_native (torch SDPA). Tolerances: conftest TOLERANCES."""

from __future__ import annotations

import pytest
import torch

from vllm_gaudi_ops import stats
from vllm_gaudi_ops.families.encoder_attention import HpuMMEncoderAttention

HEADS, HEAD_SIZE = 4, 32


def _qkv(batch, seq, kv_heads, dtype, *, split_heads, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def make(heads):
        shape = (batch, seq, heads, HEAD_SIZE) if split_heads else (batch, seq, heads * HEAD_SIZE)
        return torch.randn(shape, generator=gen).to(dtype)

    return make(HEADS), make(kv_heads), make(kv_heads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split_heads", [False, True])
@pytest.mark.parametrize("kv_heads", [HEADS, 2])
def test_encoder_attention_matches_native(
    hpu_backend, vllm_config, assert_matches, dtype, split_heads, kv_heads
):
    layer = HpuMMEncoderAttention(HEADS, HEAD_SIZE, num_kv_heads=kv_heads)
    query, key, value = _qkv(2, 9, kv_heads, dtype, split_heads=split_heads)

    out = layer.forward_oot(query, key, value)

    expected = layer.forward_native(query, key, value)
    assert out.shape == expected.shape
    # Gaudi's fused kernel (the stand-in's, here) keeps scores and softmax in float32, where the
    # native bfloat16 reference rounds them: up to ~2e-3 apart, the reference being the rougher.
    gaudi_bf16 = hpu_backend.NAME == "gaudi" and dtype == torch.bfloat16
    assert_matches(out, expected, **({"atol": 4e-3} if gaudi_bf16 else {}))


@pytest.mark.parametrize("split_heads", [False, True])
def test_packed_sequences_attend_only_within_themselves(
    hpu_backend, vllm_config, assert_matches, split_heads
):
    layer = HpuMMEncoderAttention(HEADS, HEAD_SIZE, scale=0.1)
    query, key, value = _qkv(1, 20, HEADS, torch.float32, split_heads=split_heads)
    cu_seqlens = torch.tensor([0, 5, 12, 20], dtype=torch.int32)

    out = layer.forward_oot(query, key, value, cu_seqlens)

    assert_matches(out, layer.forward_native(query, key, value, cu_seqlens))
    # The first sequence alone gives the same rows: nothing leaked across the boundary.
    alone = layer.forward_oot(query[:, :5], key[:, :5], value[:, :5])
    assert_matches(out[:, :5], alone)


def test_encoder_attention_forward_oot_counts_each_call(hpu_backend, vllm_config):
    layer = HpuMMEncoderAttention(HEADS, HEAD_SIZE)
    before = stats.COUNTS.get("encoder_attention", 0)

    layer.forward_oot(*_qkv(1, 3, HEADS, torch.float32, split_heads=False))

    assert stats.COUNTS["encoder_attention"] == before + 1
