"""The rotary family's Gaudi path against vLLM's forward_native, per variant, on both backends of
the seam (`hpu_backend`: the emulated kernels, and seam/gaudi over the Habana stand-in).

Each Hpu* class inherits its variant's cos/sin cache, so forward_oot and forward_native of the
same instance see the same cache; only the rotation differs (the kernel vs vLLM's torch code).
Tolerances: conftest TOLERANCES (the emulated kernel does vLLM's arithmetic; float32 matches to
rounding, bfloat16 within ~2 ulps).
"""

from __future__ import annotations

import pytest
import torch

from vllm_gaudi_ops import stats
from vllm_gaudi_ops.families import rotary

DTYPES = [torch.float32, torch.bfloat16]
HEAD, MAX_POS, BASE = 64, 256, 10000.0

# Variants whose only difference from RotaryEmbedding is the cache: (class, extra kwargs).
CACHED_VARIANTS = {
    "default": (rotary.HpuRotaryEmbedding, {}),
    "llama3": (
        rotary.HpuLlama3RotaryEmbedding,
        {
            "scaling_factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "orig_max_position": 64,
        },
    ),
    "linear": (rotary.HpuLinearScalingRotaryEmbedding, {"scaling_factors": [1.0, 2.0]}),
    "ntk": (rotary.HpuNTKScalingRotaryEmbedding, {"scaling_factor": 2.0}),
    "ntk_mixed": (rotary.HpuNTKScalingRotaryEmbedding, {"scaling_factor": 2.0, "mixed_b": 0.5}),
    "dynamic_ntk": (
        rotary.HpuDynamicNTKScalingRotaryEmbedding,
        {"scaling_factor": 2.0, "max_trained_positions": 128},
    ),
    "dynamic_ntk_alpha": (rotary.HpuDynamicNTKAlphaRotaryEmbedding, {"scaling_alpha": 2.0}),
    "yarn": (rotary.HpuYaRNScalingRotaryEmbedding, {"scaling_factor": 4.0}),
}


def _qk(tokens, heads, kv_heads, dtype, head=HEAD, seed=0):
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(tokens, heads * head, generator=gen).to(dtype)
    key = torch.randn(tokens, kv_heads * head, generator=gen).to(dtype)
    return query, key


def _positions(*shape, high=MAX_POS, seed=1):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


def _assert_pair(got, expected, assert_matches):
    assert_matches(got[0], expected[0])
    if expected[1] is None:
        assert got[1] is None
    else:
        assert_matches(got[1], expected[1])


