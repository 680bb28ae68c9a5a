"""Mask-building time of one attention step against the number of layers.

Each prefill query slice needs a mask (same sequence, causal, and the window or ALiBi of the
layer), an encoder-only step a padding bias or a same-sequence mask, a decode step a slot bias.
They depend on the step and on the layer's kind (window, ALiBi slopes), not on the layer: the
step's first layer builds them and the later layers of the same kind reuse them
(`HPUAttentionMetadata.derived`). This script runs the HPU attention backend (CPU emulation) on
one step for a 2-layer and an 8-layer stack and times what the layers spend building masks:

- "per step": the backend as it is;
- "per layer": the same run with the sharing switched off (every layer rebuilds), as before.

A ratio of 8-layer to 2-layer mask time near 1 means the mask work does not grow with depth.
It also reports the bytes of the masks a step keeps (shared by its layers). Attention itself is
not timed. Ends with one JSON line of the figures.

    VLLM_HPU_EMULATION=cpu python benchmarks/attention_masks.py
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import dataclass

BLOCK = 128
HEADS, DIM = 2, 16  # small heads: the masks are per step, not per head


@dataclass(frozen=True)
class Case:
    name: str
    query_lens: tuple[int, ...]
    ctx_lens: tuple[int, ...]
    window: int | None = None
    alibi: bool = False
    encoder: bool = False


CASES = (
    # Eight prompts of 128 new tokens after 1024 cached ones each, packed in one row.
    Case("packed prefill, 8 x (1024 + 128)", (128,) * 8, (1024,) * 8),
    Case("packed prefill, window 512", (128,) * 8, (1024,) * 8, window=512),
    Case("packed prefill, ALiBi", (128,) * 8, (1024,) * 8, alibi=True),
    Case("encoder-only, 16 x 128 packed", (128,) * 16, (0,) * 16, encoder=True),
    Case("decode, 64 x 2048, window 512", (1,) * 64, (2047,) * 64, window=512),
)


def _metadata(case: Case):
    import torch

    from vllm_gaudi_platform.attention import step_layout
    from vllm_gaudi_platform.attention.metadata_builder import build_metadata

    seq_lens = [c + q for c, q in zip(case.ctx_lens, case.query_lens)]
    layout = step_layout.plan_step(
        query_lens=list(case.query_lens), seq_lens=seq_lens, block_size=BLOCK, plan=None
    )
    per_seq = max(math.ceil(s / BLOCK) for s in seq_lens)
    table = torch.arange(1, len(seq_lens) * per_seq + 1, dtype=torch.int32).view(-1, per_seq)
    slots = []
    for i, (c, s) in enumerate(zip(case.ctx_lens, seq_lens)):
        pos = torch.arange(c, s)
        slots.append(table[i, pos // BLOCK].long() * BLOCK + pos % BLOCK)
    md = build_metadata(
        layout=layout,
        seq_lens=seq_lens,
        block_table=table,
        slot_mapping=torch.cat(slots),
        block_size=BLOCK,
        device=torch.device("cpu"),
    )
    return md, int(table.max()) + 1


def _layer(case: Case):
    from vllm.v1.attention.backend import AttentionType

    from vllm_gaudi_platform.attention.impl import HPUAttentionImpl

    slopes = [2.0 ** (-(i + 1)) for i in range(HEADS)] if case.alibi else None
    kind = AttentionType.ENCODER_ONLY if case.encoder else AttentionType.DECODER
    return HPUAttentionImpl(
        HEADS, DIM, DIM**-0.5, sliding_window=case.window, alibi_slopes=slopes, attn_type=kind
    )


class MaskClock:
    """Seconds spent in the metadata's mask builders (outermost calls only), and whether the
    step's sharing is on."""

    METHODS = ("derived", "prefill_keys_for", "decode_blocks_for")

    def __init__(self, share: bool) -> None:
        self.share, self.seconds, self._depth = share, 0.0, 0

    def __enter__(self) -> MaskClock:
        from vllm_gaudi_platform.attention.metadata import HPUAttentionMetadata

        self._real = {m: getattr(HPUAttentionMetadata, m) for m in self.METHODS}
        for name, real in self._real.items():
            setattr(HPUAttentionMetadata, name, self._timed(real))
        return self

    def __exit__(self, *exc: object) -> None:
        from vllm_gaudi_platform.attention.metadata import HPUAttentionMetadata

        for name, real in self._real.items():
            setattr(HPUAttentionMetadata, name, real)

    def _timed(self, real):
        clock = self

        def timed(md, *args, **kwargs):
            if not clock.share:
                md._derived.clear()  # as before: nothing built by another layer is reused
            clock._depth += 1
            start = time.perf_counter()
            try:
                return real(md, *args, **kwargs)
            finally:
                clock._depth -= 1
                if clock._depth == 0:
                    clock.seconds += time.perf_counter() - start

        return timed


