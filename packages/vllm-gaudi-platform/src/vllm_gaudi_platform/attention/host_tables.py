"""The host copies of vLLM's block tables, for the metadata builders that plan a step on the host.

vLLM's runner fills each KV cache group's block table on the host and copies it to the device
before it builds the step's attention metadata; `CommonAttentionMetadata` carries only the
device copy. The HPU builders lay out a step (buckets, block lists, state slots) on the host, so
reading that device copy back would cost a device-to-host sync every step, before the forward
pass can be issued. The runner shares the host copies here instead (`share`, each step), and the
builders read them by the device tensor they were handed (`host_rows`). In emulation host and
device are one memory and the device tensor is already the host's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

# data_ptr of a device block table -> its host copy (the same rows, in host memory)
_MIRRORS: dict[int, torch.Tensor] = {}


def share(block_tables: Iterable[Any]) -> None:
    """The host copies of vLLM's per-group block tables (`BlockTable.block_table`, a host/device
    buffer pair), keyed by their device tensors."""
    _MIRRORS.clear()
    for table in block_tables:
        pair = table.block_table
        if pair.gpu.data_ptr() != pair.cpu.data_ptr():
            _MIRRORS[pair.gpu.data_ptr()] = pair.cpu


def host_rows(table: torch.Tensor, rows: int) -> torch.Tensor:
    """The first `rows` rows of a block table, on the host: the shared host copy of a device
    table, else (a table no runner shared: a profiling run's) a copy read from the device."""
    if table.device.type == "cpu":
        return table[:rows]
    mirror = _MIRRORS.get(table.data_ptr())
    if mirror is not None and mirror.shape[1:] == table.shape[1:]:
        return mirror[:rows]
    return table[:rows].cpu()
