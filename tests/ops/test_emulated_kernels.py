"""The op-family kernels of seam/emulated.py against straightforward torch references.

Each reference is the kernel's documented formula written the plain way (float64 where the
kernel promises float32 accumulation), so a wrong emulation cannot hide behind shared code.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_gaudi_platform.seam import emulated

DTYPES = [torch.float32, torch.bfloat16]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("x_shape", [(1, 96), (33, 96), (2, 5, 96), (96,)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_the_formula(dtype, x_shape, with_bias, assert_matches):
    # Rows 1 and 33 (decode and prefill sizes), a 3-D input, and a 1-D one (F.linear's path).
    torch.manual_seed(0)
    x = torch.randn(x_shape, dtype=dtype)
    weight = torch.randn(80, 96, dtype=dtype)
    bias = torch.randn(80, dtype=dtype) if with_bias else None

    out = emulated.linear(x, weight, bias)

    expected = x.double() @ weight.double().t()
    if bias is not None:
        expected = expected + bias.double()
    assert out.shape == (*x_shape[:-1], 80) and out.dtype == dtype
    assert_matches(out, expected.to(dtype))


def test_linear_takes_non_contiguous_operands_and_an_empty_batch(assert_matches):
    # A weight that is a transposed view (tied or fused weights) and a strided input.
    torch.manual_seed(0)
    weight = torch.randn(96, 80).t()
    x = torch.randn(96, 12).t()
    assert not weight.is_contiguous() and not x.is_contiguous()
    assert_matches(emulated.linear(x, weight), (x.double() @ weight.double().t()).float())
    assert emulated.linear(torch.empty(0, 96), weight).shape == (0, 80)


ISA_CHECK = """
import torch
from vllm_gaudi_platform.seam import emulated
torch.manual_seed(0)
worst = 0.0
for rows in (1, 8, 33, 512):
    x, w, b = torch.randn(rows, 256), torch.randn(192, 256), torch.randn(192)
    ref = x.double() @ w.double().t() + b.double()
    error = (emulated.linear(x, w, b).double() - ref).abs().max() / ref.abs().max()
    worst = max(worst, error.item())
print("ISA", torch.backends.cpu.get_cpu_capability(), worst)
"""


@pytest.mark.process
@pytest.mark.parametrize("isa", ["AVX2", "machine default"])
def test_linear_on_onednn_matches_the_formula_on_avx2_and_on_the_machines_own_kernels(
    isa, run_python
):
    # The emulated float32 linear runs oneDNN, whose kernels (and rounding) follow the CPU: an
    # AVX-512 machine runs other kernels than an AVX2 one. Both are checked here: capped to AVX2
    # (what every CI machine has), and uncapped (AVX-512 where the machine has it).
    env = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"} if isa == "AVX2" else {}
    result = run_python(ISA_CHECK, env)
    line = [x for x in result.stdout.splitlines() if x.startswith("ISA ")]
    assert line, result.stderr[-3000:]
    _, capability, worst = line[0].split()
    if isa == "AVX2":
        assert capability == "AVX2"
    assert float(worst) < 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 7, 64), (3, 5, 128)])
def test_rms_norm_matches_the_formula(dtype, shape, assert_matches):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype)
    weight = torch.randn(shape[-1], dtype=dtype)

    out = emulated.rms_norm(x, weight, 1e-6)

    x64 = x.double()
    expected = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    assert_matches(out, expected.to(dtype))


def test_rms_norm_applies_a_float32_weight_to_bfloat16_input_in_float32():
    torch.manual_seed(0)
    x = torch.randn(1, 4, 64, dtype=torch.bfloat16)
    weight = 1.0 + torch.randn(64) * 1e-3  # not representable in bfloat16

    out = emulated.rms_norm(x, weight, 1e-6)

    xf = x.float()
    expected = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * weight).bfloat16()
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_rms_norm_rejects_input_that_is_not_3d():
    with pytest.raises(ValueError, match="3-D"):
        emulated.rms_norm(torch.randn(4, 64), torch.ones(64), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_blockwise_matches_the_rotate_half_formula(dtype, assert_matches):
    torch.manual_seed(0)
    p = torch.randn(6, 4, 32, dtype=dtype)
    # Distinct halves: the kernel takes full-width cos/sin, not vLLM's duplicated halves.
    cos, sin = torch.randn(6, 1, 32, dtype=dtype), torch.randn(6, 1, 32, dtype=dtype)

    out = emulated.apply_rotary_pos_emb(p, cos, sin, None, 0, emulated.ROPE_BLOCKWISE)

    assert_matches(out, p * cos + _rotate_half(p) * sin)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_pairwise_matches_the_rotate_every_two_formula(dtype, assert_matches):
    torch.manual_seed(0)
    p = torch.randn(6, 4, 32, dtype=dtype)
    cos, sin = torch.randn(6, 1, 32, dtype=dtype), torch.randn(6, 1, 32, dtype=dtype)

    out = emulated.apply_rotary_pos_emb(p, cos, sin, None, 0, emulated.ROPE_PAIRWISE)

    assert_matches(out, p * cos + _rotate_every_two(p) * sin)


def test_rotary_computes_and_returns_float32_when_cos_is_float32(assert_matches):
    torch.manual_seed(0)
    p = torch.randn(3, 2, 16, dtype=torch.bfloat16)
    cos, sin = torch.randn(3, 1, 16), torch.randn(3, 1, 16)

    out = emulated.apply_rotary_pos_emb(p, cos, sin, None, 0, emulated.ROPE_BLOCKWISE)

    pf = p.float()
    assert_matches(out, pf * cos + _rotate_half(pf) * sin)


def test_rotary_casts_cos_and_sin_to_the_input_dtype_otherwise():
    torch.manual_seed(0)
    p = torch.randn(3, 2, 16, dtype=torch.bfloat16)
    cos = torch.randn(3, 1, 16, dtype=torch.float16)
    sin = torch.randn(3, 1, 16, dtype=torch.float16)

    out = emulated.apply_rotary_pos_emb(p, cos, sin, None, 0, emulated.ROPE_BLOCKWISE)

    cos, sin = cos.bfloat16(), sin.bfloat16()
    torch.testing.assert_close(out, p * cos + _rotate_half(p) * sin)


@pytest.mark.parametrize("kwargs", [{"position_ids": torch.zeros(3)}, {"offset": 2}])
def test_rotary_refuses_position_ids_and_offset_it_does_not_emulate(kwargs):
    p, cs = torch.randn(3, 2, 16), torch.randn(3, 1, 16)
    with pytest.raises(NotImplementedError):
        emulated.apply_rotary_pos_emb(p, cs, cs, **kwargs)


def _moe_reference(x, table, weights, w12, w3, experts_min, activation):
    """Token by token, slot by slot, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(table.shape[1]):
            local = int(table[t, k]) - experts_min
            if not 0 <= local < len(w12):
                continue
            gate, up = (w12[local].double() @ x[t].double()).chunk(2)
            act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
            out[t] += float(weights[t, k]) * (w3[local].double() @ (act * up))
    return out


