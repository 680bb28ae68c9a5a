"""Private rotary-embedding helpers the rotary family's forward_oot calls."""

from __future__ import annotations

from vllm_gaudi_platform.patches import Patch, Upstream

ROTARY = "vllm.model_executor.layers.rotary_embedding"

UPSTREAM: tuple[Upstream, ...] = (
    Upstream(
        f"{ROTARY}.base:RotaryEmbedding._match_cos_sin_cache_dtype",
        "vllm_gaudi_ops rotary family",
        params=("query",),
    ),
    Upstream(
        f"{ROTARY}.mrope_interleaved:MRotaryEmbeddingInterleaved._rebuild_pos_emb",
        "vllm_gaudi_ops rotary family",
        params=("positions",),
    ),
    Upstream(
        f"{ROTARY}.fope:FourierRotaryEmbedding._compute_cos_sin_cache",
        "vllm_gaudi_ops rotary family",
    ),
)

PATCH = Patch(
    what="",
    why="the HPU rotary variants reuse vLLM's cos/sin cache construction.",
    can_go="when these helpers are public.",
    upstream=UPSTREAM,
)
