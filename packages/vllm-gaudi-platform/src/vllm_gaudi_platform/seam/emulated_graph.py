"""Emulated HPU graphs: a captured forward pass is a tape of tensor ops, replayed as recorded.

Part of the CPU emulation backend (`emulated.py` re-exports `Graph` and `graphs_supported`); the
Gaudi twin is `gaudi.Graph` over Habana's HPUGraph. What a replay on a Gaudi does, and so what
this one does:

- it runs the device ops recorded at capture, and nothing else: Python code inside the captured
  region (callbacks, counters, branches on tensor values read with `.item()`) ran once, at
  capture, and is frozen into the recording;
- it reads the buffers the recording read at capture (inputs, weights, KV caches), whatever the
  caller holds now, and writes its results into the output tensors returned at capture.

Capture runs `fn` under a TorchDispatchMode that records every aten op with its arguments. The
emulated seam kernels (decorated with `kernel`) are recorded as ONE entry each, as each is one
fused kernel on a Gaudi: their own Python (the MoE's per-expert loop, the tiled attention) runs
again at every replay on the replay's data. After capture, tensors the recording made itself
become numbered slots, so the graph keeps no intermediate alive between replays (Gaudi's
tensor-cache-free capture); tensors from outside (inputs, weights, caches) stay referenced.

Replay also checks every tensor of `inputs` against what capture recorded and raises
`GraphInputError` naming the one that moved: the check turns a bug that is silent on a Gaudi (a
re-allocated input replays stale data) into a loud one in CI.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode,
    _pop_mode_temporarily,
)
from torch.utils._pytree import tree_flatten, tree_map

from vllm_gaudi_platform.seam.contract import GraphInputError

F = TypeVar("F", bound=Callable[..., Any])

# The tapes recording now (innermost last).
_RECORDING: list[_Tape] = []
# vLLM's Python-implemented custom ops (attention, the MoE layer, ...) are not device kernels:
# a Gaudi graph records the device ops inside them, and so does the tape.
_TRACED_NAMESPACES = ("vllm",)
_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


def graphs_supported() -> bool:
    """As on a Gaudi: graphs only in lazy mode (PT_HPU_LAZY_MODE=1)."""
    from vllm_gaudi_platform import envs

    return envs.lazy_mode()


def kernel(fn: F) -> F:
    """Mark an emulated seam kernel: under capture it is recorded as one entry (its arguments and
    result), and replay calls it again, as a Gaudi replays a fused kernel."""

    @functools.wraps(fn)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        tape = _RECORDING[-1] if _RECORDING else None
        if tape is None or _get_current_dispatch_mode() is not tape:
            # Not capturing, or inside an entry being recorded already (a kernel calling one).
            return fn(*args, **kwargs)
        with _pop_mode_temporarily():
            out = fn(*args, **kwargs)
        tape.record(fn, args, kwargs, out)
        return out

    return recorded  # type: ignore[return-value]


@dataclasses.dataclass(frozen=True)
class _Slot:
    """A tensor the recording made itself: entry outputs fill the slots at replay."""

    index: int


class _Tape(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.entries: list[tuple[Callable[..., Any], Any, Any, list[int]]] = []
        self._slots: dict[int, int] = {}  # id(tensor made by the recording) -> slot
        self._made: list[torch.Tensor] = []  # keeps them alive (ids stay unique) until finish()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in _TRACED_NAMESPACES:
            # Run the op's own (Python) implementation with the tape on, so its inner ops are
            # recorded one by one; the op itself is not an entry.
            with self:
                return func.redispatch(_CPU, *args, **kwargs)
        out = func(*args, **kwargs)
        self.record(func, args, kwargs, out)
        return out

    def record(self, func: Callable[..., Any], args: Any, kwargs: Any, out: Any) -> None:
        # Arguments first: an in-place op on an outside tensor returns that tensor, which only
        # from then on is the recording's own (a slot).
        args, kwargs = tree_map(self.slot_of, args), tree_map(self.slot_of, kwargs)
        slots = []
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor):
                if id(leaf) not in self._slots:
                    self._slots[id(leaf)] = len(self._made)
                    self._made.append(leaf)
                slots.append(self._slots[id(leaf)])
            else:
                slots.append(-1)
        self.entries.append((func, args, kwargs, slots))

    def slot_of(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and id(value) in self._slots:
            return _Slot(self._slots[id(value)])
        return value

    def finish(self) -> int:
        """Drop the recording's own tensors (the entries hold slots); returns how many."""
        count = len(self._made)
        self._made.clear()
        self._slots.clear()
        return count


