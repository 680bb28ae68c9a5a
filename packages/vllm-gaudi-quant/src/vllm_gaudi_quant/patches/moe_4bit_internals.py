"""vLLM's MoE weight loading and compressed-tensors scheme selection the 4-bit methods rely on."""

from __future__ import annotations

from vllm_gaudi_platform.patches import Patch, Upstream

UPSTREAM: tuple[Upstream, ...] = (
    Upstream(
        "vllm.model_executor.layers.fused_moe.routed_experts:RoutedExperts.weight_loader",
        "vllm_gaudi_quant 4-bit MoE: expert params flagged is_transposed/quant_method; the GPTQ "
        "g_idx loader takes the same arguments by name",
        params=("param", "loaded_weight", "weight_name", "shard_id", "expert_id", "return_success"),
        mentions=("is_transposed", "quant_method"),
    ),
    Upstream(
        "vllm.model_executor.layers.fused_moe.routed_experts:"
        "RoutedExperts._map_global_expert_id_to_local_expert_id",
        "vllm_gaudi_quant GPTQ MoE g_idx loader",
        params=("expert_id",),
    ),
    Upstream(
        "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors:"
        "CompressedTensorsConfig._add_fused_moe_to_target_scheme_map",
        "vllm_gaudi_quant compressed-tensors MoE: the Linear target also matches the experts",
    ),
    Upstream(
        "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors:"
        "CompressedTensorsConfig._get_scheme_from_parts",
        "HpuCompressedTensorsConfig._get_scheme_from_parts picks the HPU schemes (and refuses the "
        "others by name) with vLLM's arguments",
        params=("weight_quant", "input_quant", "output_quant", "format", "layer_name"),
    ),
    Upstream(
        "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors:"
        "CompressedTensorsConfig._check_scheme_supported",
        "HpuCompressedTensorsConfig._check_scheme_supported (no CUDA capability check on HPU)",
    ),
)

PATCH = Patch(
    what="",
    why=(
        "the 4-bit MoE methods load experts through vLLM's loader and pick HPU schemes in place "
        "of vLLM's."
    ),
    can_go="when compressed-tensors scheme selection is a platform hook.",
    upstream=UPSTREAM,
)
