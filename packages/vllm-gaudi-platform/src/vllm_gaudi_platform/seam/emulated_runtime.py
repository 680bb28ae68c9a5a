"""Emulated device runtime: device, memory, synchronization, streams and events.

Part of the CPU emulation backend (`emulated.py` re-exports every public name here); each mirrors
the function or class of the same name in `gaudi/`.
"""

from __future__ import annotations

import contextlib
import os
from contextlib import AbstractContextManager
from typing import Any

import torch


# ----------------------------------------------------------------------------- device runtime
def torch_device(index: int = 0) -> torch.device:
    return torch.device("cpu")


def set_device(device: torch.device) -> None:
    """One emulated device: nothing to select."""


def device_count() -> int:
    return 1


def device_name(index: int = 0) -> str:
    return "HPU (emulated on cpu)"


def mem_get_info() -> tuple[int, int]:
    """(free, total) bytes of one emulated HPU: VLLM_HPU_EMULATION_MEMORY_GB caps the total."""
    from vllm_gaudi_platform import envs

    total = int(envs.get_number(envs.VLLM_HPU_EMULATION_MEMORY_GB, lo=0.1) * (1 << 30))
    try:
        import psutil

        total = min(total, psutil.virtual_memory().available)
    except ImportError:
        pass
    used = memory_allocated()
    return max(total - used, 0), total


def memory_allocated() -> int:
    """Bytes of tensors held by this process (resident set: the CPU has no allocator stats).

    Freed memory is first handed back to the system where the C library can (glibc's
    malloc_trim): freed tensors below its mmap threshold otherwise stay resident in the heap,
    and the count would not fall when a device's would."""
    _trim_heap()
    try:
        import psutil

        return psutil.Process(os.getpid()).memory_info().rss
    except ImportError:
        return 0


def max_memory_allocated() -> int:
    """The peak of memory_allocated() since the last reset_peak_memory_stats(): the process's
    peak resident set (Linux's VmHWM in /proc/self/status), which the kernel keeps at every page
    fault, so a transient tensor freed before the reading still counts.

    Where the kernel keeps no peak (no /proc: not Linux) the reading is the resident set now, and
    a warning says that a profile run's transient tensors are not counted."""
    peak = _status_bytes("VmHWM")
    if peak is None:
        _warn_no_peak()
        return memory_allocated()
    return peak


def reset_peak_memory_stats() -> None:
    """Start a new peak from the resident set now (Linux: writing 5 to /proc/self/clear_refs
    resets VmHWM to VmRSS). The heap is trimmed first, so freed memory the C library still held
    does not raise the new baseline."""
    _trim_heap()
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        _warn_no_peak()


def _status_bytes(field: str) -> int | None:
    """A "kB" field of /proc/self/status in bytes (None without /proc)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _warn_no_peak() -> None:
    global _PEAK_WARNED
    if not _PEAK_WARNED:
        _PEAK_WARNED = True
        from vllm.logger import init_logger

        init_logger(f"vllm.{__name__}").warning(
            "This system keeps no peak resident set (/proc/self/status VmHWM, "
            "/proc/self/clear_refs): the emulated peak memory is the resident set when read, and "
            "a profile run's transient tensors are not counted in the KV cache sizing."
        )


_PEAK_WARNED = False


def _trim_heap() -> None:
    import ctypes
    import ctypes.util

    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        name = ctypes.util.find_library("c")
        libc = ctypes.CDLL(name) if name else None
        _MALLOC_TRIM = getattr(libc, "malloc_trim", False) if libc is not None else False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


_MALLOC_TRIM: Any = None


def synchronize() -> None:
    """CPU ops complete when they return."""


def mark_step() -> None:
    """Lazy-mode graph flush. Eager CPU execution has nothing to flush."""


# Streams and events. The CPU runs every op to completion, in issue order, before the call
# returns: there is one stream, and an event recorded after some work is already complete. So
# these are exact, not approximate: waiting on anything has nothing left to wait for.
class Stream:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other: Stream) -> None:
        pass


class Event:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Stream | None = None) -> None:
        pass

    def synchronize(self) -> None:
        pass


def current_stream() -> Stream:
    """The stream work is issued on now: the CPU's single ordered stream."""
    return Stream()


def stream(stream: Any) -> AbstractContextManager[Any]:
    """Issue the body's work on `stream`; the CPU has a single stream, so nothing changes."""
    return contextlib.nullcontext()
