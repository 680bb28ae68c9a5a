"""Emulated kernels over the KV cache: block copies, paged decode and MLA (latent attention).

Part of the CPU emulation backend (`emulated.py` re-exports every public name here); each mirrors
the function of the same name in `gaudi/`. The attention math itself is shared with the Gaudi
backend (`paged_attention.py`, `latent_attention.py`); here it runs over the used entries only.
"""

from __future__ import annotations

import torch

from vllm_gaudi_platform.seam import latent_attention, paged_attention
from vllm_gaudi_platform.seam.emulated_graph import kernel
from vllm_gaudi_platform.seam.emulated_quant import cast_from_fp8


# ----------------------------------------------------------------------------- KV block copies
@kernel
def copy_blocks(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_block_indices: torch.Tensor,
    dst_block_indices: torch.Tensor,
) -> None:
    """dst[dst_block_indices[i]] = src[src_block_indices[i]] along dim 0 (the block axis), where
    src and dst may be on different devices (host <-> HPU); complete when it returns.

    Emulated: both sides are host memory; the copy is done when this returns. One memcpy per
    block, straight into place: a gather then scatter would write every byte twice through a
    temporary as large as the transfer."""
    if src_block_indices.numel() != dst_block_indices.numel():
        raise ValueError(
            f"copy_blocks: {src_block_indices.numel()} source blocks for "
            f"{dst_block_indices.numel()} destination blocks"
        )
    for s, d in zip(src_block_indices.tolist(), dst_block_indices.tolist()):
        dst[d].copy_(src[s])


# ---------------------------------------------------------------------- paged decode
@kernel
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
    """Gaudi's flat paged decode (seam/paged_attention.py), over the used entries only.

    The bucket's padding entries (group `batch`) are fully masked and change no result; a Gaudi
    computes them because its graph needs the static length, but the emulation runs eagerly and
    skips them. With exponential buckets they are up to half the list, and the gather and
    matmuls over them were the largest share of emulated decode time."""
    extra = [alibi[1]] if alibi is not None else []
    block_list, block_groups, block_bias, *extra = paged_attention.drop_padding_entries(
        query.shape[0], block_list, block_groups, block_bias, *extra
    )
    if alibi is not None:
        alibi = (alibi[0], extra[0])
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
@kernel
def mla_prefill(
    query: torch.Tensor,
    latent: torch.Tensor,
    attn_mask: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """Weight-absorbed MLA prefill: every query head against the one latent KV head.

    query [rows, heads, q_len, kv_lora_rank + rope_dim]; latent [rows, kv_len, same width];
    attn_mask boolean [rows, 1, q_len, kv_len]. Returns [rows, heads, q_len, kv_lora_rank]."""
    return latent_attention.latent_prefill(query, latent, attn_mask, scale, kv_lora_rank)


@kernel
def mla_paged_decode(
    query: torch.Tensor,
    cache: torch.Tensor,
    block_list: torch.Tensor,
    block_groups: torch.Tensor,
    block_bias: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """Weight-absorbed MLA decode over a flat block list of the latent cache [num_blocks,
    block_size, kv_lora_rank + rope_dim]. Returns [batch, heads, kv_lora_rank]. Like
    `paged_decode`, skips the bucket's padding entries."""
    block_list, block_groups, block_bias = paged_attention.drop_padding_entries(
        query.shape[0], block_list, block_groups, block_bias
    )
    return latent_attention.latent_paged_decode(
        query, cache, block_list, block_groups, block_bias, scale, kv_lora_rank
    )
