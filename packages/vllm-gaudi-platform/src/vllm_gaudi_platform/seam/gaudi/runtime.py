"""The Gaudi backend's identity, device runtime, HPU graphs and streams
(`habana_frameworks.torch.hpu` and `.core`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import habana_frameworks.torch as htorch  # noqa: F401 - registers the hpu device with torch
import habana_frameworks.torch.core as htcore
import habana_frameworks.torch.hpu as hthpu
import torch

NAME = "gaudi"
DEVICE_TYPE = "hpu"
IS_EMULATED = False
DISPATCH_KEY = "HPU"
DIST_BACKEND = "hccl"
COMPILE_BACKEND = "hpu_backend"
# Pinned host memory is not supported on HPU: Intel's vllm-gaudi platform answers
# is_pin_memory_available() with False.
PIN_MEMORY = False
SHARED_HOST_MEMORY = False
NIXL_DEVICE_MEMORY = "VRAM"


def torch_device(index: int = 0) -> torch.device:
    """The process's Gaudi. Each process (one per TP/PP/DP rank) acquires exactly one device,
    named torch.device("hpu") whatever its rank: Intel's vllm-gaudi worker does so, and
    "hpu:{local_rank}" names a device the process does not have for every rank but the first."""
    return torch.device("hpu")


def set_device(device: torch.device) -> None:
    """Nothing to select: the process's one Gaudi is current (Intel's platform makes this a
    no-op too)."""


def device_count() -> int:
    return int(hthpu.device_count())


def device_name(index: int = 0) -> str:
    return str(hthpu.get_device_name(index))


def mem_get_info() -> tuple[int, int]:
    free, total = hthpu.mem_get_info()
    return int(free), int(total)


def memory_allocated() -> int:
    return int(hthpu.memory_allocated())


def max_memory_allocated() -> int:
    """Peak bytes allocated on the device since the last reset_peak_memory_stats()
    (`habana_frameworks.torch.hpu.max_memory_allocated`, Habana's memory stats API)."""
    return int(hthpu.max_memory_allocated())


def reset_peak_memory_stats() -> None:
    hthpu.reset_peak_memory_stats()


def synchronize() -> None:
    hthpu.synchronize()


def mark_step() -> None:
    htcore.mark_step()


Stream = hthpu.Stream
Event = hthpu.Event


def graphs_supported() -> bool:
    """HPU graphs exist in lazy mode only: the bridge exports HPUGraph from
    habana_frameworks.torch.hpu when PT_HPU_LAZY_MODE is not 0 (Intel's vllm-gaudi wraps its
    model in HPU graphs only in lazy mode and compiles it with torch.compile otherwise)."""
    return hasattr(hthpu, "HPUGraph")


class Graph:
    """One forward pass captured as an HPU graph (`habana_frameworks.torch.hpu.HPUGraph`, lazy
    mode only: see graphs_supported).

    Replay re-runs the recorded ops on the buffers seen at capture and returns the output
    tensors captured then (overwritten by the replay). `inputs` is not read here: the emulated
    twin checks it (Gaudi gives no such check; a re-allocated input replays stale data).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._graph = hthpu.HPUGraph()
        self._output: Any = None

    def capture(self, fn: Callable[[], Any], inputs: Mapping[str, Any]) -> Any:
        """Record `fn` on a side stream (as HPU graph capture requires) and return its output."""
        with hthpu.stream(hthpu.Stream()):
            self._graph.capture_begin()
            self._output = fn()
            self._graph.capture_end()
        return self._output

    def replay(self, inputs: Mapping[str, Any]) -> Any:
        """Replay the recording; returns the captured output tensors, now holding new results."""
        self._graph.replay()
        return self._output


def current_stream() -> Any:
    return hthpu.current_stream()


def stream(stream: Any) -> AbstractContextManager[Any]:
    return hthpu.stream(stream)
