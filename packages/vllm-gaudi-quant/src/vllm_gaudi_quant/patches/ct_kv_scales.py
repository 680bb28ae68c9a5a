"""compressed-tensors' KV-cache scales, moved into the device's FP8 range after loading."""

from __future__ import annotations

from vllm_gaudi_platform.patches import Patch, Upstream

UPSTREAM: tuple[Upstream, ...] = (
    Upstream(
        "vllm.model_executor.layers.quantization.kv_cache:BaseKVCacheMethod."
        "process_weights_after_loading",
        "compressed_tensors._kv_scales_in_device_range wraps it",
        params=("layer",),
        mentions=("_k_scale", "_v_scale", "_k_scale_float", "_v_scale_float"),
    ),
)

PATCH = Patch(
    what=(
        "the KV method's `process_weights_after_loading` wrapped on the method object; after "
        "vLLM's sets `_k_scale` / `_v_scale` from the checkpoint, they are scaled into the "
        "device's E4M3 range and `_k_scale_float` / `_v_scale_float` re-set."
    ),
    why="checkpoint scales are written for E4M3's 448; Gaudi 2 saturates at 240.",
    can_go="when vLLM's KV-cache method takes the device's FP8 range from the platform.",
    sites=("vllm_gaudi_quant.methods.compressed_tensors:_kv_scales_in_device_range",),
    scope="object",
    upstream=UPSTREAM,
)
