"""The stand-in's kernels: Habana's ops computed in plain torch on the CPU, with the input rules
Habana's bridge enforces (or Intel's call sites depend on) checked first.

Written from the kernels' documented semantics, independently of the project's emulation
(`seam/emulated*.py`), so the two can be compared. Each rule cites its source in a `Fact:`
comment; the README lists them all. A broken rule raises `HabanaRuleError`: on a Gaudi the same
call fails (or silently computes something else, which is worse and why the stand-in refuses).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from habana_frameworks.torch import _device


class HabanaRuleError(RuntimeError):
    """An input that Habana's kernel rejects or reads differently from what the caller meant."""


FP8_TYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
HIGH_PRECISION = (torch.bfloat16, torch.float32)


def broadcasts_over(t: torch.Tensor, shape: tuple[int, ...]) -> bool:
    """Whether `t` broadcasts numpy-style against `shape` without growing it."""
    try:
        return torch.broadcast_shapes(tuple(t.shape), shape) == shape
    except RuntimeError:
        return False


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise HabanaRuleError(message)


# ----------------------------------------------------------------------------- FP8
def fp8_limit(dtype: torch.dtype) -> float:
    """Saturation bound of a cast to `dtype` on the stand-in's device.

    Fact: Gaudi 2's E4M3 keeps IEEE-style special exponents, so its largest finite value is 240;
    Gaudi 3 implements OCP E4M3FN (448). E5M2 is 57344 on both (Intel's vllm-gaudi and INC scale
    FP8 checkpoints for Gaudi 2 by 240/448; Habana's FP8 documentation)."""
    if dtype == torch.float8_e5m2:
        return 57344.0
    return 240.0 if _device.generation() == 2 else 448.0


def _scale_over(scale: torch.Tensor | None, operand: tuple[int, ...], what: str):
    """A dequantization/quantization scale as it multiplies an operand of shape `operand`.

    Fact: the bridge's FP8 ops broadcast a scale tensor against its operand numpy-style. A
    0-d or 1-element scale is per tensor; a 1-D scale lines up with the LAST axis (per column);
    per-row scales must be [rows, 1]. Intel's vllm-gaudi unsqueezes per-token scales to [M, 1]
    before cast_to_fp8_v2 and fp8_gemm_v2 (A_scale_inv). A scale that would grow the operand is
    an error."""
    if scale is None:
        return None
    _require(isinstance(scale, torch.Tensor), f"{what}: the scale must be a tensor")
    if scale.numel() == 1:
        return scale.reshape(()).float()
    _require(
        broadcasts_over(scale, operand),
        f"{what}: scale of shape {tuple(scale.shape)} does not broadcast over an operand of "
        f"shape {operand} (a 1-D scale applies per column; per-row scales are [rows, 1])",
    )
    return scale.float()


def _fp8_grid(dtype: torch.dtype, limit: float, device: torch.device) -> torch.Tensor:
    """Every finite value of `dtype` within +-limit, ascending, in float32."""
    codes = torch.arange(256, dtype=torch.int32, device=device).to(torch.uint8).view(dtype).float()
    return codes[codes.isfinite() & (codes.abs() <= limit)].unique()


