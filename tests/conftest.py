"""Shared test helpers: a clean environment, and Python run in a fresh process.

vLLM resolves its platform and loads its plugins once per process, so anything about the plugin
loader is tested in a fresh interpreter (`run_python`). Every test, in-process or not, starts from
an environment without the plugin-selection variables a developer may have exported.

The helpers reach tests as fixtures of the same name (`def test_x(run_python): ...`), so no test
module imports this file and any pytest import mode works.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest

from tests.vllm_build import GAUDI_STYLE_VLLM

# The cost markers (engine, process) are checked, and TEST_PROFILE_DIR=<folder> writes the
# per-module time summary: tests/costs.py.
pytest_plugins = ("tests.costs",)

# Variables that change which platform and plugins load; never inherited by a test.
SELECTION_VARIABLES = ("VLLM_PLUGINS", "VLLM_HPU_EMULATION", "VLLM_TARGET_DEVICE")

EnvOverrides = Mapping[str, "str | None"]

# The suite runs Gaudi's lazy mode, where HPU graphs exist, so every engine it starts (they
# inherit this environment) captures and replays its buckets' graphs. Tests of eager mode set
# PT_HPU_LAZY_MODE=0 themselves.
os.environ["PT_HPU_LAZY_MODE"] = "1"


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
    timeout: float = 900,
    fresh: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run `python <args> -c code` under `make_env(env)`; a failure is returned, not raised.

    This interpreter's `python -c` without interpreter options is forked from the preloaded one
    (tests/zygote.py: torch and the libraries vLLM imports already loaded, vLLM and this
    project's packages not) where `env` allows; `fresh=True` always starts a new interpreter,
    for a check of what importing something loads."""
    argv = [python, *args, "-c", code]
    run_env = make_env(env)
    if not fresh and not args and python == sys.executable:
        from tests import zygote

        proc = zygote.run(argv, run_env, timeout)
        if proc is not None:
            return proc
    return subprocess.run(
        argv, env=run_env, capture_output=True, text=True, timeout=timeout, check=False
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
    """`run_python(code, env=None, *, python=..., args=(), timeout=900, fresh=False)`."""
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


# ----------------------------------------------------------------------------- the Gaudi backend
# seam/gaudi runs in every test run: over a real Gaudi where habana_frameworks is installed,
# otherwise over the Habana stand-in (tests/habana_standin, see its README). The stand-in is
# importable only inside `habana_standin()`: the rest of the suite sees a machine without Gaudi
# software, as CI's machines are.
STANDIN_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "habana_standin")
REAL_GAUDI_SOFTWARE = importlib.util.find_spec("habana_frameworks") is not None


def standin_process_env(generation: int = 3, **extra: str) -> dict[str, str | None]:
    """A fresh (non-engine) process that imports the stand-in as `habana_frameworks`, playing
    that Gaudi generation; `extra`: more variables (HABANA_STANDIN_TORCH_DEVICE=...)."""
    return {
        "VLLM_HPU_EMULATION": None,
        "PYTHONPATH": os.pathsep.join([STANDIN_PATH, os.environ.get("PYTHONPATH", "")]),
        "HABANA_STANDIN_GENERATION": str(generation),
        **extra,
    }


# An engine process's "Gaudi": seam/gaudi over the stand-in instead of the emulation
# (tests/habana_standin/engine/sitecustomize.py).
STANDIN_ENGINE_ENV: dict[str, str | None] = {
    "VLLM_HPU_EMULATION": None,
    "PYTHONPATH": os.pathsep.join(
        [os.path.join(STANDIN_PATH, "engine"), os.environ.get("PYTHONPATH", "")]
    ),
    "HABANA_STANDIN_MEMORY_GB": "4",
}
_STANDIN_MODULES: dict[str, Any] = {}


