"""The Gaudi backend of the seam: the ONLY module in the tree that imports habana_frameworks.

Thin wrappers providing `contract.HpuBackend`, the same API as `emulated.py`. Off Gaudi, the tests
run this module over the Habana stand-in (tests/habana_standin), which enforces the input rules
of Habana's kernels; on a Gaudi the same tests (marked `gaudi`) run it over the real stack. Where
a wrapper adapts an input to a kernel's rule, the comment names the source of the rule.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import habana_frameworks.torch as htorch  # noqa: F401 - registers the hpu device with torch
import habana_frameworks.torch.core as htcore
import habana_frameworks.torch.hpu as hthpu
import torch
from habana_frameworks.torch.hpex.kernels import FusedSDPA, RotaryPosEmbeddingMode
from habana_frameworks.torch.hpex.kernels import apply_rotary_pos_emb as _hpu_rotary_pos_emb
from habana_frameworks.torch.hpex.normalization import FusedRMSNorm

from vllm_gaudi_platform.envs import lazy_mode
from vllm_gaudi_platform.seam import latent_attention, paged_attention
from vllm_gaudi_platform.seam.plain_attention import attention_with_sinks

NAME = "gaudi"
DEVICE_TYPE = "hpu"
IS_EMULATED = False
DISPATCH_KEY = "HPU"
DIST_BACKEND = "hccl"
COMPILE_BACKEND = "hpu_backend"
# Pinned host memory is not supported on HPU: Intel's vllm-gaudi platform answers
# is_pin_memory_available() with False.
PIN_MEMORY = False
SHARED_HOST_MEMORY = False
NIXL_DEVICE_MEMORY = "VRAM"


def torch_device(index: int = 0) -> torch.device:
    """The process's Gaudi. Each process (one per TP/PP/DP rank) acquires exactly one device,
    named torch.device("hpu") whatever its rank: Intel's vllm-gaudi worker does so, and
    "hpu:{local_rank}" names a device the process does not have for every rank but the first."""
    return torch.device("hpu")


def set_device(device: torch.device) -> None:
    """Nothing to select: the process's one Gaudi is current (Intel's platform makes this a
    no-op too)."""


def device_count() -> int:
    return int(hthpu.device_count())


def device_name(index: int = 0) -> str:
    return str(hthpu.get_device_name(index))


def mem_get_info() -> tuple[int, int]:
    free, total = hthpu.mem_get_info()
    return int(free), int(total)


def memory_allocated() -> int:
    return int(hthpu.memory_allocated())


def synchronize() -> None:
    hthpu.synchronize()


def mark_step() -> None:
    htcore.mark_step()


Stream = hthpu.Stream
Event = hthpu.Event


def graphs_supported() -> bool:
    """HPU graphs exist in lazy mode only: the bridge exports HPUGraph from
    habana_frameworks.torch.hpu when PT_HPU_LAZY_MODE is not 0 (Intel's vllm-gaudi wraps its
    model in HPU graphs only in lazy mode and compiles it with torch.compile otherwise)."""
    return hasattr(hthpu, "HPUGraph")


class Graph:
    """One forward pass captured as an HPU graph (`habana_frameworks.torch.hpu.HPUGraph`, lazy
    mode only: see graphs_supported).

    Replay re-runs the recorded ops on the buffers seen at capture and returns the output
    tensors captured then (overwritten by the replay). `inputs` is not read here: the emulated
    twin checks it (Gaudi gives no such check; a re-allocated input replays stale data).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._graph = hthpu.HPUGraph()
        self._output: Any = None

    def capture(self, fn: Callable[[], Any], inputs: Mapping[str, Any]) -> Any:
        """Record `fn` on a side stream (as HPU graph capture requires) and return its output."""
        with hthpu.stream(hthpu.Stream()):
            self._graph.capture_begin()
            self._output = fn()
            self._graph.capture_end()
        return self._output

    def replay(self, inputs: Mapping[str, Any]) -> Any:
        """Replay the recording; returns the captured output tensors, now holding new results."""
        self._graph.replay()
        return self._output


