"""The torch device "hpu": where the stand-in's tensors live, as a Gaudi's live on its device.

Habana's bridge registers a torch device "hpu" when `habana_frameworks.torch` is imported; vLLM's
runner on a Gaudi, neural-compressor's HPU flow (`model.to("hpu")`, observers on "hpu", `torch.hpu`)
and `seam/gaudi` all work on its tensors. The stand-in's is torch's own HPU device type and
dispatch key, where the bridge registers its backend (`_device_backend.cpp`, built with torch's C++
extension tools at first use and cached): its tensors are plain `torch.Tensor` objects whose device
is "hpu" and whose storage is host memory, so parameters, views, `data_ptr()`, `set_` and
`torch.compile` behave as they do on a device. Every op runs as the CPU's kernel over the same
bytes. The rule it enforces is the one every non-CPU torch device keeps: an op refuses "hpu" tensors
mixed with CPU tensors unless the CPU operand is 0-d. `host_reads()` counts device-to-host reads
(`.item()`, `.tolist()`, `.cpu()`, copies into CPU tensors).

Registered on request: `HABANA_STANDIN_TORCH_DEVICE=1` before the first import of
`habana_frameworks.torch` (or `install()`). It is once per process and cannot be undone (a
loaded library's registrations stay).
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import torch

_INSTALLED = False
_SOURCE = Path(__file__).with_name("_device_backend.cpp")
_LIBRARY = "habana_standin_device"


def installed() -> bool:
    return _INSTALLED


def requested() -> bool:
    return os.environ.get("HABANA_STANDIN_TORCH_DEVICE", "0") == "1"


def _build_directory() -> Path:
    """Where the compiled backend is kept: keyed by its source and by torch's version, so a
    changed source or another torch builds afresh and every process after the first loads it."""
    key = hashlib.sha256(
        _SOURCE.read_bytes() + torch.__version__.encode() + sys.version.encode()
    ).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    path = cache / "vllm-gaudi" / "standin-device" / key
    path.mkdir(parents=True, exist_ok=True)
    return path


def _load_backend() -> None:
    from torch.utils import cpp_extension

    # torch's build runs ninja from PATH: the interpreter's own environment has it.
    bindir = os.path.dirname(sys.executable)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([bindir, os.environ.get("PATH", "")])
    cpp_extension.load(
        name=_LIBRARY,
        sources=[str(_SOURCE)],
        is_python_module=False,
        build_directory=str(_build_directory()),
        extra_cflags=["-O1"],
        verbose=False,
    )


def install() -> None:
    """Register torch's device "hpu" (once per process), with `torch.hpu` the stand-in's runtime
    module `habana_frameworks.torch.hpu`."""
    global _INSTALLED
    if _INSTALLED:
        return
    from habana_frameworks.torch import hpu

    _load_backend()
    torch._register_device_module("hpu", hpu)
    _no_caching_allocator()
    _INSTALLED = True


def host_reads() -> int:
    """Device-to-host reads since the device was installed (0 before)."""
    return int(torch.ops.habana_standin.host_reads()) if _INSTALLED else 0


def host_reads_by_op() -> dict[str, int]:
    """The same reads by the op that made them ("copy to host" for copies into CPU tensors)."""
    if not _INSTALLED:
        return {}
    lines = str(torch.ops.habana_standin.host_reads_by_op()).splitlines()
    return {op: int(n) for op, n in (line.rsplit("=", 1) for line in lines)}


def memory_allocated() -> int:
    """Bytes held by "hpu" tensors now (0 where the device is not installed)."""
    return int(torch.ops.habana_standin.memory_allocated()) if _INSTALLED else 0


def max_memory_allocated() -> int:
    """The most bytes "hpu" tensors held since the last reset_peak_memory_stats()."""
    return int(torch.ops.habana_standin.max_memory_allocated()) if _INSTALLED else 0


def reset_peak_memory_stats() -> None:
    if _INSTALLED:
        torch.ops.habana_standin.reset_peak_memory_stats()


def _no_caching_allocator() -> None:
    """torch.accelerator's memory calls expect the device's caching allocator, which Habana's
    bridge registers in C++ and the stand-in does not: they answer for the stand-in's device as
    for a device that caches nothing (its allocations go straight to host memory, counted)."""
    import torch.accelerator as accelerator

    accelerator.empty_cache = lambda: None
    accelerator.synchronize = lambda device=None, /: None
    accelerator.memory_allocated = lambda device_index=None, /: memory_allocated()
    accelerator.memory_reserved = lambda device_index=None, /: memory_allocated()
    accelerator.max_memory_allocated = lambda device_index=None, /: max_memory_allocated()
    accelerator.reset_peak_memory_stats = lambda device_index=None, /: reset_peak_memory_stats()
    accelerator.reset_accumulated_memory_stats = lambda device_index=None, /: None
    accelerator.max_memory_reserved = lambda device_index=None, /: 0
    accelerator.memory_stats = lambda device_index=None, /: {}
    accelerator.empty_host_cache = lambda: None
