"""The FP8 linear's building blocks in `vllm_gaudi_quant.methods.fp8`, on both backends of the
seam (`hpu_backend`: the emulation, and seam/gaudi over the Habana stand-in off Gaudi):
the forward other methods reuse (`apply_fp8_linear`), activation quantization, and the load-time
conversions of block-scaled weights.

Tolerances: see tests/quant/conftest.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.quant import fp8_packers as P
from tests.quant.conftest import FP8_MATMUL_TOLERANCE, FP8_WEIGHT_ONLY_TOLERANCE


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def _fp8_kn(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(FP8 [K, N], per-channel scale [N], dequantized float [N, K]) from the test packer."""
    packed = P.quantize(weight, "channel")
    return (
        packed["weight"].t().contiguous(),
        packed["weight_scale"].reshape(-1),
        P.dequantize(packed),
    )


def test_apply_fp8_linear_with_dynamic_activations_matches_the_float_linear(
    hpu_backend, relative_error
):
    from vllm_gaudi_quant.methods.fp8 import apply_fp8_linear

    w8, scale, w = _fp8_kn(_weight(96, 128))
    x = torch.randn(3, 7, 128, generator=torch.Generator().manual_seed(1))
    bias = torch.linspace(-1, 1, 96)
    out = apply_fp8_linear(x, w8, scale, None, bias)
    assert out.shape == (3, 7, 96) and out.dtype == x.dtype
    assert relative_error(out, torch.nn.functional.linear(x, w, bias)) < FP8_WEIGHT_ONLY_TOLERANCE


def test_apply_fp8_linear_gives_each_token_its_own_scale(hpu_backend, relative_error):
    """Tokens a thousand times apart in magnitude are both kept accurate: one scale per token."""
    from vllm_gaudi_quant.methods.fp8 import apply_fp8_linear

    w8, scale, w = _fp8_kn(_weight(64, 128))
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(2)) * torch.tensor(
        [[1e-3], [1.0]]
    )
    out = apply_fp8_linear(x, w8, scale)
    ref = torch.nn.functional.linear(x, w)
    assert relative_error(out[:1], ref[:1]) < FP8_WEIGHT_ONLY_TOLERANCE


@pytest.mark.parametrize("tokens", [5, 128])
def test_per_token_scales_are_per_row_when_the_batch_is_square_or_not(
    hpu_backend, relative_error, tokens
):
    """Gaudi applies a 1-D scale per column: per-token scales must go in as [M, 1]. With M != K a
    1-D vector is a shape error; with M == K (128 tokens into a 128-wide layer) it would scale
    columns and give wrong numbers without an error. Both must match the float linear."""
    from vllm_gaudi_quant.methods.fp8 import apply_fp8_linear, quantize_activations

    w8, scale, w = _fp8_kn(_weight(64, 128))
    magnitudes = torch.logspace(-3, 0, tokens)[:, None]
    x = torch.randn(tokens, 128, generator=torch.Generator().manual_seed(3)) * magnitudes
    _, x_scale = quantize_activations(x, None)
    assert x_scale.shape == (tokens, 1)
    out = apply_fp8_linear(x, w8, scale)
    ref = torch.nn.functional.linear(x, w)
    for row in (0, tokens - 1):  # the smallest and the largest token, each at its own scale
        assert relative_error(out[row], ref[row]) < FP8_WEIGHT_ONLY_TOLERANCE


def test_per_channel_weight_quantization_scales_each_output_row(hpu_backend):
    from vllm_gaudi_quant.methods.fp8 import quantize_per_channel

    # Square and not: rows a hundred times apart in magnitude each keep their own scale.
    for rows, cols in ((4, 4), (4, 16)):
        w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(4))
        w = w * torch.logspace(-2, 0, rows)[:, None]
        wq, scale = quantize_per_channel(w)
        assert scale.shape == (rows,)
        back = wq.float() * scale[:, None]
        torch.testing.assert_close(back, w, rtol=0.07, atol=0.0)


def test_apply_fp8_linear_with_a_static_scale_saturates_larger_activations(hpu_backend):
    from vllm_gaudi_quant.methods.fp8 import apply_fp8_linear

    w8, scale, w = _fp8_kn(_weight(16, 32))
    x = torch.full((1, 32), 10.0)
    static = torch.tensor(1.0 / 448)  # covers |x| <= 1 only
    out = apply_fp8_linear(x, w8, scale, static)
    torch.testing.assert_close(
        out, torch.nn.functional.linear(torch.ones(1, 32), w), rtol=0.02, atol=0.02
    )


def test_apply_fp8_linear_handles_zero_rows_and_an_empty_batch(hpu_backend):
    from vllm_gaudi_quant.methods.fp8 import apply_fp8_linear

    w8, scale, _ = _fp8_kn(_weight(16, 32))
    zeros = apply_fp8_linear(torch.zeros(2, 32), w8, scale)
    assert torch.equal(zeros, torch.zeros(2, 16))
    assert apply_fp8_linear(torch.zeros(0, 32), w8, scale).shape == (0, 16)


def test_block_scaled_weights_dequantize_tile_by_tile(hpu_backend):
    from vllm_gaudi_quant.methods.fp8 import dequantize_blocks

    weight = _weight(96, 160, seed=3)  # neither dimension a multiple of the block
    packed = P.quantize(weight, "block", (32, 64))
    got = dequantize_blocks(packed["weight"], packed["weight_scale_inv"], (32, 64))
    assert torch.equal(got, P.dequantize(packed, (32, 64)))


@pytest.mark.parametrize("generation", ["3", "2"])
def test_per_channel_requantization_stays_within_one_fp8_rounding(
    hpu_backend, as_generation, relative_error, generation
):
    from vllm_gaudi_quant.methods.fp8 import quantize_per_channel

    as_generation(generation)
    weight = _weight(64, 96, seed=4) * torch.logspace(-2, 1, 64)[:, None]
    wq, scale = quantize_per_channel(weight)
    assert wq.dtype == torch.float8_e4m3fn and scale.shape == (64,)
    assert wq.float().abs().max() <= hpu_backend.fp8_max()
    back = wq.float() * scale[:, None]
    # Rows spanning three decades each keep their own precision.
    for row in (0, 63):
        assert relative_error(back[row], weight[row]) < FP8_MATMUL_TOLERANCE / 2
