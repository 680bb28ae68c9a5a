"""INC's measured FP8 KV-cache scales, written into vLLM's attention layers."""

from __future__ import annotations

from vllm_gaudi_platform.patches import Patch, Upstream

UPSTREAM: tuple[Upstream, ...] = (
    Upstream(
        "vllm.model_executor.layers.attention.attention:set_default_quant_scales",
        "INC's FP8 KV cache (vllm_gaudi_quant/methods/inc.py) writes the measured scales into "
        "_k_scale/_v_scale and _k_scale_float/_v_scale_float",
        mentions=("_k_scale", "_v_scale", "_k_scale_float", "_v_scale_float"),
    ),
)

PATCH = Patch(
    what=(
        "`Attention._k_scale` / `_v_scale` (buffers) and `_k_scale_float` / `_v_scale_float` "
        "written with the scales INC measured."
    ),
    why=(
        "vLLM keeps these on every attention layer (`set_default_quant_scales`) and the HPU "
        "backend reads them."
    ),
    can_go="when vLLM's attention layer takes KV scales through a quantization-method hook.",
    sites=("vllm_gaudi_quant.methods.inc:HpuIncConfig._load_kv_scales",),
    scope="object",
    upstream=UPSTREAM,
)
