"""`vllm-gaudi doctor`: what is installed, what will load under VLLM_PLUGINS, and why.

It reads installed metadata only and imports neither vllm nor torch, so it answers in well under a
second and still works on an install too broken to import vLLM. (On a Gaudi software stack the
device probe imports habana_frameworks: that is the only way to count Gaudi devices.)

Every check turns into plain sentences: `problems` (each one makes the exit status non-zero) and
`info` (optional features that are off). `collect()` builds the report; `render()` prints it.
"""

from __future__ import annotations

import difflib
import importlib.machinery
import importlib.util
import os
import textwrap
from dataclasses import asdict
from importlib import metadata

from packaging.utils import canonicalize_name

from vllm_gaudi_platform import compat, envs
from vllm_gaudi_platform.commands import doctor_optional
from vllm_gaudi_platform.commands.doctor_optional import QUANT_WHEEL
from vllm_gaudi_platform.commands.doctor_report import EntryPointInfo, Report, Wheel
from vllm_gaudi_platform.seam.probe import probe_device

WHEEL_PREFIX = "vllm-gaudi-"
PLATFORM_WHEEL = "vllm-gaudi-platform"
PLATFORM_GROUP = "vllm.platform_plugins"
GENERAL_GROUP = "vllm.general_plugins"
# vLLM 0.32 filters these groups by VLLM_PLUGINS (vllm.plugins.load_plugins_by_group). Endpoint
# plugins follow a stricter rule (only loaded when named), so they are left out of "will load".
FILTERED_GROUPS = (
    PLATFORM_GROUP,
    GENERAL_GROUP,
    "vllm.io_processor_plugins",
    "vllm.stat_logger_plugins",
)
# vLLM's own variables, not ours (so not in envs.py): read here exactly as vLLM 0.32 reads them.
VLLM_PLUGINS = "VLLM_PLUGINS"
VLLM_TARGET_DEVICE = "VLLM_TARGET_DEVICE"


def _distributions() -> list[tuple[str, metadata.Distribution]]:
    """(normalized name, distribution), first one on sys.path wins, as importlib.metadata does."""
    seen: dict[str, metadata.Distribution] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name and canonicalize_name(name) not in seen:
            seen[canonicalize_name(name)] = dist
    return list(seen.items())


def installed_wheels() -> list[Wheel]:
    """The installed vllm-gaudi-* wheels, platform first, with every entry point they declare."""
    wheels = []
    for name, dist in _distributions():
        if name.startswith(WHEEL_PREFIX):
            eps = tuple(
                EntryPointInfo(ep.group, ep.name, ep.value, name) for ep in dist.entry_points
            )
            wheels.append(Wheel(name, dist.version, eps))
    return sorted(wheels, key=lambda w: (w.name != PLATFORM_WHEEL, w.name))


def installed_plugin_entry_points() -> list[EntryPointInfo]:
    """Every vLLM plugin entry point of every installed distribution, ours or not."""
    return [
        EntryPointInfo(ep.group, ep.name, ep.value, name)
        for name, dist in _distributions()
        for ep in dist.entry_points
        if ep.group.startswith("vllm.")
    ]


def parse_vllm_plugins(raw: str | None) -> list[str] | None:
    """vLLM 0.32's parsing: split on commas, no trimming; None (unset) means load everything."""
    return None if raw is None else raw.split(",")


def will_load(group: str, name: str, allowed: list[str] | None) -> bool | None:
    """Whether vLLM loads this entry point; None when VLLM_PLUGINS does not govern its group."""
    if group not in FILTERED_GROUPS:
        return None
    return allowed is None or name in allowed


def target_present(value: str) -> bool | None:
    """Whether the module an entry point names is installed, found without importing it.

    None when that cannot be told without importing (an unusual loader).
    """
    parts = value.split(":")[0].strip().split(".")
    try:
        spec = importlib.util.find_spec(parts[0])
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    if len(parts) > 1 and spec.submodule_search_locations is None:
        # A plain module has no submodules; a loader without a path cannot be walked.
        return False if spec.origin else None
    locations = list(spec.submodule_search_locations or [])
    for depth, part in enumerate(parts[1:], start=2):
        packages = [os.path.join(loc, part) for loc in locations]
        packages = [path for path in packages if os.path.isdir(path)]
        is_module = any(
            os.path.isfile(os.path.join(loc, part + suffix))
            for loc in locations
            for suffix in importlib.machinery.all_suffixes()
        )
        if is_module and depth == len(parts):
            return True
        if not packages:
            return False
        locations = packages
    return True


