"""Gaudi's fused SDPA (`FusedSDPA`), and paged decode and MLA over it: the attention math
itself is shared with the emulation (`seam/paged_attention.py`, `seam/latent_attention.py`)."""

from __future__ import annotations

import torch
from habana_frameworks.torch.hpex.kernels import FusedSDPA

from vllm_gaudi_platform.seam import latent_attention, paged_attention
from vllm_gaudi_platform.seam.gaudi.quant import cast_from_fp8
from vllm_gaudi_platform.seam.plain_attention import attention_with_sinks


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
    if sinks is not None:
        # FusedSDPA has no sink input: plain ops (fused by the graph compiler) with the causal
        # and valid-length masks made explicit.
        return _sdpa_with_sinks(
            query,
            key,
            value,
            attn_mask,
            is_causal,
            scale,
            valid_sequence_lengths,
            padding_side,
            sinks,
        )
    if attn_mask is not None:
        attn_mask = _additive_mask(attn_mask, query.dtype)
    if valid_sequence_lengths is not None:
        # Intel's call sites pass valid lengths as int32.
        valid_sequence_lengths = valid_sequence_lengths.to(torch.int32)
    grouped = key.shape[-3] != query.shape[-3]
    if grouped:
        # Gaudi's kernel takes grouped-query attention as a 5-D query,
        # [batch, kv_heads, q_per_kv, q_len, head_dim], against [batch, kv_heads, 1, kv_len, d]
        # keys/values. A 4-D mask follows the query: a per-head mask [b, heads, q, k] splits its
        # head axis the same way (heads = kv_heads * q_per_kv, kv head major), a head-shared one
        # gets a unit axis.
        b, hq, s, d = query.shape
        hkv = key.shape[-3]
        query = query.view(b, hkv, hq // hkv, s, d)
        key, value = key.unsqueeze(2), value.unsqueeze(2)
        if attn_mask is not None and attn_mask.dim() == 4:
            if attn_mask.shape[1] == hq and hq != 1:
                attn_mask = attn_mask.unflatten(1, (hkv, hq // hkv))
            else:
                attn_mask = attn_mask.unsqueeze(2)
    out = FusedSDPA.apply(
        query,
        key,
        value,
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        softmax_mode,
        recompute_mode,
        valid_sequence_lengths,
        padding_side,
    )
    return out.reshape(b, hq, s, d) if grouped else out


def _additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True = attend) or additive bias as the additive bias, in the query's
    dtype, that FusedSDPA takes: Intel's call sites pass only such masks (never bool, never
    float32 under bf16 queries)."""
    if mask.dtype == torch.bool:
        bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        return bias.masked_fill_(~mask, torch.finfo(dtype).min)
    return mask.to(dtype)


def _sdpa_with_sinks(
    query, key, value, attn_mask, is_causal, scale, valid_sequence_lengths, padding_side, sinks
) -> torch.Tensor:
    q_len, kv_len = query.shape[-2], key.shape[-2]
    mask = attn_mask
    if mask is not None and mask.dim() < 4:
        mask = mask.view(*([1] * (4 - mask.dim())), *mask.shape)
    allowed = None
    if valid_sequence_lengths is not None:
        pos = torch.arange(kv_len, device=query.device)
        lens = valid_sequence_lengths.view(-1, 1)
        valid = pos >= kv_len - lens if padding_side == "left" else pos < lens
        allowed = valid[:, None, None, :]
    if is_causal:
        causal = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril()
        allowed = causal if allowed is None else allowed & causal
    if allowed is not None:
        if mask is None:
            mask = allowed
        elif mask.dtype == torch.bool:
            mask = mask & allowed
        else:
            mask = mask.masked_fill(~allowed, float("-inf"))
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return attention_with_sinks(query, key, value, mask, scale, sinks)


# ---------------------------------------------------------------------- paged decode
def paged_decode(
    query: torch.Tensor,
    cache: torch.Tensor,
    block_list: torch.Tensor,
    block_groups: torch.Tensor,
    block_bias: torch.Tensor,
    scale: float,
    *,
    soft_cap: float | None = None,
    alibi: tuple[torch.Tensor, torch.Tensor] | None = None,
    sinks: torch.Tensor | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Flat paged decode as plain tensor ops over the bucket's whole block list, padding
    included: its static length is what lets one graph per bucket replay."""
    return paged_attention.paged_decode(
        query,
        cache,
        block_list,
        block_groups,
        block_bias,
        scale,
        soft_cap=soft_cap,
        alibi=alibi,
        sinks=sinks,
        kv_scales=kv_scales,
        cast_from_fp8=cast_from_fp8,
    )


# ---------------------------------------------------------------------- MLA (latent attention)
# Plain tensor ops shared with the emulation: the graph compiler fuses them. FusedSDPA would need
# the single latent head repeated over the query heads and a value narrower than the key.
def mla_prefill(
    query: torch.Tensor,
    latent: torch.Tensor,
    attn_mask: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    return latent_attention.latent_prefill(query, latent, attn_mask, scale, kv_lora_rank)


def mla_paged_decode(
    query: torch.Tensor,
    cache: torch.Tensor,
    block_list: torch.Tensor,
    block_groups: torch.Tensor,
    block_bias: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    return latent_attention.latent_paged_decode(
        query, cache, block_list, block_groups, block_bias, scale, kv_lora_rank
    )
