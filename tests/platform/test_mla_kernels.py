"""The emulated MLA kernels (weight-absorbed latent attention, prefill and paged decode) against a
naive per-sequence float64 reference: softmax(q . latent / sqrt) @ latent[:, :kv_lora_rank]."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_gaudi_platform.seam import emulated

HEADS, RANK, ROPE = 4, 64, 16
WIDTH = RANK + ROPE
SCALE = 1 / math.sqrt(48)
BLOCK = 16


def _reference(q: torch.Tensor, latent: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """q [heads, q_len, WIDTH], latent [kv_len, WIDTH], visible bool [q_len, kv_len] -> float64
    [heads, q_len, RANK], one query and one key at a time."""
    q, latent = q.double(), latent.double()
    heads, q_len, _ = q.shape
    out = torch.zeros(heads, q_len, RANK, dtype=torch.float64)
    for h in range(heads):
        for i in range(q_len):
            keys = [j for j in range(latent.shape[0]) if visible[i, j]]
            scores = torch.stack([q[h, i] @ latent[j] * SCALE for j in keys])
            probs = torch.softmax(scores, dim=0)
            out[h, i] = sum(p * latent[j, :RANK] for p, j in zip(probs, keys))
    return out


def test_mla_prefill_matches_reference_with_causal_context_and_padding_masks():
    gen = torch.Generator().manual_seed(0)
    rows, q_len, ctx = 2, 12, 20
    kv_len = ctx + q_len
    q = torch.randn(rows, HEADS, q_len, WIDTH, generator=gen)
    latent = torch.randn(rows, kv_len, WIDTH, generator=gen)
    # Row 0: 20 cached tokens, then 12 new causal tokens. Row 1: 7 cached, 9 new, padding after.
    mask = torch.zeros(rows, 1, q_len, kv_len, dtype=torch.bool)
    qi = torch.arange(q_len)[:, None]
    kj = torch.arange(q_len)[None, :]
    mask[0, 0, :, :ctx] = True
    mask[0, 0, :, ctx:] = kj <= qi
    mask[1, 0, :9, :7] = True
    mask[1, 0, :9, ctx : ctx + 9] = (kj <= qi)[:9, :9]
    for i in range(9, q_len):  # padding queries see only their own key
        mask[1, 0, i, ctx + i] = True

    out = emulated.mla_prefill(q, latent, mask, SCALE, RANK)

    assert out.shape == (rows, HEADS, q_len, RANK)
    for r in range(rows):
        ref = _reference(q[r], latent[r], mask[r, 0])
        assert (out[r].double() - ref).abs().max().item() < 1e-4


def test_mla_prefill_keeps_bfloat16_inputs_close_to_the_reference():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, HEADS, 8, WIDTH, generator=gen).bfloat16()
    latent = torch.randn(1, 8, WIDTH, generator=gen).bfloat16()
    mask = torch.ones(8, 8, dtype=torch.bool).tril()[None, None]

    out = emulated.mla_prefill(q, latent, mask, SCALE, RANK)

    assert out.dtype == torch.bfloat16
    ref = _reference(q[0], latent[0], mask[0, 0])
    assert (out[0].double() - ref).abs().max().item() < 2e-2


def _paged_case(seq_lens: list[int], nb_bucket: int, batch_bucket: int, seed: int):
    """A latent cache with shuffled block ids, and the flat block list / groups / bias of a
    decode step over `seq_lens` (padded to the buckets)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 32
    cache = torch.randn(num_blocks, BLOCK, WIDTH, generator=gen)
    free = torch.randperm(num_blocks - 1, generator=gen) + 1  # block 0: the null block
    tables, block_list, groups, bias = [], [], [], []
    taken = 0
    for s, n in enumerate(seq_lens):
        nblk = -(-n // BLOCK)
        ids = free[taken : taken + nblk].tolist()
        taken += nblk
        tables.append(ids)
        for j, b in enumerate(ids):
            used = min(BLOCK, n - j * BLOCK)
            block_list.append(b)
            groups.append(s)
            bias.append([0.0] * used + [float("-inf")] * (BLOCK - used))
    while len(block_list) < nb_bucket:
        block_list.append(0)
        groups.append(batch_bucket)
        bias.append([float("-inf")] * BLOCK)
    q = torch.randn(batch_bucket, HEADS, WIDTH, generator=gen)
    return (
        q,
        cache,
        tables,
        torch.tensor(block_list),
        torch.tensor(groups),
        torch.tensor(bias),
    )


def test_mla_paged_decode_matches_reference_over_each_sequences_blocks():
    seq_lens = [1, 17, 40, 16]
    q, cache, tables, blocks, groups, bias = _paged_case(seq_lens, 12, 6, seed=2)

    out = emulated.mla_paged_decode(q, cache, blocks, groups, bias, SCALE, RANK)

    assert out.shape == (6, HEADS, RANK)
    for s, n in enumerate(seq_lens):
        latent = torch.cat([cache[b] for b in tables[s]])[:n]
        visible = torch.ones(1, n, dtype=torch.bool)
        ref = _reference(q[s, :, None], latent, visible)[:, 0]
        assert (out[s].double() - ref).abs().max().item() < 1e-4


def test_mla_paged_decode_gives_padding_sequences_zeros_and_finite_values():
    q, cache, _, blocks, groups, bias = _paged_case([5], 4, 3, seed=3)

    out = emulated.mla_paged_decode(q, cache, blocks, groups, bias, SCALE, RANK)

    assert torch.isfinite(out).all()
    assert out[1:].abs().max().item() == 0.0


@pytest.mark.parametrize("order", ["forward", "reversed"])
def test_mla_paged_decode_does_not_depend_on_block_list_order(order):
    q, cache, _, blocks, groups, bias = _paged_case([30, 9], 6, 2, seed=4)
    perm = torch.arange(blocks.numel())
    if order == "reversed":
        perm = perm.flip(0)

    base = emulated.mla_paged_decode(q, cache, blocks, groups, bias, SCALE, RANK)
    moved = emulated.mla_paged_decode(q, cache, blocks[perm], groups[perm], bias[perm], SCALE, RANK)

    assert (base - moved).abs().max().item() < 1e-5