def _check_wheels(report: Report, wheels: list[Wheel]) -> None:
    report.wheels = [{"name": w.name, "version": w.version} for w in wheels]
    names = {w.name for w in wheels}
    if not wheels:
        report.problems.append("no vllm-gaudi-* wheel is installed (metadata unreadable?)")
    elif PLATFORM_WHEEL not in names:
        report.problems.append(
            f"{PLATFORM_WHEEL} is not installed, but {', '.join(sorted(names))} need it; "
            f"pip install {PLATFORM_WHEEL}=={wheels[0].version}"
        )
    versions = {w.version for w in wheels}
    if len(versions) > 1:
        listed = ", ".join(f"{w.name} {w.version}" for w in wheels)
        report.problems.append(
            f"the vllm-gaudi wheels are at different versions ({listed}); they are released "
            "together and only work at the same version: install one version of all of them"
        )


def _check_entry_points(
    report: Report, wheels: list[Wheel], allowed: list[str] | None
) -> list[EntryPointInfo]:
    ours = [ep for w in wheels for ep in w.entry_points]
    for ep in ours:
        present = target_present(ep.value)
        report.entry_points.append(
            {**asdict(ep), "loads": will_load(ep.group, ep.name, allowed), "target_found": present}
        )
        if present is False:
            report.problems.append(
                f"entry point {ep.name} ({ep.group}) points at {ep.value}, whose module is "
                f"not installed: vLLM would fail to load it; reinstall {ep.distribution}"
            )
    return ours


def _check_vllm_plugins(
    report: Report,
    raw: str | None,
    allowed: list[str] | None,
    ours: list[EntryPointInfo],
    everyone: list[EntryPointInfo],
) -> None:
    platform_names = [ep.name for ep in ours if ep.group == PLATFORM_GROUP]
    general_names = [ep.name for ep in ours if ep.group == GENERAL_GROUP]
    known = sorted({ep.name for ep in [*everyone, *ours] if ep.group.startswith("vllm.")})
    unknown = [n for n in (allowed or []) if n and n not in known]
    report.vllm_plugins = {
        "set": raw is not None,
        "value": raw,
        "names": allowed,
        "unknown": unknown,
        "platform_loads": bool(platform_names)
        and all(will_load(PLATFORM_GROUP, n, allowed) for n in platform_names),
    }
    for name in unknown:
        if name.strip() in known:
            report.problems.append(
                f"VLLM_PLUGINS names {name!r}: vLLM does not trim spaces, so it matches no "
                f"plugin; write it as {name.strip()!r}"
            )
            continue
        hint = difflib.get_close_matches(name.strip(), known, n=1)
        report.problems.append(
            f"VLLM_PLUGINS names {name!r}, which matches no installed plugin (vLLM ignores it "
            f"without a word)"
            + (f"; did you mean {hint[0]!r}?" if hint else f"; installed: {', '.join(known)}")
        )
    if allowed is None or not platform_names:
        return
    platform = platform_names[0]
    if raw == "":
        report.problems.append(
            f"VLLM_PLUGINS is set but empty: vLLM loads no plugin at all, so the HPU platform "
            f"is inactive; unset VLLM_PLUGINS, or list the plugins starting with {platform} "
            f"(VLLM_PLUGINS={platform},...)"
        )
        return
    if platform in allowed:
        if not any(n in allowed for n in general_names) and general_names:
            report.info.append(
                "VLLM_PLUGINS loads no hpu_* general plugin: vLLM's own ops and methods run"
            )
        return
    fixed = ",".join([platform, *allowed])
    ours_named = [n for n in allowed if n in general_names or n.startswith(f"{platform}_")]
    if ours_named:
        report.problems.append(
            f"VLLM_PLUGINS={raw} names {', '.join(ours_named)} but not {platform}: the HPU "
            f"platform will not load, vLLM falls back to another platform and "
            f"{', '.join(ours_named)} will do nothing. Fix: add {platform}: "
            f"VLLM_PLUGINS={fixed}"
        )
    else:
        report.problems.append(
            f"VLLM_PLUGINS={raw} does not name {platform}: the HPU platform will not load. "
            f"Fix: add {platform} (VLLM_PLUGINS={fixed}) or unset VLLM_PLUGINS"
        )


def _check_target_device(report: Report) -> None:
    value = os.environ.get(VLLM_TARGET_DEVICE)
    if value is not None and value.lower() == "cpu":
        report.problems.append(
            f"{VLLM_TARGET_DEVICE}={value} makes vLLM take its CPU platform without asking any "
            f"platform plugin, so the HPU platform is never considered; unset {VLLM_TARGET_DEVICE}"
        )


