"""Entry point `hpu_quant_compressed_tensors`: compressed-tensors checkpoints on HPU.

Replaces vLLM's `compressed-tensors` config on the HPU platform with one whose schemes run on
Gaudi (W8A8-FP8, 4-bit WNA16 and MXFP4 linears; see `methods/compressed_tensors.py`). Does
nothing off HPU.
"""

from __future__ import annotations

from vllm_gaudi_platform.plugins import general_plugin


@general_plugin("hpu_quant_compressed_tensors")
def register() -> None:
    """Register the HPU `compressed-tensors` config with vLLM's quantization registry."""
    from vllm.model_executor.layers.quantization import register_quantization_config

    from vllm_gaudi_quant.methods.compressed_tensors import NAME, HpuCompressedTensorsConfig

    register_quantization_config(NAME)(HpuCompressedTensorsConfig)
