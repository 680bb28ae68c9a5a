"""Gaudi's 4-bit dequantization and FP8 kernels (casts, FP8 GEMM, the E4M3 range)."""

from __future__ import annotations

import torch

from vllm_gaudi_platform.seam.gaudi.runtime import device_name


# ----------------------------------------------------------------------------- 4-bit kernels
def convert_from_uint4(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: torch.Tensor,
    out_dtype: torch.dtype,
    g_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize 4-bit weights to [K, N] in `out_dtype`.

    `qweight` int32 [K, N/8] and `qzeros` int32 [G, N/8] are packed along N (nibble i of word j
    is column 8j+i); `qzeros` holds the zero points themselves. `scales` is [G, N].
    W[k, n] = (q[k, n] - z[g(k), n]) * s[g(k), n], g(k) = g_idx[k] if given, else k // (K / G)."""
    if g_idx is None:
        return torch.ops.hpu.convert_from_uint4(qweight, scales, qzeros, out_dtype)
    return torch.ops.hpu.convert_from_uint4(qweight, scales, qzeros, out_dtype, g_idx)


# ----------------------------------------------------------------------------- quantization kernels
# Scales are MULTIPLIERS (see emulated.py): cast_to_fp8_v2 takes 1/scale, the others take the
# dequantization scale; per tensor, per row of the activation, or per column N of a [K, N] weight.
def fp8_max(dtype: torch.dtype = torch.float8_e4m3fn) -> float:
    """Largest finite value a cast to `dtype` saturates to on this Gaudi: E4M3 is 448 on Gaudi 3
    and 240 on Gaudi 2; E5M2 is 57344 on both."""
    if dtype == torch.float8_e5m2:
        return 57344.0
    if dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_max: {dtype} is not an FP8 type Gaudi casts to")
    return 240.0 if "GAUDI2" in device_name().upper() else 448.0


def _as_tensor_scale(
    scale: torch.Tensor | float | None, device: torch.device
) -> torch.Tensor | None:
    """Gaudi's FP8 ops take scales as tensors; a per-row or per-column vector as a 1-D tensor."""
    if scale is None or isinstance(scale, torch.Tensor):
        return scale
    return torch.tensor(scale, dtype=torch.float32, device=device)


def cast_to_fp8_v2(
    x: torch.Tensor,
    scale: torch.Tensor | float | None = None,
    stochastic_rounding: bool = False,
    is_amax: bool = False,
    dtype: torch.dtype = torch.float8_e4m3fn,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8(x * scale) saturated to +-fp8_max(dtype), amax of x when is_amax)."""
    out, amax = torch.ops.hpu.cast_to_fp8_v2(
        x, _as_tensor_scale(scale, x.device), stochastic_rounding, is_amax, dtype
    )
    return out, amax


def cast_from_fp8(
    x: torch.Tensor, scale: torch.Tensor | float | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """x * scale in `out_dtype`."""
    return torch.ops.hpu.cast_from_fp8(x, _as_tensor_scale(scale, x.device), out_dtype)


def fp8_gemm_v2(
    A: torch.Tensor,
    trans_A: bool,
    B: torch.Tensor,
    trans_B: bool,
    D: torch.Tensor | None,
    out_dtype: torch.dtype,
    A_scale_inv: torch.Tensor | float | None = None,
    B_scale_inv: torch.Tensor | float | None = None,
    bias: torch.Tensor | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """(op(A) * A_scale_inv) @ (op(B) * B_scale_inv) + bias (+ D when accumulate)."""
    return torch.ops.hpu.fp8_gemm_v2(
        A,
        trans_A,
        B,
        trans_B,
        D,
        out_dtype,
        _as_tensor_scale(A_scale_inv, A.device),
        _as_tensor_scale(B_scale_inv, B.device),
        bias,
        accumulate,
    )