def _check_device(report: Report) -> None:
    try:
        probe = probe_device()
    except envs.EnvError as exc:
        report.device = {"kind": "error", "count": 0, "label": "unknown", "reason": str(exc)}
        report.problems.append(str(exc))
        return
    except Exception as exc:  # a broken Gaudi stack is reported, not raised
        reason = f"the device probe failed: {type(exc).__name__}: {exc}"
        report.device = {"kind": "error", "count": 0, "label": "unknown", "reason": reason}
        report.problems.append(reason)
        return
    if probe.kind == "gaudi":
        label = f"Gaudi x{probe.count}"
    elif probe.kind == "emulated-cpu":
        label = "emulated on cpu, not a Gaudi"
    else:
        label = "none"
    report.device = {"kind": probe.kind, "count": probe.count, "label": label}
    report.device["reason"] = probe.reason
    if not probe.active:
        report.problems.append(
            f"no device: the HPU platform is inactive ({probe.reason}); on a Gaudi, check the "
            f"Gaudi software and {envs.HABANA_VISIBLE_MODULES}; without one, set "
            f"{envs.VLLM_HPU_EMULATION}=cpu to emulate it on the CPU"
        )


def _check_versions(report: Report) -> None:
    torch = compat.check_torch()
    for check in (compat.check_vllm(), torch):
        report.versions[check.package] = {
            "found": check.found,
            "distribution": check.distribution,
            "supported": check.supported,
            "ok": check.ok,
        }
    # vLLM's range decides registration (compat's one rule, override included); torch's does not.
    problem, registers = compat.version_refusal()
    report.versions["vllm"]["registers"] = registers
    if problem:
        (report.info if registers else report.problems).append(problem)
    if torch_problem := torch.problem():
        report.problems.append(torch_problem)
    if report.versions["vllm"]["found"]:
        report.versions["vllm"]["build"] = compat.vllm_build_kind()


def _check_settings(report: Report) -> None:
    report.settings = [
        {"name": name, "value": value, "default": envs.VARIABLES[name].default}
        for name, value in sorted(envs.non_default().items())
    ]


def _check_defaults(report: Report) -> None:
    from vllm_gaudi_platform import selftest_defaults

    report.defaults, problem = selftest_defaults.doctor_entries()
    if problem:
        report.problems.append(problem)


# Entry point -> import name of the optional package (in OPTIONAL_DEPENDENCIES) it needs.
QUANT_REQUIRES = {"hpu_quant_inc": "neural_compressor"}


def _check_quantization(report: Report, wheels: list[Wheel], allowed: list[str] | None) -> None:
    """Per quantization method: installed (its entry point is declared by an installed wheel),
    registers (vLLM would load it and it would register on this HPU platform), and why not."""
    from vllm_gaudi_platform.plugins import QUANT_METHODS

    declared = {ep.name: ep for w in wheels for ep in w.entry_points if ep.group == GENERAL_GROUP}
    optional = doctor_optional.OPTIONAL_DEPENDENCIES
    deps = {d.import_name: d for group in optional.values() for d in group}
    for entry_point, methods in QUANT_METHODS.items():
        ep = declared.get(entry_point)
        why = None
        if ep is None:
            why = f"not installed: pip install {QUANT_WHEEL}"
        elif not will_load(GENERAL_GROUP, entry_point, allowed):
            why = f"{entry_point} is not named in VLLM_PLUGINS"
        elif target_present(ep.value) is False:
            why = f"{ep.value} is missing: reinstall {ep.distribution}"
        elif (need := QUANT_REQUIRES.get(entry_point)) and importlib.util.find_spec(need) is None:
            dep = deps[need]
            why = f"{dep.package} not installed: {dep.install}"
        elif not report.versions.get("vllm", {}).get("registers", True):
            why = "the installed vLLM is outside the supported range: nothing registers"
        elif not report.device.get("count") and report.device.get("kind") != "emulated-cpu":
            why = "no HPU device (real or emulated): nothing registers off HPU"
        for method in methods:
            report.quantization.append(
                {
                    "method": method,
                    "entry_point": entry_point,
                    "installed": ep is not None,
                    "registers": why is None,
                    "why_not": why,
                }
            )


WEIGHT_TRANSFER_ENTRY_POINT = "hpu_weight_transfer"


def _check_weight_transfer(report: Report, wheels: list[Wheel]) -> None:
    """vLLM's weight-transfer engine "hpu" (in-place weight updates from a trainer): whether an
    engine started here with weight_transfer_config={"backend": "hpu"} gets it, and why not.
    VLLM_PLUGINS does not matter: the worker registers it when the setting asks for it."""
    declared = {ep.name: ep for w in wheels for ep in w.entry_points if ep.group == GENERAL_GROUP}
    ep = declared.get(WEIGHT_TRANSFER_ENTRY_POINT)
    why = None
    if ep is None:
        why = f"{PLATFORM_WHEEL} declares no {WEIGHT_TRANSFER_ENTRY_POINT}: reinstall it"
    elif target_present(ep.value) is False:
        why = f"{ep.value} is missing: reinstall {ep.distribution}"
    elif not report.versions.get("vllm", {}).get("registers", True):
        why = "the installed vLLM is outside the supported range: nothing registers"
    elif not report.device.get("count") and report.device.get("kind") != "emulated-cpu":
        why = "no HPU device (real or emulated): the platform is not active"
    report.weight_transfer = {
        "engine": "hpu",
        "entry_point": WEIGHT_TRANSFER_ENTRY_POINT,
        "available": why is None,
        "why_not": why,
        "setting": 'weight_transfer_config={"backend": "hpu"}',
        "trainer_client": "vllm_gaudi_platform.distributed.weight_sender",
    }


