"""Tiny random-weight models built locally, for the tests and benchmarks: no model hub needed.

Each model is a real Hugging Face architecture with seeded random weights and a byte-level BPE
tokenizer trained on a short built-in text, saved once under a cache folder and reused. The same
seed and config always give the same weights, so results are reproducible across machines.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from vllm_gaudi_platform.envs import model_cache as cache_root  # the demo's cache too

CORPUS = """
Intel Gaudi accelerators run large language models with static shapes and graph compilation.
The model runner pads every batch to a bucket so that no new graph is compiled while serving.
A paged key value cache stores attention keys and values in fixed size blocks.
Prefill computes the prompt in one pass; decode produces one token at a time for every sequence.
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with one step.
Operators deploy vLLM on clusters of servers and measure throughput, latency and memory use.
Hello world! How are you today? The weather is sunny and the river flows to the sea.
Numbers like 1, 2, 3, 42, 100 and 2026 appear in text; so do names like Alice, Bob and Carol.
"""

VOCAB_SIZE = 512
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)

BASE_CONFIG = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    # Large weights make logits peaked, so greedy decoding has few near-ties to compare.
    "initializer_range": 0.25,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# name -> (transformers config class, overrides)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "llama-rope-scaling": (
        "LlamaConfig",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            }
        },
    ),
    "gemma": (
        "GemmaConfig",
        {
            "head_dim": 32,
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_activation": "gelu_pytorch_tanh",
        },
    ),
    "mixtral": (
        "MixtralConfig",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
    ),
    # Enough experts that a low-batch decode step routes to a fraction of them (the gather).
    "mixtral-16": (
        "MixtralConfig",
        {"num_local_experts": 16, "num_experts_per_tok": 2, "sliding_window": None},
    ),
    # Windows shorter than the test prompts (up to 300 tokens), so they really cut.
    "gemma2": (
        "Gemma2Config",
        {
            "head_dim": 32,
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": 32,
            "sliding_window": 64,  # every other layer; the others attend globally
            "attn_logit_softcapping": 20.0,
            "final_logit_softcapping": 30.0,
            "tie_word_embeddings": True,  # vLLM's Gemma 2 always ties the LM head
        },
    ),
    "mistral": ("MistralConfig", {"sliding_window": 48}),
    # Qwen2 with use_sliding_window: a 40-token window on every layer, q/k/v biases (drawn at
    # random, RANDOM_BIASES). Every layer, because that is the one layout transformers and vLLM
    # 0.32 agree on: transformers windows the layers i >= max_window_layers, while vLLM's Qwen2
    # gives every layer the config's window and refuses mixed layer_types unless
    # max_window_layers == num_hidden_layers (which in transformers means no windowed layer).
    "qwen2": (
        "Qwen2Config",
        {"use_sliding_window": True, "sliding_window": 40, "max_window_layers": 0},
    ),
    # Gemma 3 text: two local layers (a 32-token window, rotary base 10^4) and one global layer
    # (rotary base 10^6), q/k RMS norms, no soft-capping. vLLM serves it as Gemma3ForCausalLM.
    "gemma3": (
        "Gemma3TextConfig",
        {
            "num_hidden_layers": 3,
            "head_dim": 32,
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": 32,
            "sliding_window": 32,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
            # Untied (the base's default): tied to these large embeddings, every prompt's greedy
            # continuation repeats a single token; untied, they vary.
        },
    ),
    # Softer weights: activations quantized to FP8 (INC) move its logits little enough that greedy
    # decoding stays within the top-5 rule of the float model; with 0.25 attention is so peaked
    # that FP8 rounding flips tokens far down the ranking, in plain torch as well.
    "llama-soft": ("LlamaConfig", {"initializer_range": 0.1}),
    # Qwen3: RMSNorm on each head's queries and keys before the rotary embedding, head_dim set
    # apart from hidden_size / heads.
    "qwen3": ("Qwen3Config", {"head_dim": 48}),
    # ALiBi position biases instead of rotary embeddings; multi-head attention (vLLM would read
    # the base's num_key_value_heads as BLOOM's KV head count) and a tied LM head, as BLOOM has.
    "bloom": ("BloomConfig", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    # DeepSeek-V2 multi-head latent attention with its MoE: layer 0 dense, layer 1 four routed
    # experts in two groups (grouped top-k: best group, then top 2) plus a shared expert. The
    # latent width kv_lora_rank + qk_rope_head_dim = 576 is DeepSeek's own, the one size vLLM's
    # CPU MLA decode kernel takes.
    "deepseek-v2": (
        "DeepseekV2Config",
        {
            "num_key_value_heads": 4,
            "q_lora_rank": 64,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 64,
            "v_head_dim": 32,
            "first_k_dense_replace": 1,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_group": 2,
            "topk_group": 1,
            "topk_method": "group_limited_greedy",
            "n_shared_experts": 1,
            "moe_intermediate_size": 64,
        },
    ),
    # DeepSeek-V3's routing and MLA shape: sigmoid expert scores, selection by score plus a
    # correction bias (random here, so selection and weights disagree where a Gaudi kernel could
    # confuse them) within the best 2 of 4 groups (a group scored by its top two), the selected
    # scores normalized and scaled by routed_scaling_factor, one shared expert; MLA with a
    # 32 + 16 split of the query/key head and interleaved rotary. transformers' DeepseekV3Config
    # hard-codes sigmoid scoring: the checkpoint's config.json must say scoring_func and
    # topk_method as DeepSeek's own do, or vLLM routes by softmax (its default) on every backend.
    "deepseek-v3": (
        "DeepseekV3Config",
        {
            "num_key_value_heads": 4,
            "q_lora_rank": 64,
            "kv_lora_rank": 64,
            "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 16,
            "v_head_dim": 32,
            "rope_interleave": True,
            "first_k_dense_replace": 1,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_group": 4,
            "topk_group": 2,
            "n_shared_experts": 1,
            "moe_intermediate_size": 64,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
        },
    ),
    # gpt-oss: attention sinks (one learned logit per head), layer 0 attending a 40-token window
    # and layer 1 globally, biased q/k/v/o projections, YaRN rotary (factor 4 over 256
    # positions), and MoE layers of four biased experts (top 2) with the clamped swigluoai gate.
    "gpt-oss": (
        "GptOssConfig",
        {
            "head_dim": 32,
            "intermediate_size": 64,  # per expert
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 40,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 256,
            },
        },
    ),
    # Granite 4.0-H's shape (GraniteMoeHybrid): Mamba2 layers around one attention layer, MoE
    # feed-forward blocks with a shared expert, no rotary embedding. One group of B/C projections:
    # with more, transformers' gated norm and vLLM's differ (vLLM normalizes per group).
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        {
            "num_hidden_layers": 3,
            "layer_types": ["mamba", "attention", "mamba"],
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "intermediate_size": 64,  # per expert
            "shared_intermediate_size": 128,
            "position_embedding_type": "nope",
            "mamba_n_heads": 8,
            "mamba_n_groups": 1,
            "mamba_d_state": 16,
            "mamba_d_head": 32,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "mamba_chunk_size": 64,
        },
    ),
    # Nemotron-H's shape: Mamba2 (two groups of B/C projections, normed per group), attention
    # and squared-ReLU MLP blocks as separate layers. time_step_min 1e-30: transformers clamps
    # every step size at it (vLLM does not), a no-op that low (at its default, 1e-3, the clamp
    # changes transformers' greedy tokens on 6 of the 10 test prompts; the initial step sizes
    # stay at least time_step_floor, 1e-4).
    "nemotron-h": (
        "NemotronHConfig",
        {
            "layers_block_type": ["mamba", "mlp", "attention", "mlp", "mamba", "mlp"],
            "head_dim": 32,
            "mamba_num_heads": 8,
            "mamba_head_dim": 32,
            "ssm_state_size": 16,
            "n_groups": 2,
            "chunk_size": 64,
            "time_step_min": 1e-30,
            "mlp_hidden_act": "relu2",
        },
    ),
    # Falcon-H1's shape: attention and a Mamba2 mixer side by side in every layer, with muP
    # multipliers (scaled embeddings, keys, SSM input blocks, MLP gate and down projections).
    # Gated RMS norm with the gate applied first: vLLM 0.32 ignores mamba_norm_before_gate (it
    # always gates first), so with it True transformers' tokens differ from vLLM's on every
    # backend (all 10 test prompts; vLLM's CPU backend and the HPU platform agree).
    "falcon-h1": (
        "FalconH1Config",
        {
            "head_dim": 32,
            "mamba_d_ssm": 256,
            "mamba_n_heads": 8,
            "mamba_d_head": 32,
            "mamba_n_groups": 1,
            "mamba_d_state": 16,
            "mamba_chunk_size": 64,
            "mamba_rms_norm": True,
            "mamba_norm_before_gate": False,
            "embedding_multiplier": 2.0,
            "key_multiplier": 0.5,
            "ssm_multipliers": [1.0, 0.5, 2.0, 1.5, 0.75],
            "mlp_multipliers": [1.5, 0.5],
        },
    ),
    # Qwen3-Next's shape: gated delta net (linear attention) layers before each full attention
    # layer (gated, partial rotary), MoE with a shared expert; q/k/v/z projections interleaved
    # per key-head group (tests/integration/test_gdn.py).
    "qwen3-next": (
        "Qwen3NextConfig",
        {
            "num_hidden_layers": 2,
            "layer_types": ["linear_attention", "full_attention"],
            "head_dim": 32,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 32,
            "linear_value_head_dim": 32,
            "linear_conv_kernel_dim": 4,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 128,
        },
    ),
    # The MoE families next to the gated delta net hybrids (test_moe_families.py).
    # Qwen3-MoE: every layer a MoE of 8 experts, top 2, renormalized.
    "qwen3-moe": (
        "Qwen3MoeConfig",
        {
            "head_dim": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "norm_topk_prob": True,
        },
    ),
    # GLM-4.5: partial rotary (half the head), a dense first layer, then sigmoid-scored routing
    # with the correction bias (ROUTER_BIASES), a shared expert and a routed scaling factor.
    "glm4-moe": (
        "Glm4MoeConfig",
        {
            "head_dim": 32,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "moe_intermediate_size": 64,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "num_mtp_layers": 0,
        },
    ),
    # Llama 4 text: top-1 MoE with the router weight on the input and a shared expert, a NoPE
    # layer after a rotary one with chunked local attention; the chunk (64) is shorter than
    # most of the tests' prompts and half a KV block, so chunks start inside blocks.
    "llama4-text": (
        "Llama4TextConfig",
        {
            "head_dim": 32,
            "intermediate_size": 64,
            "intermediate_size_mlp": 256,
            "num_local_experts": 4,
            "num_experts_per_tok": 1,
            "interleave_moe_layer_step": 1,
            "no_rope_layers": [1, 0],
            "attention_chunk_size": 64,
            "use_qk_norm": True,
            "floor_scale": 64,
        },
    ),
    # Gemma 4 text: sliding and full attention layers, its own norms and soft-capping.
    "gemma4-text": (
        "Gemma4TextConfig",
        {
            "head_dim": 32,
            "sliding_window": 48,
            "layer_types": ["sliding_attention", "full_attention"],
            "vocab_size_per_layer_input": VOCAB_SIZE,
            "hidden_size_per_layer_input": 16,
        },
    ),
    # Qwen3.5's shape (its text model): gated delta net layers (separate q/k/v/z and b/a
    # projections, two value heads per key head) before a gated full attention layer with
    # partial rotary (tests/integration/test_gdn.py).
    "qwen3.5": (
        "Qwen3_5TextConfig",
        {
            "num_hidden_layers": 3,
            "layer_types": ["linear_attention", "linear_attention", "full_attention"],
            "head_dim": 32,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 32,
            "linear_value_head_dim": 32,
            "linear_conv_kernel_dim": 4,
        },
    ),
    # LFM2's shape: short gated convolutions (state layers without attention) before a full
    # attention layer. The HPU platform has no short-conv kernels: it refuses this model at load,
    # naming the layer (tests/integration/test_gdn.py).
    "lfm2": (
        "Lfm2Config",
        {
            "num_hidden_layers": 2,
            "layer_types": ["conv", "full_attention"],
            # vLLM's LFM2 reads these two (transformers 5 dropped them): the hidden size
            "conv_dim": 128,
            "block_dim": 128,
            "block_auto_adjust_ff_dim": False,
            "block_multiple_of": 64,
        },
    ),
    # Qwen3.5-MoE's: the same layers, MoE feed-forward blocks with a gated shared expert.
    "qwen3.5-moe": (
        "Qwen3_5MoeTextConfig",
        {
            "num_hidden_layers": 2,
            "layer_types": ["linear_attention", "full_attention"],
            "head_dim": 32,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 32,
            "linear_value_head_dim": 32,
            "linear_conv_kernel_dim": 4,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 128,
        },
    ),
}


# Models whose biases and attention-sink logits transformers initializes to zero (gpt-oss's all
# are, its router's aside; Qwen2's q/k/v biases): drawn from N(0, std) instead, so that the tests
# exercise them.
# name -> std.
RANDOM_BIASES: dict[str, float] = {"gpt-oss": 1.0, "qwen2": 0.25}
# Models whose MoE router carries a score correction bias (a saved buffer, zeros at
# initialization): name -> standard deviation of the random bias written there.
ROUTER_BIASES: dict[str, float] = {"deepseek-v3": 0.1, "glm4-moe": 0.1}

# Models whose attention would not decide a single greedy token at transformers' initialization:
# Gemma 2 scales its (tied) embeddings by sqrt(hidden_size) and norms each block's output, so the
# current token's embedding dominates the residual and every prompt just repeats its last token
# (zeroing every attention output changes none of the test's greedy tokens). A gain on the
# post-attention and post-feed-forward norms lets the blocks speak: then removing the window
# changes 6 of the 10 test prompts, the attention soft-cap 9, attention itself 10.
# name -> gain of those norms (Gemma's norms scale by 1 + weight).
BLOCK_OUTPUT_GAIN: dict[str, float] = {"gemma2": 8.0}


# Encoder-only models (bidirectional attention, no KV cache), saved without a language-model head:
# vLLM serves them with runner="pooling" (embeddings). name -> (config class, config).
ENCODERS: dict[str, tuple[str, dict[str, Any]]] = {
    "bert": (
        "BertConfig",
        {
            "vocab_size": VOCAB_SIZE,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": 1024,
            "type_vocab_size": 2,
            "initializer_range": 0.25,
            "torch_dtype": "float32",
            "pad_token_id": 0,
        },
    ),
}


def _build_tokenizer(
    path: Path, extra_special: tuple[str, ...] = (), named: dict[str, str] | None = None
) -> Any:
    """Train the byte-level BPE tokenizer on CORPUS and save it to `path`; returns it.
    `extra_special` tokens (a vision model's placeholders) take the ids after <pad>, <s>, </s>;
    `named` makes some of them tokenizer attributes (Gemma 3's processor reads
    `tokenizer.boi_token`, for one)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<pad>", "<s>", "</s>", *extra_special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        extra_special_tokens=named or {},
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def build(name: str = "llama", *, seed: int = 0, root: Path | None = None) -> Path:
    """Path of the tiny model `name`, building and caching it on first use."""
    if name in ENCODERS:
        cls_name, config_kwargs = ENCODERS[name]
    elif name in MODELS:
        cls_name, overrides = MODELS[name]
        config_kwargs = {**BASE_CONFIG, **overrides}
    else:
        known = sorted([*MODELS, *ENCODERS])
        raise ValueError(f"Unknown tiny model {name!r}; choose one of {known}.")
    recipe: list[Any] = [name, cls_name, config_kwargs, seed, CORPUS]
    if name in RANDOM_BIASES:
        recipe.append(RANDOM_BIASES[name])
    if name in BLOCK_OUTPUT_GAIN:
        recipe.append({"block_output_gain": BLOCK_OUTPUT_GAIN[name]})
    if name in ROUTER_BIASES:
        recipe.append({"router_bias": ROUTER_BIASES[name]})
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    path = (root or cache_root()) / f"tiny-{name}-{key}"
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path

    import torch
    import transformers

    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    config = getattr(transformers, cls_name)(**config_kwargs)
    torch.manual_seed(seed)
    auto = transformers.AutoModel if name in ENCODERS else transformers.AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32)
    if name in RANDOM_BIASES:
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if param_name.endswith(("bias", "sinks")):
                    param.normal_(0.0, RANDOM_BIASES[name])
    if name in BLOCK_OUTPUT_GAIN:
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "post_attention_layernorm" in param_name or "post_feedforward" in param_name:
                    param.fill_(BLOCK_OUTPUT_GAIN[name] - 1.0)
    if name in ROUTER_BIASES:
        with torch.no_grad():
            for buffer_name, buffer in model.named_buffers():
                if buffer_name.endswith("e_score_correction_bias"):
                    buffer.normal_(0.0, ROUTER_BIASES[name])
    model.save_pretrained(tmp, safe_serialization=True)
    _build_tokenizer(tmp)
    with contextlib.suppress(OSError):  # another process built it first
        tmp.rename(path)
    return path
