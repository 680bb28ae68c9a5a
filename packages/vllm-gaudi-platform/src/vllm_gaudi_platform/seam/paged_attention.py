"""Decode attention over the paged KV cache in Gaudi's flat form, as plain tensor ops.

Both backends call this (no habana_frameworks import here): on a Gaudi the graph compiler fuses
the gather, matmul, softmax and scatter ops; in emulation they run on the CPU.

The flat form: instead of a [batch, max_blocks] block table, one list of every block of every
decoding sequence, each entry tagged with its sequence (its group). A bucket fixes the list's
length; entries past the real blocks are padding, tagged with the group `batch` (one past the
last sequence) and fully masked, so they change no sequence's result.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

_WORKSPACE: dict[tuple, torch.Tensor] = {}


def workspace(name: str, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A contiguous scratch tensor of `shape`, reused by every layer and step.

    Layers run one after another, so one buffer per name serves them all: it grows to the largest
    size asked for and is viewed as the shape of the call. Reusing it spares the multi-megabyte
    allocation (and, on the CPU, the page faults of fresh memory) that a per-call gather would
    cost.
    """
    if torch.compiler.is_compiling():
        # A compiled graph allocates its own intermediates; a module-level cache would only
        # add guards on its contents.
        return torch.empty(shape, dtype=dtype, device=device)
    key = (name, dtype, str(device))
    numel = math.prod(shape)
    buf = _WORKSPACE.get(key)
    # A buffer made under inference mode cannot be written outside it (torch refuses in-place
    # updates of inference tensors there): such a caller gets its own.
    if (
        buf is None
        or buf.numel() < numel
        or (buf.is_inference() and not torch.is_inference_mode_enabled())
    ):
        buf = _WORKSPACE[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel].view(shape)


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
    cast_from_fp8: Callable[[torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor] | None = None,
) -> torch.Tensor:
    """One query per sequence against its cached keys and values, the flat form above.

    query [batch, heads, d]; cache [num_blocks, block_size, kv_heads, 2d], each slot's key then
    its value (grouped-query attention when kv_heads divides heads); block_list [nb] block ids;
    block_groups [nb] each entry's sequence (`batch`: padding); block_bias [nb, block_size]
    additive, 0 on slots to attend and -inf elsewhere. Options: `soft_cap` (scores ->
    cap * tanh(scores / cap)), `alibi` (slopes [heads], key minus query position [nb,
    block_size]: score += slope * that), `sinks` (one logit per head in every denominator, with
    no value), `kv_scales` with `cast_from_fp8` (an FP8 cache, dequantized as read).

    The softmax spans all of a sequence's blocks: one max per sequence, block sums added per
    sequence. Scores and softmax run in float32; returns [batch, heads, d] in the query's dtype,
    zeros for a sequence with no slot to attend.
    """
    bsz, h, d = query.shape
    hk, block_size = cache.shape[2], cache.shape[1]
    g = h // hk
    nb = block_list.numel()
    device = query.device
    # Keys and values of each KV head gathered into their own contiguous [nb, block_size, d]
    # buffers, kept across layers and steps: the batched matmuls below then read unit-stride
    # matrices (on a CPU, 4-5x faster than strided views of one gathered [.., hk, 2d] block).
    kbuf = workspace("decode_k", (hk, nb, block_size, d), cache.dtype, device)
    vbuf = workspace("decode_v", (hk, nb, block_size, d), cache.dtype, device)
    for k in range(hk):
        torch.index_select(cache[:, :, k, :d], 0, block_list, out=kbuf[k])
        torch.index_select(cache[:, :, k, d:], 0, block_list, out=vbuf[k])
    if kv_scales is not None:
        assert cast_from_fp8 is not None, "an FP8 cache needs the backend's cast_from_fp8"
        keys = cast_from_fp8(kbuf, kv_scales[0], torch.float32)
        values = cast_from_fp8(vbuf, kv_scales[1], torch.float32)
    else:
        keys, values = kbuf.float(), vbuf.float()  # no copy when the cache is float32
    # Each block gets its sequence's query (pre-scaled); padding entries read an extra zero row.
    q_ext = torch.zeros(bsz + 1, h, d, dtype=torch.float32, device=device)
    torch.mul(query, scale, out=q_ext[:bsz])
    qb = q_ext.index_select(0, block_groups).view(nb, hk, g, d).transpose(0, 1).contiguous()
    scores = torch.empty(hk, nb, g, block_size, device=device)
    for k in range(hk):
        torch.bmm(qb[k], keys[k].transpose(1, 2), out=scores[k])
    if soft_cap is not None:
        scores.div_(soft_cap).tanh_().mul_(soft_cap)
    if alibi is not None:
        slopes, rel = alibi
        scores += slopes.to(device).view(hk, 1, g, 1) * rel[None, :, None, :].float()
    scores += block_bias[:, None, :]
    # Softmax over each sequence's blocks: a shared max per sequence, sums added per group.
    block_max = scores.amax(dim=-1)  # [hk, nb, g]
    seq_max = torch.full((hk, bsz + 1, g), float("-inf"), device=device)
    seq_max.scatter_reduce_(1, block_groups[None, :, None].expand(hk, nb, g), block_max, "amax")
    sink = None
    if sinks is not None:
        sink = sinks.float().view(hk, 1, g)
        seq_max = torch.maximum(seq_max, sink)
    seq_max.nan_to_num_(neginf=0.0)
    scores -= seq_max.index_select(1, block_groups)[..., None]
    probs = scores.exp_()
    denom = torch.zeros(hk, bsz + 1, g, device=device)
    denom.index_add_(1, block_groups, probs.sum(dim=-1))
    if sink is not None:
        denom += (sink - seq_max).exp()
    block_out = torch.empty(hk, nb, g, d, device=device)
    for k in range(hk):
        torch.bmm(probs[k], values[k], out=block_out[k])
    num = torch.zeros(hk, bsz + 1, g, d, device=device).index_add_(1, block_groups, block_out)
    out = num[:, :bsz] / denom[:, :bsz, :, None].clamp_min(1e-30)  # [hk, bsz, g, d]
    return out.permute(1, 0, 2, 3).reshape(bsz, h, d).to(query.dtype)


def drop_padding_entries(
    batch: int, block_list: torch.Tensor, block_groups: torch.Tensor, *per_entry: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """The flat block list without its padding entries (group `batch`), and the same entries of
    every other per-entry tensor. The result depends on the data, so only an eager backend (the
    emulation) can use it; on a Gaudi the bucket's static length is what lets a graph replay.
    Under torch.compile the emulation keeps the static length too (a data-dependent length
    would break the bucket's graph)."""
    if torch.compiler.is_compiling():
        return (block_list, block_groups, *per_entry)
    used = block_groups < batch
    if bool(used.all()):
        return (block_list, block_groups, *per_entry)
    keep = used.nonzero().squeeze(1)
    return tuple(t.index_select(0, keep) for t in (block_list, block_groups, *per_entry))