@pytest.mark.parametrize("variant", sorted(CACHED_VARIANTS))
@pytest.mark.parametrize("is_neox_style", [True, False])
@pytest.mark.parametrize("rotary_dim", [HEAD, HEAD // 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cached_variant_matches_native(
    hpu_backend, vllm_config, assert_matches, variant, is_neox_style, rotary_dim, dtype
):
    cls, extra = CACHED_VARIANTS[variant]
    layer = cls(
        head_size=HEAD,
        rotary_dim=rotary_dim,
        max_position_embeddings=MAX_POS,
        base=BASE,
        is_neox_style=is_neox_style,
        dtype=dtype,
        **extra,
    )
    positions = _positions(11)
    query, key = _qk(11, 4, 2, dtype)

    got = layer.forward_oot(positions, query, key)

    _assert_pair(got, layer.forward_native(positions, query, key), assert_matches)


def test_rotary_embedding_rotates_the_query_alone_when_key_is_none(
    hpu_backend, vllm_config, assert_matches
):
    layer = rotary.HpuRotaryEmbedding(HEAD, HEAD, MAX_POS, BASE, True, torch.float32)
    positions = _positions(5)
    query, _ = _qk(5, 4, 1, torch.float32)

    got = layer.forward_oot(positions, query, None)

    _assert_pair(got, layer.forward_native(positions, query, None), assert_matches)


def test_rotary_embedding_accepts_2d_positions_and_3d_query(
    hpu_backend, vllm_config, assert_matches
):
    layer = rotary.HpuRotaryEmbedding(HEAD, HEAD // 2, MAX_POS, BASE, False, torch.float32)
    positions = _positions(2, 3)
    query = torch.randn(2, 3, 4 * HEAD)
    key = torch.randn(2, 3, 2 * HEAD)

    got = layer.forward_oot(positions, query, key)

    _assert_pair(got, layer.forward_native(positions, query, key), assert_matches)


@pytest.mark.parametrize("is_neox_style", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma4_proportional_rope_matches_native(
    hpu_backend, vllm_config, assert_matches, is_neox_style, dtype
):
    layer = rotary.HpuGemma4RotaryEmbedding(HEAD, HEAD // 2, MAX_POS, BASE, is_neox_style, dtype)
    positions = _positions(7)
    query, key = _qk(7, 2, 1, dtype)

    got = layer.forward_oot(positions, query, key)

    _assert_pair(got, layer.forward_native(positions, query, key), assert_matches)


@pytest.mark.parametrize("is_neox_style", [True, False])
@pytest.mark.parametrize("with_offsets", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_deepseek_scaling_matches_native(
    hpu_backend, vllm_config, assert_matches, is_neox_style, with_offsets, dtype
):
    layer = rotary.HpuDeepseekScalingRotaryEmbedding(
        HEAD, HEAD // 2, MAX_POS, BASE, is_neox_style, 4.0, dtype, mscale=1.0, mscale_all_dim=0.8
    )
    positions = _positions(6)
    offsets = _positions(6, high=32, seed=3) if with_offsets else None
    # DeepSeek MLA passes per-head 3-D tensors: [tokens, heads, head_size] and one key head.
    query = torch.randn(6, 4, HEAD).to(dtype)
    key = torch.randn(6, 1, HEAD).to(dtype)

    got = layer.forward_oot(positions, query, key, offsets)

    _assert_pair(got, layer.forward_native(positions, query, key, offsets), assert_matches)


@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("with_key", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_deepseek_v4_scaling_matches_native(
    hpu_backend, vllm_config, assert_matches, inverse, with_key, dtype
):
    layer = rotary.HpuDeepseekV4ScalingRotaryEmbedding(
        HEAD, HEAD // 2, MAX_POS, BASE, False, 4.0, dtype
    )
    positions = _positions(6)
    query = torch.randn(6, 4, HEAD).to(dtype)
    key = torch.randn(6, 1, HEAD).to(dtype) if with_key else None

    got = layer.forward_oot(positions, query, key, None, inverse)

    expected = layer.forward_native(positions, query, key, None, inverse)
    _assert_pair(got, expected, assert_matches)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("multimodal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mrope_matches_native(
    hpu_backend, vllm_config, assert_matches, interleaved, multimodal, dtype
):
    layer = rotary.HpuMRotaryEmbedding(
        HEAD, HEAD, MAX_POS, BASE, True, dtype, mrope_section=[8, 12, 12],
        mrope_interleaved=interleaved,
    )  # fmt: skip
    # Text-only batches pass [tokens] positions; images pass t/h/w rows, [3, tokens].
    positions = _positions(3, 9) if multimodal else _positions(9)
    query, key = _qk(9, 4, 2, dtype)

    got = layer.forward_oot(positions, query, key)

    _assert_pair(got, layer.forward_native(positions, query, key), assert_matches)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mrope_with_yarn_scaling_and_partial_rotation_matches_native(
    hpu_backend, vllm_config, assert_matches, dtype
):
    layer = rotary.HpuMRotaryEmbedding(
        HEAD, HEAD // 2, MAX_POS, BASE, True, dtype, mrope_section=[4, 6, 6], scaling_factor=2.0
    )
    positions = _positions(3, 5)
    query, key = _qk(5, 2, 1, dtype)

    got = layer.forward_oot(positions, query, key)

    _assert_pair(got, layer.forward_native(positions, query, key), assert_matches)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mrope_interleaved_class_matches_its_vllm_forward(
    hpu_backend, vllm_config, assert_matches, dtype
):
    layer = rotary.HpuMRotaryEmbeddingInterleaved(
        HEAD, HEAD, MAX_POS, BASE, True, dtype, mrope_section=[12, 10, 10]
    )
    positions = _positions(3, 7)
    query, key = _qk(7, 4, 2, dtype)

    got = layer(positions, query, key)  # the class overrides forward(), like vLLM's

    parent = rotary.MRotaryEmbeddingInterleaved
    _assert_pair(got, parent.forward(layer, positions, query, key), assert_matches)


@pytest.mark.parametrize("multimodal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_ernie45_vl_rope_matches_native(
    hpu_backend, vllm_config, assert_matches, multimodal, dtype
):
    layer = rotary.HpuErnie4_5_VLRotaryEmbedding(
        HEAD, HEAD, MAX_POS, BASE, False, dtype, mrope_section=[12, 12, 8]
    )
    positions = _positions(3, 6) if multimodal else _positions(6)
    query, key = _qk(6, 2, 2, dtype)

    got = layer.forward_oot(positions, query, key)

    _assert_pair(got, layer.forward_native(positions, query, key), assert_matches)


@pytest.mark.parametrize("is_neox_style", [True, False])
@pytest.mark.parametrize("multimodal", [False, True])
def test_bailing_mrope_matches_native(
    hpu_backend, vllm_config, assert_matches, is_neox_style, multimodal
):
    layer = rotary.HpuBailingMRotaryEmbedding(
        HEAD, HEAD, MAX_POS, BASE, is_neox_style, torch.float32, mrope_section=[8, 12, 12]
    )
    positions = _positions(3, 6) if multimodal else _positions(6)
    query, key = _qk(6, 2, 1, torch.float32)

    got = layer.forward_oot(positions, query, key)

    _assert_pair(got, layer.forward_native(positions, query, key), assert_matches)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fourier_rope_matches_native(hpu_backend, vllm_config, assert_matches, dtype):
    layer = rotary.HpuFourierRotaryEmbedding(
        HEAD, HEAD, MAX_POS, BASE, True, dtype, init_cache=False, num_key_value_heads=2,
        num_inv_freq=None, fope_sep_head=True, fope_init_factor=0.1,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(4)
    layer.cos_coef.data.copy_(torch.randn(layer.cos_coef.shape, generator=gen) / 4)
    layer.sin_coef.data.copy_(torch.randn(layer.sin_coef.shape, generator=gen) / 4)
    positions = _positions(5)
    query, key = _qk(5, 4, 2, dtype)

    got = layer.forward_oot(positions, query, key)  # builds the cache from the coefficients

    assert not layer.update_cache
    _assert_pair(got, layer.forward_native(positions, query, key), assert_matches)


@pytest.mark.parametrize("dtype", DTYPES)
def test_llama4_vision_rope_matches_native(hpu_backend, vllm_config, assert_matches, dtype):
    patches = 16  # a 4 x 4 grid, plus the class token
    # vLLM's Llama 4 vision model builds this rope with a complex cache dtype.
    layer = rotary.HpuLlama4VisionRotaryEmbedding(
        HEAD, HEAD // 2, patches, BASE, False, torch.complex64
    )
    gen = torch.Generator().manual_seed(5)
    query = torch.randn(2, patches + 1, 3, HEAD, generator=gen).to(dtype)
    key = torch.randn(2, patches + 1, 3, HEAD, generator=gen).to(dtype)

    got = layer.forward_oot(query, key)

    _assert_pair(got, layer.forward_native(query, key), assert_matches)


@pytest.mark.parametrize("is_neox_style", [True, False])
@pytest.mark.parametrize("enable_fp32_compute", [False, True])
@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_apply_rotary_emb_matches_native(
    hpu_backend, vllm_config, assert_matches, is_neox_style, enable_fp32_compute, batched, dtype
):
    layer = rotary.HpuApplyRotaryEmb(
        is_neox_style=is_neox_style, enable_fp32_compute=enable_fp32_compute
    )
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(*((2,) if batched else ()), 9, 3, 32, generator=gen).to(dtype)
    angles = torch.rand(9, 16, generator=gen) * 6
    cos, sin = angles.cos(), angles.sin()  # float32, as vision encoders build them

    assert_matches(layer.forward_oot(x, cos, sin), layer.forward_native(x, cos, sin))


def test_rotary_forward_oot_counts_each_call(hpu_backend, vllm_config):
    layer = rotary.HpuRotaryEmbedding(HEAD, HEAD, MAX_POS, BASE, True, torch.float32)
    query, key = _qk(3, 2, 1, torch.float32)
    before = stats.COUNTS.get("rotary", 0)

    layer.forward_oot(_positions(3), query, key)

    assert stats.COUNTS["rotary"] == before + 1


def test_every_rotary_replacement_subclasses_its_variant_and_overrides_forward_oot():
    for in_tree, replacement in rotary.REPLACEMENTS:
        assert issubclass(replacement, in_tree), replacement
        assert replacement.forward_oot is not in_tree.forward_oot, replacement
