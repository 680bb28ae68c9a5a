"""The platform entry point `hpu` and the contract every hpu_* general plugin follows."""

from __future__ import annotations

import logging
import os

import pytest

import vllm_gaudi_platform
from vllm_gaudi_platform import compat, plugins
from vllm_gaudi_platform.seam import probe as device_probe

PLATFORM_CLASS = "vllm_gaudi_platform.platform.HpuPlatform"


def _records(caplog: pytest.LogCaptureFixture, level: int) -> list[logging.LogRecord]:
    ours = [r for r in caplog.records if r.name.startswith("vllm.vllm_gaudi")]
    return [r for r in ours if r.levelno == level]


def test_register_returns_platform_class_under_cpu_emulation(monkeypatch):
    monkeypatch.setenv("VLLM_HPU_EMULATION", "cpu")

    assert vllm_gaudi_platform.register() == PLATFORM_CLASS


def test_register_returns_none_without_device_or_emulation():
    assert vllm_gaudi_platform.register() is None


def test_register_returns_none_and_warns_naming_the_variable_for_a_bad_emulation_value(
    monkeypatch, caplog
):
    monkeypatch.setenv("VLLM_HPU_EMULATION", "gpu")
    caplog.set_level(logging.DEBUG, logger="vllm.vllm_gaudi_platform")

    assert vllm_gaudi_platform.register() is None

    warnings = _records(caplog, logging.WARNING)
    assert len(warnings) == 1
    assert "VLLM_HPU_EMULATION" in warnings[0].getMessage()
    assert "'gpu'" in warnings[0].getMessage()


def test_register_never_raises_when_the_probe_fails(monkeypatch, caplog):
    def broken_probe():
        raise RuntimeError("device runtime exploded")

    monkeypatch.setattr(device_probe, "probe_device", broken_probe)
    caplog.set_level(logging.DEBUG, logger="vllm.vllm_gaudi_platform")

    assert vllm_gaudi_platform.register() is None
    assert "device runtime exploded" in _records(caplog, logging.WARNING)[0].getMessage()


@pytest.mark.process
def test_register_without_device_or_emulation_imports_neither_torch_nor_vllm(run_python):
    result = run_python(
        "import vllm_gaudi_platform as p; assert p.register() is None", args=("-X", "importtime")
    )

    assert result.returncode == 0, result.stderr
    imported = [line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()]
    assert "vllm_gaudi_platform" in imported  # the measurement itself works
    heavy = [m for m in imported if m.split(".")[0] in ("torch", "vllm")]
    assert heavy == []


# The general_plugin contract (vllm_gaudi_platform.plugins), on a throwaway plugin.


@pytest.fixture
def fresh_outcomes(monkeypatch):
    outcomes: dict[str, str] = {}
    monkeypatch.setattr(plugins, "OUTCOMES", outcomes)
    return outcomes


@pytest.fixture
def hpu_active(monkeypatch):
    monkeypatch.setattr(plugins, "hpu_platform_active", lambda: True)


def _counting_plugin(name: str, body=None):
    calls = []

    @plugins.general_plugin(name)
    def register() -> None:
        calls.append(1)
        if body is not None:
            body()

    return register, calls


def test_general_plugin_runs_its_body_once_when_called_twice(fresh_outcomes, hpu_active):
    register, calls = _counting_plugin("hpu_test_once")

    register()
    register()

    assert calls == [1]
    assert fresh_outcomes["hpu_test_once"] == "registered"


def test_general_plugin_skips_with_one_log_line_when_platform_is_not_hpu(
    fresh_outcomes, monkeypatch, caplog
):
    monkeypatch.setattr(plugins, "hpu_platform_active", lambda: False)
    caplog.set_level(logging.DEBUG, logger="vllm.vllm_gaudi_platform")
    register, calls = _counting_plugin("hpu_test_skip")

    register()
    register()

    assert calls == []
    lines = [r for r in caplog.records if r.name.startswith("vllm.vllm_gaudi")]
    assert len(lines) == 1
    assert lines[0].levelno == logging.DEBUG
    assert "hpu_test_skip" in lines[0].getMessage()
    assert "not HPU" in lines[0].getMessage()


def test_general_plugin_warns_once_naming_version_and_range_for_unsupported_vllm(
    fresh_outcomes, hpu_active, monkeypatch, caplog
):
    old = compat.VersionCheck("vllm", "0.31.2", str(compat.SUPPORTED_VLLM), "vllm")
    monkeypatch.setattr(compat, "check_vllm", lambda: old)
    caplog.set_level(logging.DEBUG, logger="vllm.vllm_gaudi_platform")
    register, calls = _counting_plugin("hpu_test_version")

    register()
    register()

    assert calls == []
    warnings = _records(caplog, logging.WARNING)
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "hpu_test_version" in message
    assert "vllm 0.31.2" in message
    assert str(compat.SUPPORTED_VLLM) in message


