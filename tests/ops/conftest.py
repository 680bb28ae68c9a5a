"""Fixtures for the op-family tests.

- `emulated` (from the root conftest): the seam's emulated backend for one test.
- `hpu_backend` (from the root conftest): the seam's backend for one test, once per backend (the
  emulation, and seam/gaudi over the Habana stand-in off Gaudi); the family tests take it.
- `vllm_config`: a default VllmConfig set as current, which vLLM layers need to be built.
- `assert_matches`: assert_close with the tolerance of the dtype (see TOLERANCES).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

# vLLM's own defaults for comparing a kernel with its native implementation (vllm/ir/tolerances):
# float32 agrees to rounding; bfloat16 has an 8-bit mantissa, so 1.6e-2 relative is ~2 ulps.
TOLERANCES = {
    torch.float32: {"atol": 1e-5, "rtol": 1.3e-6},
    torch.bfloat16: {"atol": 1e-3, "rtol": 1.6e-2},
}


@pytest.fixture(scope="session")
def _default_vllm_config():
    from vllm.config import VllmConfig

    return VllmConfig()


@pytest.fixture
def vllm_config(_default_vllm_config):
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(_default_vllm_config):
        yield _default_vllm_config


@pytest.fixture(scope="session")
def assert_matches() -> Callable[..., None]:
    """`assert_matches(actual, expected, **override)`: same dtype and shape, values within the
    dtype's TOLERANCES (or the override)."""

    def check(actual: torch.Tensor, expected: torch.Tensor, **override: float) -> None:
        assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
        tolerance = {**TOLERANCES[expected.dtype], **override}
        torch.testing.assert_close(actual.detach(), expected.detach(), **tolerance)

    return check
