"""The activation family's Gaudi path against vLLM's forward_native, per gated activation.

Tolerances: conftest TOLERANCES (same elementwise math in the same dtype).
"""

from __future__ import annotations

import pytest
import torch

from vllm_gaudi_ops import stats
from vllm_gaudi_ops.families import activation

DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(7, 2 * 48), (2, 3, 2 * 64)]

# name -> (class, constructor kwargs)
ACTIVATIONS = {
    "silu_and_mul": (activation.HpuSiluAndMul, {}),
    "mul_and_silu": (activation.HpuMulAndSilu, {}),
    "gelu_and_mul": (activation.HpuGeluAndMul, {}),
    "gelu_tanh_and_mul": (activation.HpuGeluAndMul, {"approximate": "tanh"}),
    "swigluoai_and_mul": (activation.HpuSwigluOAIAndMul, {"alpha": 1.702, "limit": 1.5}),
    "swiglustep_and_mul": (activation.HpuSwigluStepAndMul, {"limit": 1.5}),
    "silu_and_mul_with_clamp": (activation.HpuSiluAndMulWithClamp, {"swiglu_limit": 1.5}),
    "silu_and_mul_with_clamp_oai": (
        activation.HpuSiluAndMulWithClamp,
        {"swiglu_limit": 1.5, "alpha": 1.702, "beta": 1.0},
    ),
    "fatrelu_and_mul": (activation.HpuFatreluAndMul, {"threshold": 0.3}),
    "situ_and_mul": (activation.HpuSituAndMul, {"beta": 2.0}),
    "situ_and_mul_linear_beta": (activation.HpuSituAndMul, {"beta": 2.0, "linear_beta": 1.5}),
    "gelu_and_mul_sparse": (activation.HpuGeluAndMulSparse, {"activation_sparsity": 0.95}),
}


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_activation_matches_native(vllm_config, assert_matches, name, shape, dtype):
    cls, kwargs = ACTIVATIONS[name]
    layer = cls(**kwargs)
    # Scaled so that the clamps (limit 1.5) and the FATReLU threshold cut some values.
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 2).to(dtype)

    out = layer.forward_oot(x)

    assert out.shape == (*shape[:-1], shape[-1] // 2)
    assert_matches(out, layer.forward_native(x))


def test_every_activation_replacement_overrides_forward_oot():
    for in_tree, replacement in activation.REPLACEMENTS:
        assert issubclass(replacement, in_tree), replacement
        assert replacement.forward_oot is not in_tree.forward_oot, replacement


def test_activation_forward_oot_counts_each_call(vllm_config):
    before = stats.COUNTS.get("activation", 0)

    activation.HpuSiluAndMul().forward_oot(torch.randn(2, 8))

    assert stats.COUNTS["activation"] == before + 1
