"""Multi-head latent attention (DeepSeek-V2/V3 MLA) over the compressed KV cache, as plain
tensor ops.

Both backends call this (no habana_frameworks import here): on a Gaudi the graph compiler fuses
the matmul, softmax and scatter ops; in emulation they run on the CPU.

In the weight-absorbed form every query head attends ONE shared key/value head: each cached
token is a latent row `[kv_lora_rank + rope_dim]` (the normalized compressed KV, then the
rotated positional key); the key is the whole row and the value its first `kv_lora_rank`
columns. The caller folds W_UK into the query beforehand and W_UV into the output afterwards.
"""

from __future__ import annotations

import torch


def latent_prefill(
    query: torch.Tensor,
    latent: torch.Tensor,
    attn_mask: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """Latent attention of a grid of prefill rows.

    query [rows, heads, q_len, kv_lora_rank + rope_dim]; latent [rows, kv_len, same width] (the
    row's cached context, then its new tokens); attn_mask boolean [rows, 1, q_len, kv_len]
    (True: attend), with at least one key per query. Returns [rows, heads, q_len, kv_lora_rank]
    in the query's dtype; scores and softmax run in float32.
    """
    keys = latent.float().unsqueeze(1)  # one key head, broadcast over the query heads
    scores = torch.matmul(query.float(), keys.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~attn_mask, float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.matmul(probs, keys[..., :kv_lora_rank]).to(query.dtype)


def latent_paged_decode(
    query: torch.Tensor,
    cache: torch.Tensor,
    block_list: torch.Tensor,
    block_groups: torch.Tensor,
    block_bias: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """One query per sequence against a flat list of cache blocks (Gaudi's paged decode form).

    query [batch, heads, kv_lora_rank + rope_dim]; cache [num_blocks, block_size, same width]
    (block-size-first); block_list [nb] block ids; block_groups [nb] the sequence each listed
    block belongs to (`batch` for padding entries); block_bias [nb, block_size] additive, 0 on
    used slots and -inf elsewhere. The softmax spans all of a sequence's blocks: one max per
    sequence, block sums added per sequence. Returns [batch, heads, kv_lora_rank] in the
    query's dtype; a sequence with no used slot gets zeros.
    """
    batch, heads, _ = query.shape
    nb = block_list.numel()
    kv = cache.index_select(0, block_list).float()  # [nb, block_size, width]
    # Padding entries (group == batch) read an extra all-zero query row.
    q_ext = torch.zeros(batch + 1, heads, query.shape[-1], dtype=torch.float32, device=query.device)
    q_ext[:batch] = query.float() * scale
    q_blocks = q_ext.index_select(0, block_groups)  # [nb, heads, width]
    scores = torch.bmm(q_blocks, kv.transpose(1, 2)) + block_bias[:, None, :].float()
    block_max = scores.amax(dim=-1)  # [nb, heads]
    seq_max = torch.full((batch + 1, heads), float("-inf"), device=query.device)
    seq_max.scatter_reduce_(0, block_groups[:, None].expand(nb, heads), block_max, "amax")
    seq_max = seq_max.nan_to_num(neginf=0.0)  # a sequence with no used slot: its sums stay 0
    probs = (scores - seq_max.index_select(0, block_groups)[..., None]).exp()
    denom = torch.zeros(batch + 1, heads, device=query.device)
    denom.index_add_(0, block_groups, probs.sum(dim=-1))
    block_out = torch.bmm(probs, kv[..., :kv_lora_rank])  # [nb, heads, kv_lora_rank]
    num = torch.zeros(batch + 1, heads, kv_lora_rank, device=query.device)
    num.index_add_(0, block_groups, block_out)
    out = num[:batch] / denom[:batch, :, None].clamp_min(1e-30)
    return out.to(query.dtype)
