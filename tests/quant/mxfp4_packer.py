"""A test-side MXFP4 quantizer and gpt-oss checkpoint packer, written from the OCP Microscaling
format's definition in numpy, independently of the code under test.

MXFP4: blocks of 32 values share one E8M0 scale 2 ** e (stored as e + 127); each value is an E2M1
element (sign, and a magnitude in 0, 0.5, 1, 1.5, 2, 3, 4, 6), two per byte, the even element in
the low nibble. The scale of a block is the OCP choice, 2 ** (floor(log2(amax)) - 2) (2 is
E2M1's largest exponent), and elements round to the nearest value, saturating at 6.

`write_gpt_oss(src, out)` turns a float gpt-oss checkpoint into the MXFP4 checkpoint gpt-oss
ships (experts only; attention, router, embeddings and head stay bf16) and the bf16 model on the
dequantized experts, which the quantized model must behave like.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

BLOCK = 32
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
# gpt-oss's own quantization_config (its released checkpoints).
QUANTIZATION_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [rows, cols] -> (uint8 [rows, cols / 2] element pairs, uint8 [rows, cols / 32])."""
    w = weight.detach().double().numpy()
    rows, cols = w.shape
    blocks = w.reshape(rows, cols // BLOCK, BLOCK)
    amax = np.abs(blocks).max(axis=-1)
    with np.errstate(divide="ignore"):
        exponent = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1))) - 2, -127)
    exponent = np.clip(exponent, -127, 127).astype(np.int64)
    scaled = blocks / np.exp2(exponent)[..., None]
    magnitude = np.abs(scaled)
    index = np.abs(magnitude[..., None] - E2M1).argmin(axis=-1)  # nearest; saturates at 6
    code = index + 8 * ((scaled < 0) & (index > 0))
    code = code.reshape(rows, cols)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).astype(np.uint8)
    return torch.from_numpy(packed), torch.from_numpy((exponent + 127).astype(np.uint8))


def dequantize(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 [rows, cols] weight that `quantize`'s output stands for."""
    p = packed.numpy().astype(np.int64)
    code = np.stack((p & 0xF, p >> 4), axis=-1).reshape(p.shape[0], -1)
    value = E2M1[code & 7] * np.where(code >= 8, -1.0, 1.0)
    factor = np.exp2(scales.numpy().astype(np.float64) - 127)
    value = value.reshape(p.shape[0], -1, BLOCK) * factor[..., None]
    return torch.from_numpy(value.reshape(p.shape[0], -1)).float()


def _experts(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers' expert weight [E, in, out] -> (blocks [E, out, in / 32, 16], scales
    [E, out, in / 32], the dequantized weight [E, in, out])."""
    blocks, scales, dequantized = [], [], []
    for expert in weight.float():
        packed, scale = quantize(expert.t())  # [out, in]: rows are output channels
        blocks.append(packed.reshape(packed.shape[0], -1, BLOCK // 2))
        scales.append(scale)
        dequantized.append(dequantize(packed, scale).t())
    return torch.stack(blocks), torch.stack(scales), torch.stack(dequantized)


def write_gpt_oss(src: Path, out: Path) -> tuple[Path, Path]:
    """(MXFP4 checkpoint dir, bf16 dequantized dir) of the float gpt-oss at `src`."""
    qdir, fdir = out / "mxfp4", out / "mxfp4-dequantized"
    for d in (qdir, fdir):
        shutil.copytree(src, d, ignore=shutil.ignore_patterns("*.safetensors"))
    quantized, dequantized = {}, {}
    for name, tensor in sorted(load_file(str(src / "model.safetensors")).items()):
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            blocks, scales, deq = _experts(tensor)
            quantized[f"{name}_blocks"] = blocks.contiguous()
            quantized[f"{name}_scales"] = scales.contiguous()
            dequantized[name] = deq.to(torch.bfloat16)
        else:
            quantized[name] = dequantized[name] = tensor.to(torch.bfloat16)
    save_file(quantized, str(qdir / "model.safetensors"))
    save_file(dequantized, str(fdir / "model.safetensors"))
    for d in (qdir, fdir):
        config = json.loads((d / "config.json").read_text())
        config["torch_dtype"] = config["dtype"] = "bfloat16"
        if d == qdir:
            config["quantization_config"] = QUANTIZATION_CONFIG
        (d / "config.json").write_text(json.dumps(config, indent=2))
    return qdir, fdir
