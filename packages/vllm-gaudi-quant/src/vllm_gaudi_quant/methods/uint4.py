"""4-bit weights on the HPU platform: repacking checkpoints into Gaudi's layout, and the linear.

Gaudi dequantizes 4-bit weights with one kernel, `convert_from_uint4` (reached through the seam):
qweight int32 [K, N/8] packed along the output dim N in plain nibble order (nibble i of word j is
column 8j+i), zero points packed the same way and holding the zero point itself, scales [G, N].
Every 4-bit format (AWQ, GPTQ, compressed-tensors pack-quantized) is rewritten into that layout
once, after loading; the forward pass dequantizes to the activation dtype and runs one matmul,
as Gaudi's own plugin does.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.linear import LinearMethodBase

from vllm_gaudi_platform import seam

PACK = 8  # 4-bit values per int32 word
# AWQ's GEMM checkpoints interleave columns inside a word: nibble i holds column 8j + AWQ_ORDER[i].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_SHIFTS = tuple(range(0, 32, 4))


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2**32) -> the int32 with the same bits (no reliance on wrap-on-cast)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_cols(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C/8] packed along columns in plain nibble order -> int32 [R, C] in 0..15."""
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).reshape(packed.shape[0], -1)


def pack_cols(values: torch.Tensor) -> torch.Tensor:
    """int [R, C] in 0..15 -> int32 [R, C/8], plain nibble order (column 8j+i in nibble i)."""
    rows, cols = values.shape
    if cols % PACK:
        raise ValueError(f"cannot pack {cols} columns of 4-bit values: not a multiple of {PACK}")
    shifts = torch.tensor(_SHIFTS, dtype=torch.int64, device=values.device)
    nibbles = values.to(torch.int64).reshape(rows, cols // PACK, PACK) & 0xF
    return _to_int32((nibbles << shifts).sum(-1))


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R/8, C] packed along rows (nibble i of word j in a column is row 8j+i) -> [R, C]."""
    return unpack_cols(packed.t().contiguous()).t().contiguous()


def awq_to_plain(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's interleaved column packing -> the plain nibble order Gaudi's kernel reads."""
    nibbles = unpack_cols(packed).reshape(packed.shape[0], -1, PACK)
    plain = torch.empty_like(nibbles)
    plain[..., list(AWQ_ORDER)] = nibbles
    return pack_cols(plain.reshape(packed.shape[0], -1))


def replace_parameter(layer: Any, name: str, value: torch.Tensor) -> None:
    """Swap `layer.<name>` for a plain frozen Parameter (vLLM's loader attributes are done)."""
    delattr(layer, name)
    layer.register_parameter(name, torch.nn.Parameter(value, requires_grad=False))


def dequantize(layer: Any, dtype: torch.dtype) -> torch.Tensor:
    """[K, N] weight of a layer repacked by one of the 4-bit methods, in `dtype`."""
    g_idx = getattr(layer, "hpu_g_idx", None)
    return seam.backend().convert_from_uint4(
        layer.qweight, layer.scales, layer.qzeros, dtype, g_idx
    )


class Uint4LinearMethod(LinearMethodBase):
    """Forward of every 4-bit linear on HPU: dequantize to the activation dtype, then matmul.

    Subclasses create the checkpoint's parameters and repack them in
    `process_weights_after_loading` into `qweight` [K, N/8], `qzeros` [G, N/8], `scales` [G, N]
    (and `hpu_g_idx` [K] when the checkpoint's rows are not in group order)."""

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        weight = dequantize(layer, x.dtype)
        out = torch.matmul(x.reshape(-1, x.shape[-1]), weight)
        if bias is not None:
            out.add_(bias)
        return out.reshape(*x.shape[:-1], weight.shape[1])
