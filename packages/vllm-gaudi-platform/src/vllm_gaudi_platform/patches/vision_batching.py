"""vLLM's multimodal encoder batching, replaced while the runner encodes, and the model's encoder
entry wrapped."""

from __future__ import annotations

from vllm_gaudi_platform.patches import Patch, Upstream

RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"

UPSTREAM: tuple[Upstream, ...] = (
    Upstream(
        f"{RUNNER}._execute_mm_encoder",
        "worker/vision.py encodes one item per pass: the batching it looks up in its module",
        mentions=("group_and_batch_mm_kwargs", "embed_multimodal"),
    ),
    Upstream(
        "vllm.v1.worker.gpu_model_runner:group_and_batch_mm_kwargs",
        "worker/vision.py replaces it for one encoder pass per item",
        params=("mm_kwargs",),
        keywords=("device", "pin_memory"),
    ),
)

PATCH = Patch(
    what=(
        "`vllm.v1.worker.gpu_model_runner.group_and_batch_mm_kwargs` (a module global) replaced "
        "for the duration of one encoder call so that every item is a pass of its own; "
        "`model.embed_multimodal` wrapped on the loaded model so the recompile tracker sees "
        "each encoder shape."
    ),
    why=(
        "an encoder pass over several images has a shape per combination of image sizes, which "
        "Gaudi would compile at serving time; one item per pass has one shape per image size, "
        "all warmed."
    ),
    can_go="when vLLM's runner asks the platform how to batch encoder inputs.",
    sites=(
        "vllm_gaudi_platform.worker.vision:one_item_per_pass",
        "vllm_gaudi_platform.worker.vision:track_encoder",
    ),
    scope="call",
    upstream=UPSTREAM,
)
