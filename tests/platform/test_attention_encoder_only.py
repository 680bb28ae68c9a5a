"""Encoder-only attention (BERT-style, `AttentionType.ENCODER_ONLY`): every token of a sequence
attends to every token of that sequence, in the bucketed layout, with no KV cache; compared with
a float64 reference per sequence."""

from __future__ import annotations

import math

import pytest
import torch

from tests.platform.test_attention import BLOCK, DIM, HEADS, KV_HEADS, _plan
from vllm_gaudi_platform.attention import step_layout


@pytest.fixture(autouse=True)
def _backend(hpu_backend):
    """Every test runs on both backends of the seam: the emulation, and seam/gaudi (over the Habana
    stand-in off Gaudi)."""
    return hpu_backend


def _bidirectional_reference(q, k, v):
    group = HEADS // KV_HEADS
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / math.sqrt(DIM)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).float()


def _run_encoder(query_lens, plan, seed=0):
    from vllm.v1.attention.backend import AttentionType

    from vllm_gaudi_platform.attention.impl import HPUAttentionImpl
    from vllm_gaudi_platform.attention.metadata_builder import build_metadata

    gen = torch.Generator().manual_seed(seed)
    layout = step_layout.plan_step(
        query_lens=query_lens, seq_lens=list(query_lens), block_size=BLOCK, plan=plan
    )
    total, real = layout.num_tokens_padded, sum(query_lens)
    q = torch.full((total, HEADS * DIM), 1e3)  # padding garbage must not leak into outputs
    k = torch.full((total, KV_HEADS * DIM), 1e3)
    v = torch.full((total, KV_HEADS * DIM), 1e3)
    q[:real] = torch.randn(real, HEADS * DIM, generator=gen)
    k[:real] = torch.randn(real, KV_HEADS * DIM, generator=gen)
    v[:real] = torch.randn(real, KV_HEADS * DIM, generator=gen)
    md = build_metadata(
        layout=layout,
        seq_lens=list(query_lens),
        block_table=torch.zeros(len(query_lens), 1, dtype=torch.int32),
        slot_mapping=torch.zeros(real, dtype=torch.int64),
        block_size=BLOCK,
        device=torch.device("cpu"),
    )
    impl = HPUAttentionImpl(
        HEADS,
        DIM,
        1 / math.sqrt(DIM),
        num_kv_heads=KV_HEADS,
        attn_type=AttentionType.ENCODER_ONLY,
    )
    out = torch.zeros(total, HEADS * DIM)
    # vLLM hands encoder-only layers an empty KV cache.
    impl.forward(None, q, k, v, torch.tensor([]), md, out)
    refs, start = [], 0
    for n in query_lens:
        s = slice(start, start + n)
        refs.append(
            _bidirectional_reference(
                q[s].view(n, HEADS, DIM), k[s].view(n, KV_HEADS, DIM), v[s].view(n, KV_HEADS, DIM)
            ).reshape(n, -1)
        )
        start += n
    return out[:real], torch.cat(refs), layout


def test_encoder_only_grid_rows_attend_bidirectionally_within_each_sequence():
    out, ref, layout = _run_encoder([5, 17, 32], _plan(prompt=[(4, 32, 0)]))
    assert layout.prefill.rows == 4 and not any(len(r) > 1 for r in layout.prefill.row_members)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_encoder_only_packed_row_keeps_sequences_apart():
    out, ref, layout = _run_encoder([5, 17, 30], _plan(prompt=[(1, 64, 0)]))
    assert layout.prefill.rows == 1 and len(layout.prefill.row_members[0]) == 3
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_encoder_only_one_token_prompt_in_the_decode_part_is_its_own_value():
    out, ref, layout = _run_encoder([9, 1, 12], _plan(prompt=[(2, 16, 0)], decode=[(2, 1, 2)]))
    assert layout.decode is not None and layout.prefill is not None
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_encoder_only_attention_refuses_a_sliding_window():
    from vllm.v1.attention.backend import AttentionType

    from vllm_gaudi_platform.attention.impl import HPUAttentionImpl

    with pytest.raises(NotImplementedError, match="Encoder-only attention with a sliding window"):
        HPUAttentionImpl(HEADS, DIM, 1.0, sliding_window=8, attn_type=AttentionType.ENCODER_ONLY)
