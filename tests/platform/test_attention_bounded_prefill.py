"""Bounded prefill memory and window-narrowed block gathers in the HPU attention backend, on both
backends of the seam (`hpu_backend`: the emulation, and seam/gaudi over the Habana stand-in off
Gaudi), each checked against the float64 per-sequence reference of test_attention.py:

- prefill rows of one sequence without context, window or soft-cap call the fused SDPA in its
  causal mode with valid lengths and no mask, and equal the masked path;
- every other prefill attends in slices of VLLM_PREFILL_QUERY_SLICE queries: no mask or score
  tensor spans more than one slice of queries, and any slice length gives the unsliced result;
- a windowed layer gathers only window_blocks(window, block) context blocks per prefill row and
  keeps only batch x window_blocks decode blocks, with the result of the full gather;
- the emulated causal SDPA tiles over queries instead of building a [q_len, kv_len] mask;
- a step's masks are built by its first layer and reused by the later ones (within a budget).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.platform.test_attention import BLOCK, _plan, _run
from vllm_gaudi_platform import envs
from vllm_gaudi_platform.seam import emulated as kernels

TOL = {"atol": 1e-4, "rtol": 1e-4}


@pytest.fixture
def attention(hpu_backend):
    """The attention metadata module: `HPUAttentionMetadata` and `window_blocks`, which its
    window narrowing reads (so a patch of it here turns narrowing off)."""
    from vllm_gaudi_platform.attention import metadata as attention

    return attention


@pytest.fixture
def sdpa_calls(monkeypatch, hpu_backend):
    """Every fused_sdpa call of the backend: its keyword arguments and tensor shapes."""
    calls = []
    real = hpu_backend.fused_sdpa

    def spy(query, key, value, **kwargs):
        calls.append({"q": query.shape, "k": key.shape, **kwargs})
        return real(query, key, value, **kwargs)

    monkeypatch.setattr(hpu_backend, "fused_sdpa", spy)
    return calls


def _masked_path_only(monkeypatch, attention):
    """Force the sliced, masked prefill path even where the causal path applies."""
    monkeypatch.setattr(attention.HPUAttentionMetadata, "prefill_causal_only", lambda self: False)


def _full_gathers_only(monkeypatch, attention):
    """Turn window narrowing off: every context and decode block is gathered."""
    monkeypatch.setattr(attention, "window_blocks", lambda window, block_size: 1 << 30)


# ----------------------------------------------------------------------------- causal, no mask
def test_prefill_without_context_calls_causal_sdpa_without_a_mask(sdpa_calls):
    out, ref, layout = _run([5, 17, 32], [0, 0, 0], _plan(prompt=[(4, 32, 0)]))
    torch.testing.assert_close(out, ref, **TOL)
    assert layout.prefill.ctx_bucket == 0
    (call,) = sdpa_calls
    assert call["is_causal"] and call.get("attn_mask") is None
    assert call["padding_side"] == "right"
    # Real rows carry their query lengths; the padding row any length that keeps it finite.
    assert call["valid_sequence_lengths"].tolist()[:3] == [5, 17, 32]


def test_prefill_without_mask_equals_the_masked_path(monkeypatch, attention):
    plan = _plan(prompt=[(4, 32, 0)])
    causal, ref, _ = _run([5, 17, 32], [0, 0, 0], plan, seed=4)
    _masked_path_only(monkeypatch, attention)
    masked, _, _ = _run([5, 17, 32], [0, 0, 0], plan, seed=4)
    torch.testing.assert_close(causal, masked, **TOL)
    torch.testing.assert_close(masked, ref, **TOL)


def test_packed_rows_keep_sequences_apart_with_a_mask(sdpa_calls):
    out, ref, layout = _run([5, 17, 30], [0, 0, 0], _plan(prompt=[(1, 64, 0)]))
    assert layout.prefill.row_members == ((0, 1, 2),)
    torch.testing.assert_close(out, ref, **TOL)
    assert all(call.get("attn_mask") is not None for call in sdpa_calls)


def test_context_window_and_softcap_layers_do_not_take_the_causal_path(sdpa_calls):
    plan = _plan(prompt=[(4, 32, 0)])
    _run([5, 17, 32], [0, 0, 0], plan, window=8)
    _run([5, 17, 32], [0, 0, 0], plan, softcap=5.0)  # soft-cap runs outside the fused kernel
    _run([7, 16], [40, 16], _plan(prompt=[(2, 16, 4)]))
    assert sdpa_calls and all(call.get("attn_mask") is not None for call in sdpa_calls)


# ----------------------------------------------------------------------------- query slices
CASES = {
    "no_context": ([9, 30, 21], [0, 0, 0], [(4, 32, 0)]),
    "cached_context": ([7, 30], [40, 19], [(2, 32, 4)]),
    "packed_with_context": ([6, 20, 11], [35, 0, 18], [(1, 48, 6)]),
}


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("window", [None, 5, 20])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("query_slice", [1, 7, 16])
def test_sliced_prefill_equals_unsliced_and_reference(
    monkeypatch, case, window, softcap, query_slice, attention
):
    query_lens, ctx_lens, prompt = CASES[case]
    plan = _plan(prompt=prompt)
    _masked_path_only(monkeypatch, attention)
    whole, ref, _ = _run(query_lens, ctx_lens, plan, seed=1, window=window, softcap=softcap)
    monkeypatch.setenv(envs.VLLM_PREFILL_QUERY_SLICE, str(query_slice))
    sliced, _, _ = _run(query_lens, ctx_lens, plan, seed=1, window=window, softcap=softcap)
    torch.testing.assert_close(sliced, whole, **TOL)
    torch.testing.assert_close(sliced, ref, **TOL)


def test_no_mask_spans_more_queries_than_one_slice(monkeypatch, sdpa_calls, attention):
    monkeypatch.setenv(envs.VLLM_PREFILL_QUERY_SLICE, "8")
    out, ref, _ = _run([7, 30], [40, 19], _plan(prompt=[(2, 32, 4)]), window=20)
    torch.testing.assert_close(out, ref, **TOL)
    masks = [call["attn_mask"] for call in sdpa_calls]
    assert len(masks) == 4  # 32 queries / 8, fixed by the bucket
    assert all(mask.shape[-2] <= 8 for mask in masks)
    # Each slice reads the context plus the new tokens up to its own last query only.
    ctx_keys = attention.window_blocks(20, BLOCK) * BLOCK
    assert [mask.shape[-1] for mask in masks] == [ctx_keys + 8 * (i + 1) for i in range(4)]


@pytest.mark.parametrize("value", ["0", "-3", "abc", "1.5"])
def test_bad_query_slice_names_the_variable(monkeypatch, value):
    monkeypatch.setenv(envs.VLLM_PREFILL_QUERY_SLICE, value)
    with pytest.raises(envs.EnvError, match="VLLM_PREFILL_QUERY_SLICE"):
        envs.prefill_query_slice()


# ----------------------------------------------------------------------------- window narrowing
@pytest.mark.parametrize("window", [1, 5, 16, 17, 20, 33])
def test_window_blocks_bounds_the_blocks_any_window_touches(window, attention):
    # Slide a window of `window` positions over every offset: the blocks it touches never
    # exceed window_blocks, and some offset reaches the bound.
    touched = [len({p // BLOCK for p in range(s, s + window)}) for s in range(4 * BLOCK)]
    assert max(touched) == attention.window_blocks(window, BLOCK)


@pytest.mark.parametrize("window", [5, 20, 40])
def test_windowed_prefill_gathers_only_blocks_inside_the_window(monkeypatch, window, attention):
    # Contexts of 100 and 57 tokens: 7 blocks of context bucket, the window needs far fewer.
    plan = _plan(prompt=[(2, 16, 7)])
    narrow, ref, _ = _run([9, 16], [100, 57], plan, seed=2, window=window)
    _full_gathers_only(monkeypatch, attention)
    full, _, _ = _run([9, 16], [100, 57], plan, seed=2, window=window)
    torch.testing.assert_close(narrow, full, **TOL)
    torch.testing.assert_close(narrow, ref, **TOL)


def test_windowed_prefill_gather_count_comes_from_bucket_and_window(monkeypatch, attention):
    plan = _plan(prompt=[(2, 16, 7)])
    seen = []
    real = attention.HPUAttentionMetadata.prefill_keys_for

    def record(self, window, block_size):
        blocks, k_seq, k_pos = real(self, window, block_size)
        seen.append((window, tuple(blocks.shape), k_seq.shape[1]))
        return blocks, k_seq, k_pos

    monkeypatch.setattr(attention.HPUAttentionMetadata, "prefill_keys_for", record)
    for query_lens, ctx_lens in [([9, 16], [100, 57]), ([3, 2], [20, 97]), ([16, 16], [0, 0])]:
        _run(query_lens, ctx_lens, plan, window=20)
    wb = attention.window_blocks(20, BLOCK)
    # Asked by the layer and by its slice masks; the same narrowed shape every time.
    assert len(seen) >= 3
    assert set(seen) == {(20, (2, wb), wb * BLOCK + 16)}


def test_packed_prefill_with_context_gathers_every_block_and_stays_exact(hpu_backend):
    # Two sequences with context in one row: narrowing would need a block count per sequence,
    # so the packed variant gathers the whole context bucket.
    plan = _plan(prompt=[(1, 48, 12)])
    out, ref, layout = _run([6, 20, 11], [85, 0, 70], plan, window=20)
    assert layout.prefill.rows == 1 and len(layout.prefill.row_members[0]) == 3
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("window", [5, 20])
def test_windowed_decode_keeps_only_blocks_inside_the_window(monkeypatch, window, attention):
    plan = _plan(decode=[(4, 1, 24)])
    narrow, ref, layout = _run([1, 1, 1], [3, 150, 200], plan, seed=5, window=window)
    assert layout.decode.blocks_bucket == 24
    _full_gathers_only(monkeypatch, attention)
    full, _, _ = _run([1, 1, 1], [3, 150, 200], plan, seed=5, window=window)
    torch.testing.assert_close(narrow, full, **TOL)
    torch.testing.assert_close(narrow, ref, **TOL)


def test_windowed_decode_block_count_comes_from_bucket_and_window(attention):
    from vllm_gaudi_platform.attention.metadata_builder import build_metadata
    from vllm_gaudi_platform.attention.step_layout import plan_step

    lens = [3, 150, 200]
    layout = plan_step(
        query_lens=[1, 1, 1], seq_lens=lens, block_size=BLOCK, plan=_plan(decode=[(4, 1, 24)])
    )
    table = torch.arange(1, 1 + 3 * 13, dtype=torch.int32).view(3, 13)
    md = build_metadata(
        layout=layout,
        seq_lens=lens,
        block_table=table,
        slot_mapping=torch.zeros(3, dtype=torch.int64),
        block_size=BLOCK,
        device=torch.device("cpu"),
    )
    blocks, groups, bias = md.decode_blocks_for(20, 4, BLOCK)
    assert blocks.shape == (4 * attention.window_blocks(20, BLOCK),)  # 12 of 24
    # Kept: the blocks holding positions 130..149 and 180..199, and sequence 0's only block.
    kept = {(int(g), int(b)) for g, b in zip(groups, blocks) if g < 4}
    expected = {(0, 1)} | {(1, 14 + 130 // BLOCK), (1, 14 + 149 // BLOCK)}
    expected |= {(2, 27 + 180 // BLOCK), (2, 27 + 199 // BLOCK)}
    assert kept == expected
    assert bool(torch.isinf(bias[groups == 4]).all())


# ----------------------------------------------------------------------------- emulated kernel
@pytest.mark.parametrize("lengths", [[600, 333], [257, 1]])
def test_emulated_causal_sdpa_tiles_queries_and_matches_float64(monkeypatch, lengths):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 600, 16, generator=gen)
    k = torch.randn(2, 2, 600, 16, generator=gen)
    v = torch.randn(2, 2, 600, 16, generator=gen)
    lens = torch.tensor(lengths)
    biggest = []
    real = F.scaled_dot_product_attention

    def spy(*args, attn_mask=None, **kwargs):
        biggest.append(attn_mask.numel())
        return real(*args, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(kernels.F, "scaled_dot_product_attention", spy)
    out = kernels.fused_sdpa(
        q, k, v, is_causal=True, valid_sequence_lengths=lens, padding_side="right"
    )
    # No mask bigger than one tile of queries against every key.
    assert max(biggest) <= 2 * kernels._CAUSAL_TILE * 600 < 600 * 600
    pos = torch.arange(600)
    allowed = (pos[None, :] <= pos[:, None])[None, None] & (pos < lens[:, None])[:, None, None]
    qd, kd, vd = q.double(), k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1)
    scores = (qd @ kd.transpose(-1, -2) / 4).masked_fill(~allowed, float("-inf"))
    ref = (scores.softmax(-1) @ vd).float()
    for b, n in enumerate(lengths):
        torch.testing.assert_close(out[b, :, :n], ref[b, :, :n], atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- masks per step
def _mask_builds(monkeypatch, attention) -> list[tuple[int, int, int | None]]:
    """Every slice mask built: (q0, q1, window)."""
    builds = []
    real = attention.HPUAttentionMetadata._build_slice_mask

    def count(self, q0, q1, window, block_size):
        builds.append((q0, q1, window))
        return real(self, q0, q1, window, block_size)

    monkeypatch.setattr(attention.HPUAttentionMetadata, "_build_slice_mask", count)
    return builds


@pytest.mark.parametrize("window", [None, 20])
def test_slice_masks_are_built_once_per_step_and_shared_by_every_layer(
    monkeypatch, sdpa_calls, attention, window
):
    monkeypatch.setenv(envs.VLLM_PREFILL_QUERY_SLICE, "16")
    builds = _mask_builds(monkeypatch, attention)
    plan = _plan(prompt=[(2, 32, 4)])
    out, ref, _ = _run([7, 30], [40, 19], plan, window=window, layers=4)

    torch.testing.assert_close(out, ref, **TOL)
    assert builds == [(0, 16, window), (16, 32, window)]  # 2 slices, not 2 x 4 layers
    masks = [call["attn_mask"] for call in sdpa_calls]
    assert len(masks) == 8
    # Layer after layer, each slice reads the very tensor the first layer built.
    assert all(masks[i] is masks[i % 2] for i in range(8))


def test_alibi_masks_are_shared_by_layers_with_the_same_slopes_only(sdpa_calls):
    from tests.platform.test_attention import SLOPES, _impl

    out, ref, _ = _run([5, 17], [40, 0], _plan(prompt=[(2, 32, 4)]), alibi=SLOPES, layers=3)
    torch.testing.assert_close(out, ref, **TOL)
    first, *later = [call["attn_mask"] for call in sdpa_calls]
    assert len(later) == 2 and all(mask is first for mask in later)
    # The key that shares a mask is the slopes' values: other slopes build their own.
    assert _impl(alibi=SLOPES)._alibi_key == _impl(alibi=list(SLOPES))._alibi_key
    assert _impl(alibi=[s / 2 for s in SLOPES])._alibi_key != _impl(alibi=SLOPES)._alibi_key


def test_masks_past_the_budget_are_built_per_layer_with_the_same_result(
    monkeypatch, sdpa_calls, attention
):
    monkeypatch.setenv(envs.VLLM_PREFILL_QUERY_SLICE, "16")
    plan = _plan(prompt=[(2, 32, 4)])
    shared, ref, _ = _run([7, 30], [40, 19], plan, seed=3, layers=3)
    monkeypatch.setattr(attention, "SHARED_MASK_BYTES", 0)
    builds = _mask_builds(monkeypatch, attention)
    unshared, _, _ = _run([7, 30], [40, 19], plan, seed=3, layers=3)

    assert len(builds) == 2 * 3  # every layer builds its own
    torch.testing.assert_close(unshared, shared, rtol=0, atol=0)
    torch.testing.assert_close(shared, ref, **TOL)
