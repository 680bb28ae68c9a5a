"""Mamba state copies of prefix caching ("align" mode) without Triton.

In vLLM's align mode a request's running Mamba state lives in the block of its last token; when
a step moves past a block boundary (or starts from a cached prefix), vLLM's shared runner code
(`mamba_utils.preprocess_mamba`) first copies each Mamba layer's conv and SSM state from the
block that holds it into the new one, so the finished block keeps the state after exactly its
last token for later requests. It describes the copies as (source address, destination
address, bytes) and launches the Triton kernel `batch_memcpy_kernel` on them.

`batch_memcpy` stands in for that kernel: it resolves each address inside the KV-cache memory
the runner registered (`register_regions`: the storages of the Mamba layers' state tensors) and
copies the bytes with tensor copies, which run on the device of that memory (Gaudi HBM, or the
emulated cache's host memory). An address outside every registered region is an error, never a
raw write.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class _Region:
    base: int
    nbytes: int
    data: torch.Tensor  # uint8 [nbytes] over the storage


_regions: list[_Region] = []


def register_regions(tensors: Iterable[torch.Tensor]) -> int:
    """Make the storages of `tensors` (the Mamba layers' state views) the memory `batch_memcpy`
    may copy within; replaces earlier registrations. Returns how many storages."""
    found: dict[int, _Region] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        base = storage.data_ptr()
        if base not in found:
            data = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
            found[base] = _Region(base, storage.nbytes(), data)
    _regions[:] = sorted(found.values(), key=lambda r: r.base)
    return len(_regions)


def _locate(address: int, size: int) -> tuple[torch.Tensor, int]:
    for region in _regions:
        offset = address - region.base
        if offset >= 0 and offset + size <= region.nbytes:
            return region.data, offset
    raise RuntimeError(
        f"Mamba state copy of {size} bytes at {address:#x}: not inside the registered KV-cache "
        f"memory ({len(_regions)} regions); the runner registers the Mamba layers' states when "
        "it builds the KV cache."
    )


def batch_memcpy(
    src_ptrs: torch.Tensor, dst_ptrs: torch.Tensor, sizes: torch.Tensor, BLOCK_SIZE: int = 1024
) -> None:
    """vLLM's `batch_memcpy_kernel`: copy sizes[i] bytes from src_ptrs[i] to dst_ptrs[i]."""
    for src, dst, size in zip(src_ptrs.tolist(), dst_ptrs.tolist(), sizes.tolist()):
        src_mem, src_off = _locate(src, size)
        dst_mem, dst_off = _locate(dst, size)
        chunk = src_mem[src_off : src_off + size]
        if src_mem.data_ptr() == dst_mem.data_ptr() and abs(src_off - dst_off) < size:
            chunk = chunk.clone()  # overlapping ranges: read everything before writing
        dst_mem[dst_off : dst_off + size].copy_(chunk)


KERNELS = {"vllm.v1.worker.mamba_utils.batch_memcpy_kernel": batch_memcpy}
