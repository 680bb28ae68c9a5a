"""Which device the HPU platform would run on, decided without importing torch or vllm.

vLLM calls the platform plugin in every process before anything else, so this stays cheap: with no
Gaudi software installed and no emulation asked for, it imports nothing heavy.
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


def probe_device() -> DeviceProbe:
    """Decide the device. Raises EnvError for a bad VLLM_HPU_EMULATION value."""
    emulation = envs.emulation_mode()
    if importlib.util.find_spec("habana_frameworks") is not None:
        # Only the seam imports habana_frameworks; it also pulls in torch, which is fine here
        # because this is a Gaudi software stack.
        from vllm_gaudi_platform.seam import gaudi_device_count

        count, why = gaudi_device_count()
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
