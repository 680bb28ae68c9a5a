"""Quantized checkpoints of a tiny float model, written by the tests, each beside the float model
on its dequantized weights (what the quantized model must behave like).

`write(src, out, fmt)` -> (quantized dir, dequantized float dir). Every linear layer of every
decoder layer is quantized, and every expert of a Mixtral MoE layer (w1/w2/w3, each as a linear of
its own); embeddings, norms, the MoE router and the LM head stay float.

Formats with a KV cache scheme (`KV_FP8`) also store per-layer `k_scale`/`v_scale`, calibrated
as llm-compressor does: the largest key/value the dequantized float model produces over a few
calibration prompts (not the test prompts), over the FP8 maximum. Keys get sqrt(2) more room:
they are cached after the rotary embedding, which can move a component up to sqrt(2) times the
largest one.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.quant import mxfp4_packer
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


def _mxfp4(w: torch.Tensor, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    packed, scales = mxfp4_packer.quantize(w)
    tensors = {"weight_packed": packed, "weight_scale": scales}
    return tensors, mxfp4_packer.dequantize(packed, scales)


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
    "ct-mxfp4": (P.ct_mxfp4_config(), _mxfp4),
}


EXPERT = re.compile(r"\.block_sparse_moe\.experts\.\d+\.w[123]$")  # Mixtral's expert linears

# Formats whose checkpoint declares an FP8 KV cache: the name of the weight format they extend.
KV_FP8 = {"ct-wna16-kv-fp8": "ct-wna16-asym"}
KV_CACHE_SCHEME = {
    "num_bits": 8,
    "type": "float",
    "symmetric": True,
    "strategy": "tensor",
    "dynamic": False,
}


def _is_quantized(name: str) -> bool:
    if not name.endswith(".weight"):
        return False
    prefix = name[: -len(".weight")]
    return prefix.endswith(LINEARS) or EXPERT.search(prefix) is not None


def kv_scales(model: Path, prompts: list[list[int]]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors `model.layers.<i>.self_attn.{k,v}_scale` (float32, one element) for a
    float model: its largest |key| (times sqrt(2), see above) and |value| over `prompts`, over
    the FP8 maximum."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()
    amax: dict[str, float] = {}

    def record(name: str):
        def hook(module, inputs, output):
            amax[name] = max(amax.get(name, 0.0), float(output.abs().max()))

        return hook

    for i, layer in enumerate(hf.model.layers):
        layer.self_attn.k_proj.register_forward_hook(record(f"model.layers.{i}.self_attn.k_scale"))
        layer.self_attn.v_proj.register_forward_hook(record(f"model.layers.{i}.self_attn.v_scale"))
    with torch.no_grad():
        for prompt in prompts:
            hf(torch.tensor([prompt]))
    room = {"k_scale": math.sqrt(2), "v_scale": 1.0}
    return {
        name: torch.tensor([value * room[name.rsplit(".", 1)[1]] / P.FP8_MAX])
        for name, value in amax.items()
    }


def write(
    src: Path, out: Path, fmt: str, calibration: list[list[int]] | None = None
) -> tuple[Path, Path]:
    """Write `fmt`'s checkpoint of the float model `src` and the float model on its dequantized
    weights. Formats in KV_FP8 need `calibration` prompts for their KV scales."""
    hf_config, make = FORMATS[KV_FP8.get(fmt, fmt)]
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
        shared = shared.replace("up_proj", "gate_proj").replace(".w3", ".w1")
        packed, deq = make(tensor, sum(map(ord, shared)))
        dequantized[name] = deq.to(tensor.dtype)
        for key, value in packed.items():
            quantized[f"{prefix}.{key}"] = value.contiguous()
    save_file(dequantized, str(fdir / "model.safetensors"))
    config = json.loads((qdir / "config.json").read_text())
    config["quantization_config"] = dict(hf_config)
    if fmt in KV_FP8:
        if calibration is None:
            raise ValueError(f"{fmt}: KV cache scales need calibration prompts")
        quantized.update(kv_scales(fdir, calibration))
        config["quantization_config"]["kv_cache_scheme"] = KV_CACHE_SCHEME
    save_file(quantized, str(qdir / "model.safetensors"))
    (qdir / "config.json").write_text(json.dumps(config, indent=2))
    return qdir, fdir
