"""Attention as plain tensor ops, for what Gaudi's fused SDPA kernel has no input for.

Both backends call this (no habana_frameworks import here): on a Gaudi the graph compiler fuses
these matmul and softmax ops; in emulation they run on the CPU.
"""

from __future__ import annotations

import torch


def attention_with_sinks(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """Softmax attention whose denominator also holds one learned logit per query head.

    query [batch, heads, q_len, d]; key, value [batch, kv_heads, kv_len, d] (grouped-query
    attention when kv_heads divides heads); mask boolean (True: attend) or additive, broadcast to
    [batch, heads, q_len, kv_len], or None; sinks [heads]. The sink takes part in the softmax as
    a key with no value (gpt-oss style): out = sum_j e^{s_j} v_j / (e^{sink} + sum_j e^{s_j}).
    Scores and softmax run in float32; the result has the query's dtype.
    """
    heads, kv_heads = query.shape[-3], key.shape[-3]
    if kv_heads != heads:
        key = key.repeat_interleave(heads // kv_heads, dim=-3)
        value = value.repeat_interleave(heads // kv_heads, dim=-3)
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scale
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.float()
    sink = sinks.float().view(1, heads, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.matmul(probs, value.float()).to(query.dtype)
