"""`vllm-gaudi doctor`: a good install passes; each broken case names the problem and the fix."""

from __future__ import annotations

import dataclasses
import json

import pytest

from vllm_gaudi_platform import cli, compat, envs
from vllm_gaudi_platform.commands import doctor, doctor_optional

# The doctor probes NIXL's UCX backend in an interpreter of its own (once per process, in
# whichever test asks first).
pytestmark = pytest.mark.process

JSON_KEYS = {"wheels", "entry_points", "vllm_plugins", "device", "versions", "problems", "ok"}


def run_doctor(capsys, *args: str) -> tuple[int, str]:
    status = cli.main(["doctor", *args])
    return status, capsys.readouterr().out


def doctor_json(capsys) -> tuple[int, dict]:
    status, out = run_doctor(capsys, "--json")
    return status, json.loads(out)


def problems_mentioning(report: dict, *words: str) -> list[str]:
    return [p for p in report["problems"] if all(w in p for w in words)]


@pytest.fixture
def emulation(monkeypatch):
    monkeypatch.setenv("VLLM_HPU_EMULATION", "cpu")


def test_good_install_under_emulation_exits_zero_with_no_problems(capsys, emulation):
    status, out = run_doctor(capsys)

    assert status == 0, out
    assert out.rstrip().endswith("no problems")


def test_json_output_parses_and_has_the_stable_keys(capsys, emulation):
    status, report = doctor_json(capsys)

    assert report.keys() >= JSON_KEYS
    assert isinstance(report["problems"], list)
    assert report["ok"] is (status == 0) is (report["problems"] == [])


def test_lists_every_installed_wheel_with_its_version(capsys, emulation):
    _, report = doctor_json(capsys)

    expected = {w.name: w.version for w in doctor.installed_wheels()}
    assert "vllm-gaudi-platform" in expected
    assert {w["name"]: w["version"] for w in report["wheels"]} == expected


def test_lists_the_platform_entry_point_as_loading_when_vllm_plugins_is_unset(capsys, emulation):
    _, report = doctor_json(capsys)

    hpu = [ep for ep in report["entry_points"] if ep["name"] == "hpu"]
    assert hpu == [
        {
            "group": "vllm.platform_plugins",
            "name": "hpu",
            "value": "vllm_gaudi_platform:register",
            "distribution": "vllm-gaudi-platform",
            "loads": True,
            "target_found": True,
        }
    ]


def test_platform_omitted_from_vllm_plugins_says_why_and_the_fix(capsys, emulation, monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "hpu_ops_norm")

    status, out = run_doctor(capsys)

    assert status != 0
    assert "names hpu_ops_norm but not hpu" in out
    assert "HPU platform will not load" in out
    assert "hpu_ops_norm will do nothing" in out
    assert "add hpu" in out and "VLLM_PLUGINS=hpu,hpu_ops_norm" in out


def test_vllm_plugins_without_hpu_marks_the_platform_entry_point_skipped(
    capsys, emulation, monkeypatch
):
    monkeypatch.setenv("VLLM_PLUGINS", "hpu_ops_norm")

    _, report = doctor_json(capsys)

    loads = {ep["name"]: ep["loads"] for ep in report["entry_points"]}
    assert loads["hpu"] is False
    assert report["vllm_plugins"]["platform_loads"] is False


def test_unknown_plugin_name_is_a_problem_with_a_suggestion(capsys, emulation, monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "hpu,hpuu")

    status, report = doctor_json(capsys)

    assert status != 0
    assert report["vllm_plugins"]["unknown"] == ["hpuu"]
    [problem] = problems_mentioning(report, "'hpuu'", "matches no installed plugin")
    assert "did you mean 'hpu'?" in problem


