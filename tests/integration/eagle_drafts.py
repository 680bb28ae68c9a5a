"""Tiny EAGLE and EAGLE-3 draft heads for the locally trained tiny Llama, fitted in seconds.

vLLM loads an EAGLE head as a one-layer Llama checkpoint (`config.json` of a LlamaForCausalLM,
weights `fc.weight` and `layers.0.*`, no input layernorm, embedding and LM head shared with the
target; vllm/model_executor/models/llama_eagle.py). An EAGLE-3 head adds its own LM head and final
norm, and its `fc` combines the target's hidden states at three layers
(`eagle_aux_hidden_state_layer_ids`; llama_eagle3.py).

Fitting, in closed form (least squares), no gradient training: the attention and MLP outputs of
the head's layer get small random weights, so the layer adds a little to the residual stream
(its attention reads and writes the drafter's KV cache on the HPU backend), and `fc` alone maps
the head's input at position t to the target's final hidden state at t + 1, from which the LM
head reads the next-next token:
- EAGLE: [embedding of token t+1, target hidden state at t] -> target hidden state at t+1.
- EAGLE-3: [target residual stream entering each aux layer at t] -> target's final hidden state
  at t+1 (the head's own final norm only rescales it, which keeps the argmax).
The samples come from the target run by transformers over the training text it learned.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from pathlib import Path

from gaudi_testkit import tinymodels
from vllm_gaudi_platform.commands import demo_model

FIT_TOKENS = 8192  # least-squares samples (tokens of training text)
WINDOW = 128
LAYER_SCALE = 0.02  # std of the head layer's attention and MLP output weights
AUX_LAYERS = (0, 1, 2)  # residual stream entering layers 0, 1 and after the last (2 layers)
FORMAT_VERSION = 1


@functools.cache
def _target_states(target: Path):
    """Token ids [N], final hidden states [N, h] and aux residual streams [N, 3h] of the target
    over FIT_TOKENS of its training text, in windows of WINDOW tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target))
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    ids = tokenizer(demo_model.split()[0])["input_ids"][:FIT_TOKENS]
    windows = [ids[i : i + WINDOW] for i in range(0, len(ids) - WINDOW + 1, WINDOW)]
    prenorm: list = []
    hook = model.model.norm.register_forward_hook(lambda m, args, out: prenorm.append(args[0]))
    tokens, finals, aux = [], [], []
    try:
        with torch.no_grad():
            for window in windows:
                x = torch.tensor([window])
                out = model(input_ids=x, output_hidden_states=True)
                states = [*out.hidden_states[:-1], prenorm.pop()]
                tokens.append(x[0])
                finals.append(out.hidden_states[-1][0])
                aux.append(torch.cat([states[i][0] for i in AUX_LAYERS], dim=-1))
    finally:
        hook.remove()
    return tokens, finals, aux, model


def _fit(inputs, outputs):
    import torch

    x = torch.cat(inputs).double()
    y = torch.cat(outputs).double()
    x = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], dim=1)
    # Ridge (tiny) for a well-posed solve; the bias column is dropped (fc has no bias).
    gram = x.T @ x + 1e-3 * torch.eye(x.shape[1], dtype=x.dtype)
    w = torch.linalg.solve(gram, x.T @ y)
    return w[:-1].T.float().contiguous()


def build(method: str, *, root: Path | None = None) -> Path:
    """Path of the tiny `method` ("eagle" or "eagle3") head for demo_model.build(), fitted and
    cached on first use (about 10 s)."""
    if method not in ("eagle", "eagle3"):
        raise ValueError(f"Unknown draft method {method!r}; choose 'eagle' or 'eagle3'.")
    import torch
    from safetensors.torch import save_file

    target = demo_model.build(progress=False)
    path = (root or tinymodels.cache_root()) / f"{method}-head-v{FORMAT_VERSION}-{target.name}"
    if (path / "config.json").exists():
        return path
    config = json.loads((target / "config.json").read_text())
    h, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or h // heads
    tokens, finals, aux, model = _target_states(target)
    embed = model.model.embed_tokens.weight.detach()

    g = torch.Generator().manual_seed(1)
    layer_in = 2 * h if method == "eagle3" else h

    def rand(*shape: int, scale: float = 0.1) -> torch.Tensor:
        return scale * torch.randn(*shape, generator=g)

    tensors = {
        "layers.0.self_attn.q_proj.weight": rand(heads * head_dim, layer_in),
        "layers.0.self_attn.k_proj.weight": rand(kv_heads * head_dim, layer_in),
        "layers.0.self_attn.v_proj.weight": rand(kv_heads * head_dim, layer_in),
        "layers.0.self_attn.o_proj.weight": rand(h, heads * head_dim, scale=LAYER_SCALE),
        "layers.0.mlp.gate_proj.weight": rand(inter, h),
        "layers.0.mlp.up_proj.weight": rand(inter, h),
        "layers.0.mlp.down_proj.weight": rand(h, inter, scale=LAYER_SCALE),
        "layers.0.post_attention_layernorm.weight": torch.ones(h),
    }
    draft_config = {
        **config,
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": 1,
        "tie_word_embeddings": False,
    }
    with torch.no_grad():
        if method == "eagle":
            # Position i: embedding of token i+1 and hidden state i -> hidden state i+1.
            inputs = [torch.cat([embed[t[1:]], f[:-1]], dim=-1) for t, f in zip(tokens, finals)]
            outputs = [f[1:] for f in finals]
            tensors["fc.weight"] = _fit(inputs, outputs)
        else:
            # Position i: the aux states at i -> hidden state i+1.
            inputs = [a[:-1] for a in aux]
            outputs = [f[1:] for f in finals]
            tensors["fc.weight"] = _fit(inputs, outputs)
            tensors["layers.0.input_layernorm.weight"] = torch.ones(h)
            tensors["layers.0.hidden_norm.weight"] = torch.ones(h)
            tensors["norm.weight"] = torch.ones(h)
            tensors["lm_head.weight"] = model.lm_head.weight.detach().clone()
            draft_config["eagle_aux_hidden_state_layer_ids"] = list(AUX_LAYERS)
            draft_config["target_hidden_size"] = h
            draft_config["draft_vocab_size"] = config["vocab_size"]
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(draft_config, indent=2))
    with contextlib.suppress(OSError):  # another process built it first
        tmp.rename(path)
    return path
