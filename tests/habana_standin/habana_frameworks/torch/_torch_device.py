"""A torch device named "hpu" whose tensors hold CPU memory, for code that moves tensors itself.

Habana's bridge registers a torch device "hpu" when `habana_frameworks.torch` is imported, and
neural-compressor's HPU flow relies on it: it calls `model.to("hpu")`, creates its observers with
`device="hpu"` and asks `torch.hpu` whether a device is there. The stand-in's kernels and the
engines that run `seam/gaudi.py` over it work on CPU tensors and need no such device, so it is
registered only on request: `HABANA_STANDIN_TORCH_DEVICE=1` before the first import of
`habana_frameworks.torch` (or `install()`). It is once per process and cannot be undone (torch
renames its PrivateUse1 backend to "hpu").

How: an "hpu" tensor is a wrapper around a CPU tensor. Factory functions given `device="hpu"`
reach the PrivateUse1 kernels below; every other op on an "hpu" tensor reaches
`HpuTensor.__torch_dispatch__`, which runs it on the CPU tensors inside and wraps the results
again. `.cpu()` / `.to("cpu")` unwrap. What the wrapper checks, each a rule of a real device:
- an op mixes "hpu" tensors with CPU tensors only where torch allows a CPU scalar (0-d) operand;
  `HABANA_STANDIN_MIXED_DEVICES=1` lifts that for engines whose own tensors live on the CPU
  (the stand-in engine points `seam/gaudi.py` at the CPU, neural-compressor moves the model it
  patches to "hpu"): there the result of a mixed op is a CPU tensor, the engine's device;
- `.item()` and `.tolist()` work, as a device-to-host read.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from habana_frameworks.torch._kernels import HabanaRuleError

_INSTALLED = False
_LIBRARY: torch.library.Library | None = None
_CPU = torch.device("cpu")
# Ops that leave the device: their results are host tensors.
_TO_HOST = ("_local_scalar_dense", "equal", "is_nonzero")
# Ops that move data between the devices, and so take tensors of both.
_COPIES = ("copy_", "_to_copy", "_copy_from", "_has_compatible_shallow_copy_type")


def _allow_mixed() -> bool:
    return os.environ.get("HABANA_STANDIN_MIXED_DEVICES", "0") == "1"


def _hpu() -> torch.device:
    return torch.device("hpu", 0)


class HpuTensor(torch.Tensor):
    """A tensor on the stand-in's "hpu" device: `raw` is the CPU tensor that holds its data."""

    raw: torch.Tensor

    @staticmethod
    def __new__(cls, raw: torch.Tensor) -> HpuTensor:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls,
            raw.shape,
            strides=raw.stride(),
            storage_offset=raw.storage_offset(),
            dtype=raw.dtype,
            device=_hpu(),
            requires_grad=raw.requires_grad,
        )

    def __init__(self, raw: torch.Tensor) -> None:
        self.raw = raw

    def __repr__(self) -> str:  # type: ignore[override]
        return f"{self.raw!r} (on the stand-in's hpu)"

    def tolist(self):  # type: ignore[override]
        # A device-to-host read, as on any device (torch refuses it for wrapper subclasses).
        return self.raw.tolist()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        mixed = _check_devices(func, args, kwargs)

        def unwrap(x: Any) -> Any:
            if isinstance(x, HpuTensor):
                return x.raw
            if isinstance(x, torch.device) and x.type == "hpu":
                return _CPU
            return x

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        returns = func._schema.returns
        if returns and returns[0].alias_info is not None and returns[0].alias_info.is_write:
            return args[0]  # in place: the caller's tensor, now holding the result
        device = kwargs.get("device")
        if device is not None:
            on_device = torch.device(device).type == "hpu"
        else:
            on_device = not mixed and func._schema.name.split("::")[-1] not in _TO_HOST
        if not on_device:
            return out
        return tree_map(lambda x: HpuTensor(x) if type(x) is torch.Tensor else x, out)


def _check_devices(func: Any, args: Any, kwargs: Any) -> bool:
    """Whether the op mixes "hpu" tensors with CPU tensors (beyond 0-d CPU scalars); refused
    unless HABANA_STANDIN_MIXED_DEVICES=1, where the results stay on the CPU."""
    flat, _ = tree_flatten((args, kwargs))
    host = [t for t in flat if type(t) is torch.Tensor and t.dim() > 0]
    if not host or func._schema.name.split("::")[-1] in _COPIES:
        return False
    if _allow_mixed():
        return True
    raise HabanaRuleError(
        f"{func}: tensors on hpu and cpu in one op (a cpu tensor of shape "
        f"{tuple(host[0].shape)}); move it to the device first"
    )


def _raw(x: Any) -> Any:
    return x.raw if isinstance(x, HpuTensor) else x


def _empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return HpuTensor(torch.empty(size, dtype=dtype, layout=layout, device=_CPU))


def _empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    return HpuTensor(torch.empty_strided(size, stride, dtype=dtype, layout=layout, device=_CPU))


def _copy_from(self, dst, non_blocking=False):
    _raw(dst).copy_(_raw(self))
    return dst


def installed() -> bool:
    return _INSTALLED


def install() -> None:
    """Register torch's device "hpu" (once per process), with `torch.hpu` the stand-in's runtime
    module `habana_frameworks.torch.hpu`."""
    global _INSTALLED, _LIBRARY
    if _INSTALLED:
        return
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    from habana_frameworks.torch import hpu

    _setup_privateuseone_for_python_backend("hpu", backend_module=hpu)
    _LIBRARY = torch.library.Library("aten", "IMPL")
    _LIBRARY.impl("empty.memory_format", _empty, "PrivateUse1")
    _LIBRARY.impl("empty_strided", _empty_strided, "PrivateUse1")
    _LIBRARY.impl("_copy_from", _copy_from, "PrivateUse1")
    _no_caching_allocator()
    _INSTALLED = True


def _no_caching_allocator() -> None:
    """torch.accelerator's memory calls expect the device's caching allocator, which Habana's
    bridge registers in C++ and a Python device cannot: they answer for the stand-in's device as
    for a device with nothing cached (its tensors are CPU tensors)."""
    import torch.accelerator as accelerator

    accelerator.empty_cache = lambda: None
    accelerator.synchronize = lambda device=None, /: None
    accelerator.memory_allocated = lambda device_index=None, /: 0
    accelerator.memory_reserved = lambda device_index=None, /: 0
    accelerator.max_memory_allocated = lambda device_index=None, /: 0
    accelerator.reset_peak_memory_stats = lambda device_index=None, /: None


def requested() -> bool:
    return os.environ.get("HABANA_STANDIN_TORCH_DEVICE", "0") == "1"