def test_plugin_names_of_other_distributions_are_not_unknown(capsys, emulation, monkeypatch):
    other = doctor.EntryPointInfo("vllm.general_plugins", "their_plugin", "their:register", "x")
    real = doctor.installed_plugin_entry_points()
    monkeypatch.setattr(doctor, "installed_plugin_entry_points", lambda: [*real, other])
    monkeypatch.setenv("VLLM_PLUGINS", "hpu,their_plugin")

    _, report = doctor_json(capsys)

    assert report["vllm_plugins"]["unknown"] == []


def test_space_in_vllm_plugins_is_a_problem_because_vllm_does_not_trim(
    capsys, emulation, monkeypatch
):
    monkeypatch.setenv("VLLM_PLUGINS", " hpu")

    status, report = doctor_json(capsys)

    assert status != 0
    assert problems_mentioning(report, "' hpu'", "does not trim")


def test_empty_vllm_plugins_is_a_problem_because_nothing_loads(capsys, emulation, monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "")

    status, report = doctor_json(capsys)

    assert status != 0
    assert problems_mentioning(report, "VLLM_PLUGINS is set but empty", "unset VLLM_PLUGINS")


def test_bad_emulation_value_is_an_error_naming_the_variable(capsys, monkeypatch):
    monkeypatch.setenv("VLLM_HPU_EMULATION", "gpu")

    status, report = doctor_json(capsys)

    assert status != 0
    assert report["device"]["kind"] == "error"
    assert problems_mentioning(report, "VLLM_HPU_EMULATION='gpu'", "'cpu'")


def test_no_device_without_emulation_is_a_problem_with_the_fix(capsys):
    status, report = doctor_json(capsys)

    assert status != 0
    assert report["device"]["kind"] == "none"
    assert problems_mentioning(report, "no device", "VLLM_HPU_EMULATION=cpu")


def test_emulation_is_labelled_emulated_on_cpu_never_gaudi(capsys, emulation):
    _, out = run_doctor(capsys)

    [device_line] = [line for line in out.splitlines() if line.lstrip().startswith("device")]
    assert "emulated on cpu" in device_line
    assert "not a Gaudi" in device_line
    assert "Gaudi x" not in device_line


def test_vllm_outside_supported_range_is_a_problem_naming_version_and_range(
    capsys, emulation, monkeypatch
):
    old = compat.VersionCheck("vllm", "0.31.2", str(compat.SUPPORTED_VLLM), "vllm")
    monkeypatch.setattr(compat, "check_vllm", lambda: old)

    status, report = doctor_json(capsys)

    assert status != 0
    assert report["versions"]["vllm"]["ok"] is False
    assert problems_mentioning(report, "vllm 0.31.2", str(compat.SUPPORTED_VLLM))


def test_skip_version_check_turns_the_range_problem_into_info_saying_all_register(
    capsys, emulation, monkeypatch
):
    old = compat.VersionCheck("vllm", "0.34.0", str(compat.SUPPORTED_VLLM), "vllm")
    monkeypatch.setattr(compat, "check_vllm", lambda: old)
    monkeypatch.setenv("VLLM_HPU_SKIP_VERSION_CHECK", "1")

    status, report = doctor_json(capsys)

    assert status == 0, report["problems"]
    assert [i for i in report["info"] if "vllm 0.34.0" in i and "registering anyway" in i]
    assert report["quantization"] and all(q["registers"] for q in report["quantization"])


def _vllm_package_with(monkeypatch, tmp_path, *files: str) -> None:
    for name in files:
        (tmp_path / name).write_bytes(b"")
    spec = compat.importlib.util.spec_from_file_location(
        "vllm", tmp_path / "__init__.py", submodule_search_locations=[str(tmp_path)]
    )
    real_find_spec = compat.importlib.util.find_spec
    monkeypatch.setattr(
        compat.importlib.util,
        "find_spec",
        lambda name, *a: spec if name == "vllm" else real_find_spec(name, *a),
    )


