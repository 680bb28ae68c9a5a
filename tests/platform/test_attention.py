"""The HPU attention backend, in emulation, against a naive per-sequence attention reference:
bucketed prefill (grid and packed layouts), prefill with cached context, paged decode, mixed steps
and grouped-query attention. Padding never changes real tokens' outputs."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from vllm_gaudi_platform.attention import step_layout
from vllm_gaudi_platform.bucketing import Bucket, BucketPlan

BLOCK = 16
HEADS, KV_HEADS, DIM = 4, 2, 32
NUM_BLOCKS = 64


@pytest.fixture(autouse=True)
def _backend(hpu_backend):
    """Every test runs on both backends of the seam: the emulation, and seam/gaudi (over the Habana
    stand-in off Gaudi)."""
    return hpu_backend


def _impl(window=None, softcap=None, sinks=None, alibi=None):
    from vllm_gaudi_platform.attention.impl import HPUAttentionImpl

    return HPUAttentionImpl(
        HEADS,
        DIM,
        1 / math.sqrt(DIM),
        num_kv_heads=KV_HEADS,
        sliding_window=window,
        logits_soft_cap=softcap,
        sinks=None if sinks is None else torch.tensor(sinks),
        alibi_slopes=alibi,
    )


def _reference(
    q, k_all, v_all, ctx, window=None, softcap=None, sinks=None, alibi=None, spans=(), chunk=None
):
    """Causal attention of q (new tokens at positions ctx..) over k_all/v_all (positions 0..), in
    float64: keys at least `window` positions behind a query are masked; a query and a key both
    in one of `spans` (inclusive position ranges: an image's tokens) see each other whatever
    their order (vLLM's mm prefix rule: (causal and window) or same span); with `softcap`, scores
    become softcap * tanh(scores / softcap) before the softmax; with `alibi` (a slope per head),
    scores gain slope * (key position - query position); with `sinks` (a logit per head), the
    softmax runs over the scores and the head's sink, whose probability is dropped; with `chunk`
    (chunked local attention), a query sees only keys in its own chunk of positions."""
    group = HEADS // KV_HEADS
    q = q.double()
    k = k_all.double().repeat_interleave(group, dim=1)
    v = v_all.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(DIM)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    qpos = torch.arange(q.shape[0])[:, None] + ctx
    kpos = torch.arange(k.shape[0])[None, :]
    mask = kpos <= qpos
    if window is not None:
        mask &= qpos - kpos < window
    if chunk is not None:
        mask &= kpos // chunk == qpos // chunk
    for first, last in spans:
        mask |= (qpos >= first) & (qpos <= last) & (kpos >= first) & (kpos <= last)
    if alibi is not None:
        scores = scores + torch.tensor(alibi, dtype=torch.float64)[:, None, None] * (kpos - qpos)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = torch.tensor(sinks, dtype=torch.float64)[:, None, None].expand(-1, q.shape[0], 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v).float()


def _run(
    query_lens,
    ctx_lens,
    plan,
    seed=0,
    dtype=torch.float32,
    window=None,
    softcap=None,
    sinks=None,
    alibi=None,
    split=False,
    layers=1,
    image_spans=None,
    chunk=None,
):
    """Run one step through the backend; return its outputs and the reference per request.
    With `split`, a mixed step runs as the runner runs it: a decode pass, then a prefill pass,
    each over its own tokens with its part's metadata. With `layers`, that many layers of the
    same kind run the (unsplit) step one after another on its one metadata, as a model's
    layers do; the last layer's output is returned. `image_spans` (request -> inclusive position
    ranges) makes the step an mm prefix LM's, as vLLM passes them. `chunk`: the layers are
    chunked local attention layers (their metadata carries the chunk, as their builder sets it)."""
    from vllm_gaudi_platform.attention.metadata_builder import build_metadata

    gen = torch.Generator().manual_seed(seed)
    n = len(query_lens)
    seq_lens = [c + q for c, q in zip(ctx_lens, query_lens)]
    # Disjoint blocks per request, not starting at 0 (block 0 is the null block).
    max_blocks = max(-(-s // BLOCK) for s in seq_lens)
    table = torch.arange(1, 1 + n * max_blocks, dtype=torch.int32).view(n, max_blocks)
    kv_cache = torch.zeros(NUM_BLOCKS, KV_HEADS, BLOCK, 2 * DIM).transpose(1, 2).contiguous()
    kv_cache = kv_cache.transpose(1, 2)  # logical [B, H, N, C] over block-size-first storage
    flat = kv_cache.transpose(1, 2).reshape(NUM_BLOCKS * BLOCK, KV_HEADS, 2 * DIM)
    full_k, full_v = [], []
    for i, s in enumerate(seq_lens):
        k = torch.randn(s, KV_HEADS, DIM, generator=gen)
        v = torch.randn(s, KV_HEADS, DIM, generator=gen)
        full_k.append(k)
        full_v.append(v)
        slots = table[i, torch.arange(ctx_lens[i]) // BLOCK].long() * BLOCK + (
            torch.arange(ctx_lens[i]) % BLOCK
        )
        flat[slots] = torch.cat([k[: ctx_lens[i]], v[: ctx_lens[i]]], -1)
    queries = [torch.randn(q, HEADS, DIM, generator=gen) for q in query_lens]

    layout = step_layout.plan_step(
        query_lens=query_lens, seq_lens=seq_lens, block_size=BLOCK, plan=plan
    )
    if split:
        layout = step_layout.split_passes(layout, seq_lens, BLOCK, plan)
        assert layout.parts is not None
    total = layout.num_tokens_padded
    real = sum(query_lens)
    q = torch.zeros(total, HEADS * DIM)
    k = torch.zeros(total, KV_HEADS * DIM)
    v = torch.zeros(total, KV_HEADS * DIM)
    q[:real] = torch.cat(queries).view(real, -1)
    k[:real] = torch.cat([kk[c:] for kk, c in zip(full_k, ctx_lens)]).view(real, -1)
    v[:real] = torch.cat([vv[c:] for vv, c in zip(full_v, ctx_lens)]).view(real, -1)
    q[real:] = 1e3  # padding garbage must not leak into real outputs
    slot_mapping = torch.cat(
        [
            table[i, torch.arange(c, s) // BLOCK].long() * BLOCK + torch.arange(c, s) % BLOCK
            for i, (c, s) in enumerate(zip(ctx_lens, seq_lens))
        ]
    )
    md = build_metadata(
        layout=layout,
        seq_lens=seq_lens,
        block_table=table,
        slot_mapping=slot_mapping,
        block_size=BLOCK,
        device=torch.device("cpu"),
        image_spans=image_spans,
    )
    if chunk is not None:
        from vllm_gaudi_platform.attention.chunked_local import with_chunk

        with_chunk(md, chunk)
    out = torch.zeros(total, HEADS * DIM, dtype=dtype)
    kv_cache = kv_cache.to(dtype)
    impl = _impl(window, softcap, sinks, alibi)
    if split:
        # The passes in reverse: each reads only its own requests' cache.
        passes = [(part, one.tokens) for part, one in zip(md.parts, layout.parts.passes)]
        for part_md, tokens in reversed(passes):
            t, n_pad = list(tokens), part_md.layout.num_tokens_padded
            pq, pk, pv = (torch.full((n_pad, x.shape[1]), 1e3, dtype=dtype) for x in (q, k, v))
            pq[: len(t)], pk[: len(t)], pv[: len(t)] = q[t], k[t], v[t]
            part_out = torch.zeros(n_pad, HEADS * DIM, dtype=dtype)
            impl.forward(None, pq, pk, pv, kv_cache, part_md, part_out)
            out[t] = part_out[: len(t)]
    else:
        for layer in [impl] + [_impl(window, softcap, sinks, alibi) for _ in range(layers - 1)]:
            layer.forward(None, q.to(dtype), k.to(dtype), v.to(dtype), kv_cache, md, out)
    refs = [
        _reference(
            queries[i],
            full_k[i],
            full_v[i],
            ctx_lens[i],
            window,
            softcap,
            sinks,
            alibi,
            spans=(image_spans or {}).get(i, ()),
            chunk=chunk,
        ).reshape(query_lens[i], -1)
        for i in range(n)
    ]
    return out[:real].float(), torch.cat(refs), layout


def _plan(prompt=(), decode=()):
    return BucketPlan(
        strategy="test",
        prompt=tuple(Bucket("prompt", *b) for b in prompt),
        decode=tuple(Bucket("decode", *b) for b in decode),
    )


def test_prefill_grid_layout_matches_reference():
    plan = _plan(prompt=[(4, 32, 0)])
    out, ref, layout = _run([5, 17, 32], [0, 0, 0], plan)
    assert layout.prefill.rows == 4 and layout.prefill.warmed
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_prefill_packed_layout_matches_reference_when_no_batched_bucket_fits():
    plan = _plan(prompt=[(1, 64, 4)])
    out, ref, layout = _run([5, 17, 30], [0, 0, 0], plan)
    assert layout.prefill.rows == 1 and layout.prefill.row_members == ((0, 1, 2),)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_prefill_with_cached_context_matches_reference():
    plan = _plan(prompt=[(2, 16, 4)])
    out, ref, layout = _run([7, 16], [40, 16], plan)
    assert layout.prefill.ctx_bucket == 4
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_paged_decode_matches_reference():
    plan = _plan(decode=[(4, 1, 8)])
    out, ref, layout = _run([1, 1, 1], [3, 20, 33], plan)
    assert layout.decode.batch_bucket == 4 and layout.decode.blocks_bucket == 8
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_a_decode_only_step_lays_its_cells_out_in_token_order():
    from vllm_gaudi_platform.attention.metadata_builder import build_metadata

    lens = [3, 20, 33]
    layout = step_layout.plan_step(
        query_lens=[1, 1, 1], seq_lens=lens, block_size=BLOCK, plan=_plan(decode=[(4, 1, 8)])
    )
    md = build_metadata(
        layout=layout,
        seq_lens=lens,
        block_table=torch.arange(1, 1 + 3 * 4, dtype=torch.int32).view(3, 4),
        slot_mapping=torch.zeros(3, dtype=torch.int64),
        block_size=BLOCK,
        device=torch.device("cpu"),
    )
    assert md.identity_layout  # no permutation of q, k, v or the output
    assert md.cell_to_token.tolist() == md.token_to_cell.tolist() == [0, 1, 2, 3]
    # Blocks of each sequence in order (1, 2 and 3 blocks), then padding entries.
    assert md.decode_block_list.tolist() == [1, 5, 6, 9, 10, 11, 0, 0]
    assert md.decode_block_groups.tolist() == [0, 1, 1, 2, 2, 2, 4, 4]
    assert md.decode_block_usage.tolist() == [3, 16, 4, 16, 16, 1, 0, 0]


def test_mixed_prefill_and_decode_step_matches_reference():
    plan = _plan(prompt=[(2, 32, 2)], decode=[(2, 1, 4)])
    out, ref, layout = _run([1, 1, 9, 20], [15, 30, 0, 17], plan)
    assert layout.prefill is not None and layout.decode is not None and layout.warmed
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("window", [None, 20])
def test_mixed_step_run_as_a_decode_pass_and_a_prefill_pass_matches_reference(window):
    # How the runner runs a mixed step: each pass is exactly one warmed bucket of the plan.
    plan = _plan(prompt=[(2, 32, 2)], decode=[(2, 1, 4)])
    out, ref, layout = _run([1, 1, 9, 20], [15, 30, 0, 17], plan, window=window, split=True)
    prefill, decode = layout.parts.passes
    assert prefill.layout.buckets == (Bucket("prompt", 2, 32, 2),)
    assert decode.layout.buckets == (Bucket("decode", 2, 1, 4),)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_mixed_step_with_a_decode_among_the_prefills_runs_in_parts():
    # A prompt's one-token last chunk is a decode-part request, wherever vLLM puts it.
    plan = _plan(prompt=[(2, 32, 2)], decode=[(2, 1, 4)])
    out, ref, layout = _run([1, 9, 1, 20], [15, 0, 30, 17], plan, split=True)
    prefill, decode = layout.parts.passes
    assert decode.tokens == (0, 10)
    assert prefill.tokens == (*range(1, 10), *range(11, 31))
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_prompts_run_in_passes_of_rows_match_reference():
    # A plan without packing (a model with state-space layers) and buckets of two rows: three
    # prompts and a decode run as two prefill passes and a decode pass.
    plan = dataclasses.replace(_plan(prompt=[(2, 32, 2)], decode=[(2, 1, 4)]), pack_prefills=False)
    out, ref, layout = _run([9, 1, 20, 12], [0, 30, 17, 10], plan, split=True)
    assert [one.requests for one in layout.parts.passes] == [(0, 2), (3,), (1,)]
    assert layout.warmed
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_shape_without_bucket_runs_exactly_and_is_not_warmed():
    out, ref, layout = _run([3, 9], [0, 0], _plan(prompt=[(1, 8, 0)]))
    assert not layout.warmed
    assert layout.num_tokens_padded == 12
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_bfloat16_prefill_and_decode_stay_close_to_float32_reference():
    # bfloat16 keeps 8 bits of mantissa: outputs (|x| ~ 1) agree to a few 1e-2.
    plan = _plan(prompt=[(2, 16, 2)], decode=[(2, 1, 4)])
    out, ref, _ = _run([1, 12], [20, 5], plan, seed=3, dtype=torch.bfloat16)
    torch.testing.assert_close(out, ref, atol=5e-2, rtol=5e-2)


def test_packed_context_buckets_extend_single_row_context_fourfold():
    plan = _plan(prompt=[(1, 64, 0), (1, 64, 2), (1, 128, 2)])
    extended = step_layout.with_packed_context(plan)
    added = set(extended.prompt) - set(plan.prompt)
    assert added == {Bucket("prompt", 1, q, c) for q in (64, 128) for c in (4, 8)}
    assert extended.decode == plan.decode


def test_packed_rows_get_query_buckets_up_to_the_token_budget():
    # Budget 512 over a plan whose single-row queries stop at max_model_len (128): a row packed
    # with several prompts can hold up to 512 new tokens; those buckets only packed rows fill.
    plan = _plan(prompt=[(1, 64, 0), (1, 128, 2)])
    extended = step_layout.with_packed_context(plan, packed_rows=(512, 128))
    longer = {b for b in extended.prompt if b.query_len > 128}
    assert longer == {Bucket("prompt", 1, q, c) for q in (256, 512) for c in (0, 2, 4, 8)}
    assert all(step_layout.packed_only(b, 128) for b in longer)
    assert not any(step_layout.packed_only(b, 128) for b in plan.prompt)
    # Four prompts of 100 new tokens: one packed row, which now finds a warmed bucket.
    layout = step_layout.plan_step(
        query_lens=[100] * 4, seq_lens=[100] * 4, block_size=BLOCK, plan=extended
    )
    assert layout.warmed and layout.prefill.bucket == Bucket("prompt", 1, 512, 0)
    # A budget within max_model_len adds no query bucket: the plan's own query range (which an
    # operator may have capped below max_model_len) stays as it is.
    capped = step_layout.with_packed_context(plan, packed_rows=(512, 512))
    assert max(b.query_len for b in capped.prompt) == 128
    unextended = step_layout.with_packed_context(plan)
    layout = step_layout.plan_step(
        query_lens=[100] * 4, seq_lens=[100] * 4, block_size=BLOCK, plan=unextended
    )
    assert not layout.warmed


def test_a_packed_only_buckets_warmup_splits_it_into_schedulable_sequences():
    bucket = Bucket("prompt", 1, 512, 8)
    layout, seq_lens = step_layout.layout_for_bucket(bucket, BLOCK, packed=True, max_model_len=128)
    # 512 new tokens and 8 context blocks of 16 over sequences of at most 128 positions.
    assert sum(layout.query_lens) == 512 and len(seq_lens) == 5
    assert sum(s - q for s, q in zip(seq_lens, layout.query_lens)) == 8 * BLOCK
    assert max(seq_lens) <= 128 + BLOCK
    assert layout.prefill.row_members == (tuple(range(5)),)


def test_bucket_file_plans_are_not_extended():
    plan = BucketPlan(strategy="file", prompt=(Bucket("prompt", 1, 64, 2),), decode=())
    assert step_layout.with_packed_context(plan) is plan


# ----------------------------------------------------------------------------- sliding window
# Windows shorter than the sequences, so the window really cuts: inside one block (5), across
# blocks (20, BLOCK = 16), and in prefill rows, with context, packed rows and decode.
@pytest.mark.parametrize("window", [5, 20])
def test_windowed_prefill_with_context_matches_reference(window):
    plan = _plan(prompt=[(2, 16, 4)])
    out, ref, _ = _run([7, 16], [40, 16], plan, window=window)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("window", [5, 20])
def test_windowed_packed_prefill_keeps_sequences_apart(window):
    plan = _plan(prompt=[(1, 64, 4)])
    out, ref, layout = _run([5, 17, 30], [0, 0, 0], plan, window=window)
    assert layout.prefill.rows == 1
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("window", [5, 20])
def test_windowed_paged_decode_masks_slots_and_whole_blocks_behind_the_window(window):
    plan = _plan(decode=[(4, 1, 8)])
    out, ref, _ = _run([1, 1, 1], [3, 20, 50], plan, window=window)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_window_longer_than_every_sequence_changes_nothing():
    plan = _plan(prompt=[(2, 32, 2)], decode=[(2, 1, 4)])
    windowed, _, _ = _run([1, 1, 9, 20], [15, 30, 0, 17], plan, window=4096)
    plain, _, _ = _run([1, 1, 9, 20], [15, 30, 0, 17], plan)
    torch.testing.assert_close(windowed, plain)


def test_a_window_that_cuts_changes_the_result():
    # The reference check above could pass vacuously if no window cut anything.
    plan = _plan(decode=[(4, 1, 8)])
    windowed, _, _ = _run([1, 1, 1], [3, 20, 50], plan, window=5)
    plain, _, _ = _run([1, 1, 1], [3, 20, 50], plan)
    assert not torch.allclose(windowed[1:], plain[1:], atol=1e-3)


# ----------------------------------------------------------------------------- soft-capping
@pytest.mark.parametrize("window", [None, 20])
def test_softcapped_mixed_step_matches_reference(window):
    # Scores of random unit-variance q/k reach ~ +-10; a cap of 5 bends them strongly.
    plan = _plan(prompt=[(2, 32, 2)], decode=[(2, 1, 4)])
    out, ref, _ = _run([1, 1, 9, 20], [15, 30, 0, 17], plan, window=window, softcap=5.0)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    uncapped, _, _ = _run([1, 1, 9, 20], [15, 30, 0, 17], plan, window=window)
    assert not torch.allclose(out, uncapped, atol=1e-3)


# ----------------------------------------------------------------------------- attention sinks
# A sink logit per query head (gpt-oss style): large sinks soak up most of the probability, so a
# kernel that forgot them would be far off the reference.
SINKS = [0.0, 2.0, -1.0, 4.0]
ONE_SEQUENCE_PER_ROW = _plan(prompt=[(4, 32, 0)])  # the causal fast path, no mask tensor
MIXED_STEPS = {
    "fast-prefill": (ONE_SEQUENCE_PER_ROW, [5, 17, 32], [0, 0, 0]),
    "packed-prefill": (_plan(prompt=[(1, 64, 4)]), [5, 17, 30], [0, 0, 0]),
    "context-and-decode": (
        _plan(prompt=[(2, 32, 2)], decode=[(2, 1, 4)]),
        [1, 1, 9, 20],
        [15, 30, 0, 17],
    ),
    "decode": (_plan(decode=[(4, 1, 8)]), [1, 1, 1], [3, 20, 50]),
}


@pytest.mark.parametrize("step", sorted(MIXED_STEPS))
def test_attention_sinks_match_reference(step):
    plan, query_lens, ctx_lens = MIXED_STEPS[step]
    out, ref, _ = _run(query_lens, ctx_lens, plan, sinks=SINKS)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    plain, _, _ = _run(query_lens, ctx_lens, plan)
    assert not torch.allclose(out, plain, atol=1e-2)


@pytest.mark.parametrize("window", [5, 20])
def test_attention_sinks_with_a_sliding_window_match_reference(window):
    # gpt-oss: every layer has sinks, every other layer a window.
    plan = _plan(prompt=[(2, 16, 4)], decode=[(2, 1, 8)])
    out, ref, _ = _run([1, 1, 7, 16], [3, 50, 40, 16], plan, window=window, sinks=SINKS)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_attention_sinks_in_bfloat16_stay_close_to_float32_reference():
    plan = _plan(prompt=[(2, 16, 2)], decode=[(2, 1, 4)])
    out, ref, _ = _run([1, 12], [20, 5], plan, seed=3, dtype=torch.bfloat16, sinks=SINKS)
    torch.testing.assert_close(out, ref, atol=5e-2, rtol=5e-2)


# ----------------------------------------------------------------------------- ALiBi
# Slopes steep enough that keys a few positions back lose most of their weight.
SLOPES = [0.5, 0.25, 0.125, 0.0625]


@pytest.mark.parametrize("step", sorted(MIXED_STEPS))
def test_alibi_biases_match_reference(step):
    plan, query_lens, ctx_lens = MIXED_STEPS[step]
    out, ref, _ = _run(query_lens, ctx_lens, plan, alibi=SLOPES)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    plain, _, _ = _run(query_lens, ctx_lens, plan)
    assert not torch.allclose(out, plain, atol=1e-2)


def test_alibi_with_soft_capping_matches_reference():
    plan = _plan(prompt=[(2, 32, 2)], decode=[(2, 1, 4)])
    out, ref, _ = _run([1, 1, 9, 20], [15, 30, 0, 17], plan, softcap=5.0, alibi=SLOPES)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"alibi": SLOPES, "window": 20}, "ALiBi and a sliding window"),
        ({"alibi": SLOPES, "sinks": SINKS}, "ALiBi and attention sinks"),
        ({"sinks": SINKS, "softcap": 5.0}, "attention sinks and logit soft-capping"),
    ],
)
def test_unsupported_combinations_are_refused_by_name(settings, named):
    with pytest.raises(NotImplementedError, match=named):
        _impl(**settings)


# ----------------------------------------------------------------------------- mixed steps in parts
def test_a_mixed_step_splits_into_a_prefill_and_a_decode_layout_over_its_own_requests():
    plan = _plan(prompt=[(2, 32, 2)], decode=[(2, 1, 4)])
    layout = step_layout.plan_step(
        query_lens=[1, 1, 9, 20], seq_lens=[16, 31, 9, 37], block_size=BLOCK, plan=plan
    )
    prefill, decode = step_layout.split_passes(layout, [16, 31, 9, 37], BLOCK, plan).parts.passes
    assert decode.layout.query_lens == (1, 1) and decode.layout.prefill is None
    assert prefill.layout.query_lens == (9, 20) and prefill.layout.decode is None
    assert prefill.layout.prefill.row_members == ((0,), (1,))  # renumbered from (2,), (3,)
    assert (prefill.requests, decode.requests) == ((2, 3), (0, 1))
    assert prefill.layout.num_tokens_padded + decode.layout.num_tokens_padded == (
        layout.num_tokens_padded
    )


def test_steps_with_one_part_are_not_split():
    plan = _plan(prompt=[(2, 32, 2)], decode=[(2, 1, 4)])
    for query_lens, seq_lens in (([9, 20], [9, 20]), ([1, 1], [5, 9])):
        layout = step_layout.plan_step(
            query_lens=query_lens, seq_lens=seq_lens, block_size=BLOCK, plan=plan
        )
        assert step_layout.split_passes(layout, seq_lens, BLOCK, plan).parts is None
