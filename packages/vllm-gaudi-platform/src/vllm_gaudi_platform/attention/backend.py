"""HPU attention backend: Gaudi's KV-cache layout, bucketed prefill through fused SDPA, and paged
decode over flat block lists.

KV cache: per layer, blocks are stored block-size-first (`KVCacheLayout.LBNHC`): viewed flat it is
`[num_blocks * block_size, kv_heads, 2 * head_size]`, keys then values, one row per token slot.

Every step is split by the runner into a prefill part and a decode part (see `step_layout.py`),
each padded to a warmed bucket, so every tensor shape below depends only on the bucket:

- prefill: the query tokens are laid out on a `[rows, query_bucket]` grid; each row sees its
  sequences' cached context (gathered from `ctx_bucket` blocks) and its own new tokens. Rows of
  one sequence each, without cached context, window or soft-cap, take the fused SDPA's causal
  mode with valid lengths: no mask tensor. Every other prefill attends in slices of
  `VLLM_PREFILL_QUERY_SLICE` queries, each slice with its own boolean mask (causal,
  per-sequence, padding-aware, windowed) built from per-token positions, so mask and score
  memory grow linearly with the prompt. A windowed layer gathers only the context blocks that
  can be inside its window (a count fixed by the bucket and the window);
- decode: one query per sequence against a flat list of `num_blocks_bucket` blocks, each block
  tagged with the sequence it belongs to and how many of its slots are used; softmax across a
  sequence's blocks is done with scatter reductions, in plain torch. A windowed layer first
  keeps only the blocks that reach into the window, again a count fixed by the bucket and the
  window.

A step whose prefill row packs several sequences (`HPUAttentionMetadata.prefill_packed`) takes
the sliced path with every context block, whatever the layer: a graph captured for a bucket must
be captured separately for its packed and its one-sequence-per-row variants.

Modules, in import order (each imports from the ones below it, never from one above):

- `backend.py`: `HPUAttentionBackend`, the class vLLM is handed (what the backend supports, and
  which impl and metadata builder it uses);
- `impl.py`: `HPUAttentionImpl`, the forward pass: KV-cache writes, prefill with and without
  context, decode, sliding windows, soft-cap, ALiBi, sinks, encoder-only attention, FP8 KV cache;
- `metadata.py`: `HPUAttentionMetadata`, with the per-window narrowing of the block gathers and
  the prefill slice masks; `metadata_builder.py`: its builder (`build_metadata`, run on the host
  every step);
- `step_layout.py`: the bucketed prefill/decode layout of a step the metadata is built from.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from vllm.v1.attention.backend import AttentionBackend, AttentionType
from vllm.v1.kv_cache_layout import KVCacheLayout

from vllm_gaudi_platform.attention.cache_dtypes import HPU_KV_CACHE_DTYPES
from vllm_gaudi_platform.attention.impl import HPUAttentionImpl
from vllm_gaudi_platform.attention.metadata_builder import HPUAttentionMetadataBuilder


class HPUAttentionBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float32, torch.float16]
    # fp8_inc (Gaudi's name), fp8 and fp8_e4m3: the cache holds FP8 E4M3 with per-layer k/v scales.
    supported_kv_cache_dtypes: ClassVar[list] = list(HPU_KV_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        # vLLM resolves backends through a closed enum; out-of-tree backends take its CUSTOM slot
        # (registered by the platform, see platform.py).
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[HPUAttentionImpl]:
        return HPUAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[HPUAttentionMetadataBuilder]:
        return HPUAttentionMetadataBuilder

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBNHC,)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        # ENCODER_ONLY: BERT-style bidirectional attention over the prompt, no KV cache.
        return attn_type in (AttentionType.DECODER, AttentionType.ENCODER_ONLY)

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_sink(cls) -> bool:
        # gpt-oss style learned per-head sink logits, in prefill and decode.
        return True

    @classmethod
    def supports_mm_prefix(cls) -> bool:
        # Gemma 3 style: bidirectional attention among an image's tokens in prefill
        # (HPUAttentionMetadata.prefill_q_reach).
        return True
