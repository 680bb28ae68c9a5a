"""MXFP4 experts below the method: the test packer against transformers' MXFP4 dequantizer, and
the seam's `mixture_of_experts_mxfp4` on both backends (the emulation, and seam/gaudi over the
Habana stand-in's `bias_mxfp4_fused_weights`) against a float64 reference on the dequantized
weights, with gpt-oss's clamped SwiGLU over interleaved gate/up rows and expert biases.

Tolerance: the weights dequantize exactly (E2M1 times a power of two), so only the bf16
activations and the order of float32 accumulation differ from the float64 reference: the
output is compared at the bf16 rounding of its magnitude (atol 3e-2 on outputs of ~10)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import REAL_GAUDI_SOFTWARE
from tests.quant import mxfp4_packer as M

HIDDEN, INTER, EXPERTS, TOPK = 64, 96, 6, 2
ALPHA, LIMIT = 1.702, 7.0


def test_packer_dequantizes_as_transformers_reads_gpt_oss_checkpoints():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    weights = (
        torch.randn(3, 2 * INTER, HIDDEN, generator=gen)
        * torch.tensor([1e-3, 0.1, 30.0])[:, None, None]
    )
    packed = [M.quantize(w) for w in weights]
    blocks = torch.stack([p.reshape(p.shape[0], -1, 16) for p, _ in packed])
    scales = torch.stack([s for _, s in packed])

    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    ours = torch.stack([M.dequantize(p, s) for p, s in packed])  # [E, out, in]

    assert torch.equal(theirs, ours.transpose(1, 2))
    # Each block's scale puts its largest magnitude in [4, 8) steps of E2M1's grid, whose top is
    # 6: values round to the nearest grid point or saturate, off by at most a quarter of the
    # block's largest magnitude.
    blocks = weights.reshape(3, 2 * INTER, -1, M.BLOCK)
    error = (ours.reshape(blocks.shape) - blocks).abs().amax(dim=-1)
    assert (error <= 0.25 * blocks.abs().amax(dim=-1)).all()


def _expert_set(seed: int):
    gen = torch.Generator().manual_seed(seed)
    up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) * 0.6
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) * 0.3
    b13 = torch.randn(EXPERTS, 2 * INTER, generator=gen).to(torch.bfloat16)
    b2 = torch.randn(EXPERTS, HIDDEN, generator=gen).to(torch.bfloat16)
    packed_up = [M.quantize(w) for w in up]
    packed_down = [M.quantize(w) for w in down]
    return packed_up, packed_down, b13, b2


def _reference(x, ids, weights, packed_up, packed_down, b13, b2, experts_min):
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k]) - experts_min
            if not 0 <= e < len(packed_up):
                continue  # another rank's expert
            up = M.dequantize(*packed_up[e]).double()
            down = M.dequantize(*packed_down[e]).double()
            h = up @ x[t].double() + b13[e].double()
            gate, lin = h[0::2].clamp(max=LIMIT), h[1::2].clamp(-LIMIT, LIMIT)
            act = (lin + 1) * gate * torch.sigmoid(ALPHA * gate)
            out[t] += float(weights[t, k]) * (down @ act + b2[e].double())
    return out


def _run(kernels, x, ids, weights, packed_up, packed_down, b13, b2, experts_min=0):
    return kernels.mixture_of_experts_mxfp4(
        x,
        ids,
        weights,
        [p for p, _ in packed_up],
        [p for p, _ in packed_down],
        list(b13.unbind(0)),
        list(b2.unbind(0)),
        [s for _, s in packed_up],
        [s for _, s in packed_down],
        experts_min,
        experts_min + len(packed_up) - 1,
        ALPHA,
        LIMIT,
    )


@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_mxfp4_experts_match_a_float64_reference(hpu_backend, tokens):
    packed_up, packed_down, b13, b2 = _expert_set(1)
    gen = torch.Generator().manual_seed(tokens)
    x = (torch.randn(tokens, HIDDEN, generator=gen) * 2).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOPK] for _ in range(tokens)])
    weights = torch.rand(tokens, TOPK, generator=gen).softmax(-1).to(torch.bfloat16)

    out = _run(hpu_backend, x, ids.int(), weights, packed_up, packed_down, b13, b2)

    expected = _reference(x, ids, weights, packed_up, packed_down, b13, b2, 0)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    error = (out.double() - expected).abs().max().item()
    print(f"{hpu_backend.NAME} MXFP4 experts, {tokens} tokens: max |error| {error:.1e}")
    torch.testing.assert_close(out.double(), expected, atol=3e-2, rtol=1e-2)


def test_mxfp4_experts_exercise_the_clamp():
    # The reference input of the test above reaches gate/up values past the limit.
    packed_up, _, b13, _ = _expert_set(1)
    gen = torch.Generator().manual_seed(33)
    x = (torch.randn(33, HIDDEN, generator=gen) * 2).to(torch.bfloat16)
    gate_up = x.double() @ M.dequantize(*packed_up[0]).double().t() + b13[0].double()
    assert (gate_up[:, 0::2] > LIMIT).any() and (gate_up[:, 1::2].abs() > LIMIT).any()


def test_an_expert_parallel_rank_sums_only_its_own_experts(hpu_backend):
    packed_up, packed_down, b13, b2 = _expert_set(2)
    mine = slice(3, 6)  # this rank holds experts 3..5 of 6
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(8, HIDDEN, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOPK] for _ in range(8)])
    weights = torch.rand(8, TOPK, generator=gen).to(torch.bfloat16)
    local = (packed_up[mine], packed_down[mine], b13[mine], b2[mine])

    out = _run(hpu_backend, x, ids.int(), weights, *local, experts_min=3)

    expected = _reference(x, ids, weights, *local, 3)
    torch.testing.assert_close(out.double(), expected, atol=3e-2, rtol=1e-2)


def test_the_emulation_refuses_an_int64_routing_table_as_the_kernel_does(emulated):
    packed_up, packed_down, b13, b2 = _expert_set(3)
    x = torch.zeros(2, HIDDEN, dtype=torch.bfloat16)
    ids = torch.zeros(2, TOPK, dtype=torch.int64)
    weights = torch.ones(2, TOPK, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="int32"):
        _run(emulated, x, ids, weights, packed_up, packed_down, b13, b2)


def test_gaudi_py_runs_the_kernel_in_a_compiled_graph_outside_lazy_mode(gaudi, monkeypatch):
    # The MXFP4 overloads are not in the eager frontend: called directly with PT_HPU_LAZY_MODE=0
    # the stand-in refuses, as a Gaudi does, and seam/gaudi compiles the call with hpu_backend.
    packed_up, packed_down, b13, b2 = _expert_set(4)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, HIDDEN, generator=gen).to(torch.bfloat16)
    ids = torch.tensor([[0, 1], [2, 5], [4, 3]], dtype=torch.int32)
    weights = torch.full((3, TOPK), 0.5, dtype=torch.bfloat16)
    expected = _reference(x, ids, weights, packed_up, packed_down, b13, b2, 0)
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "0")

    with pytest.raises(RuntimeError) as refused:
        torch.ops.hpu.mixture_of_experts.bias_mxfp4_fused_weights(
            x,
            ids,
            weights,
            [p for p, _ in packed_up],
            [p for p, _ in packed_down],
            list(b13.unbind(0)),
            list(b2.unbind(0)),
            [s for _, s in packed_up],
            [s for _, s in packed_down],
            block_size=32,
            permuted_weights=True,
            experts_min=0,
            experts_max=EXPERTS - 1,
            is_fp4=True,
            alpha=ALPHA,
            limit=LIMIT,
        )
    if not REAL_GAUDI_SOFTWARE:
        assert "eager frontend" in str(refused.value)
    out = _run(gaudi, x, ids, weights, packed_up, packed_down, b13, b2)
    torch.testing.assert_close(out.double(), expected, atol=3e-2, rtol=1e-2)
