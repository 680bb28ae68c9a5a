"""FP8 checkpoints (vLLM's `fp8` format) of the tiny float models, written by the tests, each beside
the float model on its dequantized weights (what the quantized model must behave like).

`write(name, out)` -> (quantized dir, dequantized float dir). Every linear of every decoder layer
is quantized (attention, MLP, MoE experts); embeddings, norms, the MoE router and the LM head stay
float. Static activation scales come from the float model run on the test prompts (each linear's
largest input magnitude), as a calibration tool would make them.

The Llama checkpoints are made from the softer tiny Llama ("llama-soft"): FP8 activations move
its logits little enough for the top-5 rule. The Mixtral checkpoints quantize the experts only
and list the attention projections in `ignored_layers` (they stay float): FP8 activation
rounding of the attention alone takes a random tiny Mixtral outside the top-5 rule in plain
torch too (measured with exact dequantized weights, for initializer ranges 0.05 to 0.25), while
the experts, dequantized exactly for the bf16 MoE kernel, add no rounding of their own. The FP8
linear path is covered by the Llama checkpoints.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.quant import fp8_packers as P

ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
EXPERT = re.compile(r"\.block_sparse_moe\.experts\.\d+\.w[123]$")
BLOCK = (32, 64)  # [bn, bk]: divides every fused shard (k/v have 64 rows) and every K


@dataclass(frozen=True)
class Fp8Format:
    model: str  # tinymodels name
    activation_scheme: str
    attention: str | None  # weight scheme of the attention linears; None: float, ignored
    mlp: str  # weight scheme of the MLP linears / experts
    block: tuple[int, int] | None = None


FORMATS = {
    # Per-tensor attention (q/k/v with different scales: one per fused shard), per-channel MLP.
    "llama-fp8-static": Fp8Format("llama-soft", "static", "tensor", "channel"),
    "llama-fp8-block": Fp8Format("llama-soft", "dynamic", "block", "block", BLOCK),
    # vLLM loads expert scales per tensor (or per block) only.
    "mixtral-fp8-static": Fp8Format("mixtral", "static", None, "tensor"),
    "mixtral-fp8-block": Fp8Format("mixtral", "dynamic", None, "block", BLOCK),
}


def _scheme(fmt: Fp8Format, prefix: str) -> str | None:
    if prefix.endswith(ATTENTION):
        return fmt.attention
    if prefix.endswith(MLP) or EXPERT.search(prefix):
        return fmt.mlp
    return None


def _input_amax(model_dir: Path, prompts: list[list[int]]) -> dict[str, float]:
    """Largest input magnitude of every quantized linear (by checkpoint prefix) on `prompts`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    amax: dict[str, float] = {}

    def note(name: str, value: float) -> None:
        amax[name] = max(amax.get(name, 0.0), value)

    hooks = []
    for i, layer in enumerate(model.model.layers):
        base = f"model.layers.{i}"
        for name in (*ATTENTION, *MLP):
            try:
                module = layer.get_submodule(name)
            except AttributeError:  # a MoE layer has no dense MLP
                continue
            hooks.append(
                module.register_forward_hook(
                    lambda m, args, out, key=f"{base}.{name}": note(key, args[0].abs().max().item())
                )
            )
        moe = getattr(layer, "block_sparse_moe", None) or getattr(layer, "mlp", None)
        if moe is not None and hasattr(moe, "experts"):
            hooks.append(
                moe.register_forward_hook(
                    lambda m, args, out, key=f"{base}.moe": note(key, args[0].abs().max().item())
                )
            )
            hooks.append(
                moe.register_forward_hook(
                    lambda m, args, out, key=f"{base}.moe.inputs": amax.setdefault(key, []).append(
                        args[0].reshape(-1, args[0].shape[-1]).detach()
                    )
                )
            )
    with torch.no_grad():
        for prompt in prompts:
            model(torch.tensor([prompt]))
    for h in hooks:
        h.remove()
    return amax


def write(name: str, out: Path, prompts: list[list[int]]) -> tuple[Path, Path]:
    from gaudi_testkit import tinymodels

    fmt = FORMATS[name]
    src = tinymodels.build(fmt.model)
    qdir, fdir = out / name, out / f"{name}-dequantized"
    for d in (qdir, fdir):
        shutil.copytree(src, d, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = load_file(str(src / "model.safetensors"))
    amax = _input_amax(src, prompts) if fmt.activation_scheme == "static" else {}
    quantized, dequantized = {}, {}
    for tensor_name, tensor in sorted(tensors.items()):
        prefix = tensor_name.removesuffix(".weight")
        scheme = _scheme(fmt, prefix) if tensor_name.endswith(".weight") else None
        if scheme is None:
            quantized[tensor_name] = dequantized[tensor_name] = tensor
            continue
        packed = P.quantize(tensor, scheme, fmt.block)
        dequantized[tensor_name] = P.dequantize(packed, fmt.block).to(tensor.dtype)
        for key, value in packed.items():
            quantized[f"{prefix}.{key}"] = value.contiguous()
        if fmt.activation_scheme == "static":
            quantized[f"{prefix}.input_scale"] = P.input_scale(_static_amax(amax, prefix, tensors))
    save_file(quantized, str(qdir / "model.safetensors"))
    save_file(dequantized, str(fdir / "model.safetensors"))
    config = json.loads((qdir / "config.json").read_text())
    config["quantization_config"] = P.fp8_config(fmt.activation_scheme, fmt.block)
    if fmt.attention is None:
        config["quantization_config"]["ignored_layers"] = sorted(
            name.removesuffix(".weight")
            for name in tensors
            if name.removesuffix(".weight").endswith(ATTENTION)
        )
    (qdir / "config.json").write_text(json.dumps(config, indent=2))
    return qdir, fdir


def _static_amax(amax: dict, prefix: str, tensors: dict[str, torch.Tensor]) -> float:
    """Calibrated input amax of linear `prefix`; an expert's w2 input is its SiLU(w1 x) * w3 x on
    the MoE block's calibration inputs."""
    if prefix in amax:
        return amax[prefix]
    layer, expert, proj = re.match(
        r"(model\.layers\.\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])$", prefix
    ).groups()
    if proj in ("w1", "w3"):
        return amax[f"{layer}.moe"]
    x = torch.cat(amax[f"{layer}.moe.inputs"])
    w = lambda p: tensors[f"{layer}.block_sparse_moe.experts.{expert}.{p}.weight"].float()  # noqa: E731
    return float((torch.nn.functional.silu(x @ w("w1").t()) * (x @ w("w3").t())).abs().max())
