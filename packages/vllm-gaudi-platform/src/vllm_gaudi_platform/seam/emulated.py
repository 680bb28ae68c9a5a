"""CPU emulation of the Gaudi device API and fused kernels, in plain torch.

Each function mirrors the Gaudi function of the same name in `gaudi/`: same arguments, same
layouts, same results (up to floating-point rounding). Emulation never claims to be a Gaudi:
`NAME` says what it is.

This module is the backend `seam.backend()` returns. It defines the identity constants, fused
SDPA, the dense op-family kernels (RMS norm, linear, rotary embedding) and the LoRA kernels, and
re-exports the rest of the API from its sibling modules:

- `emulated_runtime.py`: device, memory, synchronization, streams and events;
- `emulated_graph.py`: graphs (a captured forward pass replayed as a tape of ops);
- `emulated_moe.py`: the mixture-of-experts kernel;
- `emulated_quant.py`: 4-bit dequantization, FP8 casts and FP8 GEMM;
- `emulated_kv_cache.py`: KV block copies, paged decode and MLA (latent attention).

Re-exports use the explicit form `from vllm_gaudi_platform.seam.emulated_x import name as name`:
`tests/platform/test_seam_contract.py` follows exactly that form to compare them with `gaudi/`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_gaudi_platform.seam.emulated_graph import Graph as Graph
from vllm_gaudi_platform.seam.emulated_graph import graphs_supported as graphs_supported
from vllm_gaudi_platform.seam.emulated_graph import kernel
from vllm_gaudi_platform.seam.emulated_kv_cache import copy_blocks as copy_blocks
from vllm_gaudi_platform.seam.emulated_kv_cache import mla_paged_decode as mla_paged_decode
from vllm_gaudi_platform.seam.emulated_kv_cache import mla_prefill as mla_prefill
from vllm_gaudi_platform.seam.emulated_kv_cache import paged_decode as paged_decode
from vllm_gaudi_platform.seam.emulated_moe import MOE_ACTIVATIONS as MOE_ACTIVATIONS
from vllm_gaudi_platform.seam.emulated_moe import mixture_of_experts as mixture_of_experts
from vllm_gaudi_platform.seam.emulated_moe import mixture_of_experts_fp8 as mixture_of_experts_fp8
from vllm_gaudi_platform.seam.emulated_moe import (
    mixture_of_experts_mxfp4 as mixture_of_experts_mxfp4,
)
from vllm_gaudi_platform.seam.emulated_quant import cast_from_fp8 as cast_from_fp8
from vllm_gaudi_platform.seam.emulated_quant import cast_to_fp8_v2 as cast_to_fp8_v2
from vllm_gaudi_platform.seam.emulated_quant import convert_from_uint4 as convert_from_uint4
from vllm_gaudi_platform.seam.emulated_quant import fp8_gemm_v2 as fp8_gemm_v2
from vllm_gaudi_platform.seam.emulated_quant import fp8_max as fp8_max
from vllm_gaudi_platform.seam.emulated_runtime import Event as Event
from vllm_gaudi_platform.seam.emulated_runtime import Stream as Stream
from vllm_gaudi_platform.seam.emulated_runtime import current_stream as current_stream
from vllm_gaudi_platform.seam.emulated_runtime import device_count as device_count
from vllm_gaudi_platform.seam.emulated_runtime import device_name as device_name
from vllm_gaudi_platform.seam.emulated_runtime import mark_step as mark_step
from vllm_gaudi_platform.seam.emulated_runtime import max_memory_allocated as max_memory_allocated
from vllm_gaudi_platform.seam.emulated_runtime import mem_get_info as mem_get_info
from vllm_gaudi_platform.seam.emulated_runtime import memory_allocated as memory_allocated
from vllm_gaudi_platform.seam.emulated_runtime import (
    reset_peak_memory_stats as reset_peak_memory_stats,
)
from vllm_gaudi_platform.seam.emulated_runtime import set_device as set_device
from vllm_gaudi_platform.seam.emulated_runtime import stream as stream
from vllm_gaudi_platform.seam.emulated_runtime import synchronize as synchronize
from vllm_gaudi_platform.seam.emulated_runtime import torch_device as torch_device
from vllm_gaudi_platform.seam.plain_attention import attention_with_sinks

NAME = "emulated on cpu"
DEVICE_TYPE = "cpu"  # torch device type the tensors live on
IS_EMULATED = True
DISPATCH_KEY = "CPU"
DIST_BACKEND = "gloo"
# torch.compile's backend in emulation, where Gaudi has Habana's hpu_backend: dynamo's aot_eager
# traces through AOTAutograd (functionalized in-place writes, decomposed ops, as hpu_backend
# does before it builds recipes) and runs the graph with torch's own kernels. Inductor would
# generate C++ for every bucket: minutes of CI for no fidelity gained.
COMPILE_BACKEND = "eager"
PIN_MEMORY = False  # host and "device" are one memory: pinning buys nothing
SHARED_HOST_MEMORY = True
NIXL_DEVICE_MEMORY = "DRAM"  # the emulated device memory is host memory


# ----------------------------------------------------------------------------- fused kernels
@kernel
def fused_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    softmax_mode: str = "None",
    recompute_mode: bool | None = None,
    valid_sequence_lengths: torch.Tensor | None = None,
    padding_side: str = "left",
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gaudi FusedSDPA: [batch, heads, q_len, head_dim] layouts, optional boolean/additive mask.

    `is_causal` masks key j > query i (top-left aligned, as on Gaudi); `valid_sequence_lengths`
    (per batch row, causal mode without a mask only, as on Gaudi) masks padded key positions on
    `padding_side`. `softmax_mode` ("None" exact,
    "fast" lower precision on Gaudi) and `recompute_mode` are performance knobs with no effect on
    the emulated result. Grouped-query attention: key/value may have fewer heads than query when
    the query heads are a multiple. `sinks` ([heads], gpt-oss style): one learned logit per
    query head joins every softmax denominator as a key with no value.
    """
    if dropout_p != 0.0:
        raise ValueError("fused_sdpa: dropout is not used at inference time")
    if valid_sequence_lengths is not None and (not is_causal or attn_mask is not None):
        # Gaudi's FusedSDPA takes valid lengths only in its causal, mask-free mode (Intel's
        # plugin masks padded keys of bidirectional attention with an attn_mask instead).
        raise ValueError(
            "fused_sdpa: valid_sequence_lengths is only taken with is_causal=True and no "
            "attn_mask, as on Gaudi; mask padded keys with an additive attn_mask instead"
        )
    q_len, kv_len = query.shape[-2], key.shape[-2]
    enable_gqa = key.shape[-3] != query.shape[-3]
    if is_causal and attn_mask is None and sinks is None:
        # Gaudi's kernel needs no mask tensor in this mode: neither does its emulation.
        return _causal_sdpa_by_query_tiles(
            query, key, value, scale, enable_gqa, valid_sequence_lengths, padding_side
        )
    mask = attn_mask
    if valid_sequence_lengths is not None:
        pos = torch.arange(kv_len, device=query.device)
        lens = valid_sequence_lengths.view(-1, 1)
        valid = pos >= kv_len - lens if padding_side == "left" else pos < lens
        valid = valid[:, None, None, :]
        mask = valid if mask is None else _combine(mask, valid)
    if is_causal:
        causal = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril()
        mask = causal if mask is None else _combine(mask, causal)
    if sinks is not None:
        return _sdpa_with_sinks_by_query_tiles(query, key, value, mask, scale, sinks)
    if (
        mask is not None
        and mask.dtype == torch.bool
        and mask.dim() == 4
        and q_len > _SDPA_TILE
        and not torch.compiler.is_compiling()  # its key selection depends on the data
    ):
        return _sdpa_skipping_masked_keys(query, key, value, mask, scale, enable_gqa)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
    )


