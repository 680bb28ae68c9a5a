"""Entry point `hpu_quant_awq`: AWQ 4-bit checkpoints on HPU as quantization method `awq_hpu`.

Checkpoints marked `"quant_method": "awq"` are claimed on the HPU platform (see `methods/awq.py`).
Does nothing off HPU.
"""

from __future__ import annotations

from vllm_gaudi_platform.plugins import general_plugin


@general_plugin("hpu_quant_awq")
def register() -> None:
    """Register `awq_hpu` with vLLM's quantization registry."""
    from vllm.model_executor.layers.quantization import register_quantization_config

    from vllm_gaudi_quant.methods.awq import NAME, HpuAwqConfig

    register_quantization_config(NAME)(HpuAwqConfig)