def _vllm_at(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    check = compat.VersionCheck("vllm", version, str(compat.SUPPORTED_VLLM), "vllm")
    monkeypatch.setattr(compat, "check_vllm", lambda: check)


def test_platform_refuses_a_vllm_outside_the_range_as_the_general_plugins_do(
    fresh_outcomes, monkeypatch, caplog
):
    monkeypatch.setenv("VLLM_HPU_EMULATION", "cpu")
    _vllm_at(monkeypatch, "0.34.0")
    caplog.set_level(logging.DEBUG, logger="vllm.vllm_gaudi_platform")

    assert vllm_gaudi_platform.register() is None

    [warning] = _records(caplog, logging.WARNING)
    message = warning.getMessage()
    assert "HPU platform not registered" in message
    assert "vllm 0.34.0" in message and str(compat.SUPPORTED_VLLM) in message
    assert "VLLM_HPU_SKIP_VERSION_CHECK=1" in message


def test_skip_version_check_registers_the_platform_and_the_plugins_each_with_a_warning(
    fresh_outcomes, hpu_active, monkeypatch, caplog
):
    monkeypatch.setenv("VLLM_HPU_EMULATION", "cpu")
    monkeypatch.setenv("VLLM_HPU_SKIP_VERSION_CHECK", "1")
    _vllm_at(monkeypatch, "0.34.0")
    caplog.set_level(logging.DEBUG, logger="vllm.vllm_gaudi_platform")
    register, calls = _counting_plugin("hpu_test_override")

    assert vllm_gaudi_platform.register() == PLATFORM_CLASS
    register()

    assert calls == [1]
    assert plugins.OUTCOMES["hpu_test_override"] == "registered"
    warnings = [r.getMessage() for r in _records(caplog, logging.WARNING)]
    assert len(warnings) == 2
    assert all("vllm 0.34.0" in w and "registering anyway" in w for w in warnings)


def test_a_bad_skip_version_check_value_refuses_both_naming_the_variable(
    fresh_outcomes, hpu_active, monkeypatch, caplog
):
    monkeypatch.setenv("VLLM_HPU_EMULATION", "cpu")
    monkeypatch.setenv("VLLM_HPU_SKIP_VERSION_CHECK", "maybe")
    caplog.set_level(logging.DEBUG, logger="vllm.vllm_gaudi_platform")
    register, calls = _counting_plugin("hpu_test_bad_override")

    assert vllm_gaudi_platform.register() is None
    register()

    assert calls == []
    warnings = [r.getMessage() for r in _records(caplog, logging.WARNING)]
    assert len(warnings) == 2
    assert all("VLLM_HPU_SKIP_VERSION_CHECK='maybe'" in w for w in warnings)


def test_general_plugin_turns_missing_dependency_into_a_warning(fresh_outcomes, hpu_active, caplog):
    def needs_nixl() -> None:
        plugins.require("nixl-test-package", "nixl_test_package_absent", "vllm-gaudi-x[nixl]")

    caplog.set_level(logging.DEBUG, logger="vllm.vllm_gaudi_platform")
    register, calls = _counting_plugin("hpu_test_missing", needs_nixl)

    register()

    assert calls == [1]
    warnings = _records(caplog, logging.WARNING)
    assert len(warnings) == 1
    assert "nixl-test-package" in warnings[0].getMessage()
    assert "vllm-gaudi-x[nixl]" in warnings[0].getMessage()
    assert fresh_outcomes["hpu_test_missing"].startswith("skipped")


def test_vllms_unknown_variable_check_knows_the_hpu_settings(monkeypatch):
    from vllm_gaudi_platform.platform import HpuPlatform

    for name in os.environ:
        if name.startswith("VLLM_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("VLLM_HPU_EMULATION", "cpu")
    monkeypatch.setenv("VLLM_DECODE_BS_BUCKET_MAX", "8")
    HpuPlatform.validate_environ(hard_fail=True)  # ours are known names: no error

    monkeypatch.setenv("VLLM_HPU_EMULATON", "cpu")  # misspelt
    with pytest.raises(ValueError, match="VLLM_HPU_EMULATON"):
        HpuPlatform.validate_environ(hard_fail=True)
