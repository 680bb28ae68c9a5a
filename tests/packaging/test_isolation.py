"""Each wheel alone: a clean venv with the CPU engine, the wheel and only its declared siblings.

A hidden import of another member, or an entry point that needs a sibling the wheel does not
declare, fails here and nowhere else: the dev venv has every member installed.
"""

from __future__ import annotations

import json
import subprocess

import pytest

EMULATION = {"VLLM_HPU_EMULATION": "cpu"}

# Loads every entry point of one distribution and calls the vLLM plugins among them, the way vLLM
# does, in a fresh process. A platform plugin's returned class path is imported too (vLLM would).
PROBE = """
import importlib, json, sys, traceback
from importlib import metadata

results = {}
for ep in metadata.distribution(sys.argv[1]).entry_points:
    try:
        func = ep.load()
        if ep.group == "vllm.stat_logger_plugins":  # vLLM instantiates these per engine later
            from vllm.v1.metrics.loggers import StatLoggerBase

            assert issubclass(func, StatLoggerBase), func
            returned = func.__name__
        else:
            returned = func() if ep.group.startswith("vllm.") else None
        if ep.group == "vllm.platform_plugins" and isinstance(returned, str):
            module, _, cls = returned.rpartition(".")
            getattr(importlib.import_module(module), cls)
        results[ep.name] = {"group": ep.group, "ok": True, "returned": repr(returned)}
    except BaseException:
        results[ep.name] = {"group": ep.group, "ok": False, "error": traceback.format_exc()}

from vllm_gaudi_platform import plugins
print("PROBE " + json.dumps({"entry_points": results, "outcomes": dict(plugins.OUTCOMES)}))
"""


@pytest.fixture
def venv(member, isolated_venv):
    return isolated_venv(member)


_probes: dict[str, dict] = {}


def run_probe(venv, run_python) -> dict:
    """The PROBE result for this venv's member, run once per member per session."""
    if venv.member.name not in _probes:
        result = run_python(
            f"import sys; sys.argv[1:] = [{venv.member.name!r}]\n{PROBE}",
            EMULATION,
            python=venv.python,
        )
        lines = [line for line in result.stdout.splitlines() if line.startswith("PROBE ")]
        assert lines, f"probe crashed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
        _probes[venv.member.name] = json.loads(lines[-1].removeprefix("PROBE "))
    return _probes[venv.member.name]


@pytest.fixture
def probe(venv, run_python) -> dict:
    return run_probe(venv, run_python)


def _declared_members(member, members) -> set[str]:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    names = {m.name for m in members}
    return {canonicalize_name(Requirement(r).name) for r in member.dependencies} & names


@pytest.mark.process
def test_wheel_installs_alone_with_only_its_declared_siblings(venv, member, members, run_python):
    result = run_python(
        "from importlib import metadata; import json; print(json.dumps(sorted("
        "d.metadata['Name'] for d in metadata.distributions() "
        "if d.metadata['Name'].startswith('vllm-gaudi'))))",
        python=venv.python,
    )

    assert result.returncode == 0, result.stderr
    assert set(json.loads(result.stdout)) == {member.name} | _declared_members(member, members)


@pytest.mark.process
def test_undeclared_siblings_are_not_importable_when_installed_alone(
    venv, member, members, run_python
):
    others = [
        m.import_name
        for m in members
        if m.name != member.name and m.name not in _declared_members(member, members)
    ]
    result = run_python(
        "import importlib.util, json; "
        f"print(json.dumps([n for n in {others!r} if importlib.util.find_spec(n)]))",
        python=venv.python,
    )

    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []


@pytest.mark.process
def test_package_imports_when_installed_alone(venv, member, run_python):
    result = run_python(f"import {member.import_name}", EMULATION, python=venv.python)

    assert result.returncode == 0, result.stderr[-5000:]


@pytest.mark.process
def test_entry_points_load_and_run_when_installed_alone(probe, member):
    expected = {name for eps in member.entry_points.values() for name in eps}
    failed = {
        name: r["error"].strip().splitlines()[-1]
        for name, r in probe["entry_points"].items()
        if not r["ok"]
    }

    assert set(probe["entry_points"]) == expected
    assert failed == {}, "\n\n".join(
        f"{name}:\n{probe['entry_points'][name]['error']}" for name in failed
    )


@pytest.mark.process
def test_general_plugins_register_on_emulated_hpu_when_installed_alone(
    plugin_sibling, isolated_venv, run_python
):
    general = plugin_sibling.entry_points["vllm.general_plugins"]
    outcomes = run_probe(isolated_venv(plugin_sibling), run_python)["outcomes"]
    # A missing optional package is a legitimate skip; anything else means the plugin did nothing.
    not_registered = {
        name: outcomes.get(name, "never went through plugins.general_plugin")
        for name in general
        if outcomes.get(name) != "registered"
        and "is not installed; install it with" not in outcomes.get(name, "")
    }

    assert not_registered == {}


@pytest.mark.process
def test_doctor_passes_with_the_wheel_installed_alone(venv, console_script, clean_env):
    result = subprocess.run(
        [console_script("vllm-gaudi", venv.python), "doctor"],
        env=clean_env(EMULATION),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )

    assert result.returncode == 0, result.stdout + result.stderr
