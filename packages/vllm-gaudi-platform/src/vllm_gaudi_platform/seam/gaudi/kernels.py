"""The dense op-family kernels (RMS norm, linear, rotary embedding), KV block copies and the
LoRA kernels on Gaudi."""

from __future__ import annotations

import torch
from habana_frameworks.torch.hpex.kernels import RotaryPosEmbeddingMode
from habana_frameworks.torch.hpex.kernels import apply_rotary_pos_emb as _hpu_rotary_pos_emb
from habana_frameworks.torch.hpex.normalization import FusedRMSNorm

# ----------------------------------------------------------------------------- op-family kernels
# Used by vllm-gaudi-ops; emulated.py states the semantics of each one.

ROPE_BLOCKWISE = RotaryPosEmbeddingMode.BLOCKWISE.value
ROPE_PAIRWISE = RotaryPosEmbeddingMode.PAIRWISE.value


def rms_norm(x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    if weight.dtype != x.dtype:
        # The contract applies a float32 weight (Gemma's 1 + weight) in float32.
        return FusedRMSNorm.apply(x.float(), weight.float(), epsilon).to(x.dtype)
    return FusedRMSNorm.apply(x, weight, epsilon)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # The MME takes the [out, in] weight as stored; the graph compiler fuses the bias add.
    return torch.nn.functional.linear(x, weight, bias)


def apply_rotary_pos_emb(
    p: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    offset: int = 0,
    mode: int = ROPE_BLOCKWISE,
) -> torch.Tensor:
    return _hpu_rotary_pos_emb(p, cos, sin, position_ids, offset, RotaryPosEmbeddingMode(mode))


# ----------------------------------------------------------------------------- KV block copies
def copy_blocks(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_block_indices: torch.Tensor,
    dst_block_indices: torch.Tensor,
) -> None:
    """dst[dst_block_indices[i]] = src[src_block_indices[i]] along dim 0 (the block axis), where
    src and dst may be on different devices (host <-> HPU); complete when it returns."""
    if src.dtype in _FP8_DTYPES:
        # CPU index_select / index_copy_ on float8 are missing from the torch builds Gaudi
        # software ships: the bytes move as uint8, as Intel's vllm-gaudi moves them.
        src, dst = src.view(torch.uint8), dst.view(torch.uint8)
    blocks = src.index_select(0, src_block_indices.to(src.device))
    # A blocking copy: with non_blocking=True a device-to-host copy may still be in flight
    # when index_copy_ reads it (Intel copies blocking here).
    dst.index_copy_(0, dst_block_indices.to(dst.device), blocks.to(dst.device))


_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


# ----------------------------------------------------------------------------- LoRA kernels
# No dedicated Gaudi LoRA kernel is used: these are plain torch ops that the graph compiler maps to
# two MME matmuls and element-wise masking, in shapes fixed by the bucket and by max_loras /
# max_lora_rank (see emulated.py for the scheme). The matmuls run in float32, as the contract's
# float32 results require: a bf16 matmul rounds its output to bf16 (twice in expand). The LoRA
# operands are rank-sized, so the float32 MME work is small.
def _lora_slot_mask(token_lora: torch.Tensor, num_slots: int, dtype: torch.dtype) -> torch.Tensor:
    slots = torch.arange(num_slots, device=token_lora.device)
    return (token_lora.unsqueeze(1) == slots).to(dtype)


def lora_shrink(
    x: torch.Tensor, lora_a: torch.Tensor, token_lora: torch.Tensor, scale: float
) -> torch.Tensor:
    """out[t] = scale * x[t] @ lora_a[token_lora[t]].T (0 where token_lora is -1), float32
    [T, rank]; x [T, in], lora_a [slots, rank, in], token_lora [T]."""
    slots, rank, width = lora_a.shape
    every = torch.matmul(x.float(), lora_a.reshape(slots * rank, width).float().t())
    mask = _lora_slot_mask(token_lora, slots, every.dtype)
    return (every.view(-1, slots, rank) * mask.unsqueeze(-1)).sum(dim=1) * scale


def lora_expand(x: torch.Tensor, lora_b: torch.Tensor, token_lora: torch.Tensor) -> torch.Tensor:
    """out[t] = x[t] @ lora_b[token_lora[t]].T (0 where token_lora is -1); float32 [T, out].
    x [T, rank], lora_b [slots, out, rank], token_lora [T]."""
    slots, width, rank = lora_b.shape
    mask = _lora_slot_mask(token_lora, slots, torch.float32)
    spread = (x.float().unsqueeze(1) * mask.unsqueeze(-1)).reshape(-1, slots * rank)
    return torch.matmul(spread, lora_b.float().transpose(1, 2).reshape(slots * rank, width))
