"""Fixtures shared by the quantization tests (tests/quant runs against the quant and platform
wheels only: nothing here or in the tests imports vllm_gaudi_ops).

- `emulated` (from the root conftest): the seam's emulated backend for one test, behaving as a
  Gaudi 3 unless VLLM_HPU_EMULATION_GAUDI says otherwise.
- `gaudi2`: the same backend behaving as a Gaudi 2 (E4M3 saturates at 240, not 448).
- `relative_error(actual, expected)`: ||actual - expected|| / ||expected|| in float64, the
  measure the tolerances below bound.

Tolerances. FP8 E4M3 keeps 3 mantissa bits: rounding to nearest moves a value by at most 2^-4 of
itself (6.25%), about 2^-4/sqrt(3) = 3.6% RMS for values spread over a binade. A product of two
independently rounded operands has about sqrt(2) times that, and a dot product over K terms
averages the independent errors, so the relative norm error of an FP8 x FP8 matmul stays near
5%. FP8_MATMUL_TOLERANCE leaves room above that; one-sided (weights only) quantization is about
half of it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

FP8_MATMUL_TOLERANCE = 0.08  # relative norm error of x_fp8 @ w_fp8 against float
FP8_WEIGHT_ONLY_TOLERANCE = 0.05  # relative norm error of x @ w_fp8 (activations in float)


@pytest.fixture
def gaudi2(emulated: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The emulated backend behaving as a Gaudi 2."""
    monkeypatch.setenv("VLLM_HPU_EMULATION_GAUDI", "2")
    yield emulated


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    diff = (actual.double() - expected.double()).norm()
    return float(diff / expected.double().norm().clamp(min=1e-30))


@pytest.fixture(scope="session")
def relative_error() -> Callable[[torch.Tensor, torch.Tensor], float]:
    """`relative_error(actual, expected) -> float`: see the module docstring."""
    return _relative_error
