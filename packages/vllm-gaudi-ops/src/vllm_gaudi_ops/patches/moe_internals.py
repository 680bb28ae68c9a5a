"""vLLM's fused-MoE layer internals the MoE family relies on (expert parallelism, biased and
swigluoai experts)."""

from __future__ import annotations

from vllm_gaudi_platform.patches import Patch, Upstream

UPSTREAM: tuple[Upstream, ...] = (
    Upstream(
        "vllm.model_executor.layers.fused_moe.routed_experts:RoutedExperts.expert_map.fget",
        "HpuUnquantizedFusedMoEMethod maps global expert ids to this rank's through "
        "layer.expert_map (-1: another rank's expert); parallel_job reports it",
        mentions=("_expert_map",),
    ),
    Upstream(
        "vllm.model_executor.layers.fused_moe.routed_experts:RoutedExperts.update_expert_map_info",
        "parallel_job reports each EP rank's local_num_experts and expert map",
        mentions=("local_num_experts", "_expert_map"),
    ),
    Upstream(
        "vllm.model_executor.layers.fused_moe.routed_experts:RoutedExperts.__init__",
        "parallel_job reads global_num_experts, local_num_experts and moe_config of a MoE layer",
        mentions=("global_num_experts", "local_num_experts", "moe_config"),
    ),
    Upstream(
        "vllm.model_executor.layers.fused_moe.config:FusedMoEParallelConfig",
        "parallel_job reports each MoE layer's use_ep, ep_rank and ep_size",
        mentions=("use_ep", "ep_rank", "ep_size"),
    ),
    Upstream(
        "vllm.model_executor.layers.fused_moe.config:FusedMoEConfig",
        "HpuUnquantizedFusedMoEMethod picks the kernel or the plain-ops path from the layer's "
        "activation and has_bias, and refuses has_hash_routing",
        mentions=("activation", "has_bias", "has_hash_routing"),
    ),
    Upstream(
        "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method:"
        "UnquantizedFusedMoEMethod.create_weights",
        "plain_experts reads the layer's w13_weight/w2_weight [experts, out, in] and its "
        "w13_bias/w2_bias",
        mentions=("w13_weight", "w2_weight", "w13_bias", "w2_bias"),
    ),
    Upstream(
        "vllm.model_executor.layers.fused_moe.activation:MoEActivation",
        "plain_experts: SWIGLUOAI takes gate/up interleaved in w13 (swigluoai_uninterleave is "
        "the packed variant, refused)",
        mentions=("SWIGLUOAI", "interleaved", "SWIGLUOAI_UNINTERLEAVE"),
    ),
    Upstream(
        "vllm.model_executor.layers.activation:SwigluOAIAndMul.__init__",
        "plain_experts' swigluoai constants (alpha 1.702, limit 7.0) are vLLM's defaults",
        mentions=("1.702", "7.0"),
    ),
    Upstream(
        "vllm.model_executor.models.gpt_oss:MLPBlock.__init__",
        "gpt-oss builds biased swigluoai experts: they run through plain_experts",
        mentions=("has_bias", "swigluoai", "GptOssRoutedExperts"),
    ),
    Upstream(
        "vllm.model_executor.models.gpt_oss:GptOssModel._load_weights_other",
        "a bf16/float32 gpt-oss checkpoint (gate_up_proj [experts, hidden, 2 * inter]) is loaded "
        "transposed into w13, keeping gate/up interleaved, as plain_experts expects",
        mentions=("w13_weight", "w13_bias", "permute"),
    ),
    Upstream(
        "vllm._custom_ops:cpu_fused_moe",
        "tests/ops/test_moe.py checks plain_experts against vLLM's CPU kernel (biases, swigluoai)",
        params=("out", "input", "w13", "w2", "w13_bias", "w2_bias", "topk_weights", "topk_ids"),
    ),
)

PATCH = Patch(
    what="",
    why=(
        "the HPU MoE method runs vLLM's routed-experts layer with Gaudi's mixture_of_experts "
        "kernel and reads its expert map and activation settings."
    ),
    can_go="when vLLM's MoE layer exposes these through its modular kernel interface.",
    upstream=UPSTREAM,
)
