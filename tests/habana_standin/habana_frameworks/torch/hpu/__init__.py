"""habana_frameworks.torch.hpu: the device runtime, streams, events and HPU graphs.

The device's memory is the CPU's. Work runs when issued, so streams and events have nothing to
wait for; synchronize() and the stream context only keep the call contract.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from habana_frameworks.torch import _device
from habana_frameworks.torch._kernels import HabanaRuleError

# Fact: HBM of one device, Gaudi 2 96 GB and Gaudi 3 128 GB (Habana's product specifications).
_MEMORY_BYTES = {2: 96 * 10**9, 3: 128 * 10**9}


def device_count() -> int:
    return _device.DEVICES_PER_PROCESS


def get_device_name(index: int = 0) -> str:
    _check_index(index)
    return _device.device_name()


def _check_index(index: int | None) -> None:
    if index not in (None, 0):
        raise HabanaRuleError(
            f"hpu:{index}: a process acquires one Gaudi, named torch.device('hpu') (index 0)"
        )


def set_device(device: Any) -> None:
    index = device.index if isinstance(device, torch.device) else device
    _check_index(index)


# What torch asks of a device module once `torch.hpu` is this module (see _torch_device.py)
# and what neural-compressor's HPU accelerator calls.
def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


def current_device() -> int:
    return 0


def _lazy_init() -> None:
    """torch calls it before it makes the first "hpu" tensor from Python (its device lazy-init
    for the HPU device type imports `torch.hpu` and calls this); the stand-in has nothing to
    initialise."""


def _is_in_bad_fork() -> bool:
    return False


def manual_seed_all(seed: int) -> None:
    """The stand-in's device draws its random numbers from the CPU generator."""


def empty_cache() -> None:
    """Nothing is cached: the stand-in's device allocates and frees host memory directly."""


def mem_get_info() -> tuple[int, int]:
    """(free, total) bytes: total is the product's HBM, or HABANA_STANDIN_MEMORY_GB (its memory
    is the host's, so a test sizes it below the product's: an engine sizes its KV cache from
    this); free is what the device's tensors leave of it."""
    override = os.environ.get("HABANA_STANDIN_MEMORY_GB")
    total = int(float(override) * (1 << 30)) if override else _MEMORY_BYTES[_device.generation()]
    return max(total - memory_allocated(), 0), total


def memory_allocated() -> int:
    """Bytes held by tensors on the stand-in's torch device "hpu" (0 where it is not installed:
    the kernels then run on CPU tensors, and no device byte is ever allocated)."""
    from habana_frameworks.torch import _torch_device

    return _torch_device.memory_allocated()


def max_memory_allocated(device: Any = None) -> int:
    """The most bytes "hpu" tensors held since the last reset_peak_memory_stats() (the bridge's
    `hpu/memory.py`: the allocator's MaxInUse), transient tensors freed since included."""
    from habana_frameworks.torch import _torch_device

    _check_memory_device(device)
    return _torch_device.max_memory_allocated()


def reset_peak_memory_stats(device: Any = None) -> None:
    """Restart the peak from the bytes held now (the bridge's `hpu/memory.py`)."""
    from habana_frameworks.torch import _torch_device

    _check_memory_device(device)
    _torch_device.reset_peak_memory_stats()


def _check_memory_device(device: Any) -> None:
    """The bridge's memory stats take a device (None, an index, "hpu", torch.device) and refuse
    an id outside the process's devices ("Invalid device id"); the process has one."""
    if device is None:
        return
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "hpu":
            raise HabanaRuleError(f"memory stats of {device}: not an HPU device")
        device = device.index
    _check_index(device)


def synchronize() -> None:
    """Every op has completed when it returns on the CPU."""


class Stream:
    def synchronize(self) -> None:
        pass

    def wait_stream(self, other: Stream) -> None:
        pass


class Event:
    def record(self, stream: Stream | None = None) -> None:
        pass

    def synchronize(self) -> None:
        pass


_CURRENT = Stream()


def current_stream() -> Stream:
    return _CURRENT


@contextlib.contextmanager
def stream(s: Stream) -> Iterator[Stream]:
    yield s


class _Tape(TorchDispatchMode):
    """Records every tensor op run under it: (op, args, kwargs, outputs), the outputs kept."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, Any, Any, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


def _overwrite(recorded: Any, fresh: Any) -> None:
    """Write a replayed op's results into the tensors recorded at capture (which later ops and
    the caller hold), so a replay leaves its results where the capture left them."""
    if isinstance(recorded, torch.Tensor) and isinstance(fresh, torch.Tensor):
        if recorded.data_ptr() != fresh.data_ptr() or recorded.stride() != fresh.stride():
            recorded.copy_(fresh)
    elif isinstance(recorded, list | tuple) and isinstance(fresh, list | tuple):
        for r, f in zip(recorded, fresh):
            _overwrite(r, f)


class _HPUGraph:
    """An HPU graph: capture_begin() ... capture_end() records the device ops issued between
    them; replay() runs exactly those ops again, on the tensors they ran on at capture.

    Facts: a replay executes recorded device work only, so Python code in the captured region
    (callbacks, counters, branches) does not run again, and a replay reads the captured input
    buffers whatever the caller holds now (hence in-place updates of static inputs). HPU graphs
    are a lazy-mode feature: the bridge exports HPUGraph (and wrap_in_hpu_graph) from
    habana_frameworks.torch.hpu only when PT_HPU_LAZY_MODE is not 0, and Intel's vllm-gaudi
    wraps models in HPU graphs only in lazy mode, using torch.compile otherwise. The stand-in
    reads the mode when the name is looked up (the bridge reads it once, at import).
    """

    def __init__(self) -> None:
        self._tape: _Tape | None = None
        self._ops: list[tuple[Any, Any, Any, Any]] | None = None

    def capture_begin(self) -> None:
        self._tape = _Tape()
        self._tape.__enter__()

    def capture_end(self) -> None:
        if self._tape is None:
            raise HabanaRuleError("HPUGraph.capture_end without capture_begin")
        self._tape.__exit__(None, None, None)
        self._ops, self._tape = self._tape.ops, None

    def replay(self) -> None:
        if self._ops is None:
            raise HabanaRuleError("HPUGraph.replay before a capture")
        with torch.no_grad():
            for func, args, kwargs, recorded in self._ops:
                fresh = func(*args, **kwargs)
                _overwrite(recorded, fresh)

    @property
    def recorded_ops(self) -> int:
        return len(self._ops or ())


def __getattr__(name: str) -> Any:
    if name == "HPUGraph":
        if _device.lazy_mode():
            return _HPUGraph
        raise AttributeError(
            "habana_frameworks.torch.hpu has no HPUGraph outside lazy mode (PT_HPU_LAZY_MODE=0)"
        )
    raise AttributeError(f"module 'habana_frameworks.torch.hpu' has no attribute {name!r}")


__all__ = [
    "Event",
    "Stream",
    "current_stream",
    "current_device",
    "device_count",
    "empty_cache",
    "get_device_name",
    "is_available",
    "is_initialized",
    "manual_seed_all",
    "max_memory_allocated",
    "mem_get_info",
    "memory_allocated",
    "reset_peak_memory_stats",
    "set_device",
    "stream",
    "synchronize",
]
