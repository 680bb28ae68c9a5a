"""Defaults a `vllm-gaudi selftest` report decides, and where each default in effect came from.

A selftest probe can decide a setting (`decided_defaults` in the report: the MoE gather
threshold from whether the MoE kernel skips empty experts). With VLLM_HPU_SELFTEST_REPORT=<the
report> the platform takes those values; an explicit setting of the variable wins over the
report, and without either the built-in default applies. `vllm-gaudi doctor` shows which one
each setting came from. Importing this is cheap: no torch, no vllm.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass

from vllm_gaudi_platform import envs

REPORT_FORMAT = "vllm-gaudi-selftest"
REPORT_VERSION = 1
# The settings a report may decide (what the probes' `decides` name).
DECIDABLE = (envs.VLLM_MOE_GATHER_MAX_TOKENS,)

_FIX = (
    f"point {envs.VLLM_HPU_SELFTEST_REPORT} at a report written by `vllm-gaudi selftest --json "
    "FILE`, or unset it"
)


@dataclass(frozen=True)
class Decided:
    value: str | None  # None: the probe keeps the built-in (automatic) default
    probe: str
    answers_from: str  # "hardware", "stand-in" or "emulation"
    device: str


@dataclass(frozen=True)
class Source:
    name: str
    value: str | None  # None: the built-in default (unset / automatic)
    origin: str  # "environment", "selftest report", "built-in default"
    detail: str


def report_path() -> str | None:
    raw = (os.environ.get(envs.VLLM_HPU_SELFTEST_REPORT) or "").strip()
    return raw or None


def report_decisions() -> dict[str, Decided]:
    """The settings the report names in VLLM_HPU_SELFTEST_REPORT decides ({} when unset);
    raises EnvError for a missing, unreadable or foreign file."""
    path = report_path()
    return (
        {} if path is None else _read(path, os.path.getmtime(path) if os.path.isfile(path) else 0)
    )


@functools.cache
def _read(path: str, mtime: float) -> dict[str, Decided]:
    name = envs.VLLM_HPU_SELFTEST_REPORT
    try:
        with open(path) as f:
            report = json.load(f)
    except FileNotFoundError:
        raise envs.EnvError(f"{name}={path!r}: no such file; {_FIX}.") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise envs.EnvError(
            f"{name}={path!r} is not a readable JSON report ({exc}); {_FIX}."
        ) from None
    if not isinstance(report, dict) or report.get("format") != REPORT_FORMAT:
        raise envs.EnvError(f"{name}={path!r} is not a vllm-gaudi selftest report; {_FIX}.")
    if report.get("version") != REPORT_VERSION:
        raise envs.EnvError(
            f"{name}={path!r} is a selftest report of version {report.get('version')!r}, this "
            f"platform reads version {REPORT_VERSION}; run `vllm-gaudi selftest --json FILE` "
            "again with this version, or unset it."
        )
    backend = report.get("backend") or {}
    source = (backend.get("answers_from") or {}).get("kind", "unknown")
    decided = {}
    for setting, entry in (report.get("decided_defaults") or {}).items():
        if setting not in DECIDABLE:
            continue
        value = entry.get("value") if isinstance(entry, dict) else None
        if value is not None:
            _check_value(setting, str(value), path)
        decided[setting] = Decided(
            None if value is None else str(value),
            str(entry.get("probe", "?")) if isinstance(entry, dict) else "?",
            source,
            str(backend.get("device", "?")),
        )
    return decided


def _check_value(setting: str, value: str, path: str) -> None:
    if setting == envs.VLLM_MOE_GATHER_MAX_TOKENS and not value.isdigit():
        raise envs.EnvError(
            f"{envs.VLLM_HPU_SELFTEST_REPORT}={path!r} decides {setting}={value!r}, not a whole "
            f"number of tokens; {_FIX}."
        )


def source_of(name: str) -> Source:
    """Where the value of a decidable setting comes from: an explicit setting wins, then the
    report, then the built-in default."""
    explicit = (os.environ.get(name) or "").strip()
    if explicit:
        return Source(name, explicit, "environment", f"{name} is set")
    decided = report_decisions().get(name)
    if decided is not None:
        model = "" if decided.answers_from == "hardware" else f", {decided.answers_from} model"
        detail = f"{report_path()} (probe {decided.probe} on {decided.device}{model})"
        if decided.value is not None:
            return Source(name, decided.value, "selftest report", detail)
        return Source(name, None, "built-in default", f"confirmed by {detail}")
    return Source(name, None, "built-in default", f"{name} unset, no selftest report")


def moe_gather_max_tokens() -> tuple[int | None, str]:
    """VLLM_MOE_GATHER_MAX_TOKENS in effect: (tokens, or None for each layer's automatic
    threshold; where it came from)."""
    source = source_of(envs.VLLM_MOE_GATHER_MAX_TOKENS)
    if source.origin == "environment":
        return envs.moe_gather_max_tokens(), envs.VLLM_MOE_GATHER_MAX_TOKENS
    if source.value is not None:
        return int(source.value), f"selftest report {source.detail}"
    return None, "automatic"


def doctor_entries() -> tuple[list[dict[str, str | None]], str | None]:
    """(one entry per decidable setting: name, value, origin, detail; the problem with the
    report file, if any)."""
    try:
        sources = [source_of(name) for name in DECIDABLE]
    except envs.EnvError as exc:
        return [], str(exc)
    return [vars(s) for s in sources], None