@pytest.mark.parametrize(
    ("files", "words"),
    [
        (("__init__.py", "_custom_ops.py"), ("gaudi-style", "no vllm._C")),
        (("__init__.py", "_C.abi3.so", "_C_AVX2.abi3.so"), ("CPU build", "_C, _C_AVX2")),
        (("__init__.py", "_C.abi3.so", "_moe_C.abi3.so"), ("vllm._C present: _C",)),
    ],
)
def test_doctor_names_the_vllm_build_and_the_version_rule(
    capsys, emulation, monkeypatch, tmp_path, files, words
):
    _vllm_package_with(monkeypatch, tmp_path, *files)

    _, out = run_doctor(capsys)

    [build] = [line for line in out.splitlines() if line.startswith("  vllm build")]
    assert all(w in build for w in words), build
    rule = out[out.index("  version rule") :]
    assert "no entry point registers" in rule and "VLLM_HPU_SKIP_VERSION_CHECK=1" in rule


def test_vllm_not_installed_is_a_problem(capsys, emulation, monkeypatch):
    missing = compat.VersionCheck("vllm", None, str(compat.SUPPORTED_VLLM))
    monkeypatch.setattr(compat, "check_vllm", lambda: missing)

    status, report = doctor_json(capsys)

    assert status != 0
    assert problems_mentioning(report, "vllm is not installed")


def test_version_mismatch_between_wheels_is_a_problem(capsys, emulation, monkeypatch):
    platform = [w for w in doctor.installed_wheels() if w.name == "vllm-gaudi-platform"]
    skewed = [*platform, doctor.Wheel("vllm-gaudi-ops", "9.9.9")]
    monkeypatch.setattr(doctor, "installed_wheels", lambda: skewed)

    status, report = doctor_json(capsys)

    assert status != 0
    assert problems_mentioning(report, "different versions", "vllm-gaudi-ops 9.9.9")


def test_entry_point_whose_module_is_missing_is_a_problem(capsys, emulation, monkeypatch):
    platform = next(w for w in doctor.installed_wheels() if w.name == "vllm-gaudi-platform")
    broken = doctor.EntryPointInfo(
        "vllm.general_plugins", "hpu_broken", "vllm_gaudi_platform.no_such_module:register", "x"
    )
    wheel = dataclasses.replace(platform, entry_points=(*platform.entry_points, broken))
    monkeypatch.setattr(doctor, "installed_wheels", lambda: [wheel])

    status, report = doctor_json(capsys)

    assert status != 0
    assert problems_mentioning(report, "hpu_broken", "module is not installed")


def test_target_present_finds_modules_without_importing_them():
    assert doctor.target_present("vllm_gaudi_platform.commands.doctor:collect") is True
    assert doctor.target_present("vllm_gaudi_platform:register") is True
    assert doctor.target_present("vllm_gaudi_platform.no_such_module:register") is False
    assert doctor.target_present("no_such_top_level_package:register") is False


def test_vllm_target_device_cpu_is_a_problem(capsys, emulation, monkeypatch):
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")

    status, report = doctor_json(capsys)

    assert status != 0
    assert problems_mentioning(report, "VLLM_TARGET_DEVICE=cpu", "unset VLLM_TARGET_DEVICE")


def test_optional_dependencies_are_info_only_for_installed_wheels(capsys, emulation, monkeypatch):
    platform = [w for w in doctor.installed_wheels() if w.name == "vllm-gaudi-platform"]
    monkeypatch.setattr(doctor, "installed_wheels", lambda: platform)

    _, report = doctor_json(capsys)

    assert {o["wheel"] for o in report["optional"]} <= {"vllm-gaudi-platform"}
    assert not any("neural" in line or "nixl" in line for line in report["info"])


def test_ray_line_names_the_hpu_resource_each_worker_requests(capsys, emulation, monkeypatch):
    monkeypatch.setenv("VLLM_RAY_PER_WORKER_GPUS", "1")

    _, report = doctor_json(capsys)

    [ray] = [o for o in report["optional"] if o["package"] == "ray"]
    assert ray["installed"] is True
    [line] = [line for line in report["info"] if line.startswith("ray ")]
    assert "{'HPU': 1.0}" in line and "--resources" in line


