"""Emulated quantization kernels: 4-bit dequantization, FP8 casts and FP8 GEMM.

Part of the CPU emulation backend (`emulated.py` re-exports every public name here); each mirrors
the Gaudi kernel of the same name wrapped in `gaudi/`, whose semantics the docstrings state.
"""

from __future__ import annotations

import torch

from vllm_gaudi_platform.seam.emulated_graph import kernel


# ----------------------------------------------------------------------------- 4-bit kernels
def _unpack_uint4_columns(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C/8] -> int32 [R, C]: nibble i of word j is column 8j+i (lowest nibble first)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    # & 0xF undoes the sign extension an arithmetic shift of a negative word brings in.
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).reshape(packed.shape[0], -1)


@kernel
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
    q = _unpack_uint4_columns(qweight)
    z = _unpack_uint4_columns(qzeros)
    rows = q.shape[0]
    if g_idx is None:
        g_idx = torch.arange(rows, device=q.device) // (rows // scales.shape[0])
    g_idx = g_idx.long()
    # (q - z) is a small integer, exact in any float type: one rounding, in the product.
    w = (q - z.index_select(0, g_idx)).to(torch.float32) * scales.index_select(0, g_idx).float()
    return w.to(out_dtype)


# ----------------------------------------------------------------------------- MXFP4 (OCP MX)
MXFP4_BLOCK = 32  # values per E8M0 scale
# E2M1 magnitudes by the low three bits of a nibble; bit 3 is the sign.
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """MXFP4 weights [rows, in] in `out_dtype` from `blocks` uint8 [rows, in / 2] (two E2M1
    values per byte, element 2j in the low nibble) and `scales` uint8 [rows, in / 32] (E8M0:
    2 ** (s - 127) for every 32 consecutive values along `in`; 255 is NaN)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4: blocks {blocks.dtype} and scales {scales.dtype}, not uint8")
    rows, half = blocks.shape
    if tuple(scales.shape) != (rows, 2 * half // MXFP4_BLOCK) or (2 * half) % MXFP4_BLOCK:
        raise ValueError(
            f"MXFP4: scales of shape {tuple(scales.shape)} for blocks {tuple(blocks.shape)}; "
            f"expected [{rows}, {2 * half // MXFP4_BLOCK}] (one per {MXFP4_BLOCK} values)"
        )
    table = torch.tensor(_E2M1, dtype=torch.float32, device=blocks.device)
    table = torch.cat((table, -table))
    nibbles = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()
    values = table[nibbles].reshape(rows, -1, MXFP4_BLOCK)
    exponent = scales.float() - 127.0
    factor = torch.where(scales == 255, torch.nan, torch.exp2(exponent))
    return (values * factor.unsqueeze(-1)).reshape(rows, -1).to(out_dtype)


# ----------------------------------------------------------------------------- quantization kernels
# FP8 casts and GEMM with the semantics of Gaudi's torch.ops.hpu.cast_to_fp8_v2 / cast_from_fp8 /
# fp8_gemm_v2. Scales are MULTIPLIERS: cast_to_fp8_v2 takes 1/scale, the others take the
# dequantization scale. A scale broadcasts against its operand numpy-style, as on a Gaudi: a
# number or a 1-element tensor applies to every value, and a vector applies along the LAST axis
# (one value per column). A per-row (per-token) scale is therefore [rows, 1]; a 1-D vector of
# row scales is a shape error unless rows == columns, and then silently scales columns. Facts:
# Intel's vllm-gaudi quantizes activations per token with `amax(dim=-1)...unsqueeze(-1)` before
# cast_to_fp8_v2 and passes that [M, 1] tensor as fp8_gemm_v2's A_scale_inv; its weight scales
# are 1-D per output column of the [K, N] operand (B_scale_inv).
_GAUDI_GENERATIONS = ("3", "2")


def fp8_max(dtype: torch.dtype = torch.float8_e4m3fn) -> float:
    """Largest finite value a cast to `dtype` saturates to on this Gaudi.

    E4M3 is 448 on Gaudi 3 and 240 on Gaudi 2 (its E4M3 keeps IEEE-style special exponents); E5M2
    is 57344 on both. Emulation behaves as VLLM_HPU_EMULATION_GAUDI (default 3)."""
    if dtype == torch.float8_e5m2:
        return 57344.0
    if dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_max: {dtype} is not an FP8 type Gaudi casts to")
    from vllm_gaudi_platform import envs

    generation = (envs.get_raw(envs.VLLM_HPU_EMULATION_GAUDI) or "").strip()
    if generation not in _GAUDI_GENERATIONS:
        raise envs.EnvError(
            f"{envs.VLLM_HPU_EMULATION_GAUDI}={generation!r} is not a Gaudi generation the "
            "emulation knows; set it to 3 or 2."
        )
    return 448.0 if generation == "3" else 240.0


def _broadcast_scale(scale: torch.Tensor | float, shape: torch.Size, what: str):
    """`scale` as it multiplies an operand of `shape`: a number as is, a tensor in float32 if it
    broadcasts numpy-style without growing the operand (ValueError naming `what` otherwise)."""
    if not isinstance(scale, torch.Tensor):
        return scale
    if scale.numel() == 1:
        return scale.reshape(()).float()
    try:
        result = torch.broadcast_shapes(tuple(scale.shape), tuple(shape))
    except RuntimeError:
        result = None
    if result != tuple(shape):
        raise ValueError(
            f"{what}: a scale of shape {tuple(scale.shape)} does not broadcast over an operand "
            f"of shape {tuple(shape)}; a 1-D scale applies along the last axis (per column), a "
            "per-row scale must be [rows, 1]"
        )
    return scale.float()


def _round_stochastic(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round float32 `v` (already within range) to one of its two FP8 neighbours, the upper one
    with probability proportional to the distance from the lower one."""
    magnitude = v.abs()
    nearest = magnitude.to(dtype)
    bits = nearest.view(torch.uint8).to(torch.int16)
    above = nearest.float() > magnitude
    # Positive FP8 values are ordered like their bit patterns: a neighbour is one code away. A
    # value that is not exact lies strictly inside the range, so both neighbours are finite.
    lo = torch.where(above, bits - 1, bits).clamp(min=0).to(torch.uint8).view(dtype).float()
    hi = torch.where(above, bits, bits + 1).clamp(max=127).to(torch.uint8).view(dtype).float()
    exact = nearest.float() == magnitude
    gap = torch.where(exact, 1.0, hi - lo)
    p_up = torch.where(exact, 0.0, (magnitude - lo) / gap)
    chosen = torch.where(torch.rand_like(magnitude) < p_up, hi, lo)
    chosen = torch.where(exact, nearest.float(), chosen)
    return (chosen * v.sign()).to(dtype)


