"""The HPU attention backend with an FP8 KV cache (kv_cache_dtype fp8_inc / fp8 / fp8_e4m3), on
both backends of the seam (`hpu_backend`: the emulation, and seam/gaudi over the Habana stand-in off
Gaudi): new keys and values are written through the seam's saturating cast_to_fp8_v2 with the
layer's k/v scale, cached ones are read back through cast_from_fp8, in prefill with cached context
and in paged decode. Compared with the same step on a float32 cache.

Tolerance: E4M3 keeps 3 mantissa bits, so a cached key or value is within 2^-4 (relative) of the
float one; for unit-normal inputs the attention outputs stay within 0.15 (absolute, max) and 0.015
(mean) of the float cache's (measured: 0.085 and 0.009 at most).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from vllm_gaudi_platform.attention import step_layout

BLOCK = 16
HEADS, KV_HEADS, DIM = 4, 2, 32
NUM_BLOCKS = 32
FP8 = torch.float8_e4m3fn


def _step(query_lens, ctx_lens, kv_cache_dtype, k_scale, v_scale, seed=0):
    """One step through the backend on a fresh cache of `kv_cache_dtype`; the cached context is
    written the way the backend writes it. Returns (outputs of the real tokens, flat cache)."""
    from vllm_gaudi_platform.attention.impl import HPUAttentionImpl
    from vllm_gaudi_platform.attention.metadata_builder import build_metadata
    from vllm_gaudi_platform.seam import backend

    seam = backend()
    fp8 = kv_cache_dtype.startswith("fp8")
    gen = torch.Generator().manual_seed(seed)
    n = len(query_lens)
    seq_lens = [c + q for c, q in zip(ctx_lens, query_lens)]
    max_blocks = max(-(-s // BLOCK) for s in seq_lens)
    table = torch.arange(1, 1 + n * max_blocks, dtype=torch.int32).view(n, max_blocks)
    storage = torch.zeros(NUM_BLOCKS, BLOCK, KV_HEADS, 2 * DIM, dtype=FP8 if fp8 else torch.float32)
    kv_cache = storage.transpose(1, 2)  # logical [B, H, N, C] over block-size-first storage
    flat = storage.view(NUM_BLOCKS * BLOCK, KV_HEADS, 2 * DIM)
    ks = [torch.randn(s, KV_HEADS, DIM, generator=gen) for s in seq_lens]
    vs = [torch.randn(s, KV_HEADS, DIM, generator=gen) for s in seq_lens]
    for i, c in enumerate(ctx_lens):
        slots = table[i, torch.arange(c) // BLOCK].long() * BLOCK + torch.arange(c) % BLOCK
        k, v = ks[i][:c], vs[i][:c]
        if fp8:
            k = seam.cast_to_fp8_v2(k, 1.0 / k_scale, False, False, FP8)[0]
            v = seam.cast_to_fp8_v2(v, 1.0 / v_scale, False, False, FP8)[0]
        flat[slots] = torch.cat([k, v], -1)
    q = torch.cat([torch.randn(ql, HEADS * DIM, generator=gen) for ql in query_lens])
    k = torch.cat([kk[c:] for kk, c in zip(ks, ctx_lens)]).view(len(q), -1)
    v = torch.cat([vv[c:] for vv, c in zip(vs, ctx_lens)]).view(len(q), -1)
    layout = step_layout.plan_step(
        query_lens=query_lens, seq_lens=seq_lens, block_size=BLOCK, plan=None
    )
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
    )
    layer = SimpleNamespace(_k_scale=torch.tensor(k_scale), _v_scale=torch.tensor(v_scale))
    impl = HPUAttentionImpl(
        HEADS, DIM, 1 / math.sqrt(DIM), num_kv_heads=KV_HEADS, kv_cache_dtype=kv_cache_dtype
    )
    total = layout.num_tokens_padded
    pad = total - len(q)
    q, k, v = (torch.cat([t, torch.zeros(pad, t.shape[1])]) for t in (q, k, v))
    out = torch.zeros(total, HEADS * DIM)
    impl.forward(layer, q, k, v, kv_cache, md, out)
    return out[: sum(query_lens)], flat, slot_mapping, (ks, vs, ctx_lens)


STEPS = {
    "prefill_with_cached_context": ([20, 7], [40, 70]),
    "decode": ([1, 1, 1], [33, 90, 5]),
    "mixed_prefill_and_decode": ([12, 1, 1], [18, 50, 130]),
}


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_inc", "fp8", "fp8_e4m3"])
@pytest.mark.parametrize("step", sorted(STEPS))
def test_fp8_cache_attention_stays_close_to_the_float_cache(hpu_backend, step, kv_cache_dtype):
    query_lens, ctx_lens = STEPS[step]
    # Scales as INC derives them: max |value| / 448, here with a margin over the randn range.
    scale = 5.0 / 448.0
    ours, *_ = _step(query_lens, ctx_lens, kv_cache_dtype, scale, scale)
    ref, *_ = _step(query_lens, ctx_lens, "auto", 1.0, 1.0)
    err = (ours - ref).abs()
    assert err.max() < 0.15 and err.mean() < 0.015, (err.max(), err.mean())
    assert err.max() > 0  # the FP8 path really ran


def test_new_keys_and_values_are_written_as_fp8_with_the_layer_scales(hpu_backend):
    from vllm_gaudi_platform.seam import backend

    k_scale, v_scale = 4.0 / 448.0, 3.0 / 448.0
    _, flat, slots, (ks, vs, _) = _step([5, 3], [10, 0], "fp8_inc", k_scale, v_scale)
    assert flat.dtype == FP8
    new_k = torch.cat([ks[0][10:], ks[1]])
    new_v = torch.cat([vs[0][10:], vs[1]])
    seam = backend()
    expected_k = seam.cast_to_fp8_v2(new_k, 1.0 / k_scale, False, False, FP8)[0]
    expected_v = seam.cast_to_fp8_v2(new_v, 1.0 / v_scale, False, False, FP8)[0]
    written = flat[slots]
    assert torch.equal(written[..., :DIM].view(torch.uint8), expected_k.view(torch.uint8))
    assert torch.equal(written[..., DIM:].view(torch.uint8), expected_v.view(torch.uint8))


def test_values_beyond_the_scale_range_saturate_instead_of_overflowing(hpu_backend):
    # A scale too small for the data: values saturate at +-448 * scale, never become NaN.
    out, flat, slots, _ = _step([1, 1], [30, 60], "fp8_inc", 0.5 / 448.0, 0.5 / 448.0)
    assert torch.isfinite(out).all()
    assert torch.isfinite(flat[slots].float()).all()
    assert flat[slots].float().abs().max() == 448.0


def test_backend_lists_the_fp8_cache_dtypes():
    from vllm_gaudi_platform.attention.backend import HPUAttentionBackend

    assert {"fp8_inc", "fp8", "fp8_e4m3"} <= set(HPUAttentionBackend.supported_kv_cache_dtypes)


@pytest.mark.process
def test_vllms_uint8_fp8_cache_names_become_gaudis_fp8_cache(run_python):
    # vLLM stores "fp8"/"fp8_e4m3" as uint8 bytes; the HPU cache must be a real FP8 E4M3 tensor.
    code = (
        "from vllm.engine.arg_utils import EngineArgs\n"
        "from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE\n"
        "from gaudi_testkit import tinymodels\n"
        "model = str(tinymodels.build('llama'))\n"
        "for name in ('fp8', 'fp8_e4m3'):\n"
        "    config = EngineArgs(model=model, kv_cache_dtype=name).create_engine_config()\n"
        "    dtype = config.cache_config.cache_dtype\n"
        "    print('CACHE', name, dtype, STR_DTYPE_TO_TORCH_DTYPE[dtype])\n"
    )

    result = run_python(code, {"VLLM_HPU_EMULATION": "cpu"})

    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("CACHE ")]
    assert lines == [
        "CACHE fp8 fp8_inc torch.float8_e4m3fn",
        "CACHE fp8_e4m3 fp8_inc torch.float8_e4m3fn",
    ]
