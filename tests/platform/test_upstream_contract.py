"""Upstream-drift guard: every private vLLM name we override, call or patch still exists, with the
parameters we rely on, in the installed vLLM (and torch).

Why: an override of a renamed private method is never called, and vLLM raises nothing about it; a
vLLM upgrade would silently lose the HPU behaviour. This test turns that into a failure that names
the method. `UPSTREAM` below is the list, kept as data; `problems_with(expectation)` checks one.

How to add yours (quant, connectors, ops): append an `Upstream(...)` to `UPSTREAM` for each vLLM
name your code overrides, calls or monkeypatches and that is private (a leading underscore) or
otherwise outside vLLM's documented plugin API: `target` is "module:Qualified.name", `used_by`
names our code, `params` the leading parameters (after self/cls) in the order we pass them,
`keywords` any further ones we pass by name, `mentions` the identifiers its source must still
contain (for attributes it sets, such as a layer's `_k_scale`). A subclass of a vLLM class goes
into `OVERRIDING_CLASSES` with the methods it adds (every other method must override one).

Ledger of the process-wide patches we apply (the patch sites point here)
-----------------------------------------------------------------------
1. `torch.accelerator.{empty_cache, empty_host_cache, synchronize}` (platform.py,
   `_route_torch_accelerator_to_seam`, when vLLM instantiates the platform, CPU emulation only).
   Why: vLLM's shared worker and runner code call torch.accelerator directly in every process;
   with no torch accelerator (emulation on the CPU) those calls fail, so they are routed to the
   seam. On a Gaudi, torch's own HPU
   accelerator answers them and nothing is patched. Can go when vLLM asks the platform
   (`current_platform.synchronize()` / `empty_cache()`) instead of torch.accelerator, or when
   torch.accelerator accepts the CPU as an accelerator.
2. `torch.Event`, `torch.cuda.{Event, Stream, current_stream, stream}` (cuda_streams.py,
   `cuda_streams_on_seam`), routed to the seam's streams and events only while
   `GPUModelRunner.__init__`, `execute_model` and `sample_tokens` run. Why: the constructor creates
   CUDA events and streams, and under async scheduling every step records an event after its
   input preparation and copies the sampled tokens to the host on a side stream
   (`AsyncGPUModelRunnerOutput`); all of these fail without CUDA. Can go when vLLM creates them
   through the platform (a device-neutral `torch.Stream(device=...)` or a platform hook).
3. Triton stand-ins (cuda_stand_ins/triton_kernels.py, registered by
   `HpuPlatform.register_triton_kernel_overrides` through
   `vllm.triton_utils.dispatcher.register_kernels`): a plain-torch
   `ComputeSlotMappingKernel.kernel` (the slot mapping of every step). Why: Gaudi has no Triton,
   and the runner's input preparation launches this kernel on every platform. Not a monkeypatch:
   vLLM's own override registry; the kernel name string is the contract. Can go when vLLM computes
   the slot mapping without Triton on non-CUDA platforms, or when a Gaudi Triton backend exists.
   Also the four rejection-sampler kernels of speculative decoding (`rejection_greedy_sample_
   kernel`, `rejection_random_sample_kernel`, `expand_kernel`, `sample_recovered_tokens_kernel`),
   whose stand-ins take the kernels' parameter names so vLLM's launcher passes them by name. Can
   go with the slot mapping's, or when vLLM's rejection sampler has a torch path. And the three
   input kernels of vLLM's EAGLE proposer (vllm/v1/spec_decode/utils.py), likewise by name; can go
   when the proposer prepares its inputs without Triton on non-CUDA platforms.

4. neural-compressor's patched-module table (vllm_gaudi_quant/methods/inc.py,
   `register_vllm_linears`, emulation's INC path only): vLLM's five parallel linear classes are
   registered with `register_patched_module(cls, device_types="cpu")` as neural-compressor's own
   vLLM-aware wrappers typed as plain linear layers. Why: neural-compressor's CPU path only patches
   modules it knows by class name; on a Gaudi it registers these classes itself. Process-wide in
   neural-compressor, once per process. Can go when neural-compressor's CPU table lists vLLM's
   linear classes, or when CI runs INC's HPU flow over the Habana stand-in only. Checked below:
   the registration helper's parameters and the three wrapper classes.

Writes to objects of another project, not process-wide, on the same list:
- `HPUModelRunner._share_host_buffers` (emulation only) points the device half of every
  `CpuGpuBuffer` and every input-batch `X`/`X_cpu_tensor` pair at the host half. It relies on
  vLLM's naming conventions, checked by the `CONVENTIONS` below.
- `scheduler_config.max_num_batched_tokens` is raised by `max_num_seqs` for the duration of
  `GPUModelRunner.__init__` (worker/model_runner.py, `HPUModelRunner.__init__`), then restored:
  a step holds a prefill part padded to the token budget plus a decode part padded to the batch
  bucket, and the base runner sizes its token buffers from that field. Can go when vLLM sizes the
  buffers from a platform hook. Checked: `GPUModelRunner.__init__` still reads the field.
- `Attention._k_scale_float` / `_v_scale_float` (and the `_k_scale` / `_v_scale` buffers) are
  written by INC's FP8 KV cache (vllm_gaudi_quant/methods/inc.py) with the measured scales. vLLM
  keeps these on every attention layer (`set_default_quant_scales`); the HPU backend reads them.
  Checked: `set_default_quant_scales` still sets all four.
- `UnquantizedLinearMethod._gemm_impl` is replaced per layer method after loading
  (worker/model_loading.py, `route_linears_through_seam`), and an EAGLE drafter's
  `build_per_group_and_layer_attn_metadata` / `_determine_batch_execution_and_padding` are
  replaced on the drafter instance (worker/spec_decode.py, `DraftBucketing`). Both checked in
  `UPSTREAM` (their names, parameters and the attributes they rely on).
- nixl's agent constructor (`nixlBind.nixlAgent` in the module of vLLM's `NixlWrapper`) is
  wrapped while `HpuNixlConnectorWorker` runs vLLM's worker constructor, only when
  VLLM_HPU_NIXL_PROGRESS_WAIT_MS > 0 (vllm_gaudi_connectors/nixl.py, `progress_wait`): the
  wrapper sets the configuration's `pthrDelay`, which nixl's `nixl_agent.__init__` sets to 0
  (its UCX progress thread then polls without pause, a host core per worker). Can go when nixl's
  `nixl_agent_config` takes the delay. Checked: both constructors in `UPSTREAM`.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest


@dataclass(frozen=True)
class Upstream:
    """One vLLM (or torch) name our code relies on, and how."""

    target: str  # "module:Qualified.name"
    used_by: str  # our code that relies on it
    params: tuple[str, ...] = ()  # leading parameters after self/cls, in order
    keywords: tuple[str, ...] = ()  # further parameters we pass by name
    mentions: tuple[str, ...] = ()  # identifiers its source must contain (attributes it sets)
    # The vLLM releases this expectation holds for (a version specifier; "" = every supported
    # one): where 0.32 and 0.33 differ, one entry per side, named after the upstream change.
    releases: str = ""

    def __str__(self) -> str:
        return self.target + (f" [vllm{self.releases}]" if self.releases else "")

    def applies(self) -> bool:
        from vllm_gaudi_platform import compat

        found = compat.check_vllm().found
        return not self.releases or found is None or compat.in_releases(found, self.releases)


RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
ROTARY = "vllm.model_executor.layers.rotary_embedding"
MLA = "vllm.model_executor.layers.attention.mla_attention"
PROPOSER = "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer"

UPSTREAM: tuple[Upstream, ...] = (
    # --- the model runner (model_runner.py: HPUModelRunner) ---------------------------------------
    Upstream(
        f"{RUNNER}._determine_batch_execution_and_padding",
        "HPUModelRunner pads every step to a bucket here (vLLM passes these by name)",
        params=("num_tokens", "num_reqs", "num_scheduled_tokens_np", "max_num_scheduled_tokens"),
    ),
    Upstream(f"{RUNNER}._sync_device", "HPUModelRunner synchronizes through the seam"),
    Upstream(
        f"{RUNNER}.__init__",
        "warmup and idle DP steps give an mm prefix LM's metadata its image-span branch",
        mentions=("self.is_mm_prefix_lm",),
    ),
    Upstream(
        f"{RUNNER}._build_attention_metadata",
        "HPUAttentionMetadataBuilder reads each request's image spans (Gemma 3)",
        mentions=("mm_req_doc_ranges", "extract_embeds_range"),
        releases="<0.33",
    ),
    # vLLM 0.33 moved the span computation out of the runner into a helper of the attention
    # backends' utilities (same source: each feature's extract_embeds_range).
    Upstream(
        f"{RUNNER}._build_attention_metadata",
        "HPUAttentionMetadataBuilder reads each request's image spans (Gemma 3)",
        mentions=("mm_req_doc_ranges", "compute_mm_prefix_ranges"),
        releases=">=0.33",
    ),
    Upstream(
        "vllm.v1.attention.backends.utils:compute_mm_prefix_ranges",
        "HPUAttentionMetadataBuilder reads the image spans it computes (Gemma 3)",
        params=("mm_features_per_req",),
        mentions=("extract_embeds_range",),
        releases=">=0.33",
    ),
    Upstream(
        f"{RUNNER}._execute_mm_encoder",
        "worker/vision.py encodes one item per pass: the batching it looks up in its module",
        mentions=("group_and_batch_mm_kwargs", "embed_multimodal"),
    ),
    Upstream(
        "vllm.v1.worker.gpu_model_runner:group_and_batch_mm_kwargs",
        "worker/vision.py replaces it for one encoder pass per item",
        params=("mm_kwargs",),
        keywords=("device", "pin_memory"),
    ),
    Upstream(
        f"{RUNNER}._gather_mm_embeddings",
        "HPUModelRunner moves the placeholder mask it returns to the device",
        params=("scheduler_output", "shift_computed_tokens"),
        mentions=("is_mm_embed",),
    ),
    Upstream(
        f"{RUNNER}._prepare_mm_inputs",
        "worker/warmup.py step_inputs: a multimodal step's inputs, as serving hands them",
        params=("num_tokens",),
    ),
    Upstream(
        f"{RUNNER}._dummy_mm_kwargs",
        "worker/warmup.py step_inputs: the extra inputs of raw-input multimodal models",
        params=("num_seqs",),
    ),
    Upstream(
        "vllm.multimodal.processing.processor:BaseMultiModalProcessor.get_dummy_inputs",
        "worker/vision.py builds a dummy image of each size to warm",
        params=("seq_len", "mm_counts", "mm_options"),
    ),
    Upstream(
        f"{RUNNER}._model_forward",
        "HPUModelRunner replays the step's bucket graph here (vLLM passes these by name)",
        keywords=("input_ids", "positions", "intermediate_tensors", "inputs_embeds"),
    ),
    Upstream(
        f"{RUNNER}._to_list", "HPUModelRunner: a plain tolist()", params=("sampled_token_ids",)
    ),
    Upstream(
        f"{RUNNER}._zero_block_ids",
        "HPUModelRunner zeroes freed KV blocks in the HPU layout",
        params=("block_ids",),
    ),
    Upstream(
        f"{RUNNER}._dummy_run",
        "HPUWorker.execute_dummy_batch calls _dummy_run(1, uniform_decode=True)",
        params=("num_tokens",),
        keywords=("uniform_decode",),
    ),
    Upstream(
        f"{RUNNER}.sync_and_gather_intermediate_tensors",
        "HPUModelRunner warms a later pipeline stage with the runner's intermediate tensors",
        params=("num_tokens", "intermediate_tensors", "sync_self"),
    ),
    Upstream(
        f"{RUNNER}.execute_model",
        "HPUModelRunner returns the DP ranks' agreed token counts from "
        "_determine_batch_execution_and_padding; execute_model puts them in the forward context",
        mentions=("num_tokens_across_dp", "_determine_batch_execution_and_padding"),
    ),
    Upstream(
        "vllm.v1.engine.core:EngineCore.execute_dummy_batch",
        "an idle DP rank's step (DPEngineCoreProc's busy loop calls it): "
        "HPUWorker.execute_dummy_batch runs the agreed buckets",
        mentions=("execute_dummy_batch",),
    ),
    Upstream(
        "vllm.distributed.device_communicators.all2all:AgRsAll2AllManager.__init__",
        "HPUCommunicator exchanges MoE tokens between DP ranks through this manager",
        params=("cpu_group",),
    ),
    Upstream(
        "vllm.distributed.device_communicators.base_device_communicator:"
        "DeviceCommunicatorBase.__init__",
        "HPUCommunicator reads use_all2all and rank_in_group, sets all2all_manager",
        mentions=("use_all2all", "all2all_manager", "rank_in_group"),
    ),
    # --- expert parallelism (ops families/moe.py; tests/integration/parallel_job.py) --------------
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
    # --- biased and swigluoai experts (ops families/moe.py: plain_experts; tiny gpt-oss) ------
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
    Upstream(
        f"{RUNNER}._make_buffer",
        "HPUModelRunner._share_host_buffers finds the runner's CpuGpuBuffers made here",
        mentions=("CpuGpuBuffer",),
    ),
    Upstream(
        f"{RUNNER}.initialize_kv_cache",
        "HPUModelRunner rebuilds the bucket plan from the real KV cache",
        params=("kv_cache_config",),
    ),
    Upstream(
        f"{RUNNER}.__init__",
        "HPUModelRunner warmup runs no compute_logits when the runner is a pooling model",
        mentions=("is_pooling_model",),
    ),
    Upstream(
        f"{RUNNER}.may_add_encoder_only_layers_to_kv_cache_config",
        "HPUModelRunner.initialize_kv_cache reads the block size from self.kv_cache_config, "
        "where this adds the encoder-only layers' group (BERT-style models have no other)",
        mentions=("self.kv_cache_config", "EncoderOnlyAttentionSpec"),
    ),
    # --- the worker (worker/hpu_worker.py: HPUWorker) ---------------------------------------------
    Upstream(
        "vllm.v1.worker.gpu_worker:Worker._maybe_get_memory_pool_context",
        "HPUWorker: no CUDA sleep-mode memory pool on HPU",
        params=("tag",),
    ),
    Upstream(
        "vllm.model_executor.layers.linear:UnquantizedLinearMethod.apply",
        "model_loading.route_linears_through_seam replaces each method's _gemm_impl",
        params=("layer", "x", "bias"),
        mentions=("_gemm_impl",),
    ),
    Upstream(
        "vllm.model_executor.layers.utils:default_unquantized_gemm",
        "the _gemm_impl HPUModelRunner installs takes the same arguments",
        params=("layer", "x", "weight", "bias"),
    ),
    Upstream(
        "vllm.model_executor.layers.fused_moe.routed_experts_capturer:RoutedExpertsSink.__init__",
        "routed_experts.capture_routed_experts fills the layer's sink buffer, then calls it",
        params=("moe_config", "capture_fn"),
        mentions=("buffer", "capture_fn"),
    ),
    # --- attention (attention.py) -----------------------------------------------------------------
    Upstream(
        "vllm.model_executor.layers.attention.attention:set_default_quant_scales",
        "HPUAttentionImpl reads layer._k_scale/_v_scale for the FP8 KV cache",
        mentions=("_k_scale", "_v_scale"),
    ),
    Upstream(
        "vllm.v1.attention.backends.registry:register_backend",
        "platform.py registers the HPU backend as AttentionBackendEnum.CUSTOM",
        params=("backend", "class_path"),
    ),
    Upstream("vllm.v1.attention.backends.registry:AttentionBackendEnum.CUSTOM", "platform.py"),
    Upstream(
        "vllm.v1.attention.backend:AttentionBackend.supports_sink",
        "HPUAttentionBackend.supports_sink (vLLM refuses backends without it for sink models)",
    ),
    Upstream(
        "vllm.model_executor.layers.attention.attention:Attention.__init__",
        "HPUAttentionImpl takes the layer's sink logits as its `sinks` keyword (extra_impl_args)",
        mentions=("extra_impl_args", "sinks"),
    ),
    # --- MLA (mla.py) -----------------------------------------------------------------------------
    Upstream(
        f"{MLA}:MLAAttention.forward_impl",
        "HPUMLAImpl.forward_mha runs the whole step: with num_decode_tokens == 0 the layer passes "
        "every token (cut to num_actual_tokens) to forward_mha and never calls forward_mqa",
        mentions=("num_decode_tokens", "num_decodes", "num_prefills", "num_actual_tokens"),
    ),
    Upstream(
        f"{MLA}:MLAAttention.bind_kv_cache",
        "HPUMLAImpl reads the layer's cache as [num_blocks, block_size, latent] (no head axis)",
        mentions=("squeeze",),
    ),
    Upstream(
        f"{MLA}:MLAAttention.process_weights_after_loading",
        "HPUMLAImpl.process_weights_after_loading splits kv_b_proj into W_UK / W_UV",
        mentions=("self.impl.process_weights_after_loading",),
    ),
    Upstream(
        f"{MLA}:split_kv_b_proj",
        "HPUMLAImpl.process_weights_after_loading",
        params=(
            "kv_b_proj",
            "out_dtype",
            "kv_lora_rank",
            "num_heads",
            "qk_nope_head_dim",
            "v_head_dim",
        ),
    ),
    Upstream(
        "vllm.v1.attention.backend:MLAAttentionImpl.forward_mha",
        "HPUMLAImpl.forward_mha",
        params=("q", "kv_c_normed", "k_pe", "kv_c_and_k_pe_cache", "attn_metadata", "k_scale"),
        keywords=("output",),
    ),
    Upstream(
        "vllm.platforms.interface:Platform.get_mla_prefill_backend_cls",
        "HpuPlatform answers with HPUMLAPrefillBackend (MLA layers ask for one when built)",
        params=("mla_selector_config",),
    ),
    # --- host/device buffers (model_runner.py: _share_host_buffers) -------------------------------
    Upstream("vllm.v1.utils:CpuGpuBuffer", "HPUModelRunner._share_host_buffers (.cpu/.gpu)"),
    Upstream(
        "vllm.v1.worker.block_table:MultiGroupBlockTable",
        "HPUModelRunner._share_host_buffers walks input_batch.block_table.block_tables",
        mentions=("block_tables",),
    ),
    # --- Triton stand-ins (cuda_stand_ins/triton_kernels.py) --------------------------------------
    Upstream(
        "vllm.triton_utils.dispatcher:register_kernels",
        "triton_kernels.register",
        params=("overrides",),
    ),
    Upstream(
        "vllm.v1.worker.block_table:ComputeSlotMappingKernel.kernel",
        "triton_kernels.compute_slot_mapping stands in for it, positionally",
        params=(
            "num_tokens",
            "max_num_tokens",
            "query_start_loc_ptr",
            "positions_ptr",
            "block_table_ptr",
            "block_table_stride",
            "slot_mapping_ptr",
            "KV_CACHE_BLOCK_SIZE",
            "TOTAL_CP_WORLD_SIZE",
            "TOTAL_CP_RANK",
            "CP_KV_CACHE_INTERLEAVE_SIZE",
            "PAD_ID",
            "BLOCK_SIZE",
        ),
    ),
    *(
        Upstream(
            f"vllm.v1.sample.rejection_sampler:{kernel}",
            f"triton_kernels.{stand_in} stands in for it, by name",
            params=params,
        )
        for kernel, stand_in, params in (
            (
                "rejection_greedy_sample_kernel",
                "rejection_greedy_sample",
                (
                    "output_token_ids_ptr",
                    "cu_num_draft_tokens_ptr",
                    "draft_token_ids_ptr",
                    "target_argmax_ptr",
                    "bonus_token_ids_ptr",
                    "is_greedy_ptr",
                    "max_spec_len",
                    "uniform_probs_ptr",
                    "synthetic_conditional_rates_ptr",
                    "SYNTHETIC_MODE",
                ),
            ),
            (
                "rejection_random_sample_kernel",
                "rejection_random_sample",
                (
                    "output_token_ids_ptr",
                    "cu_num_draft_tokens_ptr",
                    "draft_token_ids_ptr",
                    "draft_probs_ptr",
                    "target_probs_ptr",
                    "bonus_token_ids_ptr",
                    "recovered_token_ids_ptr",
                    "uniform_probs_ptr",
                    "is_greedy_ptr",
                    "max_spec_len",
                    "vocab_size",
                    "synthetic_conditional_rates_ptr",
                    "NO_DRAFT_PROBS",
                    "SYNTHETIC_MODE",
                ),
            ),
            (
                "expand_kernel",
                "expand",
                (
                    "output_ptr",
                    "input_ptr",
                    "cu_num_tokens_ptr",
                    "replace_from",
                    "replace_to",
                    "MAX_NUM_TOKENS",
                ),
            ),
            (
                "sample_recovered_tokens_kernel",
                "sample_recovered_tokens",
                (
                    "output_token_ids_ptr",
                    "cu_num_draft_tokens_ptr",
                    "draft_token_ids_ptr",
                    "draft_probs_ptr",
                    "target_probs_ptr",
                    "inv_q_ptr",
                    "vocab_size",
                    "BLOCK_SIZE",
                    "NO_DRAFT_PROBS",
                    "USE_FP64_GUMBEL",
                ),
            ),
        )
    ),
    # Mamba prefix caching ("align"): vLLM's runner describes state copies by address and
    # launches this kernel (mamba_state_copies.py stands in for it; hybrid.py states the mode).
    Upstream(
        "vllm.v1.worker.mamba_utils:batch_memcpy_kernel",
        "mamba_state_copies.batch_memcpy stands in for it, by name",
        params=("src_ptrs", "dst_ptrs", "sizes", "BLOCK_SIZE"),
    ),
    Upstream(
        "vllm.v1.worker.mamba_utils:do_mamba_copy_block",
        "the align-mode copies reach mamba_state_copies.batch_memcpy through it",
        mentions=("batch_memcpy",),
    ),
    Upstream(
        "vllm.model_executor.layers.mamba.abstract:MambaBase.get_kv_cache_spec",
        "HpuMambaMixer2.get_kv_cache_spec (no prefill checkpoint blocks)",
        params=("vllm_config",),
    ),
    Upstream(
        "vllm.model_executor.layers.mamba.abstract:MambaBase.bind_kv_cache",
        "hybrid.state_tensors reads the bound states (MambaBase.kv_cache)",
        mentions=("self.kv_cache",),
    ),
    # EAGLE drafting (cuda_stand_ins/triton_kernels.py EAGLE_KERNELS; spec_decode.py
    # DraftBucketing).
    *(
        Upstream(
            f"vllm.v1.spec_decode.utils:{kernel}",
            f"triton_kernels.{kernel.removesuffix('_kernel')} stands in for it, by name",
        )
        for kernel in (
            "eagle_step_slot_mapping_metadata_kernel",
            "eagle_prepare_inputs_padded_kernel",
            "eagle_prepare_next_token_padded_kernel",
        )
    ),
    Upstream(
        f"{PROPOSER}.build_per_group_and_layer_attn_metadata",
        "spec_decode.DraftBucketing wraps it to plan the drafting pass's bucket",
        params=("common_attn_metadata", "draft_index"),
    ),
    Upstream(
        f"{PROPOSER}._determine_batch_execution_and_padding",
        "spec_decode.DraftBucketing wraps it to pad a drafting pass to its bucket",
        params=("num_tokens", "use_cudagraphs"),
    ),
    Upstream(
        f"{PROPOSER}.propose",
        "DraftBucketing: first pass (build, then padding), one-token passes (padding, builds)",
        mentions=(
            "build_per_group_and_layer_attn_metadata",
            "_determine_batch_execution_and_padding",
        ),
    ),
    Upstream(
        f"{PROPOSER}._update_positions_dependent_metadata",
        "DraftBucketing drops the host upper bound of the lengths it raises here",
        mentions=("seq_lens_cpu_upper_bound",),
    ),
    Upstream(
        f"{PROPOSER}._get_positions",
        "DraftBucketing.warm runs the head on the proposer's buffers",
        params=("num_tokens",),
    ),
    Upstream(
        f"{PROPOSER}.__init__",
        "DraftBucketing.warm reads the proposer's buffers",
        mentions=("self.input_ids", "self.hidden_states", "self.pass_hidden_states_to_model"),
    ),
    Upstream(
        f"{RUNNER}._setup_eagle3_aux_hidden_state_outputs",
        "HPUModelRunner.load_model calls it for EAGLE-3 heads, as vLLM's load_model does",
    ),
    Upstream(
        f"{RUNNER}.propose_draft_token_ids",
        "HPUModelRunner.propose_draft_token_ids brackets it for DraftBucketing",
    ),
    # MTP drafting (tests/integration/mtp_drafts.py builds a MiMo checkpoint with an MTP layer).
    Upstream(
        "vllm.config.speculative:SpeculativeConfig.hf_config_override",
        "mtp_drafts: a MiMoForCausalLM config with num_nextn_predict_layers drafts with MiMoMTP",
        mentions=("MiMoForCausalLM", "MiMoMTPModel", "num_nextn_predict_layers"),
    ),
    Upstream(
        "vllm.model_executor.models.mimo_mtp:MiMoMultiTokenPredictorLayer.__init__",
        "mtp_drafts names the MTP layer's weights after these modules",
        mentions=("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm"),
    ),
    Upstream(
        "vllm.model_executor.models.mimo_mtp:MiMoMTP.__init__",
        "mtp_drafts stores the MTP layer under model.mtp_layers.0 (vLLM remaps the index)",
        mentions=("mtp_layers", "mtp_block"),
    ),
    Upstream(
        "vllm.model_executor.models.mimo_mtp:MiMoMTP.forward",
        "DraftBucketing.warm runs an MTP layer like an EAGLE head, by these names",
        params=("input_ids", "positions", "hidden_states"),
    ),
    # --- torch names patched process-wide (see the ledger above) ----------------------------------
    Upstream("torch:accelerator.empty_cache", "platform.py routes it to the seam (emulation)"),
    Upstream("torch:accelerator.empty_host_cache", "platform.py routes it to the seam"),
    Upstream("torch:accelerator.synchronize", "platform.py routes it to the seam (emulation)"),
    Upstream("torch:Event", "cuda_streams.py routes it to the seam (cuda_streams_on_seam)"),
    Upstream("torch:cuda.Stream", "cuda_streams.py routes it to the seam"),
    Upstream("torch:cuda.Event", "cuda_streams.py routes it to the seam (drops `blocking`)"),
    Upstream("torch:cuda.current_stream", "cuda_streams.py routes it to the seam"),
    Upstream("torch:cuda.stream", "cuda_streams.py routes it to the seam"),
    Upstream(
        "vllm.v1.worker.gpu_model_runner:AsyncGPUModelRunnerOutput.__init__",
        "HPUModelRunner.sample_tokens: under async scheduling this copies the sampled tokens on a "
        "side stream, through the CUDA names routed to the seam",
        mentions=("Event", "current_stream", "stream", "wait_stream", "record"),
    ),
    Upstream(
        f"{RUNNER}.__init__",
        "HPUWorker.get_recompile_stats reports use_async_scheduling",
        mentions=("use_async_scheduling",),
    ),
    # --- ops wheel: private rotary helpers its forward_oot calls ----------------------------------
    Upstream(
        f"{ROTARY}.base:RotaryEmbedding._match_cos_sin_cache_dtype",
        "vllm_gaudi_ops rotary family",
        params=("query",),
    ),
    Upstream(
        f"{ROTARY}.mrope_interleaved:MRotaryEmbeddingInterleaved._rebuild_pos_emb",
        "vllm_gaudi_ops rotary family",
        params=("positions",),
    ),
    Upstream(
        f"{ROTARY}.fope:FourierRotaryEmbedding._compute_cos_sin_cache",
        "vllm_gaudi_ops rotary family",
    ),
    # --- quant wheel: 4-bit MoE (methods/uint4.py, gptq.py, compressed_tensors.py) ----------------
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
    Upstream(
        f"{NIXL}.metadata:NixlAgentMetadata",
        "HpuNixlConnectorWorker checks another platform's prefill instance with these fields",
        mentions=("block_lens", "block_size", "attn_backend_name"),
    ),
    Upstream(
        f"{NIXL}.base_worker:NixlBaseConnectorWorker.initialize_host_xfer_buffer",
        "an HPU prefill instance serving another platform: head-major host buffers (README)",
        mentions=("enable_permute_local_kv", "LBHNC", "host_buffer_kv_cache_layout"),
    ),
    # --- connectors wheel (offload.py) ------------------------------------------------------------
    Upstream(
        "vllm.v1.kv_offload.tiering.spec:TieringOffloadingSpec.create_worker",
        "HpuTieringOffloadingSpec.create_worker maps the same shared region with these attributes",
        mentions=(
            "_engine_id",
            "replicated_layout",
            "cpu_page_size_per_worker",
            "kv_bytes_per_chunk",
            "num_chunks",
            "canonical_layout",
        ),
    ),
    Upstream(
        "vllm.v1.kv_offload.cpu.shared_offload_region:SharedOffloadRegion.__init__",
        "HpuTieringOffloadingSpec.create_worker opens the worker's view of the region",
        params=("engine_id", "num_chunks", "rank", "kv_bytes_per_chunk", "cpu_page_size"),
    ),
    Upstream(
        "vllm.v1.kv_offload.cpu.shared_offload_region:SharedOffloadRegion.create_next_worker_view",
        "HpuOffloadingWorker takes its host chunks from the region's rows, one view per tensor",
        params=("tensor_page_size",),
    ),
    # --- connectors wheel (nixl.py: HpuNixlConnector) ---------------------------------------------
    Upstream(
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler:"
        "NixlBaseConnectorScheduler.__init__",
        "HpuNixlConnector checks the handshake port vLLM binds: side-channel host, port + DP index",
        mentions=(
            "VLLM_NIXL_SIDE_CHANNEL_HOST",
            "VLLM_NIXL_SIDE_CHANNEL_PORT",
            "data_parallel_index",
        ),
    ),
    Upstream(
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler:"
        "NixlBaseConnectorScheduler._nixl_handshake_listener",
        "HpuNixlConnector's port check mirrors this bind (ZeroMQ ROUTER on host:port)",
        params=("encoded_data", "ready_event", "stop_event", "host", "port"),
        mentions=("ROUTER", "GET_META_MSG"),
    ),
    Upstream(
        f"{NIXL}.base_worker:NixlBaseConnectorWorker.__init__",
        "HpuNixlConnectorWorker sets the agent's progress wait while this creates the agent",
        params=("vllm_config", "engine_id", "kv_cache_config"),
        mentions=("nixl_wrapper_cls", "nixl_agent_config"),
    ),
    Upstream(
        "nixl._api:nixl_agent.__init__",
        "progress_wait (connectors nixl.py) sets pthrDelay on the config this hands the binding",
        params=("agent_name", "nixl_conf"),
        mentions=("nixlBind.nixlAgent", "pthrDelay"),
    ),
    Upstream(
        f"{NIXL}.connector:NixlPullConnector.__init__",
        "HpuNixlConnector.__init__ creates what this does, with HpuNixlConnectorWorker",
        params=("vllm_config", "role", "kv_cache_config"),
        mentions=("NixlPullConnectorScheduler", "NixlPullConnectorWorker"),
    ),
    Upstream(
        f"{NIXL}.metadata:compute_nixl_compatibility_hash",
        "HpuNixlConnector's handshake compares these factors by name (HASHED_FIELDS)",
        mentions=(
            "vllm_version",
            "NIXL_CONNECTOR_VERSION",
            "get_total_num_kv_heads",
            "get_head_size",
            "get_total_num_hidden_layers",
            "attn_backend_name",
            "cache_dtype",
            "disable_hybrid_kv_cache_manager",
            "transfer_mode",
        ),
    ),
    Upstream(f"{NIXL}.metadata:GET_META_MSG", "HpuNixlConnectorWorker's field query"),
    Upstream(f"{NIXL}.metadata:NIXL_CONNECTOR_VERSION", "HpuNixlConnector's compatibility fields"),
    Upstream(
        f"{NIXL}.metadata:NixlHandshakePayload",
        "HpuNixlHandshakePayload extends it with the compatibility fields",
        params=("compatibility_hash", "agent_metadata_bytes"),
    ),
    Upstream(
        f"{NIXL}.utils:zmq_ctx",
        "HpuNixlConnectorWorker queries the remote side channel with it",
        params=("socket_type", "addr"),
    ),
    Upstream(
        f"{NIXL}.base_worker:NixlBaseConnectorWorker._nixl_handshake",
        "HpuNixlConnectorWorker compares the compatibility fields before this handshake",
        params=(
            "host",
            "port",
            "remote_tp_size",
            "expected_engine_id",
            "remote_dcp_size",
            "remote_pp_size",
            "notif_agents_only",
        ),
        mentions=("GET_META_MSG", "RCVTIMEO", "compat_hash", "enforce_compat_hash"),
    ),
    Upstream(
        f"{NIXL}.base_worker:NixlBaseConnectorWorker.register_kv_caches",
        "HpuNixlConnectorWorker wraps the payload this sets; reads the block size, backend name",
        mentions=("transfer_topo", "compat_hash", "backend_name", "block_size"),
    ),
    Upstream(
        f"{NIXL}.base_worker:NixlBaseConnectorWorker.__init__",
        "HpuNixlConnectorWorker reads these attributes and sets use_host_buffer after it",
        mentions=(
            "xfer_handshake_metadata",
            "enforce_compat_hash",
            "use_host_buffer",
            "kv_buffer_device",
            "copy_blocks",
            "vllm_config",
        ),
    ),
    Upstream(
        f"{NIXL}.base_worker:NixlBaseConnectorWorker.set_host_xfer_buffer_ops",
        "HpuNixlConnectorWorker overrides it: keeps the copy operation for an emulated device",
        params=("copy_operation",),
        mentions=("copy_blocks",),
    ),
    Upstream(
        f"{NIXL}.base_worker:NixlBaseConnectorWorker.save_kv_to_host",
        "host staging out of the KV cache: the platform's swap_out_blocks_to_host via copy_blocks",
        mentions=("copy_blocks", "host_xfer_buffers", "d2h"),
    ),
    Upstream(
        f"{NIXL}.base_worker:NixlBaseConnectorWorker.sync_recved_kv_to_device",
        "host staging into the KV cache: the platform's insert_blocks_to_device via copy_blocks",
        mentions=("copy_blocks", "host_xfer_buffers", "h2d"),
    ),
    Upstream(
        f"{NIXL}.base_scheduler:NixlBaseConnectorScheduler.__init__",
        "HpuNixlConnectorScheduler sets use_host_buffer after it (saves prefilled blocks)",
        mentions=("use_host_buffer", "kv_buffer_device"),
    ),
    Upstream(
        "vllm.distributed.kv_transfer.kv_connector.utils:copy_kv_blocks",
        "the copy operation the runner hands the connector: calls the platform's staging hooks",
        params=("src_kv_caches", "dst_kv_caches", "src_block_ids", "dst_block_ids", "direction"),
        mentions=("insert_blocks_to_device", "swap_out_blocks_to_host"),
    ),
    Upstream(f"{NIXL}.base_worker:NixlBaseConnectorWorker._TRANSFER_MODE", "the compat fields"),
    Upstream(
        "vllm.distributed.kv_transfer.kv_connector.utils:TransferTopology.handshake_target_ranks",
        "HpuNixlConnectorWorker asks the remote rank vLLM's handshake asks first",
        params=("remote_tp_size", "remote_dcp_size"),
    ),
    # --- multi-LoRA (lora.py: PunicaWrapperHPU; warmup.py: LoRA warmup) ---------------------------
    Upstream(
        "vllm.lora.punica_wrapper.punica_base:PunicaWrapperBase._update_base_metadata",
        "PunicaWrapperHPU.update_metadata fills the per-token slots through it",
        params=("mapping", "lora_index_to_id", "max_loras", "vocab_size"),
    ),
    Upstream(
        "vllm.lora.punica_wrapper.punica_base:PunicaWrapperBase.__init__",
        "PunicaWrapperHPU resets the padding of these index buffers after each step's mapping",
        mentions=("_token_lora_indices", "_sampler_indices", "_embeddings_indices"),
    ),
    Upstream(
        "vllm.lora.layers.vocab_parallel_embedding:VocabParallelEmbeddingWithLoRA.forward",
        "PunicaWrapperHPU: the LoRA embedding reads the index buffer over the padded step",
        mentions=("_embeddings_indices",),
    ),
    Upstream(
        "vllm.v1.worker.lora_model_runner_mixin:LoRAModelRunnerMixin._set_active_loras",
        "warmup.run_bucket activates the warmup adapters of each bucket",
        params=("prompt_lora_mapping", "token_lora_mapping", "lora_requests"),
    ),
    Upstream(
        "vllm.v1.worker.lora_model_runner_mixin:LoRAModelRunnerMixin.maybe_setup_dummy_loras",
        "HPUModelRunner.warmup_model loads max_loras dummy adapters (lora ids 1..max_loras)",
        params=("lora_config",),
        mentions=("add_dummy_lora", "lora_int_id", "num_loras"),
    ),
    Upstream(
        "vllm.v1.worker.lora_model_runner_mixin:LoRAModelRunnerMixin.load_lora_model",
        "HPUModelRunner.load_model wraps the model's layers for LoRA",
        params=("model", "vllm_config", "device"),
    ),
    Upstream(
        "vllm.lora.worker_manager:WorkerLoRAManager.create_lora_manager",
        "lora.punica_wrapper_of reads the runner's LoRA manager's _adapter_manager",
        mentions=("_adapter_manager",),
    ),
    Upstream(
        "vllm.lora.model_manager:LoRAModelManager._init_punica_wrapper",
        "lora.punica_wrapper_of reads punica_wrapper_mapping[DEFAULT_LANGUAGE_WRAPPER_KEY]",
        mentions=("punica_wrapper_mapping", "DEFAULT_LANGUAGE_WRAPPER_KEY"),
    ),
    # --- the stat logger plugin (stat_logger.py: HpuStatLogger) -----------------------------------
    Upstream(
        "vllm.v1.metrics.loggers:StatLoggerManager.__init__",
        "HpuStatLogger (an aggregate logger, built with engine_indexes) comes before vLLM's own "
        "PrometheusStatLogger, whose constructor unregisters every 'vllm:' collector, and "
        "log_engine_initialized follows both: HpuStatLogger creates its metrics there",
        mentions=("AggregateStatLoggerBase", "engine_indexes", "PrometheusStatLogger"),
    ),
    Upstream(
        "vllm.v1.metrics.loggers:PrometheusStatLogger.__init__",
        "HpuStatLogger creates its metrics after this constructor clears 'vllm:' collectors",
        mentions=("unregister_vllm_metrics",),
    ),
    Upstream(
        "vllm.config.parallel:ParallelConfig",
        "HpuStatLogger reports from the first API-server process only",
        mentions=("_api_process_rank",),
    ),
    Upstream(
        "vllm.config.vllm:VllmConfig",
        "metrics.channel_path: worker and API server name the channel after instance_id",
        mentions=("instance_id",),
    ),
    # --- writes to other projects' objects (the ledger in this module's docstring) ----------------
    Upstream(
        f"{RUNNER}.__init__",
        "HPUModelRunner.__init__ raises scheduler_config.max_num_batched_tokens while the base "
        "runner sizes its token buffers from it",
        mentions=("max_num_batched_tokens",),
    ),
    Upstream(
        "vllm.model_executor.layers.attention.attention:set_default_quant_scales",
        "INC's FP8 KV cache (vllm_gaudi_quant/methods/inc.py) writes the measured scales into "
        "_k_scale/_v_scale and _k_scale_float/_v_scale_float",
        mentions=("_k_scale", "_v_scale", "_k_scale_float", "_v_scale_float"),
    ),
    Upstream(
        "neural_compressor.torch.algorithms.fp8_quant:register_patched_module",
        "inc.register_vllm_linears puts vLLM's linear classes in the CPU patched-module table",
        params=("supported_float_module_types",),
        keywords=("device_types",),
    ),
    *(
        Upstream(
            f"neural_compressor.torch.algorithms.fp8_quant._quant_common.helper_modules:{name}",
            "inc.register_vllm_linears subclasses it for vLLM's linear classes",
        )
        for name in (
            "PatchedColumnParallelLinear",
            "PatchedRowParallelLinear",
            "PatchedReplicatedLinear",
        )
    ),
    Upstream(
        "neural_compressor.torch.algorithms.fp8_quant.model_configs:ModuleType",
        "inc.register_vllm_linears types its wrappers as linear modules",
    ),
)


@dataclass(frozen=True)
class Overriding:
    """One of our subclasses of a vLLM class: every method it defines overrides one of the base,
    except those in `adds` (ours alone)."""

    ours: str  # "module:Class"
    base: str  # "module:Class"
    adds: frozenset[str] = frozenset()
    # Hooks the base class does not declare but vLLM looks up on the object anyway (duck typing):
    # method name -> "module:Qualified.name" of the vLLM code whose source calls it.
    hooks: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        return self.ours


P = "vllm_gaudi_platform"
KV_UTILS = "vllm.distributed.kv_transfer.kv_connector.utils"
NIXL_WORKER = (
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker:NixlBaseConnectorWorker"
)
OVERRIDING_CLASSES: tuple[Overriding, ...] = (
    Overriding(
        f"{P}.stat_logger:HpuStatLogger",
        "vllm.v1.metrics.loggers:AggregateStatLoggerBase",
        frozenset({"refresh"}),
    ),
    Overriding(
        f"{P}.platform:HpuPlatform",
        "vllm.platforms.interface:Platform",
        frozenset({"is_emulated", "supported_dtypes"}),
        hooks=(
            ("insert_blocks_to_device", f"{KV_UTILS}:copy_kv_blocks"),
            ("swap_out_blocks_to_host", f"{KV_UTILS}:copy_kv_blocks"),
            ("discover_numa_topology", f"{NIXL_WORKER}.__init__"),
        ),
    ),
    Overriding(
        f"{P}.worker.hpu_worker:HPUWorker",
        "vllm.v1.worker.gpu_worker:Worker",
        frozenset(
            {
                "get_recompile_stats",
                "set_compiled_forward",
                "get_sleep_report",
                "finalize_calibration",
                "_sleep",
                "_kv_cache_tensors",
            }
        ),
    ),
    Overriding(
        f"{P}.worker.model_runner:HPUModelRunner",
        RUNNER,
        frozenset(
            {
                "_share_host_buffers",
                "finalize_calibration",
                "warmup_model",
                "_forward_with_metadata",
                "_graph_forward",
                "_graph_inputs",
                "_live_weights",
                "_static_metadata",
                "recapture_graphs",
                "_attention_layer_names",
                "lora_unwarmed_shapes",
                "_agree_across_dp",
                "_num_tokens_across_dp",
                "execute_idle_dp_step",
                "_run_model",
                "_rewindable_generators",
                "token_side_buffers",
            }
        ),
    ),
    Overriding(
        f"{P}.worker.lora:PunicaWrapperHPU",
        "vllm.lora.punica_wrapper.punica_base:PunicaWrapperBase",
        frozenset(
            {
                "_slots",
                "_sampler_slots",
                "_shrink",
                "_expand",
                "_accumulate",
                "_record",
                "token_buffers",
            }
        ),
    ),
    Overriding(
        f"{P}.attention.metadata:HPUAttentionMetadataBuilder",
        "vllm.v1.attention.backend:AttentionMetadataBuilder",
        frozenset({"block_table", "state_slots"}),
    ),
    Overriding(
        f"{P}.attention.mamba_state:HPUStateMetadataBuilder",
        "vllm.v1.attention.backend:AttentionMetadataBuilder",
        frozenset({"block_table", "state_slots"}),
    ),
    Overriding(
        f"{P}.attention.mamba_state:HPUMamba2Backend", "vllm.v1.attention.backend:AttentionBackend"
    ),
    Overriding(
        "vllm_gaudi_ops.families.mamba:HpuMambaMixer2",
        "vllm.model_executor.layers.mamba.mamba_mixer2:MambaMixer2",
        frozenset({"_split_conv_out", "_prefill", "_decode"}),
    ),
    Overriding(f"{P}.attention.mla:HPUMLABackend", f"{MLA}:MLACommonBackend"),
    Overriding(
        f"{P}.attention.mla:HPUMLAImpl",
        "vllm.v1.attention.backend:MLAAttentionImpl",
        frozenset({"_prefill"}),
    ),
    Overriding(
        f"{P}.attention.mla:HPUMLAPrefillBackend",
        "vllm.v1.attention.backends.mla.prefill.base:MLAPrefillBackend",
    ),
    Overriding("vllm_gaudi_connectors.nixl:HpuNixlConnector", f"{NIXL}.connector:NixlConnector"),
    Overriding(
        "vllm_gaudi_quant.methods.compressed_tensors:HpuCompressedTensorsConfig",
        "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors:"
        "CompressedTensorsConfig",
        frozenset({"_moe_method", "hpu_check_vllm_config"}),
    ),
    Overriding(
        "vllm_gaudi_connectors.nixl:HpuNixlConnectorWorker",
        f"{NIXL}.pull_worker:NixlPullConnectorWorker",
        frozenset({"_check_remote_compatibility"}),
    ),
    Overriding(
        "vllm_gaudi_connectors.nixl:HpuNixlConnectorScheduler",
        f"{NIXL}.pull_scheduler:NixlPullConnectorScheduler",
    ),
    Overriding(
        "vllm_gaudi_connectors.offload:HpuOffloadingWorker",
        "vllm.v1.kv_offload.base:OffloadingWorker",
        frozenset({"_host_tensor", "_pairs", "_copy"}),
    ),
    Overriding(
        "vllm_gaudi_connectors.offload:HpuCPUOffloadingSpec",
        "vllm.v1.kv_offload.cpu.spec:CPUOffloadingSpec",
    ),
    Overriding(
        "vllm_gaudi_connectors.offload:HpuTieringOffloadingSpec",
        "vllm.v1.kv_offload.tiering.spec:TieringOffloadingSpec",
    ),
)


# ------------------------------------------------------------------------------------ the checks


def resolve(target: str) -> Any:
    """The object `target` ("module:Qualified.name") names; AttributeError/ImportError if gone."""
    module_name, _, qualname = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def parameter_names(obj: Any) -> list[str]:
    """Parameter names of a function, method or Triton kernel, without a leading self/cls."""
    names = getattr(obj, "arg_names", None)  # a real Triton JITFunction
    if names is None:
        names = list(inspect.signature(getattr(obj, "func", obj)).parameters)
    names = list(names)
    return names[1:] if names[:1] in (["self"], ["cls"]) else names


def _accepts_any_keyword(obj: Any) -> bool:
    params = inspect.signature(obj).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def problems_with(expected: Upstream) -> list[str]:
    """What no longer holds of one expectation in the installed packages (empty: all holds)."""
    try:
        obj = resolve(expected.target)
    except (ImportError, AttributeError) as exc:
        return [f"{expected.target} is gone ({exc}); used by {expected.used_by}"]
    problems = []
    if expected.params or expected.keywords:
        names = parameter_names(obj)
        leading = names[: len(expected.params)]
        if leading != list(expected.params):
            problems.append(
                f"{expected.target} now takes {names}, not {list(expected.params)} first; "
                f"used by {expected.used_by}"
            )
        missing = [k for k in expected.keywords if k not in names]
        if missing and not _accepts_any_keyword(getattr(obj, "func", obj)):
            problems.append(
                f"{expected.target} has no parameter {', '.join(missing)}; used by "
                f"{expected.used_by}"
            )
    if expected.mentions:
        source = inspect.getsource(obj)
        for word in expected.mentions:
            if not re.search(rf"\b{re.escape(word)}\b", source):
                problems.append(
                    f"{expected.target} no longer mentions {word}; used by {expected.used_by}"
                )
    return problems


def _defined_methods(cls: type) -> dict[str, Any]:
    """Functions, class/static methods and properties defined in the body of `cls` itself."""
    kinds = (classmethod, staticmethod, property)
    return {
        name: value
        for name, value in vars(cls).items()
        if not (name.startswith("__") and name.endswith("__"))
        and (inspect.isfunction(value) or isinstance(value, kinds))
    }


def override_problems(entry: Overriding) -> list[str]:
    """Methods of our subclass that override nothing, or that cannot take what the base's callers
    pass (a parameter name of the base missing, with no **kwargs to catch it)."""
    ours, base = resolve(entry.ours), resolve(entry.base)
    problems = []
    hooks = dict(entry.hooks)
    for name, value in sorted(_defined_methods(ours).items()):
        if name in entry.adds:
            continue
        if name in hooks and not hasattr(base, name):
            caller = Upstream(hooks[name], f"{entry.ours}.{name}", mentions=(name,))
            problems += problems_with(caller)
            continue
        if not hasattr(base, name):
            problems.append(
                f"{entry.ours}.{name} overrides nothing: {entry.base} has no {name} (renamed "
                f"upstream?); if it is ours alone, add it to `adds`"
            )
            continue
        upstream = inspect.getattr_static(base, name)
        if isinstance(value, property) or isinstance(upstream, property):
            continue
        func = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
        up_func = getattr(upstream, "__func__", upstream)
        if not callable(up_func):
            continue
        signature = inspect.signature(func)
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()):
            continue
        missing = [n for n in parameter_names(up_func) if n not in signature.parameters]
        missing = [n for n in missing if not n.startswith("*")]
        up_params = inspect.signature(up_func).parameters
        missing = [n for n in missing if up_params[n].kind not in (up_params[n].VAR_POSITIONAL,)]
        if missing:
            problems.append(
                f"{entry.ours}.{name} does not take {', '.join(missing)}, which "
                f"{entry.base}.{name} takes"
            )
    return problems


# ---------------------------------------------------------------------- conventions (by example)

# The input batch's host/device pairs that _share_host_buffers aliases in emulation: sampling
# parameters whose device tensor is `name` and host tensor `name_cpu_tensor`.
INPUT_BATCH_PAIRS = (
    "temperature",
    "top_p",
    "top_k",
    "frequency_penalties",
    "presence_penalties",
    "repetition_penalties",
)


def cpu_gpu_buffer_problems() -> list[str]:
    import torch
    from vllm.v1.utils import CpuGpuBuffer

    buffer = CpuGpuBuffer(4, dtype=torch.int32, device=torch.device("cpu"), pin_memory=False)
    return [
        f"CpuGpuBuffer has no tensor .{side}: HPUModelRunner._share_host_buffers aliases it"
        for side in ("cpu", "gpu")
        if not isinstance(getattr(buffer, side, None), torch.Tensor)
    ]


def input_batch_problems() -> list[str]:
    import torch
    from vllm.v1.utils import CpuGpuBuffer
    from vllm.v1.worker.gpu_input_batch import InputBatch

    batch = InputBatch(
        max_num_reqs=2,
        max_model_len=32,
        max_num_batched_tokens=32,
        device=torch.device("cpu"),
        vocab_size=64,
        block_sizes=[16],
        max_num_blocks_per_req=[2],
    )
    problems = [
        f"InputBatch.{name} / {name}_cpu_tensor is no longer a device/host tensor pair: "
        "HPUModelRunner._share_host_buffers would copy instead of alias it"
        for name in INPUT_BATCH_PAIRS
        if not (
            isinstance(getattr(batch, name, None), torch.Tensor)
            and isinstance(getattr(batch, f"{name}_cpu_tensor", None), torch.Tensor)
        )
    ]
    for table in batch.block_table.block_tables:
        buffers = {n for n, v in vars(table).items() if isinstance(v, CpuGpuBuffer)}
        if not {"block_table", "slot_mapping"} <= buffers:
            problems.append(
                f"BlockTable's CpuGpuBuffers are {sorted(buffers)}, not block_table and "
                "slot_mapping: HPUModelRunner._share_host_buffers aliases them"
            )
    return problems


CONVENTIONS: dict[str, Callable[[], list[str]]] = {
    "CpuGpuBuffer .cpu/.gpu": cpu_gpu_buffer_problems,
    "InputBatch X/X_cpu_tensor pairs and block-table buffers": input_batch_problems,
}


# ------------------------------------------------------------------------------------- the tests


SPEC_DECODE_KERNEL_NAMES = (
    "vllm.v1.sample.rejection_sampler.rejection_greedy_sample_kernel",
    "vllm.v1.sample.rejection_sampler.rejection_random_sample_kernel",
    "vllm.v1.sample.rejection_sampler.expand_kernel",
    "vllm.v1.sample.rejection_sampler.sample_recovered_tokens_kernel",
    "vllm.v1.spec_decode.utils.eagle_step_slot_mapping_metadata_kernel",
    "vllm.v1.spec_decode.utils.eagle_prepare_inputs_padded_kernel",
    "vllm.v1.spec_decode.utils.eagle_prepare_next_token_padded_kernel",
)


@pytest.mark.parametrize("expected", [u for u in UPSTREAM if u.applies()], ids=str)
def test_upstream_name_still_exists_with_the_parameters_we_rely_on(expected):
    problems = problems_with(expected)

    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize("entry", OVERRIDING_CLASSES, ids=str)
def test_every_method_of_our_subclass_overrides_one_of_vllm(emulated, entry):
    problems = override_problems(entry)

    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize("name", sorted(CONVENTIONS))
def test_host_buffer_sharing_convention_holds(name):
    problems = CONVENTIONS[name]()

    assert problems == [], "\n".join(problems)


def test_slot_mapping_stand_in_takes_the_kernels_parameters_in_order():
    from vllm_gaudi_platform.worker.cuda_stand_ins import triton_kernels

    kernel = resolve("vllm.v1.worker.block_table:ComputeSlotMappingKernel.kernel")
    # Launched positionally (the names differ only by the kernel's `_ptr` suffixes), then the
    # compile-time constants by name.
    expected = [n.removesuffix("_ptr") for n in parameter_names(kernel)]

    assert parameter_names(triton_kernels.compute_slot_mapping) == expected


@pytest.mark.parametrize("name", sorted(SPEC_DECODE_KERNEL_NAMES))
def test_spec_decode_stand_in_takes_the_kernels_parameters_by_name(name):
    from vllm_gaudi_platform.worker.cuda_stand_ins import triton_kernels

    module, kernel = name.rsplit(".", 1)
    # vLLM's launcher forwards by keyword only when the names match exactly, in order.
    expected = parameter_names(resolve(f"{module}:{kernel}"))

    stand_ins = {**triton_kernels.SPEC_DECODE_KERNELS, **triton_kernels.EAGLE_KERNELS}

    assert parameter_names(stand_ins[name]) == expected


def test_mamba_memcpy_stand_in_takes_the_kernels_parameters_by_name():
    from vllm_gaudi_platform.worker.cuda_stand_ins import mamba_state_copies

    expected = parameter_names(resolve("vllm.v1.worker.mamba_utils:batch_memcpy_kernel"))
    [stand_in] = mamba_state_copies.KERNELS.values()

    assert parameter_names(stand_in) == expected


def test_guard_reports_a_method_renamed_away_upstream(monkeypatch):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    [expected] = [u for u in UPSTREAM if u.target == f"{RUNNER}._sync_device"]
    monkeypatch.delattr(GPUModelRunner, "_sync_device")

    [problem] = problems_with(expected)
    assert "GPUModelRunner._sync_device is gone" in problem


def test_guard_reports_a_renamed_parameter(monkeypatch):
    from vllm.v1.worker.gpu_worker import Worker

    [expected] = [u for u in UPSTREAM if u.target.endswith("_maybe_get_memory_pool_context")]

    def renamed(self, pool_tag: str) -> Any:
        return None

    monkeypatch.setattr(Worker, "_maybe_get_memory_pool_context", renamed)

    [problem] = problems_with(expected)
    assert "['pool_tag']" in problem and "['tag']" in problem


def test_guard_reports_an_override_left_behind_by_an_upstream_rename(emulated, monkeypatch):
    from vllm.platforms.interface import Platform

    [entry] = [o for o in OVERRIDING_CLASSES if o.ours.endswith(":HpuPlatform")]
    monkeypatch.delattr(Platform, "register_triton_kernel_overrides")

    problems = override_problems(entry)

    assert any(
        "HpuPlatform.register_triton_kernel_overrides overrides nothing" in p for p in problems
    )


def test_guard_reports_a_broken_convention(monkeypatch):
    from vllm.v1.worker.gpu_input_batch import InputBatch

    original = InputBatch.__init__

    def without_top_k_pair(self, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        del self.top_k_cpu_tensor

    monkeypatch.setattr(InputBatch, "__init__", without_top_k_pair)

    [problem] = input_batch_problems()
    assert "InputBatch.top_k" in problem
