"""seam/gaudi against seam/emulated.py, function by function, on the same inputs.

Runs everywhere: over a real Gaudi where habana_frameworks is installed, otherwise over the Habana
stand-in (tests/habana_standin), which enforces the input rules of Habana's kernels. So a wrapper
that hands a kernel what Habana rejects (a 1-D per-row scale, an int32 routing table, a bool
mask) fails here, and the two backends must agree wherever both accept the input. Tolerances:
float32 to rounding; bfloat16 at 3e-2 absolute (Gaudi's TPC rounds differently from the CPU).
"""

from __future__ import annotations

import math

import pytest
import torch

# The tolerances `vllm-gaudi selftest` compares the backends with on an operator's machine.
from vllm_gaudi_platform.commands.selftest_kernels import TOLERANCE
from vllm_gaudi_platform.seam import emulated

pytestmark = pytest.mark.gaudi

DTYPES = [torch.float32, torch.bfloat16]


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.cpu()


# ----------------------------------------------------------------------------- identity and runtime
def test_gaudi_identity_facts(gaudi):
    assert (gaudi.NAME, gaudi.DEVICE_TYPE, gaudi.IS_EMULATED) == ("gaudi", "hpu", False)
    assert (gaudi.DISPATCH_KEY, gaudi.DIST_BACKEND) == ("HPU", "hccl")
    assert gaudi.COMPILE_BACKEND == "hpu_backend"
    assert gaudi.SHARED_HOST_MEMORY is False
    assert (gaudi.NIXL_DEVICE_MEMORY, emulated.NIXL_DEVICE_MEMORY) == ("VRAM", "DRAM")
    assert (gaudi.ROPE_BLOCKWISE, gaudi.ROPE_PAIRWISE) == (
        emulated.ROPE_BLOCKWISE,
        emulated.ROPE_PAIRWISE,
    )
    assert set(gaudi.MOE_ACTIVATIONS) <= {"silu", "gelu", "relu"}
    assert set(emulated.MOE_ACTIVATIONS) <= set(gaudi.MOE_ACTIVATIONS)


def test_gaudi_pin_memory_is_off_as_on_hpu(gaudi):
    # F7: pinned host memory is not supported on HPU (Intel's platform reports False).
    assert gaudi.PIN_MEMORY is False


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_every_rank_names_its_one_gaudi_hpu_and_selecting_it_succeeds(gaudi, rank):
    # F6: a process has one Gaudi; "hpu:{rank}" names a device it does not have for rank > 0.
    device = gaudi.torch_device(rank)
    assert device == torch.device("hpu")
    gaudi.set_device(device)


def test_gaudi_runtime_queries(gaudi):
    assert gaudi.device_count() >= 1
    assert "GAUDI" in gaudi.device_name().upper()
    free, total = gaudi.mem_get_info()
    assert 0 <= free <= total and total > 0
    assert gaudi.memory_allocated() >= 0
    gaudi.synchronize()
    gaudi.mark_step()
    s = gaudi.Stream()
    with gaudi.stream(s):
        e = gaudi.Event()
        e.record()
        e.synchronize()
    s.wait_stream(gaudi.current_stream())
    s.synchronize()


def test_stand_in_counts_mark_steps(standin_device):
    from habana_frameworks.torch import core

    from vllm_gaudi_platform.seam import gaudi

    before = core.MARK_STEPS
    gaudi.mark_step()
    assert before + 1 == core.MARK_STEPS


# ----------------------------------------------------------------------------- graphs
def test_gaudi_graph_replays_the_recorded_ops_on_the_captured_buffers_only(gaudi, monkeypatch):
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "1")
    assert gaudi.graphs_supported()
    x = torch.arange(4.0)
    calls = []

    def forward():
        calls.append(1)  # a Python side effect: a replay does not run it
        return torch.ops.aten.mul(x, 2) + 1

    graph = gaudi.Graph("step")
    out = graph.capture(forward, {"x": x})
    assert out.tolist() == [1.0, 3.0, 5.0, 7.0]
    x.copy_(torch.tensor([10.0, 20.0, 30.0, 40.0]))  # a static input, updated in place

    again = graph.replay({"x": x})

    assert again is out and out.tolist() == [21.0, 41.0, 61.0, 81.0]
    assert calls == [1]