def cast_to_fp8_v2(
    input: torch.Tensor,
    scale: torch.Tensor | None = None,
    stochastic_rounding: bool = False,
    is_amax: bool = False,
    dtype: torch.dtype = torch.float8_e4m3fn,
) -> tuple[torch.Tensor, torch.Tensor]:
    # Fact: the input is float32, bfloat16 or FP8 (anything else, float16 included, is refused);
    # an FP8 input passes through unchanged, in its own dtype and without amax. The output is FP8
    # and the cast saturates at the device's range instead of producing inf/nan. (Bridge:
    # CastToFp8V2::AddNode and its any-mode tests.)
    _require(
        input.dtype in HIGH_PRECISION + FP8_TYPES,
        f"cast_to_fp8_v2: input dtype {input.dtype} is not float32, bfloat16 or FP8",
    )
    _require(dtype in FP8_TYPES, f"cast_to_fp8_v2: output dtype {dtype} is not FP8")
    if input.dtype in FP8_TYPES:
        _require(dtype == input.dtype and not is_amax, "cast_to_fp8_v2: FP8 input passes through")
        return input.clone(), torch.empty(0, device=input.device)
    y = input.float()
    s = _scale_over(scale, tuple(input.shape), "cast_to_fp8_v2")
    if s is not None:
        y = y * s
    limit = fp8_limit(dtype)
    y = y.clamp(-limit, limit)
    if stochastic_rounding:
        # Fact: stochastic rounding picks one of the two FP8 values around x*scale; the stand-in
        # takes the upper one with probability by distance (values already in FP8 stay put).
        grid = _fp8_grid(dtype, limit, y.device)
        lower_i = (torch.searchsorted(grid, y.reshape(-1), right=True) - 1).clamp(0, len(grid) - 1)
        upper_i = (lower_i + 1).clamp(max=len(grid) - 1)
        lower, upper = grid[lower_i].view_as(y), grid[upper_i].view_as(y)
        gap = upper - lower
        p_up = torch.where(gap > 0, (y - lower) / torch.where(gap > 0, gap, 1.0), 0.0)
        y = torch.where(torch.rand_like(y) < p_up, upper, lower)
    out = y.to(dtype)
    amax = input.abs().amax().float() if is_amax else torch.empty(0, device=input.device)
    return out, amax


