"""Tiny PEFT-format LoRA adapters for the tiny Llama, and the merged models transformers runs as
the reference: W' = W + (lora_alpha / r) * B @ A on every targeted projection."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# PEFT module name -> (attribute path inside a decoder layer, in features, out features) keys
TARGETS = ("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj")
_PARENT = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


def _weight_key(layer: int, module: str) -> str:
    return f"model.layers.{layer}.{_PARENT[module]}.{module}.weight"


def build_adapter(base: Path, out: Path, *, seed: int, rank: int, alpha: int) -> Path:
    """A PEFT adapter (adapter_config.json + adapter_model.safetensors) with seeded random A and B
    on TARGETS of every layer of the model at `base`. Rebuilt only if missing."""
    import torch
    from safetensors.torch import load_file, save_file

    if (out / "adapter_model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    base_weights = load_file(str(base / "model.safetensors"))
    layers = json.loads((base / "config.json").read_text())["num_hidden_layers"]
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for module in TARGETS:
            out_features, in_features = base_weights[_weight_key(layer, module)].shape
            prefix = f"base_model.model.model.layers.{layer}.{_PARENT[module]}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = 0.1 * torch.randn(rank, in_features, generator=g)
            tensors[f"{prefix}.lora_B.weight"] = 0.1 * torch.randn(out_features, rank, generator=g)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(TARGETS),
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "base_model_name_or_path": None,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out


def merge(base: Path, adapter: Path, out: Path) -> Path:
    """A copy of the model at `base` with the adapter merged into its weights."""
    from safetensors.torch import load_file, save_file

    if (out / "model.safetensors").exists():
        return out
    shutil.copytree(base, out, dirs_exist_ok=True)
    config = json.loads((adapter / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    weights = load_file(str(base / "model.safetensors"))
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    for key, a in lora.items():
        if not key.endswith(".lora_A.weight"):
            continue
        b = lora[key.replace("lora_A", "lora_B")]
        target = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        merged = weights[target].double() + scale * (b.double() @ a.double())
        weights[target] = merged.to(weights[target].dtype).contiguous()
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
