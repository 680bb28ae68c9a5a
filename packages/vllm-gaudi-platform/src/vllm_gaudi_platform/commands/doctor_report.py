"""`vllm-gaudi doctor`'s report: the installed wheels and entry points it reads, and what it found
(commands/doctor.py fills it and prints it; commands/doctor_optional.py adds the optional
packages)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class EntryPointInfo:
    group: str
    name: str
    value: str
    distribution: str


@dataclass(frozen=True)
class Wheel:
    name: str
    version: str
    entry_points: tuple[EntryPointInfo, ...] = ()


@dataclass
class Report:
    wheels: list[dict[str, Any]] = field(default_factory=list)
    entry_points: list[dict[str, Any]] = field(default_factory=list)
    vllm_plugins: dict[str, Any] = field(default_factory=dict)
    device: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, dict[str, Any]] = field(default_factory=dict)
    optional: list[dict[str, Any]] = field(default_factory=list)
    # Per quantization method: its entry point installed, would it register here, and why not.
    quantization: list[dict[str, Any]] = field(default_factory=list)
    # Our settings (envs.VARIABLES) in effect that differ from their defaults.
    settings: list[dict[str, Any]] = field(default_factory=list)
    # Defaults a selftest report can decide: the value in effect and where it came from
    # (environment, selftest report, built-in default).
    defaults: list[dict[str, Any]] = field(default_factory=list)
    # vLLM's weight-transfer engine "hpu": available here, and why not.
    weight_transfer: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    info: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}
