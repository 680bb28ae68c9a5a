"""Checkpoint-format parameters removed from vLLM's layers once repacked for the HPU."""

from __future__ import annotations

from vllm_gaudi_platform.patches import Patch

PATCH = Patch(
    what=(
        "the checkpoint-format parameters (packed 4-bit, MXFP4 blocks) deleted from the layer "
        "after repacking into the HPU's layout and registered anew."
    ),
    why="keeping both layouts would hold the weights twice in device memory.",
    can_go=(
        "never: the layer is the quantization method's to shape (vLLM's own methods do the same)."
    ),
    sites=(
        "vllm_gaudi_quant.methods.uint4:replace_parameter",
        "vllm_gaudi_quant.methods.uint4:Uint4MoEMethod.process_weights_after_loading",
        "vllm_gaudi_quant.methods.ct_schemes:HpuWNA16Uint4.process_weights_after_loading",
        "vllm_gaudi_quant.methods.ct_mxfp4:HpuMxfp4Linear.process_weights_after_loading",
    ),
    scope="object",
)
