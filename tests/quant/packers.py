"""Test-side 4-bit quantizers and checkpoint packers, written from the formats' definitions and
independent of the code under test (plain numpy bit arithmetic).

`quantize` turns a float weight into 4-bit values, per-group scales and zero points; each
`pack_*` lays them out as that format's checkpoint tensors; `dequantize` is the float weight the
quantized model must behave like.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ GEMM: nibble i of a word holds column 8j + AWQ_ORDER[i]


@dataclass
class Quantized:
    q: torch.Tensor  # int64 [K, N], 0..15 (K = input features, N = output features)
    scales: torch.Tensor  # float16 [G, N]
    zeros: torch.Tensor  # int64 [G, N], 0..15: the zero point itself
    g_idx: torch.Tensor  # int64 [K], group of each input row
    group_size: int


def quantize(
    weight: torch.Tensor,
    group_size: int,
    *,
    sym: bool,
    act_order: bool = False,
    zero_range: tuple[int, int] = (0, 15),
    seed: int = 0,
) -> Quantized:
    """Round-to-nearest 4-bit quantization of a torch Linear weight [N, K] per group of
    `group_size` input rows. With `act_order` the rows are grouped in a random order (as GPTQ's
    activation ordering does): row perm[i] belongs to group i // group_size."""
    w = weight.detach().float().t()  # [K, N]
    rows = w.shape[0]
    if act_order:
        perm = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))
        g_idx = torch.empty(rows, dtype=torch.int64)
        g_idx[perm] = torch.arange(rows) // group_size
    else:
        g_idx = torch.arange(rows) // group_size
    groups = rows // group_size
    scales = torch.empty(groups, w.shape[1])
    zeros = torch.empty(groups, w.shape[1], dtype=torch.int64)
    for g in range(groups):
        block = w[g_idx == g]
        if sym:
            s = block.abs().amax(0).clamp(min=1e-6) / 7
            z = torch.full_like(s, 8, dtype=torch.int64)
        else:
            lo, hi = block.amin(0).clamp(max=0), block.amax(0).clamp(min=0)
            s = ((hi - lo) / 15).clamp(min=1e-6)
            z = torch.round(-lo / s).long().clamp(*zero_range)
        scales[g], zeros[g] = s.half().float(), z
    q = torch.round(w / scales[g_idx]) + zeros[g_idx]
    return Quantized(q.clamp(0, 15).long(), scales.half(), zeros, g_idx, group_size)


def dequantize(qt: Quantized) -> torch.Tensor:
    """The float weight [N, K] (torch Linear layout) the quantized values stand for."""
    w = (qt.q - qt.zeros[qt.g_idx]).float() * qt.scales.float()[qt.g_idx]
    return w.t().contiguous()


def _words(nibbles: np.ndarray) -> np.ndarray:
    """[..., 8] values 0..15 -> [...] int32 words, nibble i at bits 4i..4i+3."""
    words = np.zeros(nibbles.shape[:-1], dtype=np.uint32)
    for i in range(8):
        words |= nibbles[..., i].astype(np.uint32) << np.uint32(4 * i)
    return words.view(np.int32)


def pack_along_last(values: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int [R, C] -> int32 [R, C/8]: nibble i of word j holds column 8j + order[i]."""
    v = values.numpy().reshape(values.shape[0], -1, 8)[..., list(order)]
    return torch.from_numpy(_words(v).copy())


def pack_awq(qt: Quantized) -> dict[str, torch.Tensor]:
    return {
        "qweight": pack_along_last(qt.q, AWQ_ORDER),
        "qzeros": pack_along_last(qt.zeros, AWQ_ORDER),
        "scales": qt.scales,
    }


def pack_gptq(qt: Quantized) -> dict[str, torch.Tensor]:
    """GPTQ's original format: qweight packed along K, zeros stored minus one."""
    return {
        "qweight": pack_along_last(qt.q.t().contiguous()).t().contiguous(),
        "qzeros": pack_along_last((qt.zeros - 1) & 0xF),
        "scales": qt.scales,
        "g_idx": qt.g_idx.to(torch.int32),
    }


def awq_config(group_size: int) -> dict:
    return {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
    }


def gptq_config(group_size: int, *, sym: bool, desc_act: bool) -> dict:
    return {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group_size,
        "desc_act": desc_act,
        "sym": sym,
        "checkpoint_format": "gptq",
    }


# ----------------------------------------------------------------------------- compressed-tensors
def pack_ct_wna16(qt: Quantized, *, sym: bool) -> dict[str, torch.Tensor]:
    """compressed-tensors pack-quantized: eight values per int32 along the input dim ([N, K/8]),
    each stored as signed value + 8 (so the unsigned 0..15 values here are stored as they are);
    zero points the same way, packed along the output dim ([N/8, G]); scales [N, G]."""
    n, k = qt.q.shape[1], qt.q.shape[0]
    out = {
        "weight_packed": pack_along_last(qt.q.t().contiguous()),
        "weight_scale": qt.scales.t().contiguous(),
        "weight_shape": torch.tensor([n, k], dtype=torch.int64),
    }
    if not sym:
        out["weight_zero_point"] = pack_along_last(qt.zeros).t().contiguous()
    return out


def ct_wna16_config(group_size: int | None, *, sym: bool) -> dict:
    """compressed-tensors WNA16; `group_size` None: one scale per output channel."""
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": sym,
                    "strategy": "group" if group_size else "channel",
                    "group_size": group_size,
                    "dynamic": False,
                },
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": ["lm_head"],
    }


FP8_MAX = 448.0  # E4M3 as checkpoints are written (the OCP range)


@dataclass
class Fp8Weight:
    weight: torch.Tensor  # float8_e4m3fn [N, K]
    scale: torch.Tensor  # float32 [N, 1] (channel) or [1] (tensor)


def quantize_fp8(weight: torch.Tensor, *, per_channel: bool) -> Fp8Weight:
    w = weight.detach().float()
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax().reshape(1, 1)
    scale = amax.clamp(min=1e-12) / FP8_MAX
    q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return Fp8Weight(q, scale if per_channel else scale.reshape(1))


def dequantize_fp8(fw: Fp8Weight) -> torch.Tensor:
    scale = fw.scale if fw.scale.dim() == 2 else fw.scale.reshape(1, 1)
    return fw.weight.float() * scale


def ct_fp8_config(*, per_channel: bool, dynamic: bool) -> dict:
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "float",
                    "symmetric": True,
                    "strategy": "channel" if per_channel else "tensor",
                    "dynamic": False,
                },
                "input_activations": {
                    "num_bits": 8,
                    "type": "float",
                    "symmetric": True,
                    "strategy": "token" if dynamic else "tensor",
                    "dynamic": dynamic,
                },
                "output_activations": None,
            }
        },
        "ignore": ["lm_head"],
    }


MXFP4_ARGS = {
    "num_bits": 4,
    "type": "float",
    "symmetric": True,
    "strategy": "group",
    "group_size": 32,
    "scale_dtype": "torch.uint8",
    "zp_dtype": None,
}


def ct_mxfp4_config(*, activations: bool = False) -> dict:
    """llm-compressor's MXFP4A16 scheme (`activations`: its W4A4 MXFP4 scheme) as written to a
    checkpoint's quantization_config."""
    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**MXFP4_ARGS, "dynamic": False},
                "input_activations": {**MXFP4_ARGS, "dynamic": True} if activations else None,
                "output_activations": None,
            }
        },
        "ignore": ["lm_head"],
    }
