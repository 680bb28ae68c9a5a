"""CPU emulation of the Gaudi device API and fused kernels, in plain torch.

Each function mirrors the Gaudi function of the same name in `gaudi.py`: same arguments, same
layouts, same results (up to floating-point rounding). Emulation never claims to be a Gaudi:
`NAME` says what it is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn.functional as F

from vllm_gaudi_platform.seam import latent_attention, paged_attention
from vllm_gaudi_platform.seam.contract import GraphInputError
from vllm_gaudi_platform.seam.plain_attention import attention_with_sinks

NAME = "emulated on cpu"
DEVICE_TYPE = "cpu"  # torch device type the tensors live on
IS_EMULATED = True
DISPATCH_KEY = "CPU"
DIST_BACKEND = "gloo"
# Emulation runs eagerly: Gaudi graph compilation has no CPU equivalent worth its compile time.
COMPILE_BACKEND = "eager"
PIN_MEMORY = False  # host and "device" are one memory: pinning buys nothing
SHARED_HOST_MEMORY = True


# ----------------------------------------------------------------------------- device runtime
def torch_device(index: int = 0) -> torch.device:
    return torch.device("cpu")


def set_device(device: torch.device) -> None:
    """One emulated device: nothing to select."""


def device_count() -> int:
    return 1


def device_name(index: int = 0) -> str:
    return "HPU (emulated on cpu)"


def mem_get_info() -> tuple[int, int]:
    """(free, total) bytes of one emulated HPU: VLLM_HPU_EMULATION_MEMORY_GB caps the total."""
    from vllm_gaudi_platform import envs

    total = int(envs.get_number(envs.VLLM_HPU_EMULATION_MEMORY_GB, lo=0.1) * (1 << 30))
    try:
        import psutil

        total = min(total, psutil.virtual_memory().available)
    except ImportError:
        pass
    used = memory_allocated()
    return max(total - used, 0), total


def memory_allocated() -> int:
    """Bytes of tensors held by this process (resident set: the CPU has no allocator stats)."""
    try:
        import psutil

        return psutil.Process(os.getpid()).memory_info().rss
    except ImportError:
        return 0


def synchronize() -> None:
    """CPU ops complete when they return."""


def mark_step() -> None:
    """Lazy-mode graph flush. Eager CPU execution has nothing to flush."""


# Streams and events. The CPU runs every op to completion, in issue order, before the call
# returns: there is one stream, and an event recorded after some work is already complete. So
# these are exact, not approximate: waiting on anything has nothing left to wait for.
class Stream:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other: Stream) -> None:
        pass


class Event:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Stream | None = None) -> None:
        pass

    def synchronize(self) -> None:
        pass


class Graph:
    """One forward pass "captured" for replay, with the input discipline of an HPU graph.

    A Gaudi graph replays the recorded ops on the exact buffers it saw at capture: a caller that
    hands it a re-allocated input (or one of another shape or dtype) gets the old buffer's stale
    data, silently. The emulation has no recording to speed anything up, so it runs `fn` eagerly
    at each replay, but first checks every tensor of `inputs` against what capture recorded and
    raises `GraphInputError` naming the input that moved. That check is the point of the class:
    it turns a bug that is silent on a Gaudi into a loud one in CI.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._fn: Callable[[], Any] | None = None
        self._recorded: dict[str, tuple[int, tuple[int, ...], torch.dtype]] = {}

    def capture(self, fn: Callable[[], Any], inputs: Mapping[str, Any]) -> Any:
        """Run `fn` once and record every tensor input's storage pointer, shape and dtype."""
        self._recorded = _graph_inputs(inputs)
        self._fn = fn
        return fn()

    def replay(self, inputs: Mapping[str, Any]) -> Any:
        """Check `inputs` are the captured buffers, then run the captured `fn` again."""
        if self._fn is None:
            raise GraphInputError(f"graph {self.name!r} was replayed before it was captured")
        now = _graph_inputs(inputs)
        problems = []
        for key, (ptr, shape, dtype) in self._recorded.items():
            seen = now.get(key)
            if seen is None:
                problems.append(f"{key} is missing (captured as {dtype} {list(shape)})")
            elif seen[0] != ptr:
                problems.append(f"{key} is a different buffer than at capture (re-allocated)")
            elif seen[1:] != (shape, dtype):
                problems.append(
                    f"{key} is {seen[2]} {list(seen[1])}, captured as {dtype} {list(shape)}"
                )
        problems += [f"{key} was not an input at capture" for key in now.keys() - self._recorded]
        if problems:
            raise GraphInputError(
                f"graph {self.name!r} replayed with inputs that differ from its capture: "
                + "; ".join(problems)
                + ". A Gaudi would replay the captured buffers' stale data: update static "
                "inputs in place (copy_) instead of re-allocating them."
            )
        return self._fn()


