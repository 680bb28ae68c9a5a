"""Shared test helpers: a clean environment, and Python run in a fresh process.

vLLM resolves its platform and loads its plugins once per process, so anything about the plugin
loader is tested in a fresh interpreter (`run_python`). Every test, in-process or not, starts from
an environment without the plugin-selection variables a developer may have exported.

The helpers reach tests as fixtures of the same name (`def test_x(run_python): ...`), so no test
module imports this file and any pytest import mode works.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest

# Variables that change which platform and plugins load; never inherited by a test.
SELECTION_VARIABLES = ("VLLM_PLUGINS", "VLLM_HPU_EMULATION", "VLLM_TARGET_DEVICE")

EnvOverrides = Mapping[str, "str | None"]


def make_env(overrides: EnvOverrides | None = None) -> dict[str, str]:
    """os.environ without the selection variables, with a 1 GiB CPU KV cache, plus `overrides`.

    An override of None removes that variable.
    """
    env = {k: v for k, v in os.environ.items() if k not in SELECTION_VARIABLES}
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    for name, value in (overrides or {}).items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def run_python_process(
    code: str,
    env: EnvOverrides | None = None,
    *,
    python: str = sys.executable,
    args: tuple[str, ...] = (),
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """Run `python <args> -c code` under `make_env(env)`; a failure is returned, not raised."""
    return subprocess.run(
        [python, *args, "-c", code],
        env=make_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def console_script_path(name: str, python: str = sys.executable) -> str:
    """The console script `name` beside interpreter `python`; fails the test if absent."""
    path = os.path.join(os.path.dirname(python), name)
    if not os.path.isfile(path):
        pytest.fail(f"console script {name} is not installed beside {python}")
    return path


@pytest.fixture(autouse=True)
def _no_inherited_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in SELECTION_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="session")
def clean_env() -> Callable[..., dict[str, str]]:
    """`clean_env(overrides=None) -> dict`: see make_env."""
    return make_env


@pytest.fixture(scope="session")
def run_python() -> Callable[..., subprocess.CompletedProcess[str]]:
    """`run_python(code, env=None, *, python=..., args=(), timeout=300) -> CompletedProcess`."""
    return run_python_process


@pytest.fixture(scope="session")
def console_script() -> Callable[..., str]:
    """`console_script(name, python=sys.executable) -> path`."""
    return console_script_path


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The seam's emulated backend, resolved under VLLM_HPU_EMULATION=cpu for one test (the seam
    caches its backend per process, so the cache is cleared around the test)."""
    from vllm_gaudi_platform.seam import backend

    monkeypatch.setenv("VLLM_HPU_EMULATION", "cpu")
    backend.cache_clear()
    kernels = backend()
    assert kernels.IS_EMULATED
    yield kernels
    backend.cache_clear()


@pytest.fixture(autouse=True)
def _skip_gaudi_tests_without_gaudi(request: pytest.FixtureRequest) -> None:
    """Tests marked `gaudi` need a real Gaudi: skipped, with that reason, where
    habana_frameworks is not importable."""
    if request.node.get_closest_marker("gaudi") and not importlib.util.find_spec(
        "habana_frameworks"
    ):
        pytest.skip("needs an Intel Gaudi: habana_frameworks is not importable")
