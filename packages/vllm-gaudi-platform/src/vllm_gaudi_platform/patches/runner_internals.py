"""GPUModelRunner's private methods and fields HPUModelRunner overrides, calls or reads."""

from __future__ import annotations

from vllm_gaudi_platform.patches import Patch, Upstream

RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"

UPSTREAM: tuple[Upstream, ...] = (
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
    Upstream(
        f"{RUNNER}.__init__",
        "HPUWorker.get_recompile_stats reports use_async_scheduling",
        mentions=("use_async_scheduling",),
    ),
    Upstream(
        f"{RUNNER}._init_model_kwargs",
        "warmup.py runs a pooling model's forward pass with the kwargs vLLM builds here",
        keywords=("num_reqs",),
    ),
    Upstream(
        f"{RUNNER}._init_minimal_kv_cache_for_profiling",
        "worker/profiling.py profiles the largest prompt bucket over this minimal KV cache "
        "(state slots included), built through HPUModelRunner.initialize_kv_cache",
        mentions=("self.initialize_kv_cache", "is_profiling=True"),
    ),
    Upstream(
        f"{RUNNER}._cleanup_profiling_kv_cache",
        "worker/profiling.py drops the minimal KV cache after its profile pass",
        mentions=("self.kv_caches", "kv_cache_config", "layer.kv_cache"),
    ),
    Upstream(
        f"{RUNNER}.profile_run",
        "HPUModelRunner.profile_run runs vLLM's after its own profile pass",
        mentions=("_dummy_run", "is_profile=True"),
    ),
)

PATCH = Patch(
    what="",
    why=(
        "HPUModelRunner reuses vLLM's device-neutral runner (input batch, scheduler "
        "bookkeeping, sampler) and overrides the steps Gaudi does differently (bucketed "
        "padding, graphs, the KV cache); those are private methods of GPUModelRunner."
    ),
    can_go=(
        "when vLLM's model runner offers these as platform hooks (a padding hook, a forward "
        "hook, a KV-cache layout hook)."
    ),
    upstream=UPSTREAM,
)