def test_missing_ray_is_info_naming_the_platform_extra(capsys, emulation, monkeypatch):
    real_find_spec = doctor.importlib.util.find_spec
    monkeypatch.setattr(
        doctor.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "ray" else real_find_spec(name, *a),
    )

    status, report = doctor_json(capsys)

    [line] = [line for line in report["info"] if line.startswith("ray ")]
    assert "vllm-gaudi-platform[ray]" in line
    assert status == 0 and not [p for p in report["problems"] if "ray" in p]


def test_the_router_line_names_the_connectors_extra(capsys, emulation):
    _, report = doctor_json(capsys)

    [router] = [o for o in report["optional"] if o["package"] == "vllm-router"]
    assert router["wheel"] == "vllm-gaudi-connectors"
    [line] = [line for line in report["info"] if line.startswith("vllm-router ")]
    if router["installed"]:
        assert "router in front of prefill and decode instances" in line
    else:  # the dev venv keeps the router in a venv of its own (scripts/setup-dev.sh)
        assert "vllm-gaudi-connectors[router]" in line
    assert not [p for p in report["problems"] if "router" in p]


def test_missing_optional_dependency_is_info_not_a_problem(capsys, emulation, monkeypatch):
    platform = [w for w in doctor.installed_wheels() if w.name == "vllm-gaudi-platform"]
    quant = doctor.Wheel("vllm-gaudi-quant", platform[0].version)
    monkeypatch.setattr(doctor, "installed_wheels", lambda: [*platform, quant])
    monkeypatch.setattr(
        doctor_optional,
        "OPTIONAL_DEPENDENCIES",
        {
            "vllm-gaudi-quant": (
                doctor_optional.OptionalDependency(
                    "absent-pkg", "absent_pkg_for_test", ("absent-pkg",), "pip install x", "X"
                ),
            )
        },
    )

    _, report = doctor_json(capsys)

    assert [line for line in report["info"] if "absent-pkg" in line]
    assert not [p for p in report["problems"] if "absent-pkg" in p]


def test_doctor_imports_neither_torch_nor_vllm(run_python):
    result = run_python(
        "from vllm_gaudi_platform.cli import main; main(['doctor'])",
        {"VLLM_HPU_EMULATION": "cpu"},
        args=("-X", "importtime"),
    )

    imported = [line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()]
    assert "vllm_gaudi_platform.commands.doctor" in imported, result.stderr[-2000:]
    assert [m for m in imported if m.split(".")[0] in ("torch", "vllm")] == []


def test_console_script_prints_json_and_exit_status_matches_ok(console_script, clean_env):
    import subprocess

    result = subprocess.run(
        [console_script("vllm-gaudi"), "doctor", "--json"],
        env=clean_env({"VLLM_HPU_EMULATION": "cpu"}),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )

    report = json.loads(result.stdout)
    assert report.keys() >= JSON_KEYS
    assert result.returncode == (0 if report["ok"] else 1), result.stderr


def test_settings_lists_only_variables_that_differ_from_their_defaults(capsys, monkeypatch):
    for name in envs.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLLM_HPU_EMULATION", "cpu")
    monkeypatch.setenv("VLLM_BUCKETING_STRATEGY", "lin")
    monkeypatch.setenv("VLLM_DECODE_BS_BUCKET_MAX", "64")
    monkeypatch.setenv("VLLM_SKIP_WARMUP", "false")  # its default: not listed
    monkeypatch.setenv("VLLM_PROMPT_BS_BUCKET_MIN", "")  # set but empty means unset

    _, report = doctor_json(capsys)

    assert report["settings"] == [
        {"name": "VLLM_BUCKETING_STRATEGY", "value": "lin", "default": "exp"},
        {"name": "VLLM_DECODE_BS_BUCKET_MAX", "value": "64", "default": None},
        {"name": "VLLM_HPU_EMULATION", "value": "cpu", "default": None},
    ]


