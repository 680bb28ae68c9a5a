"""Peak mask and score memory of one prefill attention call, before and after bounded prefill.

Before: the prefill built one boolean mask of [rows, 1, query_bucket, ctx_bucket * block_size +
query_bucket] and handed it to the fused SDPA (and the soft-capped path computed float32 scores
over that whole product). That is the "old" column, from the shapes.

After: rows of one sequence with no cached context, window or soft-cap call the fused SDPA in its
causal mode with valid lengths (no mask tensor at all); every other prefill attends in slices of
VLLM_PREFILL_QUERY_SLICE queries, and a windowed layer gathers only the context blocks that can
be inside its window. The "new" columns are MEASURED: the script runs one attention layer of the
HPU backend (CPU emulation) on the real bucket shapes and records the largest mask handed to the
kernel, the largest mask the emulated kernel builds inside (Gaudi's kernel builds none in causal
mode), and the largest float32 score matrix per attention head that a call may hold: the
soft-capped path and any unfused SDPA hold [query rows, keys] per call, the emulated causal mode
one tile of 256 queries. Gaudi's fused kernel streams its scores, so there the score columns are
upper bounds and the mask columns are what it really reads.

    VLLM_HPU_EMULATION=cpu python benchmarks/prefill_memory.py [--tokens 32768] [--slice 1024]

Scores are per query head (the mask is shared by all heads); one head of size 16 keeps the run to
a minute on two cores without changing any byte count above.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass

BLOCK = 128


@dataclass(frozen=True)
class Case:
    name: str
    new_tokens: int  # this step's prompt tokens
    cached: int  # tokens already in the KV cache (prefix-cache hit or earlier chunk)
    window: int | None = None
    softcap: float | None = None


def cases(tokens: int) -> list[Case]:
    half = tokens // 2
    return [
        Case(f"{tokens} new, no cache", tokens, 0),
        Case(f"{half} cached + {half} new", half, half),
        Case(f"{tokens} new, soft-cap 50", tokens, 0, softcap=50.0),
        Case(f"{half} cached + {half} new, window 4096", half, half, window=4096),
    ]


def old_bytes(case: Case) -> tuple[int, int]:
    """(mask bytes, per-head float32 score bytes) of the single unsliced call."""
    ctx_blocks = math.ceil(case.cached / BLOCK)
    keys = ctx_blocks * BLOCK + case.new_tokens
    return case.new_tokens * keys, case.new_tokens * keys * 4


def measure(case: Case) -> dict[str, int]:
    """Run one attention layer on the case's bucket and record the largest tensors."""
    import torch.nn.functional as F

    from vllm_gaudi_platform.attention import impl as attention
    from vllm_gaudi_platform.seam import emulated

    seen = {"kernel_mask": 0, "emulation_mask": 0, "scores": 0}

    def note(key: str, value: int) -> None:
        seen[key] = max(seen[key], value)

    real_sdpa, real_fused, real_capped = (
        F.scaled_dot_product_attention,
        emulated.fused_sdpa,
        attention._softcapped_attention,
    )

    def sdpa(q, k, v, attn_mask=None, **kw):  # the emulation's torch call: its own masks
        if attn_mask is not None:
            note("emulation_mask", attn_mask.numel() * attn_mask.element_size())
        note("scores", q.shape[0] * q.shape[-2] * k.shape[-2] * 4)
        return real_sdpa(q, k, v, attn_mask=attn_mask, **kw)

    def fused(q, k, v, attn_mask=None, **kw):  # what the HPU kernel receives
        if attn_mask is not None:
            note("kernel_mask", attn_mask.numel() * attn_mask.element_size())
            # What an unfused kernel would hold for this call; causal mode has no such bound
            # from the call (the emulation's tiles are counted in `sdpa`).
            note("scores", q.shape[0] * q.shape[-2] * k.shape[-2] * 4)
        return real_fused(q, k, v, attn_mask=attn_mask, **kw)

    def capped(q, k, v, mask, scale, cap):
        note("kernel_mask", mask.numel() * mask.element_size())
        note("scores", q.shape[0] * q.shape[-2] * k.shape[-2] * 4)
        return real_capped(q, k, v, mask, scale, cap)

    F.scaled_dot_product_attention = sdpa
    emulated.fused_sdpa = fused
    attention._softcapped_attention = capped
    try:
        _run_layer(case)
    finally:
        F.scaled_dot_product_attention = real_sdpa
        emulated.fused_sdpa = real_fused
        attention._softcapped_attention = real_capped
    return seen


def _run_layer(case: Case) -> None:
    import torch

    from vllm_gaudi_platform.attention import step_layout
    from vllm_gaudi_platform.attention.impl import HPUAttentionImpl
    from vllm_gaudi_platform.attention.metadata_builder import build_metadata

    heads, dim = 1, 16
    seq = case.cached + case.new_tokens
    blocks = math.ceil(seq / BLOCK)
    layout = step_layout.plan_step(
        query_lens=[case.new_tokens], seq_lens=[seq], block_size=BLOCK, plan=None
    )
    table = torch.arange(1, blocks + 1, dtype=torch.int32)[None]
    positions = torch.arange(case.cached, seq)
    slot_mapping = table[0, positions // BLOCK].long() * BLOCK + positions % BLOCK
    md = build_metadata(
        layout=layout,
        seq_lens=[seq],
        block_table=table,
        slot_mapping=slot_mapping,
        block_size=BLOCK,
        device=torch.device("cpu"),
    )
    gen = torch.Generator().manual_seed(0)
    kv_cache = torch.randn(blocks + 1, BLOCK, heads, 2 * dim, generator=gen).transpose(1, 2)
    impl = HPUAttentionImpl(
        heads, dim, dim**-0.5, sliding_window=case.window, logits_soft_cap=case.softcap
    )
    n = case.new_tokens
    q, k, v = (torch.randn(n, heads * dim, generator=gen) for _ in range(3))
    out = torch.empty(n, heads * dim)
    impl.forward(None, q, k, v, kv_cache, md, out)
    assert torch.isfinite(out).all()


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB" if n else "0"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768, help="prompt length (tokens)")
    parser.add_argument("--slice", type=int, default=1024, help="VLLM_PREFILL_QUERY_SLICE")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_HPU_EMULATION", "cpu")
    os.environ["VLLM_PREFILL_QUERY_SLICE"] = str(args.slice)

    header = (
        f"{'case (block 128, one row)':<40} {'old mask':>12} {'new mask':>12} {'ratio':>7}"
        f" {'emul. mask':>12} {'old scores/hd':>16} {'new scores/hd':>16} {'ratio':>7}"
        f" {'secs':>6}"
    )
    print(f"prefill attention, query slice {args.slice}")
    print(header)
    print("-" * len(header))
    for case in cases(args.tokens):
        start = time.perf_counter()
        new = measure(case)
        secs = time.perf_counter() - start
        old_mask, old_scores = old_bytes(case)
        mask_ratio = f"{old_mask / new['kernel_mask']:,.0f}x" if new["kernel_mask"] else "inf"
        print(
            f"{case.name:<40} {_mib(old_mask):>12} {_mib(new['kernel_mask']):>12}"
            f" {mask_ratio:>7} {_mib(new['emulation_mask']):>12} {_mib(old_scores):>16}"
            f" {_mib(new['scores']):>16} {old_scores / new['scores']:>6,.0f}x {secs:>6.1f}"
        )
    print(
        "old: one [rows, 1, query, ctx*128 + query] mask (and, soft-capped, float32 scores of that"
        " size per head); new: measured, largest single tensor of any call."
    )


if __name__ == "__main__":
    main()
