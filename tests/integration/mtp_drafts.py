"""A tiny MiMo checkpoint with one multi-token-prediction (MTP) layer, built from the locally
trained tiny Llama in seconds.

Why MiMo: vLLM 0.32 drafts with a checkpoint's own MTP layers for `method="mtp"`; of the models
it knows, MiMo (`MiMoForCausalLM`, vllm/model_executor/models/mimo.py) is a plain Qwen2 with extra
`model.mtp_layers.{i}.*` weights, so its config loads as a stock Qwen2 config (no remote code)
and its target runs on the HPU platform like the Llama it is built from.
`SpeculativeConfig.hf_config_override` turns the same config into the draft model `MiMoMTPModel`
(mimo_mtp.py), which shares the target's embedding and LM head.

The target is the trained tiny Llama itself: the same weights under Qwen2 names, with the zero
q/k/v biases Qwen2 has, so its greedy tokens are the Llama's.

The MTP layer (`model.mtp_layers.0.*`) computes, for position t with the target's hidden state
h_t (before the final norm) and the embedding e of token t+1:
`final_layernorm(x + block(x))` with `x = input_proj([hidden_layernorm(h_t), token_layernorm(e)])`,
and the LM head reads the token after t+1 from it. It is fitted in closed form like the EAGLE
heads (eagle_drafts.py): the decoder block's attention and MLP get small random output weights
(it adds a little to x, and its attention reads and writes the drafter's KV cache on the HPU
backend); `input_proj` alone is the least-squares map from [h_t, e_{t+1}] (each RMS-normalised) to
the target's hidden state h_{t+1}, and `final_layernorm` carries the target's final-norm weight,
so the layer's output is about the target's next final hidden state and the draft its next token.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

from gaudi_testkit import tinymodels
from tests.integration import eagle_drafts
from vllm_gaudi_platform.commands import demo_model

FORMAT_VERSION = 1


def _rms_normalise(x):
    import torch

    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)


def build(*, root: Path | None = None) -> Path:
    """Path of the tiny MiMo target with one fitted MTP layer for demo_model.build(), built and
    cached on first use (about 10 s)."""
    import torch
    from safetensors.torch import load_file, save_file

    target = demo_model.build(progress=False)
    path = (root or tinymodels.cache_root()) / f"mimo-mtp-v{FORMAT_VERSION}-{target.name}"
    if (path / "config.json").exists():
        return path
    config = json.loads((target / "config.json").read_text())
    h, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or h // heads
    if head_dim * heads != h:
        raise ValueError(f"{target}: Qwen2 needs head_dim * num_attention_heads == hidden_size")
    layers = config["num_hidden_layers"]
    tokens, _, aux, model = eagle_drafts._target_states(target)
    embed = model.model.embed_tokens.weight.detach()
    # The last aux block of eagle_drafts is the residual stream entering the final norm.
    prenorm = [a[:, -h:] for a in aux]

    tensors = dict(load_file(str(target / "model.safetensors")))
    # An untied LM head: vLLM loads MiMo's MTP model from the same checkpoint and expects one.
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    for i in range(layers):
        for proj, width in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
            tensors[f"model.layers.{i}.self_attn.{proj}_proj.bias"] = torch.zeros(width * head_dim)

    g = torch.Generator().manual_seed(2)

    def rand(*shape: int, scale: float = 0.1) -> torch.Tensor:
        return scale * torch.randn(*shape, generator=g)

    mtp = "model.mtp_layers.0."
    scale = eagle_drafts.LAYER_SCALE
    tensors |= {
        f"{mtp}self_attn.q_proj.weight": rand(heads * head_dim, h),
        f"{mtp}self_attn.k_proj.weight": rand(kv_heads * head_dim, h),
        f"{mtp}self_attn.v_proj.weight": rand(kv_heads * head_dim, h),
        f"{mtp}self_attn.q_proj.bias": torch.zeros(heads * head_dim),
        f"{mtp}self_attn.k_proj.bias": torch.zeros(kv_heads * head_dim),
        f"{mtp}self_attn.v_proj.bias": torch.zeros(kv_heads * head_dim),
        f"{mtp}self_attn.o_proj.weight": rand(h, heads * head_dim, scale=scale),
        f"{mtp}mlp.gate_proj.weight": rand(inter, h),
        f"{mtp}mlp.up_proj.weight": rand(inter, h),
        f"{mtp}mlp.down_proj.weight": rand(h, inter, scale=scale),
        f"{mtp}input_layernorm.weight": torch.ones(h),
        f"{mtp}post_attention_layernorm.weight": torch.ones(h),
        f"{mtp}token_layernorm.weight": torch.ones(h),
        f"{mtp}hidden_layernorm.weight": torch.ones(h),
        f"{mtp}final_layernorm.weight": tensors["model.norm.weight"].clone(),
    }
    with torch.no_grad():
        # Position i: [h_i, embedding of token i+1] (normalised) -> h_{i+1}.
        inputs = [
            torch.cat([_rms_normalise(p[:-1]), _rms_normalise(embed[t[1:]])], dim=-1)
            for t, p in zip(tokens, prenorm)
        ]
        outputs = [p[1:] for p in prenorm]
        tensors[f"{mtp}input_proj.weight"] = eagle_drafts._fit(inputs, outputs)

    mimo_config = {
        **{k: v for k, v in config.items() if k not in ("attention_bias", "mlp_bias", "head_dim")},
        "architectures": ["MiMoForCausalLM"],
        "model_type": "qwen2",
        "num_nextn_predict_layers": 1,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
    }
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (target / name).exists():
            shutil.copy(target / name, tmp / name)
    (tmp / "config.json").write_text(json.dumps(mimo_config, indent=2))
    with contextlib.suppress(OSError):  # another process built it first
        tmp.rename(path)
    return path