_SDPA_TILE = 64  # query rows per tile when skipping masked-out keys
# Query rows per tile of causal attention without a mask: the per-tile mask and scores are
# [batch, heads, tile, keys], linear in the sequence length.
_CAUSAL_TILE = 256


def _causal_sdpa_by_query_tiles(
    query, key, value, scale, enable_gqa, valid_sequence_lengths, padding_side
) -> torch.Tensor:
    """Causal (top-left aligned) attention with optional valid lengths, one tile of query rows
    at a time against only the keys the tile can see (0 .. the tile's last row), so no
    [q_len, kv_len] mask or score matrix ever exists."""
    batch, q_len, kv_len = query.shape[0], query.shape[-2], key.shape[-2]
    out = torch.empty_like(query)
    for start in range(0, q_len, _CAUSAL_TILE):
        stop = min(start + _CAUSAL_TILE, q_len)
        keys = min(stop, kv_len)
        pos = torch.arange(keys, device=query.device)
        rows = torch.arange(start, stop, device=query.device)
        mask = pos[None, :] <= rows[:, None]  # [tile, keys]
        if valid_sequence_lengths is not None:
            lens = valid_sequence_lengths.view(-1, 1).to(query.device)
            valid = pos >= kv_len - lens if padding_side == "left" else pos < lens
            mask = mask[None, None] & valid.view(batch, 1, 1, keys)
        out[..., start:stop, :] = F.scaled_dot_product_attention(
            query[..., start:stop, :],
            key[..., :keys, :],
            value[..., :keys, :],
            attn_mask=mask,
            scale=scale,
            enable_gqa=enable_gqa,
        )
    return out


