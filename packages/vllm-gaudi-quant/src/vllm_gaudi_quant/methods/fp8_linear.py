"""The FP8 linear forward and the FP8 weight conversions, shared by every method with FP8 weights.

`apply_fp8_linear` multiplies FP8 weights [K, N] (per-tensor or per-output-channel scale) with
activations quantized by `cast_to_fp8_v2` (a static scale, or one per token), through
`fp8_gemm_v2`: the forward of `fp8.HpuFp8LinearMethod` and of compressed-tensors W8A8-FP8.
`quantize_per_channel` and `dequantize_blocks` convert checkpoint weights as they load.
Re-exported by `methods/fp8.py`.
"""

from __future__ import annotations

import torch

from vllm_gaudi_platform.seam import backend

FP8_DTYPE = torch.float8_e4m3fn
# Smallest per-token scale: an all-zero row would otherwise divide by zero.
_MIN_SCALE = 1e-12


# ----------------------------------------------------------------------------- the forward
def quantize_activations(
    x: torch.Tensor, input_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 x, its dequantization scale) for a 2-D x: with the static `input_scale` (0-d), or
    per token (one scale per row, [M, 1]) when it is None.

    A per-row scale is a column: Gaudi's cast_to_fp8_v2 and fp8_gemm_v2 broadcast scales
    numpy-style, so a 1-D [M] scale would apply per column (seam/emulated_quant.py)."""
    kernels = backend()
    if input_scale is None:
        amax = (
            x.abs().amax(dim=-1, keepdim=True).float()
            if x.shape[0]
            else x.new_zeros(0, 1, dtype=torch.float32)
        )
        input_scale = (amax / kernels.fp8_max(FP8_DTYPE)).clamp(min=_MIN_SCALE)
    xq, _ = kernels.cast_to_fp8_v2(x, 1.0 / input_scale, False, False, FP8_DTYPE)
    return xq, input_scale


def apply_fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """y = x @ (weight * weight_scale) + bias with FP8 weights and FP8 activations.

    `weight` FP8 [K, N]; `weight_scale` float32, 0-d (per tensor) or [N] (per output channel);
    `input_scale` a 0-d static activation scale, or None to quantize each token with its own
    scale. `x` is [..., K]; the result is [..., N] in `out_dtype` (default: x's dtype)."""
    out_dtype = out_dtype or x.dtype
    x2 = x.reshape(-1, x.shape[-1])
    xq, x_scale = quantize_activations(x2, input_scale)
    out = backend().fp8_gemm_v2(
        xq, False, weight, False, None, out_dtype, x_scale, weight_scale, bias, False
    )
    return out.reshape(*x.shape[:-1], weight.shape[-1])


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float [..., rows, cols] -> (FP8 same shape, float32 [..., rows] scales), one scale per row
    (per output channel of an [out, in] weight), saturating at the device's FP8 max."""
    kernels = backend()
    amax = w.abs().amax(dim=-1).float()
    scale = (amax / kernels.fp8_max(FP8_DTYPE)).clamp(min=_MIN_SCALE)
    flat = w.reshape(-1, w.shape[-1])
    # One scale per row of the flattened weight, as a [rows, 1] column (1-D would be per column).
    wq, _ = kernels.cast_to_fp8_v2(flat, 1.0 / scale.reshape(-1, 1), False, False, FP8_DTYPE)
    return wq.reshape(w.shape), scale


def dequantize_blocks(
    w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """FP8 [..., N, K] with block scales [..., ceil(N/bn), ceil(K/bk)] -> float32 [..., N, K]."""
    bn, bk = block
    n, k = w.shape[-2:]
    s = scale_inv.float().repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)
    return w.float() * s[..., :n, :k]