def run(case: Case, layers: int, share: bool) -> tuple[float, int]:
    """(mask seconds, bytes of masks the step keeps) for one step over `layers` layers."""
    import torch

    md, num_blocks = _metadata(case)
    gen = torch.Generator().manual_seed(0)
    n = sum(case.query_lens)
    q, k, v = (torch.randn(n, HEADS * DIM, generator=gen) for _ in range(3))
    impls = [_layer(case) for _ in range(layers)]
    # Per layer [blocks, heads, slots, 2 * dim], as the backend allocates it (block-first LBNHC).
    caches = [
        torch.randn(num_blocks, BLOCK, HEADS, 2 * DIM, generator=gen).transpose(1, 2) for _ in impls
    ]
    out = torch.empty(n, HEADS * DIM)
    with MaskClock(share) as clock:
        for impl, cache in zip(impls, caches):
            impl.forward(None, q, k, v, None if case.encoder else cache, md, out)
    kept = sum(_nbytes(value) for value in md._derived.values())
    return clock.seconds, kept


def _nbytes(value) -> int:
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, tuple):
        return sum(_nbytes(v) for v in value)
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="runs per figure (best kept)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_HPU_EMULATION", "cpu")

    header = (
        f"{'case':<36} {'2 layers':>9} {'8 layers':>9} {'8/2':>6} {'old 2':>9} {'old 8':>9}"
        f" {'old 8/2':>8} {'kept':>10}"
    )
    print("mask-building seconds per step (per step: now; old: every layer rebuilds)")
    print(header)
    print("-" * len(header))
    figures = {}
    for case in CASES:
        row = {}
        for share in (True, False):
            for layers in (2, 8):
                runs = [run(case, layers, share) for _ in range(args.repeats)]
                row[(share, layers)] = min(r[0] for r in runs)
                if share and layers == 8:
                    kept = runs[0][1]
        ratio = row[(True, 8)] / row[(True, 2)]
        old_ratio = row[(False, 8)] / row[(False, 2)]
        figures[case.name] = {
            "ratio_8_vs_2": round(ratio, 3),
            "old_ratio_8_vs_2": round(old_ratio, 3),
            "seconds_8_layers": round(row[(True, 8)], 4),
            "old_seconds_8_layers": round(row[(False, 8)], 4),
            "kept_bytes": kept,
        }
        print(
            f"{case.name:<36} {row[(True, 2)]:>9.4f} {row[(True, 8)]:>9.4f} {ratio:>6.2f}"
            f" {row[(False, 2)]:>9.4f} {row[(False, 8)]:>9.4f} {old_ratio:>8.2f}"
            f" {kept / (1 << 20):>7.1f} MiB"
        )
    worst = max(f["ratio_8_vs_2"] for f in figures.values())
    print(json.dumps({"mask_seconds_ratio_8_vs_2_layers": worst, "cases": figures}))


if __name__ == "__main__":
    main()
