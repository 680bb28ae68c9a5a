"""The norm family's Gaudi path against vLLM's forward_native, on both backends of the seam
(`hpu_backend`: the emulated kernels, and seam/gaudi over the Habana stand-in).

Tolerances: conftest TOLERANCES (vLLM's kernel-vs-native defaults). The kernel applies the
weight in float32 and normalises x + residual as rounded to the input dtype, where vLLM
multiplies in the weight dtype and normalises the float32 sum: bfloat16 results may differ by
an ulp, inside the bfloat16 tolerance.
"""

from __future__ import annotations

import pytest
import torch

from vllm_gaudi_ops import stats
from vllm_gaudi_ops.families.norm import HpuGemmaRMSNorm, HpuRMSNorm

DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(7, 64), (1, 128), (2, 5, 96)]  # [tokens, hidden] and a per-head (q/k norm) shape


def _inputs(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)


def _compare(layer, x, residual, assert_matches):
    if residual is None:
        assert_matches(layer.forward_oot(x), layer.forward_native(x))
        return
    # vLLM's native fused add may work in place: give each path its own copies.
    out, new_residual = layer.forward_oot(x.clone(), residual.clone())
    expected_out, expected_residual = layer.forward_native(x.clone(), residual.clone())
    assert_matches(out, expected_out)
    assert_matches(new_residual, expected_residual)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_native(
    hpu_backend, vllm_config, assert_matches, dtype, shape, with_residual
):
    layer = HpuRMSNorm(shape[-1], eps=1e-5, dtype=dtype)
    layer.weight.data.normal_(1.0, 0.2, generator=torch.Generator().manual_seed(1))
    x, residual = _inputs(shape, dtype)

    _compare(layer, x, residual if with_residual else None, assert_matches)


def test_rms_norm_returns_the_input_shape_and_a_tuple_with_residual(hpu_backend, vllm_config):
    layer = HpuRMSNorm(96)
    x, residual = _inputs((2, 5, 96), torch.float32)

    assert layer.forward_oot(x).shape == x.shape
    out = layer.forward_oot(x, residual)
    assert isinstance(out, tuple) and [t.shape for t in out] == [x.shape, x.shape]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_without_learned_weight_matches_native(
    hpu_backend, vllm_config, assert_matches, dtype
):
    layer = HpuRMSNorm(64, has_weight=False)
    x, residual = _inputs((5, 64), dtype)

    _compare(layer, x, None, assert_matches)
    _compare(layer, x, residual, assert_matches)


def test_rms_norm_with_a_partial_variance_size_matches_native(
    hpu_backend, vllm_config, assert_matches
):
    layer = HpuRMSNorm(64, var_hidden_size=48)
    x, residual = _inputs((5, 64), torch.float32)

    _compare(layer, x, None, assert_matches)
    _compare(layer, x, residual, assert_matches)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_gemma_rms_norm_matches_native(
    hpu_backend, vllm_config, assert_matches, dtype, shape, with_residual
):
    layer = HpuGemmaRMSNorm(shape[-1], eps=1e-6)
    # Gemma weights are offsets around 0 (scale = 1 + weight), stored in the model dtype.
    layer.weight.data = (torch.randn(shape[-1], generator=torch.Generator().manual_seed(2)) / 4).to(
        dtype
    )
    x, residual = _inputs(shape, dtype)

    _compare(layer, x, residual if with_residual else None, assert_matches)


def test_norm_forward_oot_counts_each_call(hpu_backend, vllm_config):
    layer = HpuRMSNorm(64)
    before = stats.COUNTS.get("norm", 0)

    layer.forward_oot(torch.randn(2, 64))
    HpuGemmaRMSNorm(64).forward_oot(torch.randn(2, 64), torch.randn(2, 64))

    assert stats.COUNTS["norm"] == before + 2
