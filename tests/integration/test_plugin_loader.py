"""vLLM's real plugin loader, in fresh processes, against the installed entry points.

vLLM picks its platform and runs the general plugins once per process, so every scenario is its
own interpreter. Starting vLLM costs ~20 s here; the scenarios run side by side and each test reads
the one it needs.
"""

from __future__ import annotations

import json
import os
import subprocess
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from tests.vllm_build import VLLM_OWN_PLATFORM

EMULATION = {"VLLM_HPU_EMULATION": "cpu"}

REPORT = """
import json
from vllm.platforms import current_platform
from vllm.model_executor.custom_op import op_registry_oot
cls = type(current_platform)
print("LOADER " + json.dumps({
    "platform": cls.__name__,
    "platform_path": f"{cls.__module__}.{cls.__qualname__}",
    "plugins": PLUGINS,
    "registry": {k: f"{v.__module__}.{v.__qualname__}" for k, v in op_registry_oot.items()},
}))
"""

VLLM_LOADER = """
from vllm.platforms import current_platform
from vllm.plugins import load_general_plugins
load_general_plugins()
PLUGINS = None
"""

# Calls every installed hpu_* general plugin directly, twice, in name order or reversed.
DIRECT_CALLS = """
from importlib import metadata
from vllm.platforms import current_platform
eps = metadata.entry_points(group="vllm.general_plugins")
eps = sorted((ep for ep in eps if ep.name.startswith("hpu_")), key=lambda ep: ep.name)
if REVERSED:
    eps.reverse()
funcs = [ep.load() for ep in eps]
for _ in range(2):
    for func in funcs:
        func()
PLUGINS = [ep.name for ep in eps]
"""

SCENARIOS = {
    "emulated": (VLLM_LOADER, EMULATION),
    "no_emulation": (VLLM_LOADER, {}),
    "hpu_and_norm": (VLLM_LOADER, {**EMULATION, "VLLM_PLUGINS": "hpu,hpu_ops_norm"}),
    "norm_without_hpu": (VLLM_LOADER, {**EMULATION, "VLLM_PLUGINS": "hpu_ops_norm"}),
    "direct_in_order": ("REVERSED = False\n" + DIRECT_CALLS, EMULATION),
    "direct_reversed": ("REVERSED = True\n" + DIRECT_CALLS, EMULATION),
}


class Scenarios:
    """Runs every scenario in its own process, side by side, on first use."""

    def __init__(self, run_python) -> None:
        self._run_python = run_python
        self._pool = ThreadPoolExecutor(max_workers=max(2, (os.cpu_count() or 2) // 2))
        self._futures: dict[str, Future] = {}

    def __getitem__(self, name: str) -> dict:
        if not self._futures:
            for key, (body, env) in SCENARIOS.items():
                self._futures[key] = self._pool.submit(self._run_python, body + REPORT, env)
        result = self._futures[name].result()
        lines = [line for line in result.stdout.splitlines() if line.startswith("LOADER ")]
        assert lines, f"{name} crashed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
        return json.loads(lines[-1].removeprefix("LOADER "))

    def close(self) -> None:
        self._pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def scenarios(run_python):
    runner = Scenarios(run_python)
    yield runner
    runner.close()


@pytest.mark.process
def test_emulation_makes_hpu_the_current_platform(scenarios):
    assert scenarios["emulated"]["platform"] == "HpuPlatform"
    assert scenarios["emulated"]["platform_path"] == "vllm_gaudi_platform.platform.HpuPlatform"


@pytest.mark.process
def test_without_emulation_or_gaudi_vllm_keeps_its_cpu_platform(scenarios):
    assert scenarios["no_emulation"]["platform"] == VLLM_OWN_PLATFORM


@pytest.mark.process
def test_general_plugins_register_nothing_when_the_platform_is_not_hpu(scenarios):
    assert scenarios["no_emulation"]["registry"] == {}


@pytest.mark.process
def test_vllm_plugins_hpu_and_norm_registers_rmsnorm_but_not_rotary(scenarios):
    registry = scenarios["hpu_and_norm"]["registry"]

    assert "RMSNorm" in registry
    assert registry["RMSNorm"].startswith("vllm_gaudi_ops.")
    assert "RotaryEmbedding" not in registry


@pytest.mark.process
def test_vllm_plugins_without_hpu_leaves_vllm_on_its_cpu_platform(scenarios):
    assert scenarios["norm_without_hpu"]["platform"] == VLLM_OWN_PLATFORM


@pytest.mark.process
def test_vllm_plugins_without_hpu_registers_no_op(scenarios):
    assert scenarios["norm_without_hpu"]["registry"] == {}


@pytest.mark.process
def test_doctor_fails_and_says_hpu_is_missing_when_vllm_plugins_omits_it(console_script, clean_env):
    result = subprocess.run(
        [console_script("vllm-gaudi"), "doctor"],
        env=clean_env({**EMULATION, "VLLM_PLUGINS": "hpu_ops_norm"}),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )

    assert result.returncode != 0
    assert "but not hpu" in result.stdout
    assert "add hpu" in result.stdout


@pytest.mark.process
def test_general_plugins_registry_is_the_same_in_either_order_and_twice(scenarios):
    forward, backward = scenarios["direct_in_order"], scenarios["direct_reversed"]

    assert forward["plugins"] == list(reversed(backward["plugins"]))
    assert forward["registry"], "no hpu_* general plugin registered anything"
    assert forward["registry"] == backward["registry"]


@pytest.mark.process
def test_direct_calls_register_what_vllms_loader_registers(scenarios):
    assert scenarios["direct_in_order"]["registry"] == scenarios["emulated"]["registry"]
