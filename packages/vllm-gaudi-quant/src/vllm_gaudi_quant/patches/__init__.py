"""The quant wheel's ledger: its writes into vLLM's and neural-compressor's objects and the
private names it relies on (one module per entry, `PATCH`), and what the override check must know
of its vLLM subclasses (`SUBCLASSES`). The shape and the rules are the platform's: see
`vllm_gaudi_platform.patches`."""

from __future__ import annotations

from vllm_gaudi_platform.patches import Subclass

M = "vllm_gaudi_quant.methods"
# The hooks the platform calls on a quantization config (vllm_gaudi_platform.quant_hooks).
QUANT_HOOKS = frozenset(
    {"hpu_check_vllm_config", "hpu_after_load_model", "hpu_finalize_calibration"}
)

SUBCLASSES: tuple[Subclass, ...] = (
    Subclass(f"{M}.awq:HpuAwqConfig", frozenset({"_skipped"})),
    Subclass(f"{M}.awq:HpuAwqMoEMethod", frozenset({"repack"})),
    Subclass(
        f"{M}.compressed_tensors:HpuCompressedTensorsConfig",
        frozenset({"_moe_method"}) | QUANT_HOOKS,
    ),
    Subclass(f"{M}.ct_schemes:HpuWNA16MoE", frozenset({"repack"})),
    # In-place weight updates (vllm_gaudi_platform.quant_hooks.RequantizesWeightUpdates).
    Subclass(
        f"{M}.fp8:HpuFp8LinearMethod",
        frozenset({"hpu_stage_weight_update", "hpu_commit_weight_update"}),
    ),
    Subclass(f"{M}.fp8_moe:HpuFp8MoEMethod", frozenset({"_dequantized", "_resolve_gather"})),
    Subclass(f"{M}.gptq:HpuGptqConfig", frozenset({"real_zeros"})),
    Subclass(f"{M}.gptq:HpuGptqMoEMethod", frozenset({"repack"})),
    Subclass(f"{M}.inc:HpuIncConfig", frozenset({"_load_kv_scales"}) | QUANT_HOOKS),
    Subclass(
        f"{M}.uint4:Uint4MoEMethod",
        frozenset({"add_parameter", "repack", "_resolve_gather", "dequantized_experts"}),
    ),
)