def test_graphs_exist_in_lazy_mode_only_on_both_backends(gaudi, monkeypatch):
    # F3: the bridge exports HPUGraph only in lazy mode; Intel compiles with torch.compile in
    # eager mode. The emulation follows the same rule.
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "0")
    assert not gaudi.graphs_supported() and not emulated.graphs_supported()
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "1")
    assert gaudi.graphs_supported() and emulated.graphs_supported()


# ----------------------------------------------------------------------------- fused kernels
def _qkv(b, hq, hkv, q_len, kv_len, dim=32, dtype=torch.float32, seed=0):
    g = _gen(seed)
    q = torch.randn(b, hq, q_len, dim, generator=g).to(dtype)
    k = torch.randn(b, hkv, kv_len, dim, generator=g).to(dtype)
    v = torch.randn(b, hkv, kv_len, dim, generator=g).to(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_fused_sdpa_with_a_boolean_mask_matches_the_emulation(gaudi, dtype, heads, is_causal):
    q, k, v = _qkv(2, *heads, 19, 19, dtype=dtype)
    mask = torch.rand(2, 1, 19, 19, generator=_gen(1)) > 0.3
    mask |= torch.eye(19, dtype=torch.bool)
    attn_mask = None if is_causal else mask

    out = gaudi.fused_sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal)

    expected = emulated.fused_sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal)
    torch.testing.assert_close(_host(out).float(), expected.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_sdpa_per_head_bias_with_grouped_queries_lines_up_head_for_head(gaudi, dtype):
    # F8: an ALiBi-style bias differs per query head; under grouped-query attention Gaudi's 5-D
    # query is [batch, kv_heads, q_per_kv, ...], and the bias must split its head axis the same
    # way (a unit axis would not broadcast against q_per_kv).
    q, k, v = _qkv(1, 8, 2, 11, 11, dtype=dtype)
    slopes = torch.tensor([2.0**-i for i in range(1, 9)])
    rel = torch.arange(11)[None, :] - torch.arange(11)[:, None]
    causal = torch.ones(11, 11, dtype=torch.bool).tril()
    bias = (slopes[:, None, None] * rel).masked_fill(~causal, -math.inf)[None].to(dtype)

    out = gaudi.fused_sdpa(q, k, v, attn_mask=bias)

    expected = emulated.fused_sdpa(q, k, v, attn_mask=bias)
    torch.testing.assert_close(_host(out).float(), expected.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("length_dtype", [torch.int64, torch.int32])
def test_fused_sdpa_valid_lengths_in_causal_mode(gaudi, side, length_dtype):
    # F9: Gaudi takes valid lengths as int32; callers may hold them as int64.
    q, k, v = _qkv(3, 4, 4, 9, 9)
    lens = torch.tensor([9, 4, 6], dtype=length_dtype)

    out = gaudi.fused_sdpa(q, k, v, is_causal=True, valid_sequence_lengths=lens, padding_side=side)

    expected = emulated.fused_sdpa(
        q, k, v, is_causal=True, valid_sequence_lengths=lens, padding_side=side
    )
    torch.testing.assert_close(_host(out), expected, **TOLERANCE[torch.float32])


def test_fused_sdpa_refuses_valid_lengths_without_causal_mode_on_both_backends(gaudi):
    # F2: the rule is Gaudi's (FusedSDPA asserts it); the emulation enforces it too.
    q, k, v = _qkv(1, 2, 2, 4, 4)
    lens = torch.tensor([3], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="is_causal"):
        gaudi.fused_sdpa(q, k, v, is_causal=False, valid_sequence_lengths=lens)
    with pytest.raises(ValueError, match="is_causal"):
        emulated.fused_sdpa(q, k, v, is_causal=False, valid_sequence_lengths=lens)


@pytest.mark.parametrize("with_mask", [False, True])
def test_fused_sdpa_with_sinks_matches_the_emulation(gaudi, with_mask):
    q, k, v = _qkv(2, 4, 2, 7, 7)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    mask = (torch.rand(2, 1, 7, 7, generator=_gen(3)) > 0.2) | torch.eye(7, dtype=torch.bool)
    lens = torch.tensor([7, 5])
    kwargs = {"attn_mask": mask} if with_mask else {"valid_sequence_lengths": lens}

    out = gaudi.fused_sdpa(q, k, v, is_causal=not with_mask, sinks=sinks, **kwargs)

    expected = emulated.fused_sdpa(q, k, v, is_causal=not with_mask, sinks=sinks, **kwargs)
    torch.testing.assert_close(_host(out), expected, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_dtype", [None, torch.float32])
def test_rms_norm_matches_the_emulation(gaudi, dtype, weight_dtype):
    x = torch.randn(1, 7, 64, generator=_gen()).to(dtype)
    weight = torch.randn(64, generator=_gen(1)).to(weight_dtype or dtype)

    out = gaudi.rms_norm(x, weight, 1e-6)

    torch.testing.assert_close(_host(out), emulated.rms_norm(x, weight, 1e-6), **TOLERANCE[dtype])


@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_the_emulation(gaudi, bias):
    x = torch.randn(5, 16, generator=_gen())
    w = torch.randn(8, 16, generator=_gen(1))
    b = torch.randn(8, generator=_gen(2)) if bias else None
    torch.testing.assert_close(
        _host(gaudi.linear(x, w, b)), emulated.linear(x, w, b), **TOLERANCE[torch.float32]
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", [emulated.ROPE_BLOCKWISE, emulated.ROPE_PAIRWISE])
def test_rotary_matches_the_emulation(gaudi, dtype, mode):
    p = torch.randn(9, 4, 64, generator=_gen()).to(dtype)
    angles = torch.rand(9, 1, 64, generator=_gen(1)) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)

    out = gaudi.apply_rotary_pos_emb(p, cos, sin, None, 0, mode)

    expected = emulated.apply_rotary_pos_emb(p, cos, sin, None, 0, mode)
    torch.testing.assert_close(_host(out), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("activation", ["silu", "gelu"])
@pytest.mark.parametrize(("experts_min", "experts_max"), [(0, 7), (2, 5)])
@pytest.mark.parametrize("table_dtype", [torch.int64, torch.int32])
def test_mixture_of_experts_matches_the_emulation(
    gaudi, activation, experts_min, experts_max, table_dtype
):
    # F9: expert-parallel routing tables come out int32; Gaudi's kernel takes int64.
    dtype = torch.bfloat16
    tokens, hidden, inter, experts, topk = 16, 32, 64, 8, 2
    g = _gen()
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w12 = [(torch.randn(2 * inter, hidden, generator=g) / 10).to(dtype) for _ in range(experts)]
    w3 = [(torch.randn(hidden, inter, generator=g) / 15).to(dtype) for _ in range(experts)]
    table = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)])
    table = table.to(table_dtype)
    weights = torch.rand(tokens, topk, generator=g).to(dtype)
    local = slice(experts_min, experts_max + 1)

    out = gaudi.mixture_of_experts(
        x, table, weights, w12[local], w3[local], True, activation, experts_min, experts_max
    )

    expected = emulated.mixture_of_experts(
        x, table, weights, w12[local], w3[local], True, activation, experts_min, experts_max
    )
    torch.testing.assert_close(_host(out), expected, **TOLERANCE[dtype])


def _fp8_moe_inputs(dtype, static, per_channel, experts=6, tokens=12, hidden=32, inter=48):
    """FP8 experts (per-tensor or per-output-row scales), FP8 tokens with their scale (static 0-d
    or per token [M, 1]) and the static intermediate scales (None: dynamic)."""
    g = _gen(3)
    fp8, top = torch.float8_e4m3fn, emulated.fp8_max()

    def quantize(w):
        amax = w.abs().amax(dim=-1) if per_channel else w.abs().amax()
        scale = amax / top
        q = (w / (scale[:, None] if per_channel else scale)).to(fp8)
        return q, scale.float()

    ups = [quantize(torch.randn(2 * inter, hidden, generator=g) / 10) for _ in range(experts)]
    downs = [quantize(torch.randn(hidden, inter, generator=g) / 15) for _ in range(experts)]
    x = torch.randn(tokens, hidden, generator=g)
    x_scale = x.abs().amax() / top if static else x.abs().amax(-1, keepdim=True) / top
    xq = (x / x_scale).to(fp8)
    intermediate = [torch.tensor(0.004 * (1 + e)) for e in range(experts)] if static else None
    table = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=g).to(dtype)
    return xq, table, weights, ups, downs, x_scale.float(), intermediate


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("static", [True, False], ids=["static", "dynamic"])
@pytest.mark.parametrize("per_channel", [True, False], ids=["per-channel", "per-tensor"])
def test_fp8_mixture_of_experts_matches_the_emulation(gaudi, dtype, static, per_channel):
    xq, table, weights, ups, downs, x_scale, inter = _fp8_moe_inputs(dtype, static, per_channel)
    args = (
        xq,
        table,
        weights,
        [w for w, _ in ups],
        [w for w, _ in downs],
        x_scale,
        inter,
        [s for _, s in ups],
        [s for _, s in downs],
        True,
        "silu",
        0,
        len(ups) - 1,
    )
    out = gaudi.mixture_of_experts_fp8(*args)
    expected = emulated.mixture_of_experts_fp8(*args)
    assert out.dtype == expected.dtype == dtype  # the model's dtype, from the router weights
    torch.testing.assert_close(_host(out), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("backend_name", ["gaudi", "emulated"])
def test_fp8_mixture_of_experts_refuses_a_per_token_scale_as_a_vector(gaudi, backend_name):
    # A per-token hidden-state scale is [M, 1]; a 1-D [M] vector would line up with the hidden
    # axis (numpy broadcasting), which Gaudi's kernel reads per column.
    kernels = gaudi if backend_name == "gaudi" else emulated
    # As many tokens as hidden channels: the vector even broadcasts, and must still be refused.
    xq, table, weights, ups, downs, x_scale, _ = _fp8_moe_inputs(
        torch.float32, False, True, tokens=32, hidden=32
    )
    with pytest.raises((ValueError, RuntimeError), match="d_scale_hidden_states"):
        kernels.mixture_of_experts_fp8(
            xq,
            table,
            weights,
            [w for w, _ in ups],
            [w for w, _ in downs],
            x_scale.reshape(-1),
            None,
            [s for _, s in ups],
            [s for _, s in downs],
            True,
            "silu",
            0,
            len(ups) - 1,
        )


# ----------------------------------------------------------------------------- KV block copies
class _HostRulesOfGaudiTorch(torch.utils._python_dispatch.TorchDispatchMode):
    """What the torch builds that Gaudi software ships do on the host, for the ops copy_blocks
    uses: CPU index_select / index_copy_ on float8 do not exist there, and a non_blocking copy
    toward the host may still be in flight when the next op reads it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
        if name in ("index_select", "index_copy_", "index_copy") and args[0].dtype in fp8:
            raise RuntimeError(f'"{name}_cpu" not implemented for Float8')
        if name in ("_to_copy", "copy_") and kwargs.get("non_blocking", False):
            raise RuntimeError(f"{name} with non_blocking=True: the host would read a race")
        if name == "copy_" and len(args) > 2 and args[2]:
            raise RuntimeError("copy_ with non_blocking=True: the host would read a race")
        return func(*args, **kwargs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_copy_blocks_moves_fp8_caches_as_bytes_and_blocking(gaudi, dtype):
    # F5: an FP8 KV cache through NIXL's host staging; the destination is read right after.
    src = torch.randn(6, 4, 2, 8, generator=_gen()).to(dtype)
    dst = torch.zeros(5, 4, 2, 8).to(dtype)
    expected = dst.clone()
    emulated.copy_blocks(src, expected, torch.tensor([4, 0, 2]), torch.tensor([1, 3, 0]))

    with _HostRulesOfGaudiTorch():
        gaudi.copy_blocks(src, dst, torch.tensor([4, 0, 2]), torch.tensor([1, 3, 0]))

    assert torch.equal(dst.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(dst[1].view(torch.uint8), src[4].view(torch.uint8))


# ----------------------------------------------------------------------------- 4-bit and FP8
@pytest.mark.parametrize("grouped", [False, True])
def test_convert_from_uint4_matches_the_emulation(gaudi, grouped):
    k, n, groups = 32, 16, 4
    g = _gen()
    qweight = torch.randint(-(2**31), 2**31 - 1, (k, n // 8), generator=g, dtype=torch.int64)
    qzeros = torch.randint(-(2**31), 2**31 - 1, (groups, n // 8), generator=g, dtype=torch.int64)
    qweight, qzeros = qweight.to(torch.int32), qzeros.to(torch.int32)
    scales = torch.rand(groups, n, generator=g).to(torch.bfloat16)
    g_idx = torch.randint(0, groups, (k,), generator=g, dtype=torch.int32) if grouped else None

    out = gaudi.convert_from_uint4(qweight, scales, qzeros, torch.bfloat16, g_idx)

    expected = emulated.convert_from_uint4(qweight, scales, qzeros, torch.bfloat16, g_idx)
    assert torch.equal(_host(out), expected)


@pytest.mark.parametrize("generation", [3, 2])
def test_fp8_max_follows_the_gaudi_generation(standin_device, monkeypatch, generation):
    from vllm_gaudi_platform.seam import gaudi

    standin_device.GENERATION = generation
    monkeypatch.setenv("VLLM_HPU_EMULATION_GAUDI", str(generation))
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        assert gaudi.fp8_max(dtype) == emulated.fp8_max(dtype)
    assert gaudi.fp8_max() == (448.0 if generation == 3 else 240.0)
    with pytest.raises(ValueError):
        gaudi.fp8_max(torch.bfloat16)


def _scales(rows: int, cols: int) -> dict[str, torch.Tensor | float]:
    g = _gen(7)
    return {
        "number": 0.05,
        "tensor": torch.tensor(0.05),
        "per row": torch.rand(rows, 1, generator=g) / 10 + 0.01,
        "per column": torch.rand(cols, generator=g) / 10 + 0.01,
    }


@pytest.mark.parametrize("kind", ["number", "tensor", "per row", "per column"])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_casts_match_the_emulation(gaudi, kind, dtype):
    x = torch.randn(6, 10, generator=_gen()).to(torch.bfloat16) * 20
    scale = _scales(6, 10)[kind]

    out, amax = gaudi.cast_to_fp8_v2(x, scale, False, True, dtype)

    expected, expected_amax = emulated.cast_to_fp8_v2(x, scale, False, True, dtype)
    assert torch.equal(_host(out).float(), expected.float())
    torch.testing.assert_close(_host(amax), expected_amax)
    back = gaudi.cast_from_fp8(out, scale, torch.float32)
    torch.testing.assert_close(_host(back), emulated.cast_from_fp8(expected, scale, torch.float32))


def test_fp8_cast_saturates_and_rounds_stochastically_between_neighbours(gaudi):
    x = torch.tensor([[1000.0, -1000.0, 1.0, 1.03]])
    out, amax = gaudi.cast_to_fp8_v2(x, None, False, False)
    assert _host(out).float()[0, :3].tolist() == [448.0, -448.0, 1.0]
    assert amax.numel() == 0
    picks = {float(gaudi.cast_to_fp8_v2(x, None, True, False)[0][0, 3]) for _ in range(64)}
    assert picks <= {1.0, 1.125} and len(picks) == 2


@pytest.mark.parametrize("rows", [3, 16])  # 16 == K: a 1-D per-row scale would pass silently
def test_a_per_row_scale_as_a_vector_is_refused_by_both_backends(gaudi, rows):
    # F1: a 1-D scale applies per column on Gaudi; per-row scales must be [rows, 1].
    x = torch.randn(rows, 16, generator=_gen())
    row_scale = torch.rand(rows, generator=_gen(1)) + 0.5
    if rows == 16:
        out, _ = gaudi.cast_to_fp8_v2(x, row_scale)
        per_column = emulated.cast_to_fp8_v2(x, row_scale.view(1, -1))[0]
        assert torch.equal(_host(out).float(), per_column.float())
        return
    with pytest.raises(RuntimeError, match="broadcast"):
        gaudi.cast_to_fp8_v2(x, row_scale)
    with pytest.raises(ValueError, match="broadcast"):
        emulated.cast_to_fp8_v2(x, row_scale)


@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("accumulate", [False, True])
def test_fp8_gemm_matches_the_emulation(gaudi, trans_b, accumulate):
    m, k, n = 5, 16, 8
    g = _gen()
    a = (torch.randn(m, k, generator=g) * 4).to(torch.float8_e4m3fn)
    b = (torch.randn(k, n, generator=g) * 4).to(torch.float8_e4m3fn)
    b_op = b.t().contiguous() if trans_b else b
    a_scale = torch.rand(m, 1, generator=g) / 10
    b_scale = torch.rand(n, generator=g) / 10
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    d = torch.randn(m, n, generator=g).to(torch.bfloat16) if accumulate else None
    args = (a, False, b_op, trans_b, d, torch.bfloat16, a_scale, b_scale, bias, accumulate)

    out = gaudi.fp8_gemm_v2(*args)

    torch.testing.assert_close(_host(out), emulated.fp8_gemm_v2(*args), **TOLERANCE[torch.bfloat16])


# ----------------------------------------------------------------------------- LoRA
def test_lora_kernels_match_the_emulation(gaudi):
    g = _gen()
    tokens, width, rank, out_width, slots = 7, 32, 8, 24, 3
    x = torch.randn(tokens, width, generator=g)
    lora_a = torch.randn(slots, rank, width, generator=g)
    lora_b = torch.randn(slots, out_width, rank, generator=g)
    token_lora = torch.tensor([0, 2, -1, 1, 1, -1, 0])

    shrunk = gaudi.lora_shrink(x, lora_a, token_lora, 0.5)
    expanded = gaudi.lora_expand(shrunk, lora_b, token_lora)

    expected_shrunk = emulated.lora_shrink(x, lora_a, token_lora, 0.5)
    torch.testing.assert_close(_host(shrunk), expected_shrunk, **TOLERANCE[torch.float32])
    torch.testing.assert_close(
        _host(expanded),
        emulated.lora_expand(expected_shrunk, lora_b, token_lora),
        **TOLERANCE[torch.float32],
    )
    assert shrunk.dtype == expanded.dtype == torch.float32


# ----------------------------------------------------------------------------- paged and MLA
def _flat_blocks(lens, block, num_blocks, g):
    free = iter(torch.randperm(num_blocks, generator=g).tolist())
    blocks, groups, bias, rel = [], [], [], []
    for seq, n in enumerate(lens):
        for j in range(-(-n // block)):
            used = min(block, n - j * block)
            blocks.append(next(free))
            groups.append(seq)
            bias.append([0.0] * used + [-math.inf] * (block - used))
            rel.append([j * block + s - (n - 1) for s in range(block)])
    blocks.append(0)  # one padding entry, tagged with the group past the last sequence
    groups.append(len(lens))
    bias.append([-math.inf] * block)
    rel.append([0] * block)
    return (torch.tensor(blocks), torch.tensor(groups), torch.tensor(bias), torch.tensor(rel))


@pytest.mark.parametrize("option", ["plain", "soft_cap", "alibi", "sinks", "fp8"])
def test_paged_decode_matches_the_emulation(gaudi, option):
    g = _gen()
    block, heads, kv_heads, d, lens = 4, 4, 2, 16, [5, 9, 1]
    cache = torch.randn(12, block, kv_heads, 2 * d, generator=g)
    query = torch.randn(len(lens), heads, d, generator=g)
    blocks, groups, bias, rel = _flat_blocks(lens, block, 12, g)
    kwargs: dict = {}
    if option == "soft_cap":
        kwargs["soft_cap"] = 5.0
    elif option == "alibi":
        kwargs["alibi"] = (torch.tensor([0.5, 0.25, 0.125, 0.0625]), rel.float())
    elif option == "sinks":
        kwargs["sinks"] = torch.tensor([0.1, -0.5, 1.0, 0.0])
    elif option == "fp8":
        cache = (cache * 8).to(torch.float8_e4m3fn)
        kwargs["kv_scales"] = (torch.tensor(0.125), torch.tensor(0.125))

    out = gaudi.paged_decode(query, cache, blocks, groups, bias, d**-0.5, **kwargs)

    expected = emulated.paged_decode(query, cache, blocks, groups, bias, d**-0.5, **kwargs)
    torch.testing.assert_close(_host(out), expected, **TOLERANCE[torch.float32])


def test_mla_kernels_match_the_emulation(gaudi):
    g = _gen()
    heads, rank, rope, seq, block = 4, 16, 8, 6, 4
    query = torch.randn(1, heads, seq, rank + rope, generator=g)
    latent = torch.randn(1, 1, seq, rank + rope, generator=g)
    mask = torch.ones(seq, seq, dtype=torch.bool).tril()[None, None]
    scale = (rank + rope) ** -0.5

    out = gaudi.mla_prefill(query, latent, mask, scale, rank)
    torch.testing.assert_close(
        _host(out),
        emulated.mla_prefill(query, latent, mask, scale, rank),
        **TOLERANCE[torch.float32],
    )

    lens = [5, 2]
    cache = torch.randn(8, block, rank + rope, generator=g)
    q = torch.randn(len(lens), heads, rank + rope, generator=g)
    blocks, groups, bias, _ = _flat_blocks(lens, block, 8, g)
    out = gaudi.mla_paged_decode(q, cache, blocks, groups, bias, scale, rank)
    torch.testing.assert_close(
        _host(out),
        emulated.mla_paged_decode(q, cache, blocks, groups, bias, scale, rank),
        **TOLERANCE[torch.float32],
    )