def test_text_output_shows_each_changed_setting_with_its_default(capsys, monkeypatch):
    for name in envs.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLLM_HPU_EMULATION", "cpu")
    monkeypatch.setenv("VLLM_GRAPH_RESERVED_MEM", "0.2")

    _, out = run_doctor(capsys)

    assert "VLLM_GRAPH_RESERVED_MEM=0.2 (default 0.1)" in out
    assert "VLLM_HPU_EMULATION=cpu (default unset)" in out
    assert "VLLM_SKIP_WARMUP" not in out


QUANT_METHODS = ["inc", "fp8", "awq_hpu", "gptq_hpu", "compressed-tensors", "gpt_oss_mxfp4"]


def quantization(report: dict) -> dict[str, dict]:
    return {q["method"]: q for q in report["quantization"]}


def test_every_quantization_method_registers_on_a_complete_emulated_install(capsys, emulation):
    _, report = doctor_json(capsys)

    methods = quantization(report)
    assert list(methods) == QUANT_METHODS
    assert all(q["installed"] and q["registers"] and q["why_not"] is None for q in methods.values())


def test_inc_without_neural_compressor_does_not_register_and_says_how_to_install_it(
    capsys, emulation, monkeypatch
):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "neural_compressor" else real(name, *a),
    )

    _, out = run_doctor(capsys)

    assert "inc: neural-compressor not installed: pip install 'vllm-gaudi-quant[inc]'" in out
    assert "awq_hpu: registers" in out


def test_a_quantization_entry_point_left_out_of_vllm_plugins_does_not_register(
    capsys, emulation, monkeypatch
):
    monkeypatch.setenv("VLLM_PLUGINS", "hpu,hpu_quant_fp8")

    _, report = doctor_json(capsys)

    methods = quantization(report)
    assert methods["fp8"]["registers"]
    assert not methods["gptq_hpu"]["registers"]
    assert methods["gptq_hpu"]["why_not"] == "hpu_quant_gptq is not named in VLLM_PLUGINS"


def test_without_the_quant_wheel_no_method_is_said_to_be_available(capsys, emulation, monkeypatch):
    platform = [w for w in doctor.installed_wheels() if w.name == "vllm-gaudi-platform"]
    monkeypatch.setattr(doctor, "installed_wheels", lambda: platform)

    _, report = doctor_json(capsys)

    methods = quantization(report)
    assert not any(q["installed"] or q["registers"] for q in methods.values())
    assert methods["awq_hpu"]["why_not"] == "not installed: pip install vllm-gaudi-quant"
    assert not any("available" in line and "quant" in line.lower() for line in report["info"])


def test_lists_the_weight_transfer_engine_and_the_setting_that_uses_it(capsys, emulation):
    _, out = run_doctor(capsys)
    _, report = doctor_json(capsys)

    wt = report["weight_transfer"]
    assert wt["engine"] == "hpu" and wt["available"] and wt["why_not"] is None
    assert 'engine hpu: available with weight_transfer_config={"backend": "hpu"}' in out


def test_off_hpu_the_weight_transfer_engine_says_why_it_is_not_available(capsys):
    _, report = doctor_json(capsys)

    wt = report["weight_transfer"]
    assert not wt["available"]
    assert wt["why_not"] == "no HPU device (real or emulated): the platform is not active"


def test_a_platform_wheel_without_the_entry_point_says_to_reinstall(capsys, emulation, monkeypatch):
    wheels = [
        dataclasses.replace(
            w,
            entry_points=tuple(ep for ep in w.entry_points if ep.name != "hpu_weight_transfer"),
        )
        for w in doctor.installed_wheels()
    ]
    monkeypatch.setattr(doctor, "installed_wheels", lambda: wheels)

    _, report = doctor_json(capsys)

    assert report["weight_transfer"]["why_not"] == (
        "vllm-gaudi-platform declares no hpu_weight_transfer: reinstall it"
    )
