"""KV offloading to host memory (and disk behind it) on the HPU: vLLM's `OffloadingConnector`
with a CPU tier whose worker copies blocks between the HPU KV cache and host buffers.

vLLM 0.32's CPU spec (`CPUOffloadingSpec`) keeps its scheduler half (the host-chunk manager,
eviction policy, metrics) platform-free, but its worker refuses any platform other than CUDA and
XPU and copies with a CUDA kernel on raw pointers. `HpuCPUOffloadingSpec` keeps the former and
brings its own worker, `HpuOffloadingWorker`, which copies through the seam's `copy_blocks` (the
block copy NIXL's host staging uses): on a Gaudi a gather on the device, one transfer and a
scatter; in the emulation one copy per block, straight into place.

How vLLM hands the caches over (`CanonicalKVCaches`): one int8 tensor per layer-compact KV cache,
[num_blocks, page bytes] (the HPU cache is [blocks, block_size, kv_heads, 2 * head_size] per layer,
so one page is one block of one layer), and per KV-cache group the (tensor, unpadded page size)
of each of its layers. The host side is ours: per tensor [chunks, blocks_per_chunk, page] bytes,
where a chunk is the unit vLLM's manager allocates (`blocks_per_chunk` device blocks, set by the
`block_size` or `blocks_per_chunk` of the connector's extra config).

`HpuTieringOffloadingSpec` is the same for vLLM's tiered spec (`TieringOffloadingSpec`), whose
secondary tiers (the file tier among them) run in the scheduler and move whole chunk rows of a
shared host region (`SharedOffloadRegion`, one mmap of /dev/shm): there the worker's host chunks
are strided views of its own cell in every row, and the copies go one chunk slot at a time.

A job names device blocks (grouped per KV-cache group, with the logical index of each group's
first block, which may fall inside a chunk) and host chunks. Copies run when the job is
submitted and are reported at the next `get_finished`; `wait` has nothing to wait for. That is
correct (a store reads the cache after the step that wrote it; a load lands before the step that
reads it) and costs the copy time inside the step; an asynchronous copy stream is a later step.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from vllm.logger import init_logger
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from vllm_gaudi_platform.seam import backend

logger = init_logger(__name__)


class HpuOffloadingWorker(OffloadingWorker):
    """Moves whole block pages between the HPU KV cache and host chunks, one job at a time."""

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        blocks_per_chunk: int,
        num_chunks: int,
        region: SharedOffloadRegion | None = None,
    ):
        self.blocks_per_chunk = blocks_per_chunk
        self.device = [t.tensor for t in kv_caches.tensors]
        self.refs = kv_caches.group_data_refs
        # Host chunks: per canonical tensor, [chunks, blocks_per_chunk, padded page] bytes. With
        # a shared region (the tiered spec) each is a strided view of the worker's cell of every
        # chunk row, which the scheduler's secondary tiers read and write as whole rows.
        self.region = region
        self.host = [
            self._host_tensor(num_chunks, blocks_per_chunk, t.page_size_bytes)
            for t in kv_caches.tensors
        ]
        self._finished: list[TransferResult] = []
        logger.debug(
            "HPU KV offload worker: %d host chunks of %d blocks, %.1f MiB host memory%s",
            num_chunks,
            blocks_per_chunk,
            sum(h.numel() for h in self.host) / 2**20,
            " (shared region)" if region is not None else "",
        )

    def _host_tensor(self, chunks: int, blocks: int, page: int) -> torch.Tensor:
        if self.region is None:
            return torch.zeros(chunks, blocks, page, dtype=torch.int8)
        return self.region.create_next_worker_view(blocks * page).view(chunks, blocks, page)

    def _pairs(self, device_spec: GPULoadStoreSpec, chunks: np.ndarray):
        """Per KV-cache group: its device block ids, and the (chunk, slot) of each in host
        memory. A group's first block sits at slot `block_indices[g] % blocks_per_chunk` of its
        first chunk; its blocks fill the chunks in order from there."""
        bpc = self.blocks_per_chunk
        ids = device_spec.block_ids
        offset = chunk_offset = 0
        for group, (size, first) in enumerate(
            zip(device_spec.group_sizes, device_spec.block_indices, strict=True)
        ):
            if size == 0:
                continue
            logical = first % bpc + np.arange(size)
            used = -(-(first % bpc + size) // bpc)
            host_chunks = chunks[chunk_offset + logical // bpc]
            yield group, ids[offset : offset + size], host_chunks, logical % bpc
            offset += size
            chunk_offset += used
        assert offset == len(ids) and chunk_offset == len(chunks), "job spans do not add up"

    def _copy(self, job_id: int, device_spec: GPULoadStoreSpec, host_spec: Any, store: bool):
        start = time.perf_counter()
        chunks = np.asarray(host_spec.block_ids, dtype=np.int64)
        moved = 0
        kernels = backend()
        for group, blocks, host_chunks, slots in self._pairs(device_spec, chunks):
            # One copy per slot within a chunk: host[:, slot] is a [chunks, page] tensor with
            # one stride between chunks, whether the chunks are ours or rows of a shared region.
            for slot in np.unique(slots):
                mine = slots == slot
                rows = torch.from_numpy(host_chunks[mine])
                index = torch.from_numpy(blocks[mine].astype(np.int64))
                for ref in self.refs[group]:
                    size = ref.page_size_bytes
                    device = self.device[ref.tensor_idx][:, :size]
                    host = self.host[ref.tensor_idx][:, slot, :size]
                    if store:
                        kernels.copy_blocks(device, host, index, rows)
                    else:
                        kernels.copy_blocks(host, device, rows, index)
                    moved += len(index) * size
        self._finished.append(TransferResult(job_id, True, moved, time.perf_counter() - start))
        return True

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        return self._copy(job_id, src_spec, dst_spec, store=True)

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        # `expedited` (vLLM 0.33: a load waited on within the step must not queue behind others):
        # every load here is done when this call returns, so none ever queues.
        return self._copy(job_id, dst_spec, src_spec, store=False)

    def get_finished(self) -> list[TransferResult]:
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        # Every job completed inside its submit call: nothing touches device memory later.
        return

    def shutdown(self) -> None:
        self.host = []
        if self.region is not None:
            self.region.cleanup()
            self.region = None


class _HpuWorkerMixin:
    """The worker half shared by both HPU specs: vLLM's `get_worker` refuses every platform but
    CUDA and XPU; this one builds the HPU worker once per process."""

    _hpu_worker: HpuOffloadingWorker | None = None

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._hpu_worker is None:
            self._hpu_worker = self.create_worker(kv_caches)  # type: ignore[attr-defined]
        return self._hpu_worker


class HpuCPUOffloadingSpec(_HpuWorkerMixin, CPUOffloadingSpec):
    """vLLM's CPU offloading (host-chunk manager, eviction policy, metrics) with the HPU worker."""

    def create_worker(self, kv_caches: CanonicalKVCaches) -> Any:
        return HpuOffloadingWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)


class HpuTieringOffloadingSpec(_HpuWorkerMixin, TieringOffloadingSpec):
    """vLLM's tiered offloading with the HPU worker: host memory as the primary tier and the
    secondary tiers of `secondary_tiers` (for example `{"type": "fs", "root_dir": ...}`, block
    files on disk) behind it. The secondary tiers run in the scheduler and move whole chunk rows
    between the shared host region and their medium, so the worker's host chunks must live in
    that region: each rank maps it and copies into its own cell of every row."""

    def create_worker(self, kv_caches: CanonicalKVCaches) -> Any:
        if self.config.canonical_layout:
            raise ValueError(
                "HpuTieringOffloadingSpec stores the HPU's own block layout; remove "
                "canonical_layout from kv_connector_extra_config"
            )
        region = SharedOffloadRegion(
            engine_id=self._engine_id,
            num_chunks=self.num_chunks,
            rank=0 if self.replicated_layout else self.config.parallel.rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        try:
            return HpuOffloadingWorker(kv_caches, self.blocks_per_chunk, self.num_chunks, region)
        except Exception:
            region.cleanup()
            raise
