"""Emulated device runtime: device, memory, synchronization, streams, events and graphs.

Part of the CPU emulation backend (`emulated.py` re-exports every public name here); each mirrors
the function or class of the same name in `gaudi.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch

from vllm_gaudi_platform.seam.contract import GraphInputError


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
    """Bytes of tensors held by this process (resident set: the CPU has no allocator stats)."""
    try:
        import psutil

        return psutil.Process(os.getpid()).memory_info().rss
    except ImportError:
        return 0


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


def graphs_supported() -> bool:
    """As on a Gaudi: graphs only in lazy mode (PT_HPU_LAZY_MODE=1)."""
    from vllm_gaudi_platform import envs

    return envs.lazy_mode()


class Graph:
    """One forward pass "captured" for replay, with the input discipline of an HPU graph.

    A Gaudi graph replays the recorded ops on the exact buffers it saw at capture: a caller that
    hands it a re-allocated input (or one of another shape or dtype) gets the old buffer's stale
    data, silently. The emulation has no recording to speed anything up, so it runs `fn` eagerly
    at each replay, but first checks every tensor of `inputs` against what capture recorded and
    raises `GraphInputError` naming the input that moved. That check is the point of the class:
    it turns a bug that is silent on a Gaudi into a loud one in CI.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._fn: Callable[[], Any] | None = None
        self._recorded: dict[str, tuple[int, tuple[int, ...], torch.dtype]] = {}

    def capture(self, fn: Callable[[], Any], inputs: Mapping[str, Any]) -> Any:
        """Run `fn` once and record every tensor input's storage pointer, shape and dtype."""
        self._recorded = _graph_inputs(inputs)
        self._fn = fn
        return fn()

    def replay(self, inputs: Mapping[str, Any]) -> Any:
        """Check `inputs` are the captured buffers, then run the captured `fn` again."""
        if self._fn is None:
            raise GraphInputError(f"graph {self.name!r} was replayed before it was captured")
        now = _graph_inputs(inputs)
        problems = []
        for key, (ptr, shape, dtype) in self._recorded.items():
            seen = now.get(key)
            if seen is None:
                problems.append(f"{key} is missing (captured as {dtype} {list(shape)})")
            elif seen[0] != ptr:
                problems.append(f"{key} is a different buffer than at capture (re-allocated)")
            elif seen[1:] != (shape, dtype):
                problems.append(
                    f"{key} is {seen[2]} {list(seen[1])}, captured as {dtype} {list(shape)}"
                )
        problems += [f"{key} was not an input at capture" for key in now.keys() - self._recorded]
        if problems:
            raise GraphInputError(
                f"graph {self.name!r} replayed with inputs that differ from its capture: "
                + "; ".join(problems)
                + ". A Gaudi would replay the captured buffers' stale data: update static "
                "inputs in place (copy_) instead of re-allocating them."
            )
        return self._fn()


def _graph_inputs(
    value: Any, name: str = "", out: dict | None = None
) -> dict[str, tuple[int, tuple[int, ...], torch.dtype]]:
    """Every tensor reachable from `value` (mappings, lists/tuples, dataclass fields not starting
    with '_'), by dotted path: (data pointer, shape, dtype)."""
    out = {} if out is None else out
    if isinstance(value, torch.Tensor):
        out[name] = (value.data_ptr(), tuple(value.shape), value.dtype)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _graph_inputs(item, f"{name}.{key}" if name else str(key), out)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _graph_inputs(item, f"{name}[{i}]", out)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            if not f.name.startswith("_"):
                _graph_inputs(getattr(value, f.name), f"{name}.{f.name}", out)
    return out


def current_stream() -> Stream:
    """The stream work is issued on now: the CPU's single ordered stream."""
    return Stream()


def stream(stream: Any) -> AbstractContextManager[Any]:
    """Issue the body's work on `stream`; the CPU has a single stream, so nothing changes."""
    return contextlib.nullcontext()