def _sdpa_skipping_masked_keys(query, key, value, mask, scale, enable_gqa) -> torch.Tensor:
    """The same attention as one masked SDPA call, computed per tile of query rows over only the
    key positions that some row of the tile may attend.

    A key no row of a tile may see contributes exactly nothing to that tile's softmax, so leaving
    it out changes no result. Packed prefill rows (several sequences with a block-diagonal mask)
    and padded context otherwise cost the full q_len x kv_len product.
    """
    batch, q_len, kv_len = query.shape[0], query.shape[-2], key.shape[-2]
    mask = mask.expand(batch, mask.shape[1], q_len, kv_len)
    # Which keys each tile may see: [batch, tiles, kv_len], one reduction for all tiles.
    tiles = -(-q_len // _SDPA_TILE)
    visible = (mask[:, 0] if mask.shape[1] == 1 else mask.any(dim=1)).view(torch.uint8)
    if q_len % _SDPA_TILE:
        visible = F.pad(visible, (0, 0, 0, tiles * _SDPA_TILE - q_len))
    # amax over uint8 is a vectorized reduction; `any` over a middle dimension is not.
    visible = visible.view(batch, tiles, _SDPA_TILE, kv_len).amax(dim=2)
    out = torch.empty_like(query)
    for b in range(batch):
        for t in range(tiles):
            rows = slice(t * _SDPA_TILE, (t + 1) * _SDPA_TILE)
            keys = visible[b, t].nonzero().squeeze(1)
            out[b : b + 1, :, rows] = F.scaled_dot_product_attention(
                query[b : b + 1, :, rows],
                key[b : b + 1].index_select(-2, keys),
                value[b : b + 1].index_select(-2, keys),
                attn_mask=mask[b : b + 1, :, rows].index_select(-1, keys),
                scale=scale,
                enable_gqa=enable_gqa,
            )
    return out


def _sdpa_with_sinks_by_query_tiles(query, key, value, mask, scale, sinks) -> torch.Tensor:
    """Attention with sink logits (plain ops, as on a Gaudi), one tile of query rows at a time so
    the float32 scores stay [batch, heads, tile, keys]."""
    q_len = query.shape[-2]
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    if mask is not None and mask.dim() < 4:
        mask = mask.view(*([1] * (4 - mask.dim())), *mask.shape)
    out = torch.empty_like(query)
    for start in range(0, q_len, _CAUSAL_TILE):
        rows = slice(start, min(start + _CAUSAL_TILE, q_len))
        tile_mask = None
        if mask is not None:
            tile_mask = mask[..., rows, :] if mask.shape[-2] > 1 else mask
        out[..., rows, :] = attention_with_sinks(
            query[..., rows, :], key, value, tile_mask, scale, sinks
        )
    return out


def _combine(mask: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return mask & allowed
    return mask.masked_fill(~allowed, float("-inf"))


# ----------------------------------------------------------------------------- op-family kernels
# Used by vllm-gaudi-ops. Each mirrors one Gaudi kernel wrapped in seam/gaudi (same name, arguments
# and semantics); the docstrings state the semantics both backends implement.

ROPE_BLOCKWISE = 0  # RotaryPosEmbeddingMode.BLOCKWISE: rotate the two halves (GPT-NeoX style)
ROPE_PAIRWISE = 1  # RotaryPosEmbeddingMode.PAIRWISE: rotate adjacent pairs (GPT-J style)


@kernel
def rms_norm(x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    """Gaudi FusedRMSNorm: x * rsqrt(mean(x^2, last dim) + epsilon) * weight.

    `x` must be 3-D ([batch, seq, hidden]), as the Gaudi kernel requires. The reduction and the
    weight multiply run in float32 and the result has x's dtype, so `weight` may be float32 with
    a bfloat16 `x` (Gemma's 1 + weight).
    """
    if x.dim() != 3:
        raise ValueError(f"rms_norm: Gaudi's kernel takes a 3-D input, got shape {tuple(x.shape)}")
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + epsilon)
    return (out * weight.float()).to(x.dtype)


# oneDNN's inner-product through torch's own op (no vLLM C++ extension is involved). Feature-tested
# once: a torch built without oneDNN takes F.linear.
_ONEDNN_LINEAR = torch.backends.mkldnn.is_available() and hasattr(
    torch.ops.mkldnn, "_linear_pointwise"
)


@kernel
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias, what the MME computes for an unquantized linear layer.

    float32 runs through oneDNN's inner product (torch.ops.mkldnn._linear_pointwise) on the
    weight as stored, with no packed copy to keep in step with weight reloads or sleep mode.
    It computes the same product as F.linear (rounding differs in the last bits), 2.1 to 2.6x
    faster on the CPUs CI runs on for 8 to 512 rows, where F.linear's BLAS path is slow; it is
    the kernel family vLLM's CPU backend uses too (benchmarks/e2e_emulation.py). Other dtypes,
    1-D inputs and a torch without oneDNN take F.linear.
    """
    if (
        _ONEDNN_LINEAR
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.dim() >= 2
        and weight.dim() == 2
        and (bias is None or bias.dtype == torch.float32)
    ):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


@kernel
def apply_rotary_pos_emb(
    p: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    offset: int = 0,
    mode: int = ROPE_BLOCKWISE,
) -> torch.Tensor:
    """Gaudi's rotary kernel: p * cos + rotate(p) * sin over the last dim of `p`.

    `cos`/`sin` are full width (the last dim of `p`) and broadcast against `p`. BLOCKWISE rotates
    halves: rotate(x) = [-x2, x1]; PAIRWISE rotates pairs: rotate(x)[2i] = -x[2i+1],
    rotate(x)[2i+1] = x[2i]. Dtypes follow the kernel: float32 when any input is float32 (the
    result is then float32), otherwise cos/sin are cast to p's dtype. The ops always pass
    gathered cos/sin, so `position_ids` and `offset` are not emulated.
    """
    if position_ids is not None or offset != 0:
        raise NotImplementedError("apply_rotary_pos_emb: position_ids/offset are not emulated")
    if torch.float32 in (p.dtype, cos.dtype, sin.dtype):
        p, cos, sin = p.float(), cos.float(), sin.float()
    else:
        cos, sin = cos.to(p.dtype), sin.to(p.dtype)
    # Both forms compute the formula above; each is the cheaper one on the CPU for its layout:
    # contiguous halves need no rotated copy of p, while strided pairs are cheaper to rotate
    # once than to multiply four times (benchmarks/ops.py keeps this honest).
    if mode == ROPE_BLOCKWISE:
        half = p.shape[-1] // 2
        x1, x2 = p[..., :half], p[..., half:]
        c1, c2, s1, s2 = cos[..., :half], cos[..., half:], sin[..., :half], sin[..., half:]
        return torch.cat((x1 * c1 - x2 * s1, x2 * c2 + x1 * s2), dim=-1)
    if mode == ROPE_PAIRWISE:
        rotated = torch.stack((-p[..., 1::2], p[..., ::2]), dim=-1).flatten(-2)
        return p * cos + rotated * sin
    raise ValueError(f"apply_rotary_pos_emb: unknown mode {mode!r}")


# ----------------------------------------------------------------------------- LoRA kernels
# Multi-LoRA in static shapes: every token is multiplied by EVERY adapter slot's A (one matmul over
# the stacked [slots * rank, in] weights) and a one-hot mask of the token's slot keeps its own
# adapter's rows. Shapes depend only on (tokens, slots, rank), which are fixed by the bucket and by
# max_loras / max_lora_rank, so a batch mixing adapters (or with none) never makes a new shape.
def _lora_slot_mask(token_lora: torch.Tensor, num_slots: int) -> torch.Tensor:
    """[T] slot per token (-1 = no adapter) -> float32 [T, num_slots] one-hot (all zero for -1)."""
    slots = torch.arange(num_slots, device=token_lora.device)
    return (token_lora.unsqueeze(1) == slots).to(torch.float32)


@kernel
def lora_shrink(
    x: torch.Tensor, lora_a: torch.Tensor, token_lora: torch.Tensor, scale: float
) -> torch.Tensor:
    """LoRA shrink batched over adapters: out[t] = scale * x[t] @ lora_a[token_lora[t]].T, and 0
    for a token whose slot is -1.

    x [T, in]; lora_a [slots, rank, in] (vLLM's stacked A without its layer axis); token_lora [T]
    integer slot per token (padding tokens carry -1). Returns float32 [T, rank]."""
    slots, rank, width = lora_a.shape
    every = x.float() @ lora_a.reshape(slots * rank, width).float().t()  # [T, slots * rank]
    mask = _lora_slot_mask(token_lora, slots)
    return (every.view(-1, slots, rank) * mask.unsqueeze(-1)).sum(dim=1) * scale


@kernel
def lora_expand(x: torch.Tensor, lora_b: torch.Tensor, token_lora: torch.Tensor) -> torch.Tensor:
    """LoRA expand batched over adapters: out[t] = x[t] @ lora_b[token_lora[t]].T, and 0 for a
    token whose slot is -1.

    x [T, rank] (the shrink output); lora_b [slots, out, rank] (vLLM's stacked B without its layer
    axis); token_lora [T]. Returns float32 [T, out]."""
    slots, width, rank = lora_b.shape
    mask = _lora_slot_mask(token_lora, slots)
    spread = (x.float().unsqueeze(1) * mask.unsqueeze(-1)).reshape(-1, slots * rank)
    return spread @ lora_b.float().transpose(1, 2).reshape(slots * rank, width)