class Graph:
    """One forward pass captured as a tape and replayed as recorded (see the module docstring)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._entries: list[tuple[Callable[..., Any], Any, Any, list[int]]] | None = None
        self._num_slots = 0
        self._output: Any = None
        self._output_slots: Any = None
        self._inference = False
        self._grad = False
        self._recorded: dict[str, tuple[int, tuple[int, ...], torch.dtype]] = {}

    @property
    def num_ops(self) -> int:
        return len(self._entries or ())

    def capture(self, fn: Callable[[], Any], inputs: Mapping[str, Any]) -> Any:
        """Run `fn` once, recording its ops and every tensor input's buffer, shape and dtype."""
        self._recorded = _graph_inputs(inputs)
        # Replays run in the autograd mode of the capture (a recording has no autograd).
        self._inference = torch.is_inference_mode_enabled()
        self._grad = torch.is_grad_enabled()
        tape = _Tape()
        _RECORDING.append(tape)
        try:
            with tape:
                out = fn()
        finally:
            _RECORDING.pop()
        self._entries = tape.entries
        self._output = out
        self._output_slots = tree_map(tape.slot_of, out)
        self._num_slots = tape.finish()
        return out

    def replay(self, inputs: Mapping[str, Any]) -> Any:
        """Check `inputs` are the captured buffers, run the recorded ops, and return the output
        tensors of the capture holding this replay's results."""
        if self._entries is None:
            raise GraphInputError(f"graph {self.name!r} was replayed before it was captured")
        self._check_inputs(inputs)
        with torch.inference_mode(self._inference), torch.set_grad_enabled(self._grad):
            slots: list[Any] = [None] * self._num_slots

            def fill(value: Any) -> Any:
                return slots[value.index] if isinstance(value, _Slot) else value

            for func, args, kwargs, out_slots in self._entries:
                try:
                    result = func(*tree_map(fill, args), **tree_map(fill, kwargs))
                except RuntimeError as exc:
                    raise RuntimeError(
                        f"graph {self.name!r}: replaying {getattr(func, '__name__', func)} "
                        f"failed: {exc}"
                    ) from exc
                for slot, leaf in zip(out_slots, tree_flatten(result)[0]):
                    if slot >= 0:
                        slots[slot] = leaf
                    elif _is_work(leaf):
                        # A collective's completion handle: the caller's wait() ran at capture
                        # only, while a device stream orders the next op after the collective.
                        leaf.wait()
            for held, slot in zip(
                tree_flatten(self._output)[0], tree_flatten(self._output_slots)[0]
            ):
                if isinstance(slot, _Slot) and slots[slot.index] is not held:
                    held.copy_(slots[slot.index])
        return self._output

    def _check_inputs(self, inputs: Mapping[str, Any]) -> None:
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


def _is_work(value: Any) -> bool:
    """A c10d op's Work handle (returned next to its outputs)."""
    return not isinstance(value, torch.Tensor) and callable(getattr(value, "wait", None))


def _graph_inputs(
    value: Any, name: str = "", out: dict | None = None
) -> dict[str, tuple[int, tuple[int, ...], torch.dtype]]:
    """Every tensor reachable from `value` (mappings, lists/tuples, dataclass fields not starting
    with '_', and the result of a zero-argument callable, for inputs the caller only gathers when
    checked), by dotted path: (data pointer, shape, dtype)."""
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
    elif callable(value):
        _graph_inputs(value(), name, out)
    return out
