"""The FP8 kernels of the seam against straightforward references: casts checked against the
table of every E4M3 value, the GEMM against float64 matmuls of explicitly dequantized operands.
Each runs on both backends (`hpu_backend`: the emulation, and seam/gaudi over the Habana stand-in
off Gaudi); the emulation's own error messages (shape errors, VLLM_HPU_EMULATION_GAUDI) are
checked on the emulation only.

Tolerance: the GEMM emulation and the reference compute the same float products, only in a
different order and precision (float32 vs float64): 1e-5 relative, float32 rounding over K terms.
"""

from __future__ import annotations

import pytest
import torch

FP8 = torch.float8_e4m3fn


def e4m3_values() -> torch.Tensor:
    """Every finite E4M3 (fn) value, from all 256 bit patterns."""
    values = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(FP8).float()
    return values[torch.isfinite(values)].unique()


def nearest_e4m3(x: torch.Tensor, limit: float) -> torch.Tensor:
    """Reference cast: clamp to +-limit, then the closest value of the E4M3 table."""
    table = e4m3_values()
    table = table[table.abs() <= limit]
    clamped = x.float().clamp(-limit, limit)
    return table[(clamped.reshape(-1, 1) - table).abs().argmin(dim=1)].reshape(x.shape)


def test_cast_to_fp8_rounds_each_value_to_a_nearest_e4m3_value(hpu_backend):
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * 30
    out, _ = hpu_backend.cast_to_fp8_v2(x, None, False, False, FP8)
    assert out.dtype == FP8
    ref = nearest_e4m3(x, 448.0)
    # Ties may round either way in a reference built on argmin; the distance must be minimal.
    assert torch.equal((out.float() - x).abs(), (ref - x).abs())


def test_cast_to_fp8_saturates_at_448_on_gaudi3(hpu_backend):
    x = torch.tensor([1e6, -1e6, 449.0, 464.0, -500.0, 448.0, 0.5])
    out, _ = hpu_backend.cast_to_fp8_v2(x)
    assert hpu_backend.fp8_max() == 448.0
    assert out.float().tolist() == [448.0, -448.0, 448.0, 448.0, -448.0, 448.0, 0.5]


def test_cast_to_fp8_saturates_at_240_on_gaudi2(gaudi2):
    x = torch.tensor([1e6, -300.0, 241.0, 240.0, 200.0])
    out, _ = gaudi2.cast_to_fp8_v2(x)
    assert gaudi2.fp8_max() == 240.0
    assert out.float().tolist() == [240.0, -240.0, 240.0, 240.0, 192.0]


def test_fp8_max_of_e5m2_is_the_same_on_both_generations(gaudi2):
    assert gaudi2.fp8_max(torch.float8_e5m2) == 57344.0


def test_unknown_emulated_gaudi_generation_is_an_error_naming_the_variable(emulated, monkeypatch):
    from vllm_gaudi_platform.envs import EnvError

    monkeypatch.setenv("VLLM_HPU_EMULATION_GAUDI", "4")
    with pytest.raises(EnvError, match="VLLM_HPU_EMULATION_GAUDI"):
        emulated.fp8_max()


@pytest.mark.parametrize("form", ["float", "0-d tensor", "1-element tensor"])
def test_cast_to_fp8_multiplies_by_a_per_tensor_scale(hpu_backend, form):
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    scale = {
        "float": 37.5,
        "0-d tensor": torch.tensor(37.5),
        "1-element tensor": torch.tensor([37.5]),
    }[form]
    out, _ = hpu_backend.cast_to_fp8_v2(x, scale)
    assert torch.equal(out.float(), nearest_e4m3(x * 37.5, 448.0))


def test_cast_to_fp8_multiplies_each_row_by_its_own_scale_given_as_a_column(hpu_backend):
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(2))
    scales = torch.tensor([[1.0], [10.0], [100.0], [1000.0]])
    out, _ = hpu_backend.cast_to_fp8_v2(x, scales)
    assert torch.equal(out.float(), nearest_e4m3(x * scales, 448.0))


def test_cast_to_fp8_applies_a_1d_scale_per_column_as_gaudi_broadcasts(hpu_backend):
    # Gaudi broadcasts numpy-style: a 1-D scale runs along the last axis, whatever its meaning
    # to the caller. Square x: a vector of row scales silently scales the columns.
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(4))
    scales = torch.tensor([1.0, 10.0, 100.0, 1000.0])
    out, _ = hpu_backend.cast_to_fp8_v2(x, scales)
    assert torch.equal(out.float(), nearest_e4m3(x * scales[None, :], 448.0))


def test_cast_to_fp8_rejects_a_1d_row_scale_when_rows_differ_from_columns(emulated):
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match=r"\[rows, 1\]"):
        emulated.cast_to_fp8_v2(x, torch.tensor([1.0, 10.0, 100.0, 1000.0]))


def test_cast_to_fp8_reports_the_amax_of_the_unscaled_input_when_asked(hpu_backend):
    x = torch.tensor([[1.0, -7.5], [3.0, 2.0]])
    _, amax = hpu_backend.cast_to_fp8_v2(x, 100.0, False, True)
    assert amax.dim() == 0 and amax.item() == 7.5
    _, none = hpu_backend.cast_to_fp8_v2(x, 100.0, False, False)
    assert none.numel() == 0


