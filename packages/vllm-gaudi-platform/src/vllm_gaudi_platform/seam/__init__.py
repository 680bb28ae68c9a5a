"""The hardware seam: the only door from the plugins to Gaudi.

Everything above this package is the same code on a Gaudi and in CPU emulation. Below it there
are two backends with one API, the `HpuBackend` Protocol of `contract.py`:

- `gaudi/`: the only module in the tree that imports `habana_frameworks`; thin wrappers over
  Gaudi's device runtime and fused kernels.
- `emulated.py`: the same functions, with the same signatures and semantics, in plain torch on the
  CPU (`VLLM_HPU_EMULATION=cpu`). It is the backend module; the kernels it does not hold itself
  come from `emulated_runtime.py` (device, memory, streams), `emulated_graph.py` (graphs, a
  captured forward pass replayed as a tape of ops), `emulated_quant.py` (FP8 and 4-bit),
  `emulated_moe.py` and `emulated_kv_cache.py` (block copies, paged and MLA glue), each
  re-exported by name (`from ... import x as x`).

`probe.py` decides which one this process uses (the one device probe of the tree); `backend()`
returns it, chosen once per process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm_gaudi_platform.seam import emulated, gaudi
    from vllm_gaudi_platform.seam.contract import HpuBackend

    # The type checker proves both backend modules satisfy the Protocol (here, not in contract.py,
    # which the backends import: the check would close an import circle).
    _emulated_backend: HpuBackend = emulated
    _gaudi_backend: HpuBackend = gaudi


# The chosen backend, once chosen. A plain module global, not a functools cache: the op families
# call backend() inside forward passes that torch.compile traces, and dynamo warns at every
# functools.lru_cache it meets there (it traces through the wrapper), while a global read is
# what it guards on anyway.
_active: HpuBackend | None = None


def backend() -> HpuBackend:
    """The active backend: `gaudi` on a Gaudi, `emulated` under VLLM_HPU_EMULATION=cpu."""
    global _active
    if _active is None:
        _active = _choose()
    return _active


def _cache_clear() -> None:
    """Forget the choice (tests switch the environment between backends)."""
    global _active
    _active = None


backend.cache_clear = _cache_clear  # type: ignore[attr-defined]


def _choose() -> HpuBackend:
    from vllm_gaudi_platform.seam.probe import probe_device

    probe = probe_device()
    if probe.kind == "gaudi":
        from vllm_gaudi_platform.seam import gaudi

        return gaudi
    if probe.kind == "emulated-cpu":
        from vllm_gaudi_platform.seam import emulated

        return emulated
    raise RuntimeError(f"No HPU backend: {probe.reason}")
