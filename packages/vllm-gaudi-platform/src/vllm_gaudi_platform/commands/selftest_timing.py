"""`vllm-gaudi selftest`'s timings of the kernels our defaults depend on, as ratios.

Absolute times depend on the machine; the ratios are what a default rests on: the MoE kernel over
all experts against the routed ones at batch 1 (the low-batch expert gather), FusedSDPA at the
prompt bucket shapes (per token, against the smallest bucket; the causal mode against an explicit
mask), and the FP8 GEMM against the bf16 matmul of the same shape. Each time is the median of a
few calls after one warm-up call, with the device synchronized around each.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

REPEATS = 5


def median_seconds(kernels: Any, fn: Callable[[], Any], repeats: int = REPEATS) -> float:
    fn()
    kernels.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        kernels.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# A decode step of one token over a layer of many experts (sizes of a small MoE layer).
MOE_SHAPE = {"experts": 32, "topk": 2, "hidden": 512, "inter": 512}


def moe_batch1(kernels: Any, device: torch.device) -> dict[str, Any]:
    """One token routed to 2 of 32 experts: the dense call (every expert handed to the kernel),
    the call over the 2 routed experts only, and the gather of their weights; and whether NaN
    weights in the unrouted experts reach the result (a kernel that reads them computes them)."""
    e, _, h, i = MOE_SHAPE.values()
    g = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16
    w12 = torch.randn(e, 2 * i, h, generator=g).div(10).to(dtype).to(device)
    w3 = torch.randn(e, h, i, generator=g).div(10).to(dtype).to(device)
    x = torch.randn(1, h, generator=g).to(dtype).to(device)
    routed = torch.tensor([[3, 17]], device=device)
    weights = torch.tensor([[0.6, 0.4]], dtype=dtype, device=device)
    renumbered = torch.tensor([[0, 1]], device=device)
    index = torch.tensor([3, 17], device=device)

    def dense(up=w12, down=w3):
        return kernels.mixture_of_experts(
            x, routed, weights, list(up.unbind(0)), list(down.unbind(0)), True, "silu", 0, e - 1
        )

    def routed_only(up, down):
        return kernels.mixture_of_experts(
            x, renumbered, weights, list(up.unbind(0)), list(down.unbind(0)), True, "silu", 0, 1
        )

    picked = (w12.index_select(0, index), w3.index_select(0, index))
    t_dense = median_seconds(kernels, dense)
    t_routed = median_seconds(kernels, lambda: routed_only(*picked))
    t_gathered = median_seconds(
        kernels, lambda: routed_only(w12.index_select(0, index), w3.index_select(0, index))
    )
    poisoned = w12.clone()
    unrouted = torch.ones(e, dtype=torch.bool)
    unrouted[[3, 17]] = False
    poisoned[unrouted.to(device)] = float("nan")
    finite = bool(torch.isfinite(dense(up=poisoned)).all().cpu())
    return {
        **MOE_SHAPE,
        "dense_seconds": t_dense,
        "routed_seconds": t_routed,
        "gathered_seconds": t_gathered,
        "dense_over_routed": t_dense / t_routed,
        "gathered_over_dense": t_gathered / t_dense,
        "nan_unrouted_finite": finite,
    }


# Prompt buckets (query tokens of one sequence) the SDPA timings run at.
SDPA_BUCKETS = (128, 256, 512)
SDPA_HEADS, SDPA_HEAD_DIM = 8, 64


def sdpa_buckets(kernels: Any, device: torch.device) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    rows = []
    for q_len in SDPA_BUCKETS:
        q, k, v = (
            torch.randn(1, SDPA_HEADS, q_len, SDPA_HEAD_DIM, generator=g)
            .to(torch.bfloat16)
            .to(device)
            for _ in range(3)
        )
        allowed = torch.ones(q_len, q_len, dtype=torch.bool).tril()
        mask = torch.zeros(q_len, q_len).masked_fill(~allowed, -1e30)[None, None]
        mask = mask.to(torch.bfloat16).to(device)
        causal = median_seconds(
            kernels, functools.partial(kernels.fused_sdpa, q, k, v, is_causal=True)
        )
        masked = median_seconds(
            kernels, functools.partial(kernels.fused_sdpa, q, k, v, attn_mask=mask)
        )
        rows.append({"query_tokens": q_len, "causal_seconds": causal, "mask_seconds": masked})
    base = rows[0]["causal_seconds"] / rows[0]["query_tokens"]
    for row in rows:
        row["per_token_vs_smallest"] = row["causal_seconds"] / row["query_tokens"] / base
        row["mask_over_causal"] = row["mask_seconds"] / row["causal_seconds"]
    return {"heads": SDPA_HEADS, "head_dim": SDPA_HEAD_DIM, "buckets": rows}


GEMM_SHAPE = (64, 1024, 1024)  # M tokens, K in, N out


def fp8_gemm(kernels: Any, device: torch.device) -> dict[str, Any]:
    m, k, n = GEMM_SHAPE
    g = torch.Generator().manual_seed(2)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(device)
    w = torch.randn(n, k, generator=g).div(32).to(torch.bfloat16).to(device)
    xq = x.float().clamp(-200, 200).to(torch.float8_e4m3fn)
    wq = (w.float() * 32).to(torch.float8_e4m3fn)
    scale = torch.tensor(1 / 32, device=device)
    one = torch.tensor(1.0, device=device)
    t_bf16 = median_seconds(kernels, lambda: kernels.linear(x, w))
    t_fp8 = median_seconds(
        kernels,
        lambda: kernels.fp8_gemm_v2(xq, False, wq, True, None, torch.bfloat16, one, scale),
    )
    return {
        "shape": list(GEMM_SHAPE),
        "bf16_seconds": t_bf16,
        "fp8_seconds": t_fp8,
        "fp8_over_bf16": t_fp8 / t_bf16,
    }


def run_timings(kernels: Any) -> dict[str, Any]:
    device = kernels.torch_device(0)
    return {
        "moe_batch1": moe_batch1(kernels, device),
        "sdpa_buckets": sdpa_buckets(kernels, device),
        "fp8_gemm": fp8_gemm(kernels, device),
    }
