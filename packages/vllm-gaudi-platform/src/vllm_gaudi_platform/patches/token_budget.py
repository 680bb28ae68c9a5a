"""The scheduler's token budget, raised while the base runner sizes its buffers."""

from __future__ import annotations

from vllm_gaudi_platform.patches import Patch, Upstream

RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"

UPSTREAM: tuple[Upstream, ...] = (
    Upstream(
        f"{RUNNER}.__init__",
        "HPUModelRunner.__init__ raises scheduler_config.max_num_batched_tokens while the base "
        "runner sizes its token buffers from it",
        mentions=("max_num_batched_tokens",),
    ),
)

PATCH = Patch(
    what=(
        "`scheduler_config.max_num_batched_tokens` raised by `max_num_seqs` for the duration of "
        "`GPUModelRunner.__init__`, then restored."
    ),
    why=(
        "a step holds a prefill part padded to the token budget plus a decode part padded to "
        "the batch bucket, and the base runner sizes its token buffers from that field."
    ),
    can_go="when vLLM sizes the runner's buffers from a platform hook.",
    sites=("vllm_gaudi_platform.worker.model_runner:HPUModelRunner.__init__",),
    scope="call",
    upstream=UPSTREAM,
)