@kernel
def cast_to_fp8_v2(
    x: torch.Tensor,
    scale: torch.Tensor | float | None = None,
    stochastic_rounding: bool = False,
    is_amax: bool = False,
    dtype: torch.dtype = torch.float8_e4m3fn,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaudi's torch.ops.hpu.cast_to_fp8_v2: (fp8(x * scale), amax).

    `scale` multiplies before the cast (callers pass 1/scale): a number, or a tensor that
    broadcasts over x numpy-style ([rows, 1] per row, 1-D per column). The cast saturates:
    values beyond fp8_max(dtype) become +-fp8_max (torch's own cast does not saturate). `amax`
    is max |x| of the unscaled input as a 0-d float32 tensor when `is_amax`, else an empty
    tensor."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        # Gaudi's cast takes float32 and bfloat16 (and FP8 passed through); float16 is refused.
        raise ValueError(f"cast_to_fp8_v2: input dtype {x.dtype}; Gaudi casts float32/bfloat16")
    y = x.float()
    if scale is not None:
        y = y * _broadcast_scale(scale, x.shape, "cast_to_fp8_v2")
    limit = fp8_max(dtype)
    y = y.clamp(-limit, limit)
    out = _round_stochastic(y, dtype) if stochastic_rounding else y.to(dtype)
    amax = x.abs().amax().float() if is_amax else torch.empty(0, device=x.device)
    return out, amax


@kernel
def cast_from_fp8(
    x: torch.Tensor, scale: torch.Tensor | float | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """Gaudi's torch.ops.hpu.cast_from_fp8: x * scale in `out_dtype` (scale a number or a tensor
    that broadcasts over x numpy-style; None means 1)."""
    y = x.float()
    if scale is not None:
        y = y * _broadcast_scale(scale, x.shape, "cast_from_fp8")
    return y.to(out_dtype)


@kernel
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
    """Gaudi's torch.ops.hpu.fp8_gemm_v2: (op(A) @ op(B)) * A_scale_inv * B_scale_inv + bias,
    plus D when `accumulate`, in `out_dtype`; op transposes the last two axes when asked.

    A is [M, K] (after op), FP8 activations; B is [K, N] (after op; a weight stored [N, K]
    passes trans_B=True), FP8. The scales dequantize the PRODUCT and broadcast against it
    numpy-style, as the bridge applies them: per tensor, per row ([M, 1], a per-token A scale) or
    per output column ([N], a per-channel weight scale). A 1-D per-row scale is a shape error
    unless M == N (and then scales columns). Emulated in float32."""
    a = A.float().transpose(-2, -1) if trans_A else A.float()
    b = B.float().transpose(-2, -1) if trans_B else B.float()
    out = a @ b
    if A_scale_inv is not None:
        out = out * _broadcast_scale(A_scale_inv, out.shape, "fp8_gemm_v2 A_scale_inv")
    if B_scale_inv is not None:
        out = out * _broadcast_scale(B_scale_inv, out.shape, "fp8_gemm_v2 B_scale_inv")
    if bias is not None:
        out = out + bias.float()
    if accumulate:
        if D is None:
            raise ValueError("fp8_gemm_v2: accumulate=True needs D")
        out = out + D.float()
    return out.to(out_dtype)
