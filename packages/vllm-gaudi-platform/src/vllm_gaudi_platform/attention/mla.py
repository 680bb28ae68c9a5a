"""HPU attention backend for multi-head latent attention (DeepSeek-V2/V3 MLA).

KV cache: per layer, one latent row per token slot, block-size-first like the other HPU caches:
`[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]` (the normalized compressed KV, then
the rotated positional key), one KV head.

vLLM's `MLAAttention` layer hands its backend the query (`q_nope | q_pe` per head), the
compressed KV and the positional key of every token, and splits a step into decode tokens (weight
absorbed, `forward_mqa`) and prefill tokens (`forward_mha`) by the metadata's decode counts. The
HPU step layout (`step_layout.py`) already splits the step into bucketed prefill and decode parts,
each padded to a warmed shape, so the metadata reports no decode tokens and `forward_mha` runs
the whole step at once, every part in the weight-absorbed form:

- W_UK is folded into the query: `q_latent = q_nope @ W_UK | q_pe`, one row per head of width
  `kv_lora_rank + qk_rope_head_dim`; every head attends the single latent head (key: the whole
  row, value: its first `kv_lora_rank` columns);
- prefill: the `[rows, query_bucket]` grid of the attention backend, each row over its cached
  context (gathered from `ctx_bucket` blocks) and its new tokens, in query slices with the same
  position masks (seam `mla_prefill`);
- decode: one query per sequence over the flat block list (seam `mla_paged_decode`);
- W_UV maps the latent outputs back to `v_head_dim` per head.

Every shape depends on the bucket only; the metadata is the attention backend's
(`HPUAttentionMetadata`), so HPU graphs capture and replay MLA steps like any other.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from vllm.logger import init_logger
from vllm.model_executor.layers.attention.mla_attention import MLACommonBackend, split_kv_b_proj
from vllm.v1.attention.backend import AttentionLayer, AttentionType, MLAAttentionImpl
from vllm.v1.attention.backends.mla.prefill.base import MLAPrefillBackend
from vllm.v1.kv_cache_layout import KVCacheLayout

from vllm_gaudi_platform import envs
from vllm_gaudi_platform.attention.metadata import HPUAttentionMetadata
from vllm_gaudi_platform.attention.metadata_builder import HPUAttentionMetadataBuilder
from vllm_gaudi_platform.seam import backend as seam_backend

logger = init_logger(f"vllm.{__name__}")

# The latent cache stores the model's own dtype; FP8 latent caches are not implemented yet.
MLA_KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32")


class HPUMLABackend(MLACommonBackend):
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float32, torch.float16]
    supported_kv_cache_dtypes: ClassVar[list] = list(MLA_KV_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        # Out-of-tree backends take vLLM's CUSTOM slot (see platform.py).
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[HPUMLAImpl]:
        return HPUMLAImpl

    @staticmethod
    def get_builder_cls() -> type[HPUAttentionMetadataBuilder]:  # type: ignore[override]
        return HPUAttentionMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any kv_lora_rank + qk_rope_head_dim: the kernels take the width as it comes

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBNHC,)


class HPUMLAPrefillBackend(MLAPrefillBackend):
    """What vLLM's MLA layer asks the platform for at construction. On HPU the backend's
    `forward_mha` runs prefill attention itself (weight-absorbed, through the seam), so the
    layer never calls these ragged-batch entry points; if it ever does, it fails loudly."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float32, torch.float16]

    @staticmethod
    def get_name() -> str:
        return "HPU_MLA_PREFILL"

    def run_prefill_new_tokens(self, *args, **kwargs):
        raise RuntimeError(_UNREACHABLE)

    def run_prefill_context_chunk(self, *args, **kwargs):
        raise RuntimeError(_UNREACHABLE)


_UNREACHABLE = (
    "HPU MLA runs prefill and decode inside HPUMLAImpl.forward_mha (its metadata reports no "
    "decode tokens); reaching vLLM's split MLA path means the layer's contract changed."
)


