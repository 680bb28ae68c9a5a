"""habana_frameworks.torch.utils.experimental: which Gaudi this is, as neural-compressor asks.

Facts: neural-compressor compares `_get_device_type()` with `synDeviceType.synDeviceGaudi2` /
`synDeviceGaudi3` to pick the FP8 range and the hardware scales of the device (its
`auto_accelerator.py`, `fp_utils.py`), and calls `_set_is_dynamic_quantization(flag)` when it
prepares a model (`_core/utils.py`). The enum's numeric values could not be established; only
identity is compared, so the stand-in's values are its own. `_set_scale_attributes` (runtime
scale patching) is not provided: neural-compressor checks for it and does without.
"""

from __future__ import annotations

import enum

from habana_frameworks.torch import _device


class synDeviceType(enum.Enum):
    synDeviceGaudi = enum.auto()
    synDeviceGaudi2 = enum.auto()
    synDeviceGaudi3 = enum.auto()


_DYNAMIC_QUANTIZATION = {"enabled": False}


def _get_device_type() -> synDeviceType:
    return {2: synDeviceType.synDeviceGaudi2, 3: synDeviceType.synDeviceGaudi3}[
        _device.generation()
    ]


def _set_is_dynamic_quantization(enabled: bool) -> None:
    _DYNAMIC_QUANTIZATION["enabled"] = bool(enabled)


def _is_dynamic_quantization() -> bool:
    return _DYNAMIC_QUANTIZATION["enabled"]
