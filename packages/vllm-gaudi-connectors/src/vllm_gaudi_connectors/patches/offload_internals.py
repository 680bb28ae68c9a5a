"""vLLM's KV offloading internals the HPU offloading specs rely on."""

from __future__ import annotations

from vllm_gaudi_platform.patches import Patch, Upstream

UPSTREAM: tuple[Upstream, ...] = (
    Upstream(
        "vllm.v1.kv_offload.tiering.spec:TieringOffloadingSpec.create_worker",
        "HpuTieringOffloadingSpec.create_worker maps the same shared region with these attributes",
        mentions=(
            "_engine_id",
            "replicated_layout",
            "cpu_page_size_per_worker",
            "kv_bytes_per_chunk",
            "num_chunks",
            "canonical_layout",
        ),
    ),
    Upstream(
        "vllm.v1.kv_offload.cpu.shared_offload_region:SharedOffloadRegion.__init__",
        "HpuTieringOffloadingSpec.create_worker opens the worker's view of the region",
        params=("engine_id", "num_chunks", "rank", "kv_bytes_per_chunk", "cpu_page_size"),
    ),
    Upstream(
        "vllm.v1.kv_offload.cpu.shared_offload_region:SharedOffloadRegion.create_next_worker_view",
        "HpuOffloadingWorker takes its host chunks from the region's rows, one view per tensor",
        params=("tensor_page_size",),
    ),
)

PATCH = Patch(
    what="",
    why=(
        "the HPU offloading specs map vLLM's shared offload region with the same attributes as "
        "vLLM's own specs."
    ),
    can_go="when vLLM's offloading spec factory takes the worker as a platform hook.",
    upstream=UPSTREAM,
)
