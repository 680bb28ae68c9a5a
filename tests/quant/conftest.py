"""Fixtures shared by the quantization tests (tests/quant runs against the quant and platform
wheels only: nothing here or in the tests imports vllm_gaudi_ops).

- `emulated` (from the root conftest): the seam's emulated backend for one test, behaving as a
  Gaudi 3 unless VLLM_HPU_EMULATION_GAUDI says otherwise.
- `hpu_backend` (from the root conftest): the seam's backend for one test, once per backend (the
  emulation, and seam/gaudi over the Habana stand-in off Gaudi); both behave as a Gaudi 3 by
  default.
- `gaudi2`: `hpu_backend` behaving as a Gaudi 2 (E4M3 saturates at 240, not 448).
- `as_generation(generation)`: make this test's `hpu_backend` behave as Gaudi `generation` (2 or 3).
- `relative_error(actual, expected)`: ||actual - expected|| / ||expected|| in float64, the
  measure the tolerances below bound.
- `job_backend` (module scope, once per backend): for the layer tests that run vLLM's layers in
  a fresh process (`run_python`), the environment and the prelude that make that process's seam
  resolve to the emulation or to seam/gaudi over the Habana stand-in (`job_backend.job(code)`); the
  prelude also defines `set_generation(generation)` (2 or 3) for the job to call.

Tolerances. FP8 E4M3 keeps 3 mantissa bits: rounding to nearest moves a value by at most 2^-4 of
itself (6.25%), about 2^-4/sqrt(3) = 3.6% RMS for values spread over a binade. A product of two
independently rounded operands has about sqrt(2) times that, and a dot product over K terms
averages the independent errors, so the relative norm error of an FP8 x FP8 matmul stays near
5%. FP8_MATMUL_TOLERANCE leaves room above that; one-sided (weights only) quantization is about
half of it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

FP8_MATMUL_TOLERANCE = 0.08  # relative norm error of x_fp8 @ w_fp8 against float
FP8_WEIGHT_ONLY_TOLERANCE = 0.05  # relative norm error of x @ w_fp8 (activations in float)


@pytest.fixture
def as_generation(
    hpu_backend: Any, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Callable[[int | str], None]:
    """`as_generation(generation)`: this test's backend behaves as that Gaudi from now on. The
    emulation reads VLLM_HPU_EMULATION_GAUDI; the stand-in has a GENERATION (skipped on a real
    Gaudi of another generation, which cannot change what it is)."""

    def select(generation: int | str) -> None:
        generation = int(generation)
        if hpu_backend.IS_EMULATED:
            monkeypatch.setenv("VLLM_HPU_EMULATION_GAUDI", str(generation))
            return
        limit = 240.0 if generation == 2 else 448.0
        if hpu_backend.fp8_max() == limit:
            return  # already that generation (a real Gaudi of it, or the stand-in's default)
        # Skipped on a real Gaudi of another generation: only the stand-in can be switched.
        request.getfixturevalue("standin_device").GENERATION = generation

    return select


@pytest.fixture
def gaudi2(hpu_backend: Any, as_generation: Callable[[int | str], None]) -> Iterator[Any]:
    """`hpu_backend` behaving as a Gaudi 2."""
    as_generation(2)
    yield hpu_backend


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    diff = (actual.double() - expected.double()).norm()
    return float(diff / expected.double().norm().clamp(min=1e-30))


@pytest.fixture(scope="session")
def relative_error() -> Callable[[torch.Tensor, torch.Tensor], float]:
    """`relative_error(actual, expected) -> float`: see the module docstring."""
    return _relative_error


# ----------------------------------------------------------------------------- fresh-process jobs
# The layer jobs run in a fresh process (vLLM's parallel state is process-wide), where the
# `hpu_backend` fixture cannot reach: the prelude does there what it does in-process. Off Gaudi the
# gaudi param puts the Habana stand-in (tests/habana_standin) on the job's path and points
# seam/gaudi's device facts at the CPU, where the stand-in's memory is. Where a real
# habana_frameworks is installed that param is skipped: the jobs build their tensors on the CPU.
STANDIN_PATH = Path(__file__).resolve().parents[1] / "habana_standin"
REAL_GAUDI_SOFTWARE = importlib.util.find_spec("habana_frameworks") is not None

_EMULATED_PRELUDE = """
import os as _os

def set_generation(generation):
    # fp8_max() reads the variable at each call, so one process can emulate both.
    _os.environ["VLLM_HPU_EMULATION_GAUDI"] = str(generation)
"""

_GAUDI_PRELUDE = """
import importlib as _importlib, sys as _sys
_sys.path.insert(0, __STANDIN__)
for _name in ("habana_frameworks.torch", "habana_frameworks.torch.core",
              "habana_frameworks.torch.hpu", "habana_frameworks.torch.hpex.kernels",
              "habana_frameworks.torch.hpex.normalization"):
    _importlib.import_module(_name)
import torch as _torch
from habana_frameworks.torch import _device as _standin_device
from vllm_gaudi_platform.seam import backend as _backend, gaudi as _gaudi
_gaudi.DEVICE_TYPE = "cpu"
_gaudi.torch_device = lambda index=0: _torch.device("cpu")
assert _backend().NAME == "gaudi", _backend().NAME

def set_generation(generation):
    _standin_device.GENERATION = int(generation)
"""


@dataclass(frozen=True)
class JobBackend:
    name: str
    env: dict[str, str]
    prelude: str

    def job(self, code: str) -> str:
        """`code` run after the prelude."""
        return self.prelude + code


@pytest.fixture(scope="module", params=["emulated", "gaudi"])
def job_backend(request: pytest.FixtureRequest) -> JobBackend:
    """See the module docstring."""
    if request.param == "emulated":
        return JobBackend("emulated", {"VLLM_HPU_EMULATION": "cpu"}, _EMULATED_PRELUDE)
    if REAL_GAUDI_SOFTWARE:
        pytest.skip("the layer jobs build CPU tensors: run over the stand-in, not a real Gaudi")
    prelude = _GAUDI_PRELUDE.replace("__STANDIN__", repr(str(STANDIN_PATH)))
    return JobBackend("gaudi", {}, prelude)
