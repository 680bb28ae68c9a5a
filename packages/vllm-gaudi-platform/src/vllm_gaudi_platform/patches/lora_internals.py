"""vLLM's multi-LoRA internals the HPU Punica wrapper and LoRA warmup rely on."""

from __future__ import annotations

from vllm_gaudi_platform.patches import Patch, Upstream

UPSTREAM: tuple[Upstream, ...] = (
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
)

PATCH = Patch(
    what="",
    why=(
        "PunicaWrapperHPU replaces vLLM's Punica kernels with bucketed torch ops; warmup "
        "activates dummy adapters through the runner's LoRA mixin."
    ),
    can_go="when vLLM's LoRA mixin offers warmup of adapters as a public hook.",
    upstream=UPSTREAM,
)