def collect() -> Report:
    """Run every check against the installed metadata and the environment."""
    report = Report()
    wheels = installed_wheels()
    raw = os.environ.get(VLLM_PLUGINS)
    allowed = parse_vllm_plugins(raw)
    _check_wheels(report, wheels)
    ours = _check_entry_points(report, wheels, allowed)
    _check_vllm_plugins(report, raw, allowed, ours, installed_plugin_entry_points())
    _check_target_device(report)
    _check_device(report)
    _check_versions(report)
    doctor_optional.check_torchvision(report)
    doctor_optional.check_optional(report, wheels)
    _check_quantization(report, wheels, allowed)
    _check_weight_transfer(report, wheels)
    _check_settings(report)
    _check_defaults(report)
    return report


def _wrap(text: str, first: str, rest: str) -> list[str]:
    return textwrap.wrap(
        text, width=100, initial_indent=first, subsequent_indent=rest, break_on_hyphens=False
    )


def render(report: Report) -> str:
    """The report as one screen of text."""
    lines = ["vllm-gaudi doctor"]
    wheels = ", ".join(f"{w['name']} {w['version']}" for w in report.wheels) or "none"
    lines += _wrap(wheels, "  wheels        ", " " * 16)
    plugins = report.vllm_plugins
    if not plugins.get("set"):
        lines.append("  VLLM_PLUGINS  unset: every installed plugin loads")
    else:
        lines.append(f"  VLLM_PLUGINS  {plugins['value']!r}: only the plugins named load")
    lines.append("  entry points")
    width = max((len(ep["name"]) for ep in report.entry_points), default=0)
    group_width = max((len(ep["group"]) for ep in report.entry_points), default=0)
    for ep in report.entry_points:
        status = {True: "loads", False: "skipped", None: "-"}[ep["loads"]]
        missing = "  <- module not installed" if ep["target_found"] is False else ""
        lines.append(
            f"    {ep['name']:<{width}}  {ep['group']:<{group_width}}  {status:<7}  "
            f"{ep['value']}{missing}"
        )
    device = report.device
    lines += _wrap(f"{device.get('label')} ({device.get('reason')})", "  device        ", " " * 16)
    for package, v in report.versions.items():
        found = v["found"] or "not installed"
        dist = (
            f" ({v['distribution']})" if v["distribution"] and v["distribution"] != package else ""
        )
        verdict = "ok" if v["ok"] else "OUT OF RANGE" if v["found"] else "MISSING"
        lines.append(f"  {package:<12}  {found}{dist}, supported {v['supported']}: {verdict}")
        if v.get("build"):
            lines += _wrap(v["build"], "  vllm build    ", " " * 16)
    lines += _wrap(
        f"outside the supported vLLM range no entry point registers; {compat.SKIP_VERSION_CHECK}"
        "=1 registers them all anyway (untested)",
        "  version rule  ",
        " " * 16,
    )
    if not report.settings:
        lines.append("  settings      all defaults")
    for setting in report.settings:
        default = "unset" if setting["default"] is None else setting["default"]
        text = f"{setting['name']}={setting['value']} (default {default})"
        lines += _wrap(text, "  settings      ", " " * 16)
    for d in report.defaults:
        value = "unset (automatic)" if d["value"] is None else d["value"]
        text = f"{d['name']}={value}: {d['origin']}, {d['detail']}"
        lines += _wrap(text, "  defaults      ", " " * 16)
    for q in report.quantization:
        text = f"{q['method']}: " + ("registers" if q["registers"] else q["why_not"])
        lines += _wrap(text, "  quantization  ", " " * 16)
    wt = report.weight_transfer
    if wt:
        text = f"engine {wt['engine']}: " + (
            f"available with {wt['setting']} (trainer: {wt['trainer_client']})"
            if wt["available"]
            else wt["why_not"]
        )
        lines += _wrap(text, "  weights sync  ", " " * 16)
    for line in report.info:
        lines += _wrap(line, "  info          ", " " * 16)
    if report.problems:
        lines.append(f"{len(report.problems)} problem(s):")
        for problem in report.problems:
            lines += _wrap(problem, "  - ", "    ")
    else:
        lines.append("no problems")
    return "\n".join(lines)