def current_stream() -> Any:
    return hthpu.current_stream()


def stream(stream: Any) -> AbstractContextManager[Any]:
    return hthpu.stream(stream)


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


# ----------------------------------------------------------------------------- op-family kernels
# Used by vllm-gaudi-ops; emulated.py states the semantics of each one.

ROPE_BLOCKWISE = RotaryPosEmbeddingMode.BLOCKWISE.value
ROPE_PAIRWISE = RotaryPosEmbeddingMode.PAIRWISE.value

MOE_ACTIVATIONS: tuple[str, ...] = ("silu", "gelu")


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
    return torch.ops.hpu.mixture_of_experts(
        hidden_states=hidden_states,
        # The kernel is built for int64 expert ids (Intel casts the top-k ids before the call);
        # expert-parallel routing tables come out int32.
        expert_routing_table=expert_routing_table.to(torch.int64),
        router_weights=router_weights.to(hidden_states.dtype),
        w12=list(w12),
        w3=list(w3),
        permuted_weights=permuted_weights,
        activation=activation,
        experts_min=experts_min,
        experts_max=experts_max,
    )


def mixture_of_experts_fp8(
    hidden_states: torch.Tensor,
    expert_routing_table: torch.Tensor,
    router_weights: torch.Tensor,
    w12: list[torch.Tensor] | tuple[torch.Tensor, ...],
    w3: list[torch.Tensor] | tuple[torch.Tensor, ...],
    d_scale_hidden_states: torch.Tensor,
    d_scale_intermediate_hidden_states: list[torch.Tensor] | None,
    d_scale_w12: list[torch.Tensor] | tuple[torch.Tensor, ...],
    d_scale_w3: list[torch.Tensor] | tuple[torch.Tensor, ...],
    permuted_weights: bool,
    activation: str,
    experts_min: int,
    experts_max: int,
) -> torch.Tensor:
    # The FP8 overload of the same op, picked by its scale arguments; without intermediate
    # scales the kernel scales the intermediate activations itself.
    intermediate = (
        {}
        if d_scale_intermediate_hidden_states is None
        else {"d_scale_intermediate_hidden_states": list(d_scale_intermediate_hidden_states)}
    )
    return torch.ops.hpu.mixture_of_experts(
        hidden_states=hidden_states,
        expert_routing_table=expert_routing_table.to(torch.int64),
        router_weights=router_weights,
        w12=list(w12),
        w3=list(w3),
        d_scale_hidden_states=d_scale_hidden_states,
        d_scale_w12=list(d_scale_w12),
        d_scale_w3=list(d_scale_w3),
        permuted_weights=permuted_weights,
        activation=activation,
        experts_min=experts_min,
        experts_max=experts_max,
        **intermediate,
    )


