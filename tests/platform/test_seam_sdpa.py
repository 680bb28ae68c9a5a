"""The emulated fused SDPA kernel (seam/emulated.py) against attention written the plain way in
float64: masks (boolean and additive), causal, valid sequence lengths on either side, grouped-query
heads, and the tiled path that skips keys no query of a tile may see."""

from __future__ import annotations

import pytest
import torch

from vllm_gaudi_platform.seam import emulated

TOL = {"atol": 1e-5, "rtol": 1e-5}


def _reference(q, k, v, allowed, scale=None):
    """softmax(q k^T * scale, masked) v in float64; `allowed` is boolean, broadcastable."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(dim=-1) @ v).float()


def _qkv(batch, heads, kv_heads, q_len, kv_len, dim=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(batch, heads, q_len, dim, generator=gen),
        torch.randn(batch, kv_heads, kv_len, dim, generator=gen),
        torch.randn(batch, kv_heads, kv_len, dim, generator=gen),
    )


def _packed_mask(q_len, ctx_lens, query_lens):
    """A packed prefill row: each sequence sees its own context block then its own tokens
    causally; padding queries see only their own key (the backend's convention)."""
    ctx_total = sum(ctx_lens)
    kv_len = ctx_total + q_len
    mask = torch.zeros(q_len, kv_len, dtype=torch.bool)
    col, ctx_col = 0, 0
    for c, n in zip(ctx_lens, query_lens):
        for i in range(n):
            mask[col + i, ctx_col : ctx_col + c] = True
            mask[col + i, ctx_total + col : ctx_total + col + i + 1] = True
        col += n
        ctx_col += c
    for i in range(col, q_len):
        mask[i, ctx_total + i] = True
    return mask


@pytest.mark.parametrize(
    "ctx_lens,query_lens,q_len",
    [
        ([0, 0, 0], [50, 40, 60], 160),  # three prompts, padded; not a multiple of the tile
        ([70, 0, 200], [30, 90, 10], 192),  # cached context for some sequences
        ([5], [300], 300),  # one long sequence
    ],
)
def test_tiled_path_equals_plain_masked_attention(ctx_lens, query_lens, q_len):
    assert q_len > emulated._SDPA_TILE  # the tiled path is the one under test
    mask = _packed_mask(q_len, ctx_lens, query_lens)
    q, k, v = _qkv(1, 4, 2, q_len, mask.shape[-1])
    out = emulated.fused_sdpa(q, k, v, attn_mask=mask[None, None], scale=0.3)
    torch.testing.assert_close(out, _reference(q, k, v, mask, scale=0.3), **TOL)


def test_tiled_path_handles_batches_and_per_head_masks():
    q_len, kv_len = 2 * emulated._SDPA_TILE + 3, 150
    gen = torch.Generator().manual_seed(1)
    mask = torch.rand(2, 4, q_len, kv_len, generator=gen) < 0.1
    mask[..., 0] = True  # every query row sees at least one key
    q, k, v = _qkv(2, 4, 4, q_len, kv_len, seed=2)
    out = emulated.fused_sdpa(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, _reference(q, k, v, mask), **TOL)


def test_short_queries_with_a_boolean_mask():
    mask = _packed_mask(24, [8, 0], [10, 12])
    q, k, v = _qkv(1, 2, 1, 24, mask.shape[-1])
    out = emulated.fused_sdpa(q, k, v, attn_mask=mask[None, None])
    torch.testing.assert_close(out, _reference(q, k, v, mask), **TOL)


def test_additive_mask_is_added_to_the_scores():
    q, k, v = _qkv(1, 2, 2, 5, 7)
    bias = torch.zeros(5, 7)
    bias[:, 3:] = float("-inf")
    out = emulated.fused_sdpa(q, k, v, attn_mask=bias[None, None])
    allowed = torch.ones(5, 7, dtype=torch.bool)
    allowed[:, 3:] = False
    torch.testing.assert_close(out, _reference(q, k, v, allowed), **TOL)


def test_causal_is_top_left_aligned():
    q, k, v = _qkv(1, 2, 2, 6, 6)
    out = emulated.fused_sdpa(q, k, v, is_causal=True)
    allowed = torch.ones(6, 6, dtype=torch.bool).tril()
    torch.testing.assert_close(out, _reference(q, k, v, allowed), **TOL)


@pytest.mark.parametrize("side", ["left", "right"])
def test_valid_sequence_lengths_mask_the_padded_side(side):
    q, k, v = _qkv(2, 2, 2, 9, 9)
    lens = torch.tensor([9, 5])
    out = emulated.fused_sdpa(
        q, k, v, is_causal=True, valid_sequence_lengths=lens, padding_side=side
    )
    pos = torch.arange(9)
    valid = pos[None] >= 9 - lens[:, None] if side == "left" else pos[None] < lens[:, None]
    allowed = valid[:, None, None, :] & torch.ones(9, 9, dtype=torch.bool).tril()
    # A fully masked query row (left padding) has no defined output; compare the others.
    keep = allowed.any(-1, keepdim=True).expand_as(out)
    torch.testing.assert_close(out[keep], _reference(q, k, v, allowed)[keep], **TOL)


@pytest.mark.parametrize("with_mask", [False, True])
def test_valid_sequence_lengths_are_refused_outside_the_causal_mask_free_mode(with_mask):
    # Gaudi's FusedSDPA takes valid lengths only with is_causal=True and no mask.
    q, k, v = _qkv(2, 2, 2, 4, 4)
    lens = torch.tensor([4, 2])
    mask = torch.zeros(2, 1, 4, 4) if with_mask else None
    with pytest.raises(ValueError, match="only taken with is_causal=True"):
        emulated.fused_sdpa(
            q, k, v, attn_mask=mask, is_causal=with_mask, valid_sequence_lengths=lens
        )


def test_dropout_is_refused():
    q, k, v = _qkv(1, 1, 1, 2, 2)
    with pytest.raises(ValueError, match="dropout"):
        emulated.fused_sdpa(q, k, v, dropout_p=0.1)


@pytest.mark.gaudi
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("is_causal", [False, True])
def test_gaudi_fused_sdpa_takes_grouped_query_heads_like_the_emulation(
    gaudi, gaudi_device, dtype, is_causal
):
    # seam/gaudi reshapes a grouped-query call into Gaudi's 5-D layout; the result must be the
    # emulation's (and the float64 reference's), head for head.
    q, k, v = (t.to(dtype) for t in _qkv(2, 8, 2, 37, 37, dim=64))
    mask = torch.rand(2, 1, 37, 37, generator=torch.Generator().manual_seed(1)) > 0.3
    mask |= torch.eye(37, dtype=torch.bool)  # every query sees at least one key
    attn_mask = None if is_causal else mask
    on_device = [t.to(gaudi_device) for t in (q, k, v)]
    device_mask = None if attn_mask is None else attn_mask.to(gaudi_device)

    out = gaudi.fused_sdpa(*on_device, attn_mask=device_mask, is_causal=is_causal).cpu()

    expected = emulated.fused_sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal)
    tol = TOL if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    torch.testing.assert_close(out.float(), expected.float(), **tol)
