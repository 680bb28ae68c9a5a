"""The hardware seam: the only door from the plugins to Gaudi.

Everything above this package is the same code on a Gaudi and in CPU emulation. Below it there
are two backends with one API:

- `gaudi.py`: the only module in the tree that imports `habana_frameworks`; thin wrappers over
  Gaudi's device runtime and fused kernels.
- `emulated.py`: the same functions, with the same signatures and semantics, in plain torch on the
  CPU (`VLLM_HPU_EMULATION=cpu`).

Use `backend()` to get the active one. It is chosen once per process.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any


def gaudi_device_count() -> tuple[int, str]:
    """(number of Gaudi devices, how that was found). Only called when habana_frameworks exists."""
    try:
        from vllm_gaudi_platform.seam import gaudi
    except Exception as exc:
        return 0, f"habana_frameworks failed to import: {exc}"
    return gaudi.device_count(), "habana_frameworks.torch.hpu.device_count()"


@functools.cache
def backend() -> Any:
    """The active backend module: `gaudi` on a Gaudi, `emulated` under VLLM_HPU_EMULATION=cpu."""
    from vllm_gaudi_platform.detection import probe_device

    probe = probe_device()
    if probe.kind == "gaudi":
        from vllm_gaudi_platform.seam import gaudi

        return gaudi
    if probe.kind == "emulated-cpu":
        from vllm_gaudi_platform.seam import emulated

        return emulated
    raise RuntimeError(f"No HPU backend: {probe.reason}")


def gaudi_software_installed() -> bool:
    return importlib.util.find_spec("habana_frameworks") is not None
