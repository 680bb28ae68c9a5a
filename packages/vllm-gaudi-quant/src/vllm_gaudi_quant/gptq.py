"""Entry point `hpu_quant_gptq`: GPTQ 4-bit checkpoints on HPU as quantization method `gptq_hpu`.

Checkpoints marked `"quant_method": "gptq"` are claimed on the HPU platform (see
`methods/gptq.py`). Does nothing off HPU.
"""

from __future__ import annotations

from vllm_gaudi_platform.plugins import general_plugin


@general_plugin("hpu_quant_gptq")
def register() -> None:
    """Register `gptq_hpu` with vLLM's quantization registry."""
    from vllm.model_executor.layers.quantization import register_quantization_config

    from vllm_gaudi_quant.methods.gptq import NAME, HpuGptqConfig

    register_quantization_config(NAME)(HpuGptqConfig)