def _moe_inputs(dtype, tokens=9, hidden=32, inter=48, experts=6, topk=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w12 = [(torch.randn(2 * inter, hidden, generator=gen) / 6).to(dtype) for _ in range(experts)]
    w3 = [(torch.randn(hidden, inter, generator=gen) / 7).to(dtype) for _ in range(experts)]
    table = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)])
    weights = torch.rand(tokens, topk, generator=gen).to(dtype)
    return x, table, weights, w12, w3


# Products of bfloat16 weights round at every matmul; 2e-2 absolute on outputs of magnitude ~1.
MOE_TOLERANCE = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2}}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_moe_matches_the_token_by_token_reference(dtype, activation, assert_matches):
    x, table, weights, w12, w3 = _moe_inputs(dtype)

    out = emulated.mixture_of_experts(x, table, weights, w12, w3, True, activation, 0, 5)

    expected = _moe_reference(x, table, weights, w12, w3, 0, activation).to(dtype)
    assert_matches(out, expected, **MOE_TOLERANCE[dtype])


def test_moe_takes_transposed_weights_when_not_permuted(assert_matches):
    x, table, weights, w12, w3 = _moe_inputs(torch.float32)

    out = emulated.mixture_of_experts(
        x, table, weights, [w.t() for w in w12], [w.t() for w in w3], False, "silu", 0, 5
    )

    expected = _moe_reference(x, table, weights, w12, w3, 0, "silu").float()
    assert_matches(out, expected, **MOE_TOLERANCE[torch.float32])


def test_moe_skips_experts_outside_the_local_range(assert_matches):
    # Expert parallelism: this rank holds experts 2..4 of 6; slots routed elsewhere add nothing.
    x, table, weights, w12, w3 = _moe_inputs(torch.float32)

    out = emulated.mixture_of_experts(x, table, weights, w12[2:5], w3[2:5], True, "silu", 2, 4)

    expected = _moe_reference(x, table, weights, w12[2:5], w3[2:5], 2, "silu").float()
    assert_matches(out, expected, **MOE_TOLERANCE[torch.float32])
    assert (table < 2).any() or (table > 4).any()  # the case is exercised


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu"])
@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("experts_min, experts_max", [(0, 7), (2, 5)])
def test_moe_at_decode_size_where_most_experts_get_no_token(
    dtype, activation, tokens, experts_min, experts_max, assert_matches
):
    # 1 or 3 tokens, top-2 of 8 experts: most experts get no slot; on the rank holding experts
    # 2..5, some of the few slots are routed elsewhere.
    x, table, weights, w12, w3 = _moe_inputs(dtype, tokens=tokens, experts=8)
    w12, w3 = w12[experts_min : experts_max + 1], w3[experts_min : experts_max + 1]

    out = emulated.mixture_of_experts(
        x, table, weights, w12, w3, True, activation, experts_min, experts_max
    )

    expected = _moe_reference(x, table, weights, w12, w3, experts_min, activation).to(dtype)
    assert_matches(out, expected, **MOE_TOLERANCE[dtype])
    assert len(table.unique()) < 8  # the case is exercised


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_is_zero_when_no_slot_is_routed_to_this_rank(dtype):
    x, table, weights, w12, w3 = _moe_inputs(dtype, tokens=2, experts=8)
    assert (table > 2).all()  # this rank holds experts 0..2, which no token chose

    out = emulated.mixture_of_experts(x, table, weights, w12[:3], w3[:3], True, "silu", 0, 2)

    assert out.dtype == dtype
    assert torch.equal(out, torch.zeros_like(x))


def test_moe_rejects_an_activation_the_kernel_does_not_have():
    x, table, weights, w12, w3 = _moe_inputs(torch.float32)
    with pytest.raises(ValueError, match="relu"):
        emulated.mixture_of_experts(x, table, weights, w12, w3, True, "relu", 0, 5)


def test_moe_rejects_weight_lists_that_do_not_cover_the_expert_range():
    x, table, weights, w12, w3 = _moe_inputs(torch.float32)
    with pytest.raises(ValueError, match="expert weights"):
        emulated.mixture_of_experts(x, table, weights, w12, w3, True, "silu", 0, 3)
