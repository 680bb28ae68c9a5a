"""The HPU MLA backend (mla.py), in emulation, against naive DeepSeek-V2 attention in float64:
keys and values expanded per head from the latent through kv_b_proj (no weight absorption),
causal over each sequence's cached and new tokens. Covers the bucketed prefill grid, prefill with
cached context, paged decode, a mixed step, and the latent rows written to the cache."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_gaudi_platform.attention import step_layout
from vllm_gaudi_platform.bucketing import Bucket, BucketPlan

BLOCK = 16
NUM_BLOCKS = 32
HEADS, NOPE, ROPE, RANK, VDIM = 4, 16, 8, 32, 16
SCALE = 1 / math.sqrt(NOPE + ROPE)


@pytest.fixture(autouse=True)
def _backend(hpu_backend):
    """Every test runs on both backends of the seam: the emulation, and seam/gaudi (over the Habana
    stand-in off Gaudi)."""
    return hpu_backend


def _kv_b_proj(gen: torch.Generator) -> torch.nn.Linear:
    proj = torch.nn.Linear(RANK, HEADS * (NOPE + VDIM), bias=False)
    proj.weight.data = torch.randn(HEADS * (NOPE + VDIM), RANK, generator=gen) / math.sqrt(RANK)
    proj.quant_method = None  # an unquantized vLLM linear layer, as split_kv_b_proj reads it
    return proj


def _impl(kv_b_proj):
    from vllm_gaudi_platform.attention.mla import HPUMLAImpl

    impl = HPUMLAImpl(
        num_heads=HEADS,
        head_size=RANK + ROPE,
        scale=SCALE,
        num_kv_heads=1,
        alibi_slopes=None,
        sliding_window=None,
        kv_cache_dtype="auto",
        logits_soft_cap=None,
        attn_type="decoder",
        kv_sharing_target_layer_name=None,
        q_lora_rank=None,
        kv_lora_rank=RANK,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE,
        qk_head_dim=NOPE + ROPE,
        v_head_dim=VDIM,
        kv_b_proj=kv_b_proj,
    )
    impl.process_weights_after_loading(torch.float32)
    return impl


def _reference(q, latent, ctx, kv_b_proj):
    """Non-absorbed MLA of one sequence: q [new, HEADS, NOPE + ROPE] at positions ctx..;
    latent [ctx + new, RANK + ROPE]. Returns [new, HEADS * VDIM] in float64."""
    w = kv_b_proj.weight.double().view(HEADS, NOPE + VDIM, RANK)
    c, k_pe = latent[:, :RANK].double(), latent[:, RANK:].double()
    k_nope = torch.einsum("tl,hpl->thp", c, w[:, :NOPE])
    v = torch.einsum("tl,hvl->thv", c, w[:, NOPE:])
    k = torch.cat([k_nope, k_pe[:, None].expand(-1, HEADS, -1)], dim=-1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * SCALE
    qpos = torch.arange(q.shape[0])[:, None] + ctx
    kpos = torch.arange(latent.shape[0])[None, :]
    scores = scores.masked_fill(kpos > qpos, float("-inf"))
    return torch.einsum("hqk,khv->qhv", scores.softmax(-1), v).reshape(q.shape[0], -1)


def _run(query_lens, ctx_lens, plan, seed=0):
    """One step through the backend; its outputs, the per-request references, the layout, the
    cache and where the new tokens' latent rows should have gone."""
    from vllm_gaudi_platform.attention.metadata_builder import build_metadata

    gen = torch.Generator().manual_seed(seed)
    proj = _kv_b_proj(gen)
    impl = _impl(proj)
    n = len(query_lens)
    seq_lens = [c + q for c, q in zip(ctx_lens, query_lens)]
    max_blocks = max(-(-s // BLOCK) for s in seq_lens)
    table = torch.arange(1, 1 + n * max_blocks, dtype=torch.int32).view(n, max_blocks)
    cache = torch.zeros(NUM_BLOCKS, BLOCK, RANK + ROPE)
    flat = cache.view(-1, RANK + ROPE)

    def slots(i, lo, hi):
        pos = torch.arange(lo, hi)
        return table[i, pos // BLOCK].long() * BLOCK + pos % BLOCK

    latents = [torch.randn(s, RANK + ROPE, generator=gen) for s in seq_lens]
    for i, c in enumerate(ctx_lens):
        flat[slots(i, 0, c)] = latents[i][:c]
    queries = [torch.randn(q, HEADS, NOPE + ROPE, generator=gen) for q in query_lens]

    layout = step_layout.plan_step(
        query_lens=query_lens, seq_lens=seq_lens, block_size=BLOCK, plan=plan
    )
    real = sum(query_lens)
    slot_mapping = torch.cat([slots(i, c, s) for i, (c, s) in enumerate(zip(ctx_lens, seq_lens))])
    md = build_metadata(
        layout=layout,
        seq_lens=seq_lens,
        block_table=table,
        slot_mapping=slot_mapping,
        block_size=BLOCK,
        device=torch.device("cpu"),
    )
    q = torch.cat(queries)
    new = torch.cat([lat[c:] for lat, c in zip(latents, ctx_lens)])
    out = torch.zeros(real, HEADS * VDIM)
    # As vLLM's layer calls it in eager mode: the real tokens only (padding cut off).
    impl.forward_mha(q, new[:, :RANK], new[:, None, RANK:], cache, md, None, out)
    refs = torch.cat([_reference(queries[i], latents[i], ctx_lens[i], proj) for i in range(n)])
    return out, refs, layout, cache, slot_mapping, new


def _plan(prompt=(), decode=()):
    return BucketPlan(
        strategy="test",
        prompt=tuple(Bucket("prompt", *b) for b in prompt),
        decode=tuple(Bucket("decode", *b) for b in decode),
    )


def _max_err(out, ref) -> float:
    return (out.double() - ref).abs().max().item()


def test_mla_prefill_grid_matches_non_absorbed_reference():
    out, ref, layout, *_ = _run([5, 17, 32], [0, 0, 0], _plan(prompt=[(4, 32, 0)]))
    assert layout.prefill.rows == 4 and layout.prefill.warmed
    assert _max_err(out, ref) < 1e-4


def test_mla_prefill_with_cached_context_matches_reference():
    out, ref, layout, *_ = _run([7, 16], [40, 16], _plan(prompt=[(2, 16, 4)]))
    assert layout.prefill.ctx_bucket == 4
    assert _max_err(out, ref) < 1e-4


def test_mla_packed_prefill_matches_reference():
    out, ref, layout, *_ = _run([5, 9], [20, 0], _plan(prompt=[(1, 16, 4)]))
    assert layout.prefill.rows == 1 and layout.prefill.row_members == ((0, 1),)
    assert _max_err(out, ref) < 1e-4


def test_mla_paged_decode_matches_reference():
    out, ref, layout, *_ = _run([1, 1, 1], [3, 20, 33], _plan(decode=[(4, 1, 8)]))
    assert layout.decode.batch_bucket == 4 and layout.decode.blocks_bucket == 8
    assert _max_err(out, ref) < 1e-4


def test_mla_mixed_step_matches_reference():
    plan = _plan(prompt=[(2, 32, 2)], decode=[(2, 1, 4)])
    out, ref, layout, *_ = _run([1, 1, 9, 20], [15, 30, 0, 17], plan)
    assert layout.prefill is not None and layout.decode is not None and layout.warmed
    assert _max_err(out, ref) < 1e-4


def test_mla_writes_each_new_tokens_latent_row_to_its_cache_slot():
    plan = _plan(prompt=[(2, 32, 2)], decode=[(2, 1, 4)])
    *_, cache, slot_mapping, new = _run([1, 9], [15, 4], plan)
    assert torch.equal(cache.view(-1, RANK + ROPE)[slot_mapping], new)


def test_platform_selects_the_hpu_mla_backend_for_mla_layers():
    from types import SimpleNamespace

    from vllm.utils.import_utils import resolve_obj_by_qualname

    from vllm_gaudi_platform.attention.mla import HPUMLAImpl, HPUMLAPrefillBackend
    from vllm_gaudi_platform.platform import HpuPlatform

    path = HpuPlatform.get_attn_backend_cls(None, SimpleNamespace(use_mla=True, use_sparse=False))
    backend = resolve_obj_by_qualname(path)
    assert backend.is_mla() and backend.get_impl_cls() is HPUMLAImpl
    assert HpuPlatform.get_mla_prefill_backend_cls(None) is HPUMLAPrefillBackend


def test_platform_refuses_sparse_mla_by_name():
    from types import SimpleNamespace

    from vllm_gaudi_platform.platform import HpuPlatform

    with pytest.raises(NotImplementedError, match=r"Sparse attention \(.*DeepSeek-V3\.2 and GLM-5"):
        HpuPlatform.get_attn_backend_cls(None, SimpleNamespace(use_mla=True, use_sparse=True))