@contextlib.contextmanager
def habana_standin() -> Iterator[Any]:
    """The stand-in imported as `habana_frameworks` for the body (its modules are imported once
    per process and kept, so op registrations and settings survive between tests); yields its
    `habana_frameworks.torch._device` (GENERATION selects Gaudi 2 or 3)."""
    if REAL_GAUDI_SOFTWARE:
        raise RuntimeError("a real habana_frameworks is installed: the stand-in must not shadow it")
    if not _STANDIN_MODULES:
        sys.path.insert(0, STANDIN_PATH)
        try:
            for name in _STANDIN_SUBMODULES:
                importlib.import_module(name)
        finally:
            sys.path.remove(STANDIN_PATH)
        _STANDIN_MODULES.update(
            (name, module)
            for name, module in sys.modules.items()
            if name == "habana_frameworks" or name.startswith("habana_frameworks.")
        )
    else:
        sys.modules.update(_STANDIN_MODULES)
    try:
        yield _STANDIN_MODULES["habana_frameworks.torch._device"]
    finally:
        for name in _STANDIN_MODULES:
            sys.modules.pop(name, None)


_STANDIN_SUBMODULES = (
    "habana_frameworks.torch",
    "habana_frameworks.torch.core",
    "habana_frameworks.torch.hpu",
    "habana_frameworks.torch.hpex.kernels",
    "habana_frameworks.torch.hpex.normalization",
)


@pytest.fixture
def standin_device() -> Iterator[Any]:
    """The stand-in's device state (`_device`: GENERATION, DEVICES_PER_PROCESS), restored after
    the test; the stand-in is importable meanwhile. Skipped where a real Gaudi stack exists."""
    if REAL_GAUDI_SOFTWARE:
        pytest.skip("checks the Habana stand-in, which does not load beside a real Gaudi stack")
    with habana_standin() as device:
        saved = (device.GENERATION, device.DEVICES_PER_PROCESS)
        yield device
        device.GENERATION, device.DEVICES_PER_PROCESS = saved


@pytest.fixture
def gaudi(request: pytest.FixtureRequest) -> Iterator[Any]:
    """The seam's Gaudi backend module (`seam/gaudi`), over a real Gaudi where one is
    installed, otherwise over the Habana stand-in (importable for the test's duration)."""
    if REAL_GAUDI_SOFTWARE:
        from vllm_gaudi_platform.seam import gaudi as module

        yield module
        return
    request.getfixturevalue("standin_device")
    from vllm_gaudi_platform.seam import gaudi as module

    yield module


@pytest.fixture
def gaudi_device() -> Any:
    """Where the Gaudi backend's tensors live: "hpu" on a Gaudi, the CPU under the stand-in."""
    import torch

    return torch.device("hpu" if REAL_GAUDI_SOFTWARE else "cpu")


