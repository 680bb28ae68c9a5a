"""Which device the HPU platform runs on: the one device probe of the tree.

Decided without importing torch or vllm: vLLM calls the platform plugin in every process before
anything else, so with no Gaudi software installed and no emulation asked for this imports nothing
heavy. The seam's `backend()` and the platform plugin's `register()` both ask here.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from vllm_gaudi_platform import envs


@dataclass(frozen=True)
class DeviceProbe:
    kind: str  # "gaudi", "emulated-cpu" or "none"
    count: int
    reason: str

    @property
    def active(self) -> bool:
        return self.kind != "none"


def gaudi_software_installed() -> bool:
    return importlib.util.find_spec("habana_frameworks") is not None


def _gaudi_device_count() -> tuple[int, str]:
    """(number of Gaudi devices, how that was found). Only called when habana_frameworks exists."""
    try:
        # seam/gaudi is the one module that imports habana_frameworks (and torch with it, which is
        # fine on a Gaudi software stack).
        from vllm_gaudi_platform.seam import gaudi
    except Exception as exc:
        return 0, f"habana_frameworks failed to import: {exc}"
    return gaudi.device_count(), "habana_frameworks.torch.hpu.device_count()"


def probe_device() -> DeviceProbe:
    """Decide the device. Raises EnvError for a bad VLLM_HPU_EMULATION value."""
    emulation = envs.emulation_mode()
    if gaudi_software_installed():
        count, why = _gaudi_device_count()
        if count > 0:
            return DeviceProbe("gaudi", count, f"{count} Gaudi device(s) found ({why})")
        if emulation is None:
            return DeviceProbe("none", 0, f"habana_frameworks is installed but {why}")
    if emulation == "cpu":
        return DeviceProbe(
            "emulated-cpu", 1, "VLLM_HPU_EMULATION=cpu: Gaudi kernels emulated on cpu"
        )
    return DeviceProbe(
        "none",
        0,
        "no Gaudi software (habana_frameworks) installed and VLLM_HPU_EMULATION is not set",
    )