def test_stochastic_rounding_picks_a_neighbour_and_is_unbiased(hpu_backend):
    torch.manual_seed(3)
    value = 1.1  # between the E4M3 neighbours 1.0 and 1.125
    out, _ = hpu_backend.cast_to_fp8_v2(torch.full((20000,), value), None, True)
    assert set(out.float().unique().tolist()) == {1.0, 1.125}
    assert abs(out.float().mean().item() - value) < 0.003


def test_stochastic_rounding_keeps_exact_values_and_saturates(hpu_backend):
    x = torch.tensor([1.0, -1.125, 448.0, 1e5, -1e5, 0.0])
    out, _ = hpu_backend.cast_to_fp8_v2(x, None, True)
    assert out.float().tolist() == [1.0, -1.125, 448.0, 448.0, -448.0, 0.0]


def test_cast_from_fp8_multiplies_by_the_scale_in_the_output_dtype(hpu_backend):
    x = torch.tensor([[1.0, -2.0], [0.5, 448.0]]).to(FP8)
    assert torch.equal(
        hpu_backend.cast_from_fp8(x, torch.tensor(0.25), torch.float32),
        torch.tensor([[0.25, -0.5], [0.125, 112.0]]),
    )
    per_row = hpu_backend.cast_from_fp8(x, torch.tensor([[2.0], [3.0]]), torch.bfloat16)
    assert per_row.dtype == torch.bfloat16
    assert per_row.float().tolist() == [[2.0, -4.0], [1.5, 1344.0]]
    per_column = hpu_backend.cast_from_fp8(x, torch.tensor([2.0, 3.0]), torch.float32)
    assert per_column.tolist() == [[2.0, -6.0], [1.0, 1344.0]]


def _fp8_operand(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 50).clamp(-448, 448).to(FP8)


@pytest.mark.parametrize("trans_A", [False, True])
@pytest.mark.parametrize("trans_B", [False, True])
@pytest.mark.parametrize("a_scale", ["tensor", "token"])
@pytest.mark.parametrize("b_scale", ["tensor", "channel"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp8_gemm_is_the_matmul_of_the_dequantized_operands(
    hpu_backend, trans_A, trans_B, a_scale, b_scale, with_bias
):
    M, K, N = 5, 48, 24
    A = _fp8_operand((K, M) if trans_A else (M, K), 10)
    B = _fp8_operand((N, K) if trans_B else (K, N), 11)
    sa = torch.tensor(0.02) if a_scale == "tensor" else torch.linspace(0.01, 0.05, M)[:, None]
    sb = torch.tensor(0.003) if b_scale == "tensor" else torch.linspace(0.001, 0.004, N)
    bias = torch.linspace(-1, 1, N) if with_bias else None

    out = hpu_backend.fp8_gemm_v2(A, trans_A, B, trans_B, None, torch.float32, sa, sb, bias, False)

    a = A.double().t() if trans_A else A.double()  # [M, K]
    b = B.double().t() if trans_B else B.double()  # [K, N]
    a = a * sa.double()
    b = b * (sb.double() if sb.dim() == 0 else sb.double()[None, :])
    ref = a @ b + (bias.double() if bias is not None else 0)
    assert out.dtype == torch.float32 and out.shape == (M, N)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_fp8_gemm_accumulates_into_d_when_asked(hpu_backend):
    A, B = _fp8_operand((3, 16), 12), _fp8_operand((16, 4), 13)
    D = torch.full((3, 4), 7.0)
    plain = hpu_backend.fp8_gemm_v2(A, False, B, False, None, torch.float32, 0.1, 0.1)
    summed = hpu_backend.fp8_gemm_v2(A, False, B, False, D, torch.float32, 0.1, 0.1, None, True)
    torch.testing.assert_close(summed, plain + 7.0)
    ignored = hpu_backend.fp8_gemm_v2(A, False, B, False, D, torch.float32, 0.1, 0.1, None, False)
    torch.testing.assert_close(ignored, plain)


def test_fp8_gemm_returns_the_requested_dtype(hpu_backend):
    A, B = _fp8_operand((3, 16), 14), _fp8_operand((16, 4), 15)
    out = hpu_backend.fp8_gemm_v2(A, False, B, False, None, torch.bfloat16, 0.1, 0.1)
    ref = hpu_backend.fp8_gemm_v2(A, False, B, False, None, torch.float32, 0.1, 0.1)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref.to(torch.bfloat16))


def test_fp8_gemm_rejects_a_scale_vector_of_the_wrong_length(emulated):
    A, B = _fp8_operand((3, 16), 16), _fp8_operand((16, 4), 17)
    with pytest.raises(ValueError, match="B_scale_inv"):
        emulated.fp8_gemm_v2(A, False, B, False, None, torch.float32, 0.1, torch.ones(5))


def test_fp8_gemm_rejects_per_token_scales_given_as_a_1d_vector(emulated):
    # A_scale_inv broadcasts over A [M, K]: a 1-D [M] vector runs along K. M != K: an error,
    # as on a Gaudi (per-token scales are [M, 1]).
    A, B = _fp8_operand((3, 16), 18), _fp8_operand((16, 4), 19)
    with pytest.raises(ValueError, match="A_scale_inv"):
        emulated.fp8_gemm_v2(A, False, B, False, None, torch.float32, torch.ones(3), 0.1)