class HPUMLAImpl(MLAAttentionImpl[HPUAttentionMetadata]):
    """Weight-absorbed MLA over the bucketed step layout (see the module docstring)."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None,
        attn_type: str,
        kv_sharing_target_layer_name: str | None,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        qk_head_dim: int,
        v_head_dim: int,
        kv_b_proj,
        indexer: object | None = None,
        q_pad_num_heads: int | None = None,
        **kwargs,
    ) -> None:
        unsupported = {
            "ALiBi": alibi_slopes is not None,
            "a sliding window": sliding_window is not None,
            "logit soft-capping": bool(logits_soft_cap),
            "KV sharing across layers": kv_sharing_target_layer_name is not None,
            "a sparse indexer (DeepSeek-V3.2)": indexer is not None,
        }
        for what, present in unsupported.items():
            if present:
                raise NotImplementedError(f"MLA with {what} is not supported on HPU yet.")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"MLA attention type {attn_type} is not supported on HPU.")
        if kv_cache_dtype not in MLA_KV_CACHE_DTYPES:
            raise NotImplementedError(
                f"kv_cache_dtype={kv_cache_dtype!r} is not supported for MLA models on HPU yet; "
                f"use one of {', '.join(MLA_KV_CACHE_DTYPES)}."
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = 1
        self.kv_cache_dtype = kv_cache_dtype
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.qk_head_dim = qk_head_dim
        self.v_head_dim = v_head_dim
        self.kv_b_proj = kv_b_proj
        self.indexer = None
        self.q_pad_num_heads = None
        self.supports_quant_query_input = False
        # vLLM's layer reads these; decode context parallelism does not exist on HPU.
        self.dcp_world_size = 1
        self.dcp_rank = 0
        self.cp_kv_cache_interleave_size = 1
        self.seam = seam_backend()
        self.query_slice = envs.prefill_query_slice()
        self.W_UK_T: torch.Tensor | None = None  # [heads, qk_nope_head_dim, kv_lora_rank]
        self.W_UV: torch.Tensor | None = None  # [heads, kv_lora_rank, v_head_dim]

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        # kv_b_proj maps a latent row to (k_nope | v) per head; its two halves are the absorbed
        # weights. For an unquantized kv_b_proj these are views of its weight (no copy).
        w_uk, w_uv = split_kv_b_proj(
            self.kv_b_proj,
            act_dtype,
            self.kv_lora_rank,
            self.num_heads,
            self.qk_nope_head_dim,
            self.v_head_dim,
        )  # [L, N, P], [L, N, V]
        self.W_UK_T = w_uk.permute(1, 2, 0)
        self.W_UV = w_uv.transpose(0, 1)

    def do_kv_cache_update(
        self,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache_dtype: str,
        k_scale: torch.Tensor,
        skip_scale: bool = False,  # vLLM 0.33's signature (FP8 writes without a scale); unused
    ) -> None:
        # forward_mha writes the latent rows itself, from the metadata's slot mapping: with HPU
        # graphs that mapping is the bucket's static buffer (padding tokens write to the null
        # block), which the forward context's per-step mapping is not.
        return None

    def forward_mqa(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: HPUAttentionMetadata,
        layer: AttentionLayer,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise RuntimeError(_UNREACHABLE)

    def forward_mha(  # type: ignore[override]
        self,
        q: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: HPUAttentionMetadata,
        k_scale: torch.Tensor,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
    ) -> None:
        """The whole step: q [T, heads, qk_head_dim], kv_c_normed [T, kv_lora_rank], k_pe
        [T, (1,) rope_dim]; writes output [T, heads * v_head_dim]. T is the step's real token
        count (eager) or its padded count (HPU graphs, whose metadata counts every padded
        token as real): the bucket's padding is restored here either way."""
        if output_scale is not None:
            raise NotImplementedError("Fused output quantization is not supported on HPU.")
        md = attn_metadata
        n_heads, rank = self.num_heads, self.kv_lora_rank
        total = md.layout.num_tokens_padded
        n = q.shape[0]
        latent_new = torch.cat([kv_c_normed, k_pe.reshape(n, self.qk_rope_head_dim)], dim=-1)
        width = latent_new.shape[-1]  # kv_lora_rank + qk_rope_head_dim
        if n < total:
            # vLLM's layer cut the padding tokens off; the bucket's shapes need them back.
            q = torch.cat([q, q.new_zeros(total - n, *q.shape[1:])])
            latent_new = torch.cat(
                [latent_new, latent_new.new_zeros(total - n, rank + self.qk_rope_head_dim)]
            )

        cache = kv_c_and_k_pe_cache  # [num_blocks, block_size, width]
        num_blocks, block_size = cache.shape[:2]
        if md.num_actual_tokens:
            m = md.num_actual_tokens
            cache.view(num_blocks * block_size, width)[md.slot_mapping[:m]] = latent_new[:m].to(
                cache.dtype
            )

        # Absorb W_UK: [T, N, P] -> [T, N, L], then append the rotated part.
        assert self.W_UK_T is not None and self.W_UV is not None
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        ql_nope = torch.bmm(q_nope.transpose(0, 1), self.W_UK_T).transpose(0, 1)
        q_lat = torch.cat([ql_nope, q_pe], dim=-1)  # [T, N, L + R]

        if md.identity_layout:
            q_cells, lat_cells = q_lat, latent_new
        else:
            q_cells, lat_cells = q_lat[md.cell_to_token], latent_new[md.cell_to_token]
        out_cells = q_lat.new_empty(total, n_heads, rank)
        layout = md.layout
        n_cells = 0
        if layout.prefill is not None:
            p = layout.prefill
            n_cells = p.rows * p.query_bucket
            out_cells[:n_cells] = self._prefill(
                q_cells[:n_cells], lat_cells[:n_cells], cache, block_size, md
            )
        if layout.decode is not None:
            bsz = layout.decode.batch_bucket
            blocks, groups, bias = md.decode_blocks_for(None, bsz, block_size)
            out_cells[n_cells : n_cells + bsz] = self.seam.mla_paged_decode(
                q_cells[n_cells : n_cells + bsz], cache, blocks, groups, bias, self.scale, rank
            )
        out_lat = out_cells if md.identity_layout else out_cells[md.token_to_cell]

        # Absorb W_UV: [N, T, L] @ [N, L, V] -> [T, N, V], only for the tokens vLLM asked for.
        rows = output.shape[0]
        out_v = torch.bmm(out_lat[:rows].transpose(0, 1), self.W_UV)
        output.view(rows, n_heads, self.v_head_dim).copy_(out_v.transpose(0, 1))

    def _prefill(self, q, latent_new, cache, block_size: int, md: HPUAttentionMetadata):
        """Latent attention of the prefill grid: each row over its cached context and its new
        tokens, in query slices (mask and scores grow linearly with the prompt)."""
        p = md.layout.prefill
        assert p is not None
        rows, qb = p.rows, p.query_bucket
        width = latent_new.shape[-1]
        q = q.view(rows, qb, self.num_heads, width).transpose(1, 2)  # [rows, N, qb, W]
        keys = latent_new.view(rows, qb, width)
        blocks, _, _ = md.prefill_keys_for(None, block_size)
        n_ctx = blocks.shape[1] * block_size
        if n_ctx:
            ctx = cache.index_select(0, blocks.reshape(-1)).view(rows, n_ctx, width)
            keys = torch.cat([ctx.to(keys.dtype), keys], dim=1)
        out = q.new_empty(rows, self.num_heads, qb, self.kv_lora_rank)
        # New-token keys after a slice's last query are in every query's future: each slice
        # reads keys up to its own end only (as many as its mask has columns).
        for q0 in range(0, qb, self.query_slice):
            q1 = min(q0 + self.query_slice, qb)
            mask = md.prefill_slice_mask(q0, q1, None, block_size)
            end = mask.shape[-1]
            out[:, :, q0:q1] = self.seam.mla_prefill(
                q[:, :, q0:q1], keys[:, :end], mask, self.scale, self.kv_lora_rank
            )
        return out.transpose(1, 2).reshape(rows * qb, self.num_heads, self.kv_lora_rank)
