"""Entry point `hpu_quant_fp8`: vLLM's `fp8` checkpoints on HPU through Gaudi's FP8 kernels.

Registers `HpuFp8Config` under vLLM's own name `fp8` when the active platform is HPU, so both a
checkpoint marked `"quant_method": "fp8"` and `--quantization fp8` resolve to it (vLLM's `Fp8Config`
selects CUDA/ROCm kernels). Does nothing off HPU. Registering again in the same process is a
no-op (see `vllm_gaudi_platform.plugins.general_plugin`), and overriding the name is itself
idempotent, so the order against other plugins does not matter.
"""

from __future__ import annotations

from vllm_gaudi_platform.plugins import general_plugin


@general_plugin("hpu_quant_fp8")
def register() -> None:
    """Register `fp8` (FP8 checkpoints: per-tensor, per-channel, block) with vLLM's registry."""
    from vllm.model_executor.layers.quantization import register_quantization_config

    from vllm_gaudi_quant.methods.fp8 import NAME, HpuFp8Config

    register_quantization_config(NAME)(HpuFp8Config)
