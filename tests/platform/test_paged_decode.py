"""The flat paged decode kernel: the emulation (which skips the bucket's padding entries) against
the whole-list computation a Gaudi runs, and both against a float64 per-sequence reference."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_gaudi_platform.seam import emulated, paged_attention

HEADS, KV_HEADS, D, BLOCK = 4, 2, 16, 8
SCALE = 1 / math.sqrt(D)
LENS = [13, 1, 24]  # three decoding sequences; the batch bucket has a fourth, padding row
BATCH = 4


def _flat_step(pad_entries: int, gen: torch.Generator, pad_in_the_middle: bool = False):
    """A cache, queries and the flat block list of LENS, with `pad_entries` padding entries."""
    num_blocks = 16
    cache = torch.randn(num_blocks, BLOCK, KV_HEADS, 2 * D, generator=gen)
    query = torch.randn(BATCH, HEADS, D, generator=gen)
    free = iter(torch.randperm(num_blocks, generator=gen).tolist())
    blocks, groups, bias, rel = [], [], [], []
    for seq, n in enumerate(LENS):
        for j in range(-(-n // BLOCK)):
            used = min(BLOCK, n - j * BLOCK)
            blocks.append(next(free))
            groups.append(seq)
            bias.append([0.0] * used + [float("-inf")] * (BLOCK - used))
            rel.append([j * BLOCK + s - (n - 1) for s in range(BLOCK)])
    pad = [(0, BATCH, [float("-inf")] * BLOCK, [0] * BLOCK)] * pad_entries
    at = 2 if pad_in_the_middle else len(blocks)
    for column, fill in zip((blocks, groups, bias, rel), zip(*pad)):
        column[at:at] = list(fill)
    return (
        query,
        cache,
        torch.tensor(blocks),
        torch.tensor(groups),
        torch.tensor(bias),
        torch.tensor(rel),
    )


def _reference(query, cache, opts) -> torch.Tensor:
    """Each sequence's query against its tokens, in block order, in float64."""
    out = torch.zeros(BATCH, HEADS, D, dtype=torch.float64)
    g = HEADS // KV_HEADS
    for seq, n in enumerate(LENS):
        blocks = opts["blocks_of"][seq]
        rows = torch.cat([cache[b] for b in blocks])[:n].double()  # [n, kv_heads, 2d]
        for h in range(HEADS):
            k, v = rows[:, h // g, :D], rows[:, h // g, D:]
            scores = k @ query[seq, h].double() * SCALE
            if opts.get("soft_cap"):
                cap = opts["soft_cap"]
                scores = cap * torch.tanh(scores / cap)
            if opts.get("slopes") is not None:
                scores = scores + opts["slopes"][h].double() * (torch.arange(n) - (n - 1))
            logits = scores
            if opts.get("sinks") is not None:
                logits = torch.cat([scores, opts["sinks"][h].double().view(1)])
            probs = torch.softmax(logits, dim=0)[:n]
            out[seq, h] = probs @ v
    return out


@pytest.mark.parametrize("middle", [False, True], ids=["padding_last", "padding_in_the_middle"])
@pytest.mark.parametrize("option", ["plain", "soft_cap", "alibi", "sinks"])
def test_emulation_skipping_padding_equals_the_whole_list_and_the_reference(option, middle):
    gen = torch.Generator().manual_seed(7)
    query, cache, blocks, groups, bias, rel = _flat_step(5, gen, pad_in_the_middle=middle)
    kwargs: dict = {}
    ref_opts: dict = {"blocks_of": {}}
    for b, s in zip(blocks.tolist(), groups.tolist()):
        if s < BATCH:
            ref_opts["blocks_of"].setdefault(s, []).append(b)
    if option == "soft_cap":
        kwargs["soft_cap"] = ref_opts["soft_cap"] = 2.0
    elif option == "alibi":
        slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
        kwargs["alibi"] = (slopes, rel)
        ref_opts["slopes"] = slopes
    elif option == "sinks":
        kwargs["sinks"] = ref_opts["sinks"] = torch.randn(HEADS, generator=gen)

    whole = paged_attention.paged_decode(query, cache, blocks, groups, bias, SCALE, **kwargs)
    skipped = emulated.paged_decode(query, cache, blocks, groups, bias, SCALE, **kwargs)

    ref = _reference(query, cache, ref_opts)
    assert (whole.double() - ref).abs().max().item() < 1e-5
    assert (skipped.double() - ref).abs().max().item() < 1e-5
    assert torch.equal(whole[len(LENS) :], torch.zeros_like(whole[len(LENS) :]))
    assert torch.equal(skipped[len(LENS) :], torch.zeros_like(skipped[len(LENS) :]))


def test_padding_entries_are_dropped_with_every_per_entry_tensor():
    groups = torch.tensor([0, 0, 3, 1, 3, 2])
    blocks = torch.tensor([10, 11, 0, 12, 0, 13])
    rel = torch.arange(6)
    kept_blocks, kept_groups, kept_rel = paged_attention.drop_padding_entries(
        3, blocks, groups, rel
    )
    assert kept_blocks.tolist() == [10, 11, 12, 13]
    assert kept_groups.tolist() == [0, 0, 1, 2]
    assert kept_rel.tolist() == [0, 1, 3, 5]


def test_a_list_without_padding_is_passed_through_unchanged():
    groups, blocks = torch.tensor([0, 1]), torch.tensor([4, 5])
    out = paged_attention.drop_padding_entries(2, blocks, groups)
    assert out[0] is blocks and out[1] is groups


def test_the_gather_workspace_grows_and_is_reused_across_list_lengths():
    small = paged_attention.workspace("test_ws", (2, 3, 4), torch.float32, "cpu")
    big = paged_attention.workspace("test_ws", (2, 5, 4), torch.float32, "cpu")
    again = paged_attention.workspace("test_ws", (2, 2, 4), torch.float32, "cpu")
    assert small.shape == (2, 3, 4) and big.shape == (2, 5, 4) and again.shape == (2, 2, 4)
    assert again.data_ptr() == big.data_ptr() and again.is_contiguous()
