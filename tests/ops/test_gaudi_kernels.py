"""The Gaudi wrappers in seam/gaudi.py against the emulation in seam/emulated.py, on a Gaudi.

Skipped (see conftest) where habana_frameworks is not importable. Both backends implement one
contract, so the same inputs must give the same results; Gaudi's kernels round differently
(bfloat16 TPC arithmetic), hence the bfloat16 tolerance of 3e-2 absolute.
"""

from __future__ import annotations

import pytest
import torch

from vllm_gaudi_platform.seam import emulated

pytestmark = pytest.mark.gaudi

DTYPES = [torch.float32, torch.bfloat16]
TOLERANCE = {torch.float32: {"atol": 1e-4, "rtol": 1e-4}, torch.bfloat16: {"atol": 3e-2}}


@pytest.fixture
def gaudi():
    pytest.importorskip("habana_frameworks")
    from vllm_gaudi_platform.seam import gaudi

    return gaudi


def _on_hpu(*tensors):
    return [t.to("hpu") for t in tensors]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_dtype", [None, torch.float32])
def test_gaudi_rms_norm_matches_emulation(gaudi, dtype, weight_dtype):
    x = torch.randn(1, 7, 128).to(dtype)
    weight = torch.randn(128).to(weight_dtype or dtype)

    out = gaudi.rms_norm(*_on_hpu(x, weight), 1e-6).cpu()

    torch.testing.assert_close(out, emulated.rms_norm(x, weight, 1e-6), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", [emulated.ROPE_BLOCKWISE, emulated.ROPE_PAIRWISE])
def test_gaudi_rotary_matches_emulation(gaudi, dtype, mode):
    p = torch.randn(9, 4, 64).to(dtype)
    angles = torch.rand(9, 1, 64) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)

    out = gaudi.apply_rotary_pos_emb(*_on_hpu(p, cos, sin), None, 0, mode).cpu()

    expected = emulated.apply_rotary_pos_emb(p, cos, sin, None, 0, mode)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


def test_gaudi_rotary_mode_constants_match_emulation(gaudi):
    assert (gaudi.ROPE_BLOCKWISE, gaudi.ROPE_PAIRWISE) == (
        emulated.ROPE_BLOCKWISE,
        emulated.ROPE_PAIRWISE,
    )


@pytest.mark.parametrize("activation", ["silu", "gelu"])
@pytest.mark.parametrize(("experts_min", "experts_max"), [(0, 7), (2, 5)])
def test_gaudi_mixture_of_experts_matches_emulation(gaudi, activation, experts_min, experts_max):
    dtype = torch.bfloat16
    tokens, hidden, inter, experts, topk = 16, 128, 256, 8, 2
    x = torch.randn(tokens, hidden).to(dtype)
    w12 = [(torch.randn(2 * inter, hidden) / 10).to(dtype) for _ in range(experts)]
    w3 = [(torch.randn(hidden, inter) / 15).to(dtype) for _ in range(experts)]
    table = torch.stack([torch.randperm(experts)[:topk] for _ in range(tokens)])
    weights = torch.rand(tokens, topk).to(dtype)
    local = slice(experts_min, experts_max + 1)

    out = gaudi.mixture_of_experts(
        *_on_hpu(x, table, weights),
        [w.to("hpu") for w in w12[local]],
        [w.to("hpu") for w in w3[local]],
        True,
        activation,
        experts_min,
        experts_max,
    ).cpu()

    expected = emulated.mixture_of_experts(
        x, table, weights, w12[local], w3[local], True, activation, experts_min, experts_max
    )
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