def cast_from_fp8(
    input: torch.Tensor, scale: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    _require(input.dtype in FP8_TYPES, f"cast_from_fp8: input dtype {input.dtype} is not FP8")
    _require(out_dtype in HIGH_PRECISION, f"cast_from_fp8: out_dtype {out_dtype}")
    y = input.float()
    s = _scale_over(scale, tuple(input.shape), "cast_from_fp8")
    if s is not None:
        y = y * s
    return y.to(out_dtype)


def fp8_gemm_v2(
    A: torch.Tensor,
    trans_A: bool,
    B: torch.Tensor,
    trans_B: bool,
    D: torch.Tensor | None,
    out_dtype: torch.dtype,
    A_scale_inv: torch.Tensor | None = None,
    B_scale_inv: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    # Fact: out = (op(A) @ op(B)) * A_scale_inv * B_scale_inv (+ bias) (+ D when accumulate),
    # op transposing the last two axes; the scales broadcast against the [M, N] product, so a
    # per-row (per-token) A scale is [M, 1] and a 1-D B scale is per output column N (Intel's
    # per-channel FP8 linear passes x_scale [M, 1] and weight_scale [N] with trans_B=True). The
    # output is bf16 or fp32; accumulate needs D. (Bridge: Fp8GemmV2::AddNode and its tests.)
    _require(A.dtype in FP8_TYPES and B.dtype in FP8_TYPES, "fp8_gemm_v2: A and B must be FP8")
    _require(out_dtype in HIGH_PRECISION, f"fp8_gemm_v2: out_dtype {out_dtype}")
    a = A.float().transpose(-2, -1) if trans_A else A.float()
    b = B.float().transpose(-2, -1) if trans_B else B.float()
    _require(
        a.shape[-1] == b.shape[-2], f"fp8_gemm_v2: op(A) {a.shape} @ op(B) {b.shape} do not chain"
    )
    out = a @ b
    for name, scale in (("A_scale_inv", A_scale_inv), ("B_scale_inv", B_scale_inv)):
        s = _scale_over(scale, tuple(out.shape), f"fp8_gemm_v2 {name}")
        if s is not None:
            out = out * s
    if bias is not None:
        out = out + bias.float()
    if accumulate:
        _require(D is not None, "fp8_gemm_v2: accumulate=True needs D")
        out = out + D.float()  # type: ignore[union-attr]
    return out.to(out_dtype)


# The `.scalar` overloads take their scales as Python floats (neural-compressor's default scale
# format on a Gaudi, SCALAR) and otherwise compute what the tensor forms compute. Schemas: the
# bridge's `hpu::cast_to_fp8_v2.scalar`, `hpu::cast_from_fp8.scalar`, `hpu::fp8_gemm_v2.scalar`
# registrations. `scale_shape` / `B_scale_shape` are accepted and must be None (what they
# describe could not be established).
SCALAR_SCHEMAS = {
    "cast_to_fp8_v2": (
        "(Tensor input, float scale, bool stochastic_rounding=False, bool is_amax=False, "
        "ScalarType? dtype=None, int[]? scale_shape=None) -> (Tensor, Tensor)"
    ),
    "cast_from_fp8": (
        "(Tensor input, float scale, ScalarType out_dtype, int[]? scale_shape=None) -> Tensor"
    ),
    "fp8_gemm_v2": (
        "(Tensor A, bool trans_A, Tensor B, bool trans_B, Tensor? D, ScalarType out_dtype, "
        "float A_scale_inv, float B_scale_inv, Tensor? bias=None, bool accumulate=False, "
        "int[]? B_scale_shape=None) -> Tensor"
    ),
}


def _scalar(value: float) -> torch.Tensor:
    return torch.tensor(float(value), dtype=torch.float32)


def cast_to_fp8_v2_scalar(
    input, scale, stochastic_rounding=False, is_amax=False, dtype=None, scale_shape=None
):
    _require(scale_shape is None, "cast_to_fp8_v2.scalar: scale_shape is not supported")
    return cast_to_fp8_v2(
        input, _scalar(scale), stochastic_rounding, is_amax, dtype or torch.float8_e4m3fn
    )


def cast_from_fp8_scalar(input, scale, out_dtype, scale_shape=None):
    _require(scale_shape is None, "cast_from_fp8.scalar: scale_shape is not supported")
    return cast_from_fp8(input, _scalar(scale), out_dtype)


def fp8_gemm_v2_scalar(
    A,
    trans_A,
    B,
    trans_B,
    D,
    out_dtype,
    A_scale_inv,
    B_scale_inv,
    bias=None,
    accumulate=False,
    B_scale_shape=None,
):
    _require(B_scale_shape is None, "fp8_gemm_v2.scalar: B_scale_shape is not supported")
    return fp8_gemm_v2(
        A,
        trans_A,
        B,
        trans_B,
        D,
        out_dtype,
        _scalar(A_scale_inv),
        _scalar(B_scale_inv),
        bias,
        accumulate,
    )


# ----------------------------------------------------------------------------- 4-bit
def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C/8] -> [R, C]; nibble i (from the least significant) of word j is column 8j+i."""
    parts = [(packed >> (4 * i)) & 0xF for i in range(8)]
    return torch.stack(parts, dim=-1).reshape(packed.shape[0], -1)


def convert_from_uint4(
    input: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    out_dtype: torch.dtype,
    g_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    # Fact: weights and zero points are int32 words of eight 4-bit values packed along the output
    # axis N; scales are [groups, N]; the result is [K, N]. The bridge's tests produce float32
    # and bfloat16; whether float16 is refused could not be established, so it is accepted.
    _require(input.dtype == torch.int32, f"convert_from_uint4: weight dtype {input.dtype}")
    _require(zero_point.dtype == torch.int32, f"convert_from_uint4: zeros {zero_point.dtype}")
    _require(
        out_dtype in (*HIGH_PRECISION, torch.float16), f"convert_from_uint4: out_dtype {out_dtype}"
    )
    q = _nibbles(input)
    z = _nibbles(zero_point)
    groups, columns = scale.shape
    _require(
        columns == q.shape[1] and z.shape == (groups, columns),
        f"convert_from_uint4: weight {tuple(q.shape)}, zeros {tuple(z.shape)}, scales "
        f"{tuple(scale.shape)} disagree",
    )
    rows = q.shape[0]
    if g_idx is None:
        _require(rows % groups == 0, f"convert_from_uint4: {rows} rows in {groups} groups")
        group = torch.arange(rows, device=q.device) // (rows // groups)
    else:
        group = g_idx.long()
    w = (q - z[group]).float() * scale.float()[group]
    return w.to(out_dtype)


# ----------------------------------------------------------------------------- MoE
MOE_ACTIVATIONS = ("gelu", "relu", "silu")


def mixture_of_experts(
    hidden_states: torch.Tensor,
    expert_routing_table: torch.Tensor,
    router_weights: torch.Tensor,
    w12: list[torch.Tensor],
    w3: list[torch.Tensor],
    permuted_weights: bool,
    activation: str,
    experts_min: int,
    experts_max: int,
) -> torch.Tensor:
    return _moe(
        hidden_states,
        expert_routing_table,
        router_weights,
        w12,
        w3,
        permuted_weights,
        activation,
        experts_min,
        experts_max,
    )


# Fact: the FP8 form's schema (bridge registration, fused weights): after the weight lists come
# d_scale_hidden_states, d_scale_intermediate_hidden_states, d_scale_w12, d_scale_w3, then the
# bf16 form's flags. The stand-in declares the intermediate scales optional (Intel's dynamic
# calls leave them out), which makes the arguments after d_scale_hidden_states keyword-only
# here (every call site passes them by name).
MOE_FP8_SCHEMA = (
    "(Tensor hidden_states, Tensor expert_routing_table, Tensor router_weights, Tensor[] w12, "
    "Tensor[] w3, Tensor d_scale_hidden_states, *, "
    "Tensor[]? d_scale_intermediate_hidden_states=None, Tensor[] d_scale_w12, "
    "Tensor[] d_scale_w3, bool permuted_weights, str activation, int experts_min, "
    "int experts_max) -> Tensor"
)


def mixture_of_experts_fp8(
    hidden_states: torch.Tensor,
    expert_routing_table: torch.Tensor,
    router_weights: torch.Tensor,
    w12: list[torch.Tensor],
    w3: list[torch.Tensor],
    d_scale_hidden_states: torch.Tensor,
    *,
    d_scale_intermediate_hidden_states: list[torch.Tensor] | None = None,
    d_scale_w12: list[torch.Tensor],
    d_scale_w3: list[torch.Tensor],
    permuted_weights: bool,
    activation: str,
    experts_min: int,
    experts_max: int,
) -> torch.Tensor:
    return _moe(
        hidden_states,
        expert_routing_table,
        router_weights,
        w12,
        w3,
        permuted_weights,
        activation,
        experts_min,
        experts_max,
        d_scale_hidden_states,
        d_scale_intermediate_hidden_states,
        d_scale_w12,
        d_scale_w3,
    )


def _moe(
    hidden_states: torch.Tensor,
    expert_routing_table: torch.Tensor,
    router_weights: torch.Tensor,
    w12: list[torch.Tensor],
    w3: list[torch.Tensor],
    permuted_weights: bool,
    activation: str,
    experts_min: int,
    experts_max: int,
    d_scale_hidden_states: torch.Tensor | None = None,
    d_scale_intermediate_hidden_states: list[torch.Tensor] | None = None,
    d_scale_w12: list[torch.Tensor] | None = None,
    d_scale_w3: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    # Fact: the op has a bf16 form and an FP8 form (`fp8_fused_weights`), the latter picked by
    # its scale arguments: FP8 hidden states with `d_scale_hidden_states`, FP8 expert weights
    # with one scale list per weight list, and optionally one intermediate scale per expert
    # (bridge: mixture_of_experts_fp8* registrations and test_mixture_of_experts_fp8; Intel's
    # per-channel FP8 MoE passes per-token hidden scales [M, 1] and per-output-channel weight
    # scales, and leaves the intermediate scales out when activations are dynamic).
    # Fact: the routing table is int64 (the kernel is built for it; Intel casts top-k ids with
    # .to(torch.int64) before the call).
    _require(
        expert_routing_table.dtype == torch.int64,
        f"mixture_of_experts: expert_routing_table is {expert_routing_table.dtype}, not int64",
    )
    fp8 = d_scale_w12 is not None
    if fp8:
        _require(
            hidden_states.dtype in FP8_TYPES,
            f"mixture_of_experts (FP8): hidden_states are {hidden_states.dtype}, not FP8",
        )
        _require(
            d_scale_hidden_states is not None and d_scale_w3 is not None,
            "mixture_of_experts (FP8): d_scale_hidden_states and d_scale_w3 are required",
        )
        _require(
            router_weights.dtype in HIGH_PRECISION,
            f"mixture_of_experts (FP8): router_weights are {router_weights.dtype}",
        )
    else:
        _require(
            d_scale_hidden_states is None and d_scale_intermediate_hidden_states is None,
            "mixture_of_experts: activation scales without weight scales",
        )
        # Fact: router weights have the activations' dtype.
        _require(
            router_weights.dtype == hidden_states.dtype,
            f"mixture_of_experts: router_weights {router_weights.dtype} vs hidden_states "
            f"{hidden_states.dtype}",
        )
    _require(activation in MOE_ACTIVATIONS, f"mixture_of_experts: activation {activation!r}")
    local = experts_max - experts_min + 1
    _require(
        len(w12) == local and len(w3) == local,
        f"mixture_of_experts: {len(w12)}/{len(w3)} weights for experts "
        f"{experts_min}..{experts_max}",
    )

    def expert_weight(w: torch.Tensor, scales: list[torch.Tensor] | None, e: int, what: str):
        # Weights as [out, in] in float32, dequantized in the FP8 form: a weight scale is per
        # tensor (one element) or one per output channel (1-D, as Intel squeezes its [out, 1]).
        out_in = w.float() if permuted_weights else w.float().t()
        if scales is None:
            return out_in
        _require(w.dtype in FP8_TYPES, f"mixture_of_experts (FP8): {what} is {w.dtype}")
        _require(len(scales) == local, f"mixture_of_experts (FP8): {len(scales)} {what} scales")
        s = scales[e]
        if s.numel() == 1:
            return out_in * s.reshape(()).float()
        _require(
            s.dim() == 1 and s.shape[0] == out_in.shape[0],
            f"mixture_of_experts (FP8): {what} scale {tuple(s.shape)} for an expert weight with "
            f"{out_in.shape[0]} output channels",
        )
        return out_in * s.float().unsqueeze(1)

    x = hidden_states.float()
    if fp8:
        s = _scale_over(d_scale_hidden_states, tuple(hidden_states.shape), "mixture_of_experts")
        _require(
            s.dim() == 0 or tuple(s.shape) == (hidden_states.shape[0], 1),
            f"mixture_of_experts (FP8): d_scale_hidden_states {tuple(s.shape)}; per tensor or "
            "per token [M, 1]",
        )
        x = x * s
        # The kernel computes in the model's precision (router weights' dtype).
        x = x.to(router_weights.dtype).float()
    if d_scale_intermediate_hidden_states is not None:
        _require(
            len(d_scale_intermediate_hidden_states) == local
            and all(t.numel() == 1 for t in d_scale_intermediate_hidden_states),
            "mixture_of_experts (FP8): one 1-element intermediate scale per expert",
        )
    fp8_type = hidden_states.dtype if fp8 else None
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for slot in range(expert_routing_table.shape[1]):
        ids = expert_routing_table[:, slot]
        for e in range(local):
            rows = (ids == experts_min + e).nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            up = expert_weight(w12[e], d_scale_w12, e, "w12")
            down = expert_weight(w3[e], d_scale_w3, e, "w3")
            if fp8:
                up = up.to(router_weights.dtype).float()
                down = down.to(router_weights.dtype).float()
            gate, lin = (x[rows] @ up.t()).chunk(2, dim=-1)
            if activation == "silu":
                act = F.silu(gate)
            elif activation == "gelu":
                act = F.gelu(gate, approximate="tanh")
            else:
                act = F.relu(gate)
            h = act * lin
            if fp8_type is not None:
                # The FP8 form quantizes the intermediate for the second matmul: with its
                # expert's static scale, or per token from the values (dynamic).
                h = h.to(router_weights.dtype).float()
                if d_scale_intermediate_hidden_states is not None:
                    sc = d_scale_intermediate_hidden_states[e].reshape(()).float()
                else:
                    sc = (h.abs().amax(dim=-1, keepdim=True) / fp8_limit(fp8_type)).clamp(min=1e-12)
                limit = fp8_limit(fp8_type)
                h = (h / sc).clamp(-limit, limit).to(fp8_type).float() * sc
            y = h @ down.t()
            out[rows] += y * router_weights[rows, slot].float().unsqueeze(-1)
    return out.to(router_weights.dtype if fp8 else hidden_states.dtype)


# ----------------------------------------------------------------------------- MXFP4 MoE
# Fact: the biased MXFP4 overload's argument order (Intel's call of
# torch.ops.hpu.mixture_of_experts.bias_mxfp4_fused_weights): hidden states, routing table, router
# weights, then per-expert lists w12, w3, w12 biases, w3 biases, w12 scales, w3 scales; then
# block_size, permuted_weights, experts_min, experts_max, is_fp4, chunk_size, total_experts, alpha
# and limit, which Intel passes by name. The stand-in makes those keyword-only.
MOE_MXFP4_SCHEMA = (
    "(Tensor hidden_states, Tensor expert_routing_table, Tensor router_weights, Tensor[] w12, "
    "Tensor[] w3, Tensor[] w12_bias, Tensor[] w3_bias, Tensor[] d_scale_w12, "
    "Tensor[] d_scale_w3, *, int block_size, bool permuted_weights, int experts_min, "
    "int experts_max, bool is_fp4, int chunk_size=0, int total_experts=0, float alpha, "
    "float limit) -> Tensor"
)
# Fact: OCP MX E2M1 element values (sign bit 3, magnitude by bits 0-2) and E8M0 scales
# 2 ** (s - 127), 255 reserved for NaN; two elements per byte, the even one in the low nibble
# (OCP Microscaling Formats v1.0; the gpt-oss checkpoints and transformers' MXFP4 dequantizer).
_FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# Set while the stand-in's hpu_backend runs a compiled graph (see __init__.py).
IN_COMPILED_GRAPH = [0]


def _mxfp4_weight(w: torch.Tensor, scale: torch.Tensor, block: int, what: str) -> torch.Tensor:
    _require(w.dtype == torch.uint8, f"bias_mxfp4_fused_weights: {what} is {w.dtype}, not uint8")
    _require(
        scale.dtype == torch.uint8,
        f"bias_mxfp4_fused_weights: {what} scale is {scale.dtype}, not uint8 (E8M0)",
    )
    _require(w.dim() == 2, f"bias_mxfp4_fused_weights: {what} of shape {tuple(w.shape)}")
    rows, cols = w.shape[0], 2 * w.shape[1]
    _require(
        tuple(scale.shape) == (rows, cols // block) and cols % block == 0,
        f"bias_mxfp4_fused_weights: {what} scale {tuple(scale.shape)} for a [{rows}, {cols}] "
        f"weight in blocks of {block}",
    )
    magnitudes = torch.tensor(_FP4_MAGNITUDES, device=w.device)
    codes = torch.empty(rows, cols, dtype=torch.long, device=w.device)
    codes[:, 0::2] = (w & 0xF).long()
    codes[:, 1::2] = (w >> 4).long()
    values = magnitudes[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    exps = scale.long().repeat_interleave(block, dim=1)
    factors = torch.where(exps == 255, float("nan"), torch.exp2((exps - 127).double()).float())
    return values * factors


def mixture_of_experts_mxfp4(
    hidden_states: torch.Tensor,
    expert_routing_table: torch.Tensor,
    router_weights: torch.Tensor,
    w12: list[torch.Tensor],
    w3: list[torch.Tensor],
    w12_bias: list[torch.Tensor],
    w3_bias: list[torch.Tensor],
    d_scale_w12: list[torch.Tensor],
    d_scale_w3: list[torch.Tensor],
    *,
    block_size: int,
    permuted_weights: bool,
    experts_min: int,
    experts_max: int,
    is_fp4: bool,
    chunk_size: int = 0,
    total_experts: int = 0,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    # Fact: the MXFP4 overloads are blocklisted in the eager frontend: outside lazy mode they
    # run only inside a graph compiled by hpu_backend (Intel wraps each call in
    # torch.compile(backend="hpu_backend") for that reason).
    _require(
        _device.lazy_mode() or IN_COMPILED_GRAPH[0] > 0,
        "bias_mxfp4_fused_weights: not supported in the eager frontend (PT_HPU_LAZY_MODE=0 "
        "outside a compiled graph)",
    )
    # Fact: the MXFP4 overloads take an int32 routing table (Intel casts the top-k ids).
    _require(
        expert_routing_table.dtype == torch.int32,
        f"bias_mxfp4_fused_weights: expert_routing_table is {expert_routing_table.dtype}, "
        "not int32",
    )
    _require(
        router_weights.dtype == hidden_states.dtype,
        f"bias_mxfp4_fused_weights: router_weights {router_weights.dtype} vs hidden_states "
        f"{hidden_states.dtype}",
    )
    # Fact: Intel's only configuration: 32-value blocks, FP4 elements, [out, in] weights.
    _require(block_size == 32, f"bias_mxfp4_fused_weights: block_size {block_size}")
    _require(is_fp4, "bias_mxfp4_fused_weights: is_fp4=False (the FP4 form only)")
    _require(permuted_weights, "bias_mxfp4_fused_weights: permuted_weights=False")
    local = experts_max - experts_min + 1
    for what, tensors in (
        ("w12", w12),
        ("w3", w3),
        ("w12_bias", w12_bias),
        ("w3_bias", w3_bias),
        ("d_scale_w12", d_scale_w12),
        ("d_scale_w3", d_scale_w3),
    ):
        _require(
            len(tensors) == local,
            f"bias_mxfp4_fused_weights: {len(tensors)} {what} for experts "
            f"{experts_min}..{experts_max}",
        )
    x = hidden_states.float()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(local):
        up = _mxfp4_weight(w12[e], d_scale_w12[e], block_size, "w12")
        down = _mxfp4_weight(w3[e], d_scale_w3[e], block_size, "w3")
        _require(
            up.shape[1] == x.shape[1] and down.shape[0] == x.shape[1],
            f"bias_mxfp4_fused_weights: expert weights {tuple(up.shape)} / {tuple(down.shape)} "
            f"for hidden size {x.shape[1]}",
        )
        _require(
            tuple(w12_bias[e].shape) == (up.shape[0],) and tuple(w3_bias[e].shape) == (x.shape[1],),
            "bias_mxfp4_fused_weights: one bias per output row of each expert weight",
        )
        # Router weight of expert e for each token (0 where it is not among the token's top k).
        hit = expert_routing_table == experts_min + e
        rows = hit.any(dim=1).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        weight = (router_weights.float() * hit).sum(dim=1)[rows]
        h = x[rows] @ up.t() + w12_bias[e].float()
        # Fact: gpt-oss's SwiGLU on interleaved rows (gate 2j, up 2j + 1), with the clamp
        # `limit` and the sigmoid slope `alpha` (Intel: the op's GPT_SWIGLU mode, alpha 1.702,
        # limit 7.0; the model's reference implementation).
        gate = h[:, 0::2].clamp(max=limit)
        lin = h[:, 1::2].clamp(min=-limit, max=limit)
        y = ((lin + 1) * gate * torch.sigmoid(alpha * gate)) @ down.t() + w3_bias[e].float()
        out[rows] += y * weight.unsqueeze(-1)
    return out.to(hidden_states.dtype)