def _graph_inputs(
    value: Any, name: str = "", out: dict | None = None
) -> dict[str, tuple[int, tuple[int, ...], torch.dtype]]:
    """Every tensor reachable from `value` (mappings, lists/tuples, dataclass fields not starting
    with '_'), by dotted path: (data pointer, shape, dtype)."""
    out = {} if out is None else out
    if isinstance(value, torch.Tensor):
        out[name] = (value.data_ptr(), tuple(value.shape), value.dtype)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _graph_inputs(item, f"{name}.{key}" if name else str(key), out)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _graph_inputs(item, f"{name}[{i}]", out)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            if not f.name.startswith("_"):
                _graph_inputs(getattr(value, f.name), f"{name}.{f.name}", out)
    return out


def current_stream() -> Stream:
    """The stream work is issued on now: the CPU's single ordered stream."""
    return Stream()


def stream(stream: Any) -> AbstractContextManager[Any]:
    """Issue the body's work on `stream`; the CPU has a single stream, so nothing changes."""
    return contextlib.nullcontext()


# ----------------------------------------------------------------------------- fused kernels
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
    (per batch row) masks padded key positions on `padding_side`. `softmax_mode` ("None" exact,
    "fast" lower precision on Gaudi) and `recompute_mode` are performance knobs with no effect on
    the emulated result. Grouped-query attention: key/value may have fewer heads than query when
    the query heads are a multiple. `sinks` ([heads], gpt-oss style): one learned logit per
    query head joins every softmax denominator as a key with no value.
    """
    if dropout_p != 0.0:
        raise ValueError("fused_sdpa: dropout is not used at inference time")
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
    if mask is not None and mask.dtype == torch.bool and mask.dim() == 4 and q_len > _SDPA_TILE:
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
# Used by vllm-gaudi-ops. Each mirrors one Gaudi kernel wrapped in gaudi.py (same name, arguments
# and semantics); the docstrings state the semantics both backends implement.

ROPE_BLOCKWISE = 0  # RotaryPosEmbeddingMode.BLOCKWISE: rotate the two halves (GPT-NeoX style)
ROPE_PAIRWISE = 1  # RotaryPosEmbeddingMode.PAIRWISE: rotate adjacent pairs (GPT-J style)

MOE_ACTIVATIONS: tuple[str, ...] = (
    "silu",
    "gelu",
)  # activations the mixture_of_experts kernel accepts


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


def mixture_of_experts(
    hidden_states: torch.Tensor,
    expert_routing_table: torch.Tensor,
    router_weights: torch.Tensor,
    w12: list[torch.Tensor] | tuple[torch.Tensor, ...],
    w3: list[torch.Tensor] | tuple[torch.Tensor, ...],
    permuted_weights: bool,
    activation: str,
    experts_min: int,
    experts_max: int,
) -> torch.Tensor:
    """Gaudi's mixture_of_experts kernel (torch.ops.hpu.mixture_of_experts).

    hidden_states [tokens, hidden]; expert_routing_table [tokens, topk] expert ids; router_weights
    [tokens, topk]. w12[i] / w3[i] belong to expert experts_min + i (experts_min..experts_max,
    inclusive): w12 is the fused gate+up projection (gate rows first), w3 the down projection;
    with permuted_weights they are [out_features, in_features] ([2 * inter, hidden] and
    [hidden, inter]), otherwise transposed. Expert ids outside [experts_min, experts_max] belong
    to other ranks and contribute nothing. out[t] = sum_k router_weights[t, k] *
    w3[e] @ (act(gate) * up), gate/up = halves of w12[e] @ hidden_states[t], e = table[t, k].
    `activation` is "silu" or "gelu" (Gaudi's gelu is the tanh approximation). Per-expert sums
    accumulate in float32; the result has hidden_states' dtype.
    """
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"mixture_of_experts: activation {activation!r} not in {MOE_ACTIVATIONS}")
    num_local = experts_max - experts_min + 1
    if len(w12) != num_local or len(w3) != num_local:
        raise ValueError(
            f"mixture_of_experts: {len(w12)}/{len(w3)} expert weights for experts "
            f"{experts_min}..{experts_max}"
        )
    tokens, hidden = hidden_states.shape
    topk = expert_routing_table.shape[-1]
    local = expert_routing_table.reshape(-1).long() - experts_min
    # Slots routed to other ranks sort last, under the id num_local, and are dropped.
    local = torch.where((local >= 0) & (local < num_local), local, num_local)
    counts = torch.bincount(local, minlength=num_local + 1)[:num_local].tolist()
    order = torch.argsort(local, stable=True)[: sum(counts)]
    rows = order // topk
    # The routed slots' inputs are gathered once, grouped by expert, and each selected expert
    # runs on its span of rows; router weights and the scatter back to the tokens then apply to
    # all slots at once. Per-expert gathers and scatters cost about as much as the matmuls on
    # small models, and at decode sizes (a few rows per expert) are a measurable share too.
    x = hidden_states.index_select(0, rows)
    y = torch.empty_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        span = slice(start, start + count)
        start += count
        up_w, down_w = w12[expert], w3[expert]
        gate_up = x[span] @ (up_w.t() if permuted_weights else up_w)
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
        torch.mm(act * up, down_w.t() if permuted_weights else down_w, out=y[span])
    weights = router_weights.reshape(-1)[order].float().unsqueeze(-1)
    out = torch.zeros(tokens, hidden, dtype=torch.float32, device=hidden_states.device)
    out.index_add_(0, rows, y.float() * weights)
    return out.to(hidden_states.dtype)


# ----------------------------------------------------------------------------- KV block copies
def copy_blocks(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_block_indices: torch.Tensor,
    dst_block_indices: torch.Tensor,
) -> None:
    """dst[dst_block_indices[i]] = src[src_block_indices[i]] along dim 0 (the block axis), where
    src and dst may be on different devices (host <-> HPU). Asynchronous on a Gaudi: call
    synchronize() before reading dst on the host.

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


# ----------------------------------------------------------------------------- 4-bit kernels
def _unpack_uint4_columns(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C/8] -> int32 [R, C]: nibble i of word j is column 8j+i (lowest nibble first)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    # & 0xF undoes the sign extension an arithmetic shift of a negative word brings in.
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).reshape(packed.shape[0], -1)