def mixture_of_experts_mxfp4(
    hidden_states: torch.Tensor,
    expert_routing_table: torch.Tensor,
    router_weights: torch.Tensor,
    w12: list[torch.Tensor] | tuple[torch.Tensor, ...],
    w3: list[torch.Tensor] | tuple[torch.Tensor, ...],
    w12_bias: list[torch.Tensor] | tuple[torch.Tensor, ...],
    w3_bias: list[torch.Tensor] | tuple[torch.Tensor, ...],
    d_scale_w12: list[torch.Tensor] | tuple[torch.Tensor, ...],
    d_scale_w3: list[torch.Tensor] | tuple[torch.Tensor, ...],
    experts_min: int,
    experts_max: int,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    args = (
        hidden_states,
        # Intel: the MXFP4 overloads take an int32 routing table.
        expert_routing_table.to(torch.int32),
        router_weights.to(hidden_states.dtype),
        list(w12),
        list(w3),
        list(w12_bias),
        list(w3_bias),
        list(d_scale_w12),
        list(d_scale_w3),
    )
    flags: dict[str, Any] = {
        "experts_min": experts_min,
        "experts_max": experts_max,
        "alpha": alpha,
        "limit": limit,
    }
    if _eager_frontend():
        # The MXFP4 overloads are blocklisted in the eager frontend (Intel: "frontend_blocklist:
        # [eager]"): outside lazy mode and outside a compiled graph, a graph of their own.
        return _compiled_mxfp4_moe()(*args, **flags)
    return _mxfp4_moe(*args, **flags)


def _mxfp4_moe(*args: Any, experts_min: int, experts_max: int, alpha: float, limit: float):
    # Intel's call: 32-value blocks, [out, in] ("permuted") weights, FP4 (not FP8) elements.
    return torch.ops.hpu.mixture_of_experts.bias_mxfp4_fused_weights(
        *args,
        block_size=32,
        permuted_weights=True,
        experts_min=experts_min,
        experts_max=experts_max,
        is_fp4=True,
        chunk_size=0,
        total_experts=0,
        alpha=alpha,
        limit=limit,
    )


def _eager_frontend() -> bool:
    return not lazy_mode() and not torch.compiler.is_compiling()


_COMPILED: dict[str, Callable[..., Any]] = {}


def _compiled_mxfp4_moe() -> Callable[..., Any]:
    if "mxfp4" not in _COMPILED:
        _COMPILED["mxfp4"] = torch.compile(_mxfp4_moe, backend=COMPILE_BACKEND, dynamic=False)
    return _COMPILED["mxfp4"]


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


# ----------------------------------------------------------------------------- 4-bit kernels
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
    if g_idx is None:
        return torch.ops.hpu.convert_from_uint4(qweight, scales, qzeros, out_dtype)
    return torch.ops.hpu.convert_from_uint4(qweight, scales, qzeros, out_dtype, g_idx)


# ----------------------------------------------------------------------------- quantization kernels
# Scales are MULTIPLIERS (see emulated.py): cast_to_fp8_v2 takes 1/scale, the others take the
# dequantization scale; per tensor, per row of the activation, or per column N of a [K, N] weight.
def fp8_max(dtype: torch.dtype = torch.float8_e4m3fn) -> float:
    """Largest finite value a cast to `dtype` saturates to on this Gaudi: E4M3 is 448 on Gaudi 3
    and 240 on Gaudi 2; E5M2 is 57344 on both."""
    if dtype == torch.float8_e5m2:
        return 57344.0
    if dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_max: {dtype} is not an FP8 type Gaudi casts to")
    return 240.0 if "GAUDI2" in device_name().upper() else 448.0


def _as_tensor_scale(
    scale: torch.Tensor | float | None, device: torch.device
) -> torch.Tensor | None:
    """Gaudi's FP8 ops take scales as tensors; a per-row or per-column vector as a 1-D tensor."""
    if scale is None or isinstance(scale, torch.Tensor):
        return scale
    return torch.tensor(scale, dtype=torch.float32, device=device)


def cast_to_fp8_v2(
    x: torch.Tensor,
    scale: torch.Tensor | float | None = None,
    stochastic_rounding: bool = False,
    is_amax: bool = False,
    dtype: torch.dtype = torch.float8_e4m3fn,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8(x * scale) saturated to +-fp8_max(dtype), amax of x when is_amax)."""
    out, amax = torch.ops.hpu.cast_to_fp8_v2(
        x, _as_tensor_scale(scale, x.device), stochastic_rounding, is_amax, dtype
    )
    return out, amax


def cast_from_fp8(
    x: torch.Tensor, scale: torch.Tensor | float | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """x * scale in `out_dtype`."""
    return torch.ops.hpu.cast_from_fp8(x, _as_tensor_scale(scale, x.device), out_dtype)


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
    """(op(A) * A_scale_inv) @ (op(B) * B_scale_inv) + bias (+ D when accumulate)."""
    return torch.ops.hpu.fp8_gemm_v2(
        A,
        trans_A,
        B,
        trans_B,
        D,
        out_dtype,
        _as_tensor_scale(A_scale_inv, A.device),
        _as_tensor_scale(B_scale_inv, B.device),
        bias,
        accumulate,
    )


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
