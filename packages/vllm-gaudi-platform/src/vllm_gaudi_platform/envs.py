"""Every environment variable the Gaudi plugins read, with its default and meaning.

Reading a variable goes through this module so that a bad value fails in one place, with a message
that names the variable and the fix. Importing it is cheap: no torch, no vllm.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass


class EnvError(ValueError):
    """An environment variable holds a value the plugins cannot use."""


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str | None
    doc: str


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}

VARIABLES: dict[str, EnvVar] = {}


def _declare(name: str, default: str | None, doc: str) -> str:
    VARIABLES[name] = EnvVar(name, default, doc)
    return name


VLLM_HPU_EMULATION = _declare(
    "VLLM_HPU_EMULATION",
    None,
    "Run the HPU platform without a Gaudi. 'cpu' emulates the Gaudi kernels in torch on the CPU. "
    "Unset or empty: use a real Gaudi if one is present, otherwise stay inactive.",
)
HABANA_VISIBLE_MODULES = _declare(
    "HABANA_VISIBLE_MODULES", None, "Comma-separated Gaudi module ids this process may use."
)
PT_HPU_LAZY_MODE = _declare(
    "PT_HPU_LAZY_MODE",
    "0",
    "1: Gaudi lazy mode (graphs built op by op, flushed by mark_step); 0: eager / torch.compile.",
)
PT_HPU_WEIGHT_SHARING = _declare(
    "PT_HPU_WEIGHT_SHARING", "0", "Set to 0 by the platform: weight sharing breaks torch.compile."
)
RUNTIME_SCALE_PATCHING = _declare(
    "RUNTIME_SCALE_PATCHING",
    "1",
    "FP8 scales patched at run time instead of baked into graphs (default 1 in eager/compile).",
)
VLLM_SKIP_WARMUP = _declare("VLLM_SKIP_WARMUP", "false", "true: skip the bucket warmup.")
VLLM_FULL_WARMUP = _declare(
    "VLLM_FULL_WARMUP",
    "false",
    "true: a forward pass with a shape that was not warmed up (a recompile) is an error.",
)
VLLM_GRAPH_RESERVED_MEM = _declare(
    "VLLM_GRAPH_RESERVED_MEM",
    "0.1",
    "Share (0..1) of the usable device memory kept back for captured graphs, not KV cache.",
)
VLLM_HPU_EMULATION_MEMORY_GB = _declare(
    "VLLM_HPU_EMULATION_MEMORY_GB",
    "8",
    "Device memory (GiB) the CPU emulation reports as the total memory of one emulated HPU.",
)
VLLM_HPU_EMULATION_GAUDI = _declare(
    "VLLM_HPU_EMULATION_GAUDI",
    "3",
    "Gaudi generation the CPU emulation behaves as where generations differ: 3 or 2. Today that is "
    "the FP8 E4M3 range (largest value 448 on Gaudi 3, 240 on Gaudi 2).",
)
VLLM_HPU_OPS_STATS_FILE = _declare(
    "VLLM_HPU_OPS_STATS_FILE",
    None,
    "A JSON file each process adds its per-op-family forward_oot counts to at exit (tests).",
)

QUANT_CONFIG = _declare(
    "QUANT_CONFIG",
    None,
    "JSON file of INC FP8 settings for --quantization inc (vllm-gaudi-quant[inc]): mode MEASURE "
    "(collect calibration statistics, written at shutdown) or QUANTIZE (run in FP8 from them). "
    "`vllm-gaudi calibrate` writes a ready one.",
)

VLLM_NIXL_DEVICE_TO_DEVICE = _declare(
    "VLLM_NIXL_DEVICE_TO_DEVICE",
    "false",
    "true: the NIXL connector (vllm-gaudi-connectors) registers Gaudi device memory with NIXL and "
    "moves KV blocks device to device (kv_buffer_device 'hpu'); false: through host buffers "
    "(kv_buffer_device 'cpu'). Gaudi only: emulated KV caches already live in host memory.",
)


def get_raw(name: str) -> str | None:
    value = os.environ.get(name)
    if value is None:
        return VARIABLES[name].default if name in VARIABLES else None
    return value


def get_bool(name: str) -> bool:
    raw = (get_raw(name) or "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise EnvError(f"{name}={os.environ.get(name)!r} is not a boolean; set it to true or false.")


def get_number(name: str, cast: Callable[[str], float] = float, *, lo=None, hi=None) -> float:
    raw = (get_raw(name) or "").strip()
    try:
        value = cast(raw)
    except ValueError:
        raise EnvError(
            f"{name}={raw!r} is not a number; unset it to use the default "
            f"({VARIABLES[name].default})."
        ) from None
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise EnvError(f"{name}={raw!r} is out of range [{lo}, {hi}].")
    return value


def emulation_mode() -> str | None:
    """'cpu' when CPU emulation is asked for, None when not; raises EnvError on a bad value."""
    raw = (os.environ.get(VLLM_HPU_EMULATION) or "").strip().lower()
    if raw in ("", "0", "false", "off", "none"):
        return None
    if raw == "cpu":
        return "cpu"
    raise EnvError(
        f"{VLLM_HPU_EMULATION}={os.environ.get(VLLM_HPU_EMULATION)!r} is not supported; "
        "set it to 'cpu' for CPU emulation or unset it to use a real Gaudi."
    )
