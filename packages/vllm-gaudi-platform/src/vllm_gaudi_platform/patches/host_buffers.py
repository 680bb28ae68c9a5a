"""The runner's host/device buffer pairs, aliased in emulation."""

from __future__ import annotations

from vllm_gaudi_platform.patches import Patch, Upstream

UPSTREAM: tuple[Upstream, ...] = (
    Upstream("vllm.v1.utils:CpuGpuBuffer", "HPUModelRunner._share_host_buffers (.cpu/.gpu)"),
    Upstream(
        "vllm.v1.worker.block_table:MultiGroupBlockTable",
        "HPUModelRunner._share_host_buffers walks input_batch.block_table.block_tables",
        mentions=("block_tables",),
    ),
)

PATCH = Patch(
    what=(
        "the device half of every `CpuGpuBuffer` and of every input-batch `X` / `X_cpu_tensor` "
        "pair pointed at the host half (CPU emulation only)."
    ),
    why=("in emulation both halves are CPU memory: a copy between them per step is pure overhead."),
    can_go="when vLLM skips the copies where device and host are one memory.",
    sites=("vllm_gaudi_platform.worker.model_runner:HPUModelRunner._share_host_buffers",),
    scope="object",
    upstream=UPSTREAM,
)