@pytest.fixture(params=["emulated", "gaudi"])
def hpu_backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The seam's backend as `seam.backend()` resolves it, once per backend: the emulation, and
    seam/gaudi (over the stand-in off Gaudi, its device facts pointed at the CPU, where the
    stand-in's memory is). Layer-level tests take it to run the same code on both."""
    from vllm_gaudi_platform.seam import backend

    backend.cache_clear()
    if request.param == "emulated":
        monkeypatch.setenv("VLLM_HPU_EMULATION", "cpu")
        kernels = backend()
        assert kernels.IS_EMULATED
        yield kernels
        backend.cache_clear()
        return
    if not REAL_GAUDI_SOFTWARE:
        request.getfixturevalue("standin_device")
        import torch

        from vllm_gaudi_platform.seam import gaudi as module

        monkeypatch.setattr(module, "DEVICE_TYPE", "cpu")
        monkeypatch.setattr(module, "torch_device", lambda index=0: torch.device("cpu"))
    kernels = backend()
    assert kernels.NAME == "gaudi", kernels.NAME
    yield kernels
    backend.cache_clear()


@pytest.fixture(autouse=True)
def _skip_device_tests_without_gaudi(request: pytest.FixtureRequest) -> None:
    """Tests marked `gaudi_device` measure the physical device (memory, timing): skipped, with
    that reason, where habana_frameworks is not installed. Tests marked `gaudi` run everywhere
    (over the stand-in off Gaudi)."""
    if request.node.get_closest_marker("gaudi_device") and not REAL_GAUDI_SOFTWARE:
        pytest.skip("measures a physical Intel Gaudi (memory, timing): no Gaudi here")


# ----------------------------------------------------------------------------- two workers
# `make test` runs the suite on two pytest-xdist workers. A worker gets whole groups (the
# scheduler below): by default a module, so a module's engines (module-scoped fixtures) start
# once; modules that read one cached run share a group, so that run happens on one worker only.
# Groups that start engines go first, so a long one does not end up alone at the tail while the
# other worker idles. Each worker's torch (and every engine it starts) uses one thread: two
# workers on two cores beat one worker with two threads, as a tiny model's steps are mostly Python.
SHARED_GROUPS = {
    # architectures.hpu_run / cpu_runs: one process runs every architecture, once per worker
    **dict.fromkeys(
        (
            "tests/integration/test_alibi.py",
            "tests/integration/test_cpu_backend.py",
            "tests/integration/test_fp16_checkpoint.py",
            "tests/integration/test_generation.py",
            "tests/integration/test_gpt_oss.py",
            "tests/integration/test_hybrid.py",
            "tests/integration/test_sliding_window.py",
        ),
        "architectures",
    ),
    # NIXL deployments (vLLM servers over loopback): one after the other, on one worker, so
    # their starts and handshakes do not compete with each other for the two cores
    **dict.fromkeys(
        (
            "tests/connectors/test_nixl_1p1d.py",
            "tests/connectors/test_nixl_heterogeneous.py",
        ),
        "nixl",
    ),
    # the session's built wheels (tests/packaging/conftest.py: dist_dir, isolated_venv)
    **dict.fromkeys(
        (
            "tests/packaging/test_house.py",
            "tests/packaging/test_isolation.py",
            "tests/packaging/test_wheels.py",
        ),
        "packaging",
    ),
}

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# A Gaudi-style vLLM build (VLLM_TARGET_DEVICE=empty, no vllm._C: the vLLM 0.33 leg) resolves no
# platform in a process that does not select the HPU one, where the CPU build resolves its CPU
# platform. The tests that run vLLM layers in this process (op families against vLLM's native
# forward, drift-guard constructions) need a platform, so this process resolves vLLM's CPU
# platform as the CPU build does: VLLM_TARGET_DEVICE=cpu while it is resolved, then removed so no
# child inherits it. Engines and children resolve their own platform from their environment.
if GAUDI_STYLE_VLLM:
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    try:
        from vllm.platforms import current_platform

        assert current_platform.is_cpu(), current_platform
    finally:
        del os.environ["VLLM_TARGET_DEVICE"]

_MODELINFO_FILL: subprocess.Popen[bytes] | None = None


def pytest_configure(config: pytest.Config) -> None:
    """In the process that hands out the tests (xdist's controller, or the only process), unless
    engine tests are deselected: fill vLLM's model-info cache in the background
    (tests/modelinfo_cache.py), so the engines do not each inspect their architecture in an
    interpreter of its own. An engine that starts before its architecture is written inspects
    it as vLLM always does."""
    global _MODELINFO_FILL
    if os.environ.get("PYTEST_XDIST_WORKER") or "not engine" in (config.option.markexpr or ""):
        return
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}  # as a job's
    env["VLLM_HPU_EMULATION"] = "cpu"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _MODELINFO_FILL = subprocess.Popen(
        [sys.executable, "-m", "tests.modelinfo_cache"],
        cwd=root,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def pytest_unconfigure(config: pytest.Config) -> None:
    from tests import zygote

    zygote.stop_all()
    if _MODELINFO_FILL is not None and _MODELINFO_FILL.poll() is None:
        _MODELINFO_FILL.terminate()  # its cache files are written whole (vLLM's atomic writer)


def worker_unit(nodeid: str) -> str:
    """The unit one worker runs whole: the test's module, or the group it shares a run with."""
    module = nodeid.split("::", 1)[0]
    return SHARED_GROUPS.get(module, module)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    starts_engines = {worker_unit(i.nodeid) for i in items if i.get_closest_marker("engine")}
    items[:] = sorted(items, key=lambda item: worker_unit(item.nodeid) not in starts_engines)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's load-by-scope scheduling with `worker_unit` as the scope (its own `loadgroup` marks
    do not reach the node ids under pytest 9)."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_unit(nodeid)

    return GroupScheduling(config, log)
