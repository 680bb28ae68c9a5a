"""Quantized checkpoints of a tiny float model, written by the tests, each beside the float model
on its dequantized weights (what the quantized model must behave like).

`write(src, out, fmt)` -> (quantized dir, dequantized float dir). Every linear layer of every
decoder layer is quantized; embeddings, norms and the LM head stay float.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.quant import packers as P

LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)

# A format: its quantization_config, and how one float weight [N, K] (with a seed) becomes that
# format's tensors (named after the layer: prefix.<key>) plus the float weight they stand for.
Make = Callable[[torch.Tensor, int], tuple[dict[str, torch.Tensor], torch.Tensor]]


def _int4(group: int, pack: Callable[[P.Quantized], dict], **qargs) -> Make:
    def make(w: torch.Tensor, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        qt = P.quantize(w, group, seed=seed, **qargs)
        return pack(qt), P.dequantize(qt)

    return make


def _fp8(per_channel: bool) -> Make:
    def make(w: torch.Tensor, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        fw = P.quantize_fp8(w, per_channel=per_channel)
        return {"weight": fw.weight, "weight_scale": fw.scale}, P.dequantize_fp8(fw)

    return make


FORMATS: dict[str, tuple[dict, Make]] = {
    "awq": (P.awq_config(32), _int4(32, P.pack_awq, sym=False)),
    "gptq": (
        P.gptq_config(64, sym=False, desc_act=False),
        _int4(64, P.pack_gptq, sym=False, zero_range=(1, 15)),
    ),
    "gptq-act-order": (
        P.gptq_config(32, sym=True, desc_act=True),
        _int4(32, P.pack_gptq, sym=True, act_order=True),
    ),
    "ct-wna16-asym": (
        P.ct_wna16_config(64, sym=False),
        _int4(64, lambda qt: P.pack_ct_wna16(qt, sym=False), sym=False),
    ),
    "ct-fp8-dynamic": (P.ct_fp8_config(per_channel=True, dynamic=True), _fp8(per_channel=True)),
}


def _is_quantized(name: str) -> bool:
    return name.endswith(".weight") and name[: -len(".weight")].endswith(LINEARS)


def write(src: Path, out: Path, fmt: str) -> tuple[Path, Path]:
    hf_config, make = FORMATS[fmt]
    qdir, fdir = out / fmt, out / f"{fmt}-dequantized"
    for d in (qdir, fdir):
        shutil.copytree(src, d, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = load_file(str(src / "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, tensor in sorted(tensors.items()):
        if not _is_quantized(name):
            quantized[name] = dequantized[name] = tensor
            continue
        prefix = name[: -len(".weight")]
        # Layers that read the same input (q/k/v, gate/up) share GPTQ's activation order, as in
        # real checkpoints: vLLM fuses them into one layer with one g_idx.
        shared = prefix.replace("k_proj", "q_proj").replace("v_proj", "q_proj")
        packed, deq = make(tensor, sum(map(ord, shared.replace("up_proj", "gate_proj"))))
        dequantized[name] = deq.to(tensor.dtype)
        for key, value in packed.items():
            quantized[f"{prefix}.{key}"] = value.contiguous()
    save_file(quantized, str(qdir / "model.safetensors"))
    save_file(dequantized, str(fdir / "model.safetensors"))
    config = json.loads((qdir / "config.json").read_text())
    config["quantization_config"] = hf_config
    (qdir / "config.json").write_text(json.dumps(config, indent=2))
    return qdir, fdir