def convert_from_uint4(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: torch.Tensor,
    out_dtype: torch.dtype,
    g_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize 4-bit weights to [K, N] in `out_dtype`.

    `qweight` int32 [K, N/8] and `qzeros` int32 [G, N/8] are packed along N (nibble i of word j
    is column 8j+i); `qzeros` holds the zero points themselves. `scales` is [G, N].
    W[k, n] = (q[k, n] - z[g(k), n]) * s[g(k), n], g(k) = g_idx[k] if given, else k // (K / G)."""
    q = _unpack_uint4_columns(qweight)
    z = _unpack_uint4_columns(qzeros)
    rows = q.shape[0]
    if g_idx is None:
        g_idx = torch.arange(rows, device=q.device) // (rows // scales.shape[0])
    g_idx = g_idx.long()
    # (q - z) is a small integer, exact in any float type: one rounding, in the product.
    w = (q - z.index_select(0, g_idx)).to(torch.float32) * scales.index_select(0, g_idx).float()
    return w.to(out_dtype)


# ----------------------------------------------------------------------------- quantization kernels
# FP8 casts and GEMM with the semantics of Gaudi's torch.ops.hpu.cast_to_fp8_v2 / cast_from_fp8 /
# fp8_gemm_v2. Scales are MULTIPLIERS: cast_to_fp8_v2 takes 1/scale, the others take the
# dequantization scale. A scale is a number, a 0-d or 1-element tensor (per tensor), or a vector:
# one value per row of the activation (per token) or per column N of a [K, N] weight (per
# channel).
_GAUDI_GENERATIONS = ("3", "2")


def fp8_max(dtype: torch.dtype = torch.float8_e4m3fn) -> float:
    """Largest finite value a cast to `dtype` saturates to on this Gaudi.

    E4M3 is 448 on Gaudi 3 and 240 on Gaudi 2 (its E4M3 keeps IEEE-style special exponents); E5M2
    is 57344 on both. Emulation behaves as VLLM_HPU_EMULATION_GAUDI (default 3)."""
    if dtype == torch.float8_e5m2:
        return 57344.0
    if dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_max: {dtype} is not an FP8 type Gaudi casts to")
    from vllm_gaudi_platform import envs

    generation = (envs.get_raw(envs.VLLM_HPU_EMULATION_GAUDI) or "").strip()
    if generation not in _GAUDI_GENERATIONS:
        raise envs.EnvError(
            f"{envs.VLLM_HPU_EMULATION_GAUDI}={generation!r} is not a Gaudi generation the "
            "emulation knows; set it to 3 or 2."
        )
    return 448.0 if generation == "3" else 240.0


def _row_scale(scale: torch.Tensor | float, rows: int) -> torch.Tensor | float:
    """A per-tensor scale as is; a per-row vector as a [rows, 1] column that broadcasts."""
    if not isinstance(scale, torch.Tensor) or scale.numel() == 1:
        return scale if not isinstance(scale, torch.Tensor) else scale.reshape(()).float()
    if scale.numel() != rows:
        raise ValueError(f"scale with {scale.numel()} values for {rows} rows")
    return scale.reshape(rows, 1).float()


def _col_scale(scale: torch.Tensor | float, cols: int) -> torch.Tensor | float:
    """A per-tensor scale as is; a per-column vector as a [1, cols] row that broadcasts."""
    if not isinstance(scale, torch.Tensor) or scale.numel() == 1:
        return scale if not isinstance(scale, torch.Tensor) else scale.reshape(()).float()
    if scale.numel() != cols:
        raise ValueError(f"scale with {scale.numel()} values for {cols} columns")
    return scale.reshape(1, cols).float()


def _round_stochastic(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round float32 `v` (already within range) to one of its two FP8 neighbours, the upper one
    with probability proportional to the distance from the lower one."""
    magnitude = v.abs()
    nearest = magnitude.to(dtype)
    bits = nearest.view(torch.uint8).to(torch.int16)
    above = nearest.float() > magnitude
    # Positive FP8 values are ordered like their bit patterns: a neighbour is one code away. A
    # value that is not exact lies strictly inside the range, so both neighbours are finite.
    lo = torch.where(above, bits - 1, bits).clamp(min=0).to(torch.uint8).view(dtype).float()
    hi = torch.where(above, bits, bits + 1).clamp(max=127).to(torch.uint8).view(dtype).float()
    exact = nearest.float() == magnitude
    gap = torch.where(exact, 1.0, hi - lo)
    p_up = torch.where(exact, 0.0, (magnitude - lo) / gap)
    chosen = torch.where(torch.rand_like(magnitude) < p_up, hi, lo)
    chosen = torch.where(exact, nearest.float(), chosen)
    return (chosen * v.sign()).to(dtype)


def cast_to_fp8_v2(
    x: torch.Tensor,
    scale: torch.Tensor | float | None = None,
    stochastic_rounding: bool = False,
    is_amax: bool = False,
    dtype: torch.dtype = torch.float8_e4m3fn,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaudi's torch.ops.hpu.cast_to_fp8_v2: (fp8(x * scale), amax).

    `scale` multiplies before the cast (callers pass 1/scale), per tensor or per row of a 2-D x.
    The cast saturates: values beyond fp8_max(dtype) become +-fp8_max (torch's own cast does
    not saturate). `amax` is max |x| of the unscaled input as a 0-d float32 tensor when
    `is_amax`, else an empty tensor."""
    y = x.float()
    if scale is not None:
        y = y * _row_scale(scale, x.shape[0] if x.dim() > 1 else 1)
    limit = fp8_max(dtype)
    y = y.clamp(-limit, limit)
    out = _round_stochastic(y, dtype) if stochastic_rounding else y.to(dtype)
    amax = x.abs().amax().float() if is_amax else torch.empty(0, device=x.device)
    return out, amax


def cast_from_fp8(
    x: torch.Tensor, scale: torch.Tensor | float | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """Gaudi's torch.ops.hpu.cast_from_fp8: x * scale in `out_dtype` (scale per tensor or per
    row of a 2-D x; None means 1)."""
    y = x.float()
    if scale is not None:
        y = y * _row_scale(scale, x.shape[0] if x.dim() > 1 else 1)
    return y.to(out_dtype)


def fp8_gemm_v2(
    A: torch.Tensor,
    trans_A: bool,
    B: torch.Tensor,
    trans_B: bool,
    D: torch.Tensor | None,
    out_dtype: torch.dtype,
    A_scale_inv: torch.Tensor | float | None = None,
    B_scale_inv: torch.Tensor | float | None = None,
    bias: torch.Tensor | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """Gaudi's torch.ops.hpu.fp8_gemm_v2: (op(A) * A_scale_inv) @ (op(B) * B_scale_inv) + bias,
    plus D when `accumulate`, in `out_dtype`; op transposes the last two axes when asked.

    A is [M, K] (after op), FP8 activations with a per-tensor or per-row ([M]) dequantization
    scale; B is [K, N] (after op; a weight stored [K, N] passes trans_B=False), FP8 with a
    per-tensor or per-column ([N], per output channel) scale. Emulated in float32: both scales
    factor out of the dot products, so they apply to the float32 product."""
    a = A.float().transpose(-2, -1) if trans_A else A.float()
    b = B.float().transpose(-2, -1) if trans_B else B.float()
    out = a @ b
    if A_scale_inv is not None:
        out = out * _row_scale(A_scale_inv, a.shape[-2])
    if B_scale_inv is not None:
        out = out * _col_scale(B_scale_inv, b.shape[-1])
    if bias is not None:
        out = out + bias.float()
    if accumulate:
        if D is None:
            raise ValueError("fp8_gemm_v2: accumulate=True needs D")
        out = out + D.float()
    return out.to(out_dtype)


# ----------------------------------------------------------------------------- LoRA kernels
# Multi-LoRA in static shapes: every token is multiplied by EVERY adapter slot's A (one matmul over
# the stacked [slots * rank, in] weights) and a one-hot mask of the token's slot keeps its own
# adapter's rows. Shapes depend only on (tokens, slots, rank), which are fixed by the bucket and by
# max_loras / max_lora_rank, so a batch mixing adapters (or with none) never makes a new shape.
def _lora_slot_mask(token_lora: torch.Tensor, num_slots: int) -> torch.Tensor:
    """[T] slot per token (-1 = no adapter) -> float32 [T, num_slots] one-hot (all zero for -1)."""
    slots = torch.arange(num_slots, device=token_lora.device)
    return (token_lora.unsqueeze(1) == slots).to(torch.float32)


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


def lora_expand(x: torch.Tensor, lora_b: torch.Tensor, token_lora: torch.Tensor) -> torch.Tensor:
    """LoRA expand batched over adapters: out[t] = x[t] @ lora_b[token_lora[t]].T, and 0 for a
    token whose slot is -1.

    x [T, rank] (the shrink output); lora_b [slots, out, rank] (vLLM's stacked B without its layer
    axis); token_lora [T]. Returns float32 [T, out]."""
    slots, width, rank = lora_b.shape
    mask = _lora_slot_mask(token_lora, slots)
    spread = (x.float().unsqueeze(1) * mask.unsqueeze(-1)).reshape(-1, slots * rank)
    return spread @ lora_b.float().transpose(1, 2).reshape(slots * rank, width)


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
