"""Entry point `hpu_quant_mxfp4`: gpt-oss's MXFP4 checkpoints on HPU through Gaudi's MXFP4
mixture-of-experts kernel.

Registers `HpuGptOssMxfp4Config` under vLLM's own name `gpt_oss_mxfp4`, the name vLLM gives a
gpt-oss checkpoint marked `"quant_method": "mxfp4"` (vLLM's class picks CUDA/ROCm/CPU kernels and
refuses the HPU). Other models' `mxfp4` checkpoints stay vLLM's `mxfp4`, which the HPU platform
refuses by name. Does nothing off HPU; registering again is a no-op.
"""

from __future__ import annotations

from vllm_gaudi_platform.plugins import general_plugin


@general_plugin("hpu_quant_mxfp4")
def register() -> None:
    """Register `gpt_oss_mxfp4` (gpt-oss MXFP4 experts) with vLLM's registry."""
    from vllm.model_executor.layers.quantization import register_quantization_config

    from vllm_gaudi_quant.methods.mxfp4 import NAME, HpuGptOssMxfp4Config

    register_quantization_config(NAME)(HpuGptOssMxfp4Config)
