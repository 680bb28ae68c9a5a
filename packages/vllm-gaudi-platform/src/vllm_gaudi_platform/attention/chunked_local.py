"""Chunked local attention (Llama 4's `attention_chunk_size`) on the HPU: a query at position p
attends the keys from (p // chunk) * chunk up to p only.

vLLM gives each chunked layer a backend derived from the platform's whose metadata builder splits
every request into one "virtual" request per chunk its new tokens touch. On the HPU that would
give the chunked layers a step layout of their own, of shapes no bucket was warmed for, beside the
full-attention layers' (and it needs a chunk of whole KV blocks). Here the chunked layers keep the
step's layout, and the chunk is a mask: their metadata carries `attention_chunk`, which the
prefill slice masks and the decode block narrowing read (metadata.py), like a sliding window
anchored at the chunk's start. KV blocks are not freed behind the chunk: the HPU keeps one
KV-cache group, so vLLM manages the chunked layers' blocks as full attention.

`use_hpu_chunking` swaps the backend of a loaded model's chunked layers for `backend_for(chunk)`
(patch ledger: patches/chunked_local.py).
"""

from __future__ import annotations

import functools
from typing import Any

from vllm.model_executor.layers.attention.chunked_local_attention import ChunkedLocalAttention
from vllm.v1.attention.backend import AttentionBackend, subclass_attention_backend

from vllm_gaudi_platform.attention.backend import HPUAttentionBackend
from vllm_gaudi_platform.attention.metadata import HPUAttentionMetadata
from vllm_gaudi_platform.attention.metadata_builder import HPUAttentionMetadataBuilder


class HPUChunkedLocalBuilder(HPUAttentionMetadataBuilder):
    """The step's metadata, as every attention layer gets it, with the layers' chunk set."""

    attention_chunk: int  # set on the per-chunk subclass (`backend_for`)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        return with_chunk(
            super().build(common_prefix_len, common_attn_metadata, fast_build),
            self.attention_chunk,
        )


def with_chunk(md: HPUAttentionMetadata, chunk: int) -> HPUAttentionMetadata:
    """`md` (and each pass of a step run in parts) read as chunked local attention."""
    md.attention_chunk = chunk
    for part in md.parts or ():
        with_chunk(part, chunk)
    return md


@functools.cache
def backend_for(chunk: int) -> type[AttentionBackend]:
    """The HPU backend of the layers with chunk `chunk`: one class per chunk size, so vLLM puts
    all those layers in one attention group (one metadata build per step). Named as vLLM names
    its own chunked backends."""
    builder = type(
        f"HPUChunkedLocal{chunk}Builder", (HPUChunkedLocalBuilder,), {"attention_chunk": chunk}
    )
    return subclass_attention_backend(
        name_prefix=f"ChunkedLocalAttention_{chunk}_",
        attention_backend_cls=HPUAttentionBackend,
        builder_cls=builder,
    )


def chunk_of(backend: type[AttentionBackend]) -> int | None:
    """The chunk of a layer's backend (None: not chunked local attention)."""
    builder = backend.get_builder_cls()
    return builder.attention_chunk if issubclass(builder, HPUChunkedLocalBuilder) else None


def use_hpu_chunking(model: Any) -> int:
    """Give every chunked local attention layer of `model` the HPU's chunked backend instead of
    the one vLLM derived (its impl stays: the same HPU attention); returns how many layers."""
    swapped = 0
    for module in model.modules():
        if isinstance(module, ChunkedLocalAttention):
            backend = module.attn_backend
            if not issubclass(backend, HPUAttentionBackend):
                raise NotImplementedError(
                    f"{module.layer_name}: chunked local attention on a backend that is not the "
                    f"HPU's ({backend.get_name()})."
                )
            module.attn_backend = backend_for(module.attention_chunk_size)
            swapped += 1
    return swapped
