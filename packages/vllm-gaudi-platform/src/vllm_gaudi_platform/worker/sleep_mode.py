"""Sleep mode on the HPU: give the device memory of the weights and the KV cache back, and take it
again on wake-up, without rebuilding the model.

vLLM's CUDA sleep mode swaps whole allocator pools (CuMemAllocator); the HPU has no such pools.
Here the memory is released per STORAGE: every tensor keeps its identity, shape and strides, and
only its storage shrinks to zero bytes. Views made after loading (fused-weight views cached by
the MoE and quantization methods, the attention layers' KV cache views) therefore stay valid and
see the restored memory after wake-up, which replacing `param.data` would not give.

- level 1: the weights' bytes are copied to host memory, then released; the KV cache is released
  (its contents are lost, as vLLM's contract allows). Wake-up restores both.
- level 2: the weights are released without a host copy, the KV cache too. Wake-up re-allocates
  them and reloads the weights from the checkpoint (vLLM's in-place reload, which also repeats
  the quantization methods' post-load processing).

`wake_up(tags)` takes vLLM's tags: "weights" and/or "kv_cache" (None: both).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

WEIGHTS = "weights"
KV_CACHE = "kv_cache"
TAGS = (WEIGHTS, KV_CACHE)


@dataclass
class _Released:
    """One released storage: the storage object, its size, and (level 1) its bytes on the host."""

    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None = None


def unique_storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The distinct storages behind `tensors` (views and tied weights share one)."""
    seen: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen[storage.data_ptr()] = storage
    return list(seen.values())


def _bytes_of(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


@dataclass
class SleepState:
    """What a worker released, per tag, and how to get it back."""

    level: int = 0
    released: dict[str, list[_Released]] = field(default_factory=dict)

    @property
    def asleep(self) -> bool:
        return bool(self.released)

    def release(self, tag: str, tensors: Iterable[torch.Tensor], *, keep_on_host: bool) -> int:
        """Release the storages of `tensors` under `tag`; returns the bytes released."""
        if tag in self.released:
            raise RuntimeError(f"HPU sleep: {tag} is already released; call wake_up first.")
        out: list[_Released] = []
        for storage in unique_storages(tensors):
            entry = _Released(storage, storage.nbytes())
            if keep_on_host:
                device = storage.device
                entry.host = _bytes_of(storage, device).to("cpu", copy=True)
            storage.resize_(0)
            out.append(entry)
        self.released[tag] = out
        return sum(e.nbytes for e in out)

    def restore(self, tag: str, *, reload: Callable[[], None] | None = None) -> int:
        """Re-allocate the storages released under `tag`: copied back from the host when a copy
        was kept, zero-filled otherwise, then `reload()` when weights came back without a copy
        (level 2). Returns the bytes.

        Only the WEIGHTS tag reloads: the KV cache never keeps a copy, and reloading the
        checkpoint when it woke put back the weights the engine loaded over any written in place
        since (an update from a trainer) that level 1 had just copied back."""
        entries = self.released.pop(tag, None)
        if entries is None:
            return 0
        needs_reload = False
        for entry in entries:
            entry.storage.resize_(entry.nbytes)
            view = _bytes_of(entry.storage, entry.storage.device)
            if entry.host is not None:
                view.copy_(entry.host)
                entry.host = None
            else:
                view.zero_()
                needs_reload = True
        if needs_reload and reload is not None and tag == WEIGHTS:
            reload()
        if not self.released:
            self.level = 0
        return sum(e.nbytes for e in entries)


def parse_tags(tags: list[str] | None) -> tuple[str, ...]:
    """vLLM's wake-up tags, checked: None means every tag."""
    if tags is None:
        return TAGS
    unknown = sorted(set(tags) - set(TAGS))
    if unknown:
        raise ValueError(f"wake_up(tags={tags}): unknown tag(s) {unknown}; use {list(TAGS)}.")
    return tuple(tags)


def device_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes currently held by the distinct storages of `tensors`."""
    return sum(s.nbytes() for s in unique_storages(tensors))
