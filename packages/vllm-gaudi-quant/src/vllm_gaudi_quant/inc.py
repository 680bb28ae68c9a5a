"""Entry point `hpu_quant_inc`: INC FP8 (neural-compressor) as vLLM's `inc` quantization method.

Registers `HpuIncConfig` under the name `inc` when the active platform is HPU. vLLM's own `inc`
means Intel AutoRound checkpoints; on HPU, `--quantization inc` means Gaudi's runtime FP8 flow
driven by `QUANT_CONFIG` (see `methods/inc.py`), so ours overrides it there. Does nothing off HPU,
and registers nothing (one WARNING naming the install command) without neural-compressor.
"""

from __future__ import annotations

from vllm_gaudi_platform.plugins import general_plugin, require


@general_plugin("hpu_quant_inc")
def register() -> None:
    """Register `inc` (INC FP8 with neural-compressor) with vLLM's quantization registry."""
    require("neural-compressor-pt", "neural_compressor", "vllm-gaudi-quant[inc]")
    from vllm.model_executor.layers.quantization import register_quantization_config

    from vllm_gaudi_quant.methods.inc import HpuIncConfig

    register_quantization_config("inc")(HpuIncConfig)
