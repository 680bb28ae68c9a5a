"""The backend of vLLM's chunked local attention layers (Llama 4), swapped for the HPU's."""

from __future__ import annotations

from vllm_gaudi_platform.patches import Patch, Upstream

LAYER = "vllm.model_executor.layers.attention.chunked_local_attention:ChunkedLocalAttention"

UPSTREAM: tuple[Upstream, ...] = (
    Upstream(
        f"{LAYER}.__init__",
        "attention/chunked_local.py: the layer keeps its chunk and hands the derived backend to "
        "Attention, whose impl (the HPU's) it keeps",
        mentions=("attention_chunk_size", "create_chunked_local_attention_backend"),
    ),
    Upstream(
        "vllm.model_executor.layers.attention.attention:Attention.get_attn_backend",
        "vLLM's runner forms attention groups from each layer's attn_backend, read after load",
        mentions=("attn_backend",),
    ),
    Upstream(
        "vllm.v1.attention.backend:subclass_attention_backend",
        "attention/chunked_local.py: backend_for derives the HPU's chunked backend as vLLM does",
        params=("name_prefix", "attention_backend_cls", "builder_cls"),
    ),
    Upstream(
        "vllm.v1.worker.utils:AttentionGroup",
        "worker/warmup.py: attention_groups reads each group's backend and layer names",
        mentions=("backend", "layer_names"),
    ),
)

PATCH = Patch(
    what=(
        "`attn_backend` of every `ChunkedLocalAttention` layer of the loaded model set to the "
        "HPU's chunked backend (attention/chunked_local.py, one class per chunk size)."
    ),
    why=(
        "vLLM's derived builder splits each request into one virtual request per chunk, which "
        "gives the chunked layers a step layout of shapes no bucket warmed (and needs a chunk of "
        "whole KV blocks); the HPU's builder keeps the step's layout and makes the chunk a mask."
    ),
    can_go="when vLLM asks the platform for the chunked local backend of a layer.",
    sites=("vllm_gaudi_platform.attention.chunked_local:use_hpu_chunking",),
    scope="object",
    upstream=UPSTREAM,
)
