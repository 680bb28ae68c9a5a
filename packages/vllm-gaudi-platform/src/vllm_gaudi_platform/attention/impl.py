"""The HPU decoder attention's forward pass (`HPUAttentionImpl`), over the metadata of
`metadata.py`: the KV-cache write, then the step's prefill part (fused causal SDPA, or query slices
with masks over cached context) and its decode part (paged decode over the flat block list), or
bidirectional encoder-only attention without a cache; sliding windows, soft-cap, ALiBi, attention
sinks and the FP8 KV cache's quantize/dequantize on each path. The kernels come from the seam.
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backend import AttentionImpl, AttentionLayer, AttentionType

from vllm_gaudi_platform import envs
from vllm_gaudi_platform.attention.metadata import HPUAttentionMetadata
from vllm_gaudi_platform.seam import backend as seam_backend


def _softcapped_attention(q, k, v, mask, scale: float, cap: float) -> torch.Tensor:
    """Attention with Gemma 2's logit soft-capping, [batch, heads, len, dim] layouts; `mask`
    boolean (True: attend) or additive (ALiBi biases, -inf where masked).

    Gaudi's fused SDPA has no soft-cap input, so this path runs as plain matmul, tanh and softmax
    ops (fused by Gaudi's graph compiler); scores are computed in float32.
    """
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / cap) * cap
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif mask is not None:
        scores = scores + mask
    return torch.matmul(scores.softmax(dim=-1), v.float()).to(q.dtype)


def alibi_bias(slopes: torch.Tensor, rel_pos: torch.Tensor) -> torch.Tensor:
    """ALiBi's additive score bias: slope of each head times (key position - query position).

    slopes [heads]; rel_pos [..., q, k] -> [..., heads, q, k] float32 (0 on the diagonal,
    more negative the farther a key lies behind its query)."""
    return slopes.view(-1, 1, 1) * rel_pos.unsqueeze(-3).float()


def _key_padding_bias(md: HPUAttentionMetadata, qb: int, q: torch.Tensor) -> torch.Tensor:
    """Encoder-only, one sequence per row: [rows, 1, 1, keys], 0 for a row's own keys, the
    dtype's lowest value for padding (an additive bias in the query's dtype, as Gaudi's kernel
    takes masks; finite, so an all-padding row stays finite and is discarded)."""
    assert md.prefill_valid_lens is not None
    padded = torch.arange(qb, device=q.device)[None, :] >= md.prefill_valid_lens[:, None]
    bias = torch.zeros(padded.shape, dtype=q.dtype, device=q.device)
    bias.masked_fill_(padded, torch.finfo(q.dtype).min)
    return bias[:, None, None, :]


def _same_sequence_mask(md: HPUAttentionMetadata, qb: int, q0: int, q1: int) -> torch.Tensor:
    """Encoder-only, packed rows: query cells q0..q1 attend the new-token key columns of their
    own sequence (a padding cell sees only its own key); [rows, 1, q1 - q0, qb]."""
    assert md.prefill_q_seq is not None and md.prefill_k_seq is not None
    k_seq = md.prefill_k_seq[:, -qb:]  # the new tokens' key columns (there is no context)
    return (md.prefill_q_seq[:, q0:q1, None] == k_seq[:, None, :])[:, None]


class HPUAttentionImpl(AttentionImpl[HPUAttentionMetadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
        **kwargs,
    ) -> None:
        if attn_type not in (AttentionType.DECODER, AttentionType.ENCODER_ONLY):
            raise NotImplementedError(f"Attention type {attn_type} is not supported on HPU yet.")
        extras = [
            name
            for name, used in (
                ("a sliding window", sliding_window),
                ("logit soft-capping", logits_soft_cap),
                ("ALiBi", alibi_slopes is not None),
                ("attention sinks", sinks is not None),
            )
            if used
        ]
        if attn_type == AttentionType.ENCODER_ONLY and extras:
            raise NotImplementedError(
                f"Encoder-only attention with {' and '.join(extras)} is not supported on HPU yet."
            )
        # Combinations no model vLLM ships uses, each with a reason the kernels below would need
        # more: ALiBi's decode bias assumes the unwindowed block order; the soft-cap path has no
        # sink column.
        for a, b in (
            ("ALiBi", "a sliding window"),
            ("ALiBi", "attention sinks"),
            ("attention sinks", "logit soft-capping"),
        ):
            if a in extras and b in extras:
                raise NotImplementedError(
                    f"Attention with {a} and {b} together is not supported on HPU yet."
                )
        self.attn_type = attn_type
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        # A query attends keys fewer than `sliding_window` positions behind it (itself included).
        self.sliding_window = sliding_window
        # Gemma 2 style: scores -> cap * tanh(scores / cap) before the softmax.
        self.logits_soft_cap = float(logits_soft_cap) if logits_soft_cap else None
        # BLOOM style: score bias slope * (key position - query position), one slope per head.
        self.alibi_slopes = (
            torch.tensor(alibi_slopes, dtype=torch.float32) if alibi_slopes is not None else None
        )
        # Layers with the same slopes share a step's ALiBi masks.
        self._alibi_key = tuple(alibi_slopes) if alibi_slopes is not None else None
        # gpt-oss style: one learned logit per head joins every softmax denominator. The layer's
        # parameter itself (weights load into it after this constructor runs).
        self.sinks = sinks
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        # FP8 cache: writes quantize with the layer's k/v scale, reads dequantize with it.
        self.fp8_cache = kv_cache_dtype.startswith("fp8")
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.seam = seam_backend()
        self.query_slice = envs.prefill_query_slice()  # query tokens per prefill slice

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: HPUAttentionMetadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("Fused output quantization is not supported on HPU.")
        if attn_metadata is None:  # profiling run: no KV cache yet
            return output.zero_()
        md = attn_metadata
        h, hk, d = self.num_heads, self.num_kv_heads, self.head_size
        total = md.layout.num_tokens_padded
        q = query[:total].view(total, h, d)
        k = key[:total].view(total, hk, d)
        v = value[:total].view(total, hk, d)
        if self.attn_type == AttentionType.ENCODER_ONLY:
            return self._forward_encoder_only(q, k, v, md, output)

        # [blocks, heads, slots, 2d] viewed block-size-first, flat over token slots.
        cache = kv_cache.transpose(1, 2)
        num_blocks, block_size = cache.shape[0], cache.shape[1]
        flat = cache.reshape(num_blocks * block_size, hk, 2 * d)
        if self.kv_sharing_target_layer_name is None and md.num_actual_tokens:
            n = md.num_actual_tokens
            if self.fp8_cache:
                flat[md.slot_mapping[:n]] = self._quantize_kv(layer, k[:n], v[:n], flat.dtype)
            else:
                flat[md.slot_mapping[:n]] = torch.cat([k[:n], v[:n]], dim=-1).to(flat.dtype)
        blocks_view = flat.view(num_blocks, block_size, hk, 2 * d)

        q_cells, k_cells, v_cells, out_cells = self._to_cells(q, k, v, output, md)
        layout = md.layout
        n_cells = 0
        if layout.prefill is not None:
            p = layout.prefill
            n_cells = p.rows * p.query_bucket
            out_cells[:n_cells] = self._prefill(
                q_cells[:n_cells],
                k_cells[:n_cells],
                v_cells[:n_cells],
                blocks_view,
                block_size,
                md,
                layer,
            )
        if layout.decode is not None:
            bsz = layout.decode.batch_bucket
            out_cells[n_cells : n_cells + bsz] = self._decode(
                q_cells[n_cells : n_cells + bsz], blocks_view, block_size, md, layer
            )
        return self._from_cells(out_cells, output, md)

    def _to_cells(self, q, k, v, output: torch.Tensor, md: HPUAttentionMetadata):
        """q, k, v in the bucketed cell layout, and the buffer the cells' outputs go to.

        A permutation of the tokens (static shapes, no data lost); a step with one part only is
        usually laid out in token order already, and then its cells are the tokens themselves
        and write straight into `output`."""
        total = md.layout.num_tokens_padded
        if md.identity_layout:
            return q, k, v, output[:total].view(total, self.num_heads, self.head_size)
        cells = md.cell_to_token
        q_cells = q[cells]
        return q_cells, k[cells], v[cells], torch.empty_like(q_cells)

    def _from_cells(self, out_cells, output: torch.Tensor, md: HPUAttentionMetadata):
        """Write the cells' outputs back in token order (a no-op when the layout was already)."""
        if not md.identity_layout:
            total = md.layout.num_tokens_padded
            view = output[:total].view(total, self.num_heads, self.head_size)
            view.copy_(out_cells[md.token_to_cell])
        return output

    # ------------------------------------------------------------------ encoder-only
    def _forward_encoder_only(self, q, k, v, md: HPUAttentionMetadata, output: torch.Tensor):
        """Bidirectional attention of each sequence over its own tokens (BERT-style encoders),
        in the same bucketed cell layout as a decoder step; no KV cache is read or written.

        vLLM schedules an encoder-only prompt whole (no chunked prefill, no prefix caching), so
        no sequence has cached context: a one-token prompt lands in the decode part and attends
        to itself alone.
        """
        h = self.num_heads
        q_cells, k_cells, v_cells, out_cells = self._to_cells(q, k, v, output, md)
        n_cells = 0
        p = md.layout.prefill
        if p is not None:
            n_cells = p.rows * p.query_bucket
            out_cells[:n_cells] = self._encoder_prefill(
                q_cells[:n_cells], k_cells[:n_cells], v_cells[:n_cells], md
            )
        if md.layout.decode is not None:
            # Softmax over a single key is 1: the output is the token's own value.
            bsz = md.layout.decode.batch_bucket
            own = v_cells[n_cells : n_cells + bsz]
            out_cells[n_cells : n_cells + bsz] = own.repeat_interleave(h // own.shape[1], dim=1)
        return self._from_cells(out_cells, output, md)

    def _encoder_prefill(self, q, k, v, md: HPUAttentionMetadata) -> torch.Tensor:
        """Bidirectional prefill over the [rows, query_bucket] grid: one sequence per row takes
        the fused SDPA with an additive key-padding mask; packed rows attend in query slices with
        a same-sequence mask (a padding cell sees only its own key). Not valid lengths: Gaudi's
        FusedSDPA takes those only in its causal mode."""
        p = md.layout.prefill
        assert p is not None and md.prefill_valid_lens is not None
        rows, qb = p.rows, p.query_bucket
        h, hk, d = self.num_heads, self.num_kv_heads, self.head_size
        q = q.view(rows, qb, h, d).transpose(1, 2)
        k = k.reshape(rows, qb, hk, d).transpose(1, 2)
        v = v.reshape(rows, qb, hk, d).transpose(1, 2)
        # Masks are built by the step's first layer and shared by the others (metadata.derived).
        if not md.prefill_packed:
            bias = md.derived(("encoder_bias", q.dtype), _key_padding_bias, md, qb, q)
            out = self.seam.fused_sdpa(q, k, v, attn_mask=bias, is_causal=False, scale=self.scale)
            return out.transpose(1, 2).reshape(rows * qb, h, d)
        out = torch.empty_like(q)
        for q0 in range(0, qb, self.query_slice):
            q1 = min(q0 + self.query_slice, qb)
            mask = md.derived(("encoder_mask", q0, q1), _same_sequence_mask, md, qb, q0, q1)
            out[:, :, q0:q1] = self.seam.fused_sdpa(
                q[:, :, q0:q1], k, v, attn_mask=mask, scale=self.scale
            )
        return out.transpose(1, 2).reshape(rows * qb, h, d)

    # ------------------------------------------------------------------ FP8 KV cache
    @staticmethod
    def _kv_scales(layer: AttentionLayer | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's dequantization scales (stored = value / scale); 1.0 without a layer."""
        if layer is None:
            one = torch.ones((), dtype=torch.float32)
            return one, one
        return layer._k_scale, layer._v_scale

    def _quantize_kv(self, layer, k, v, cache_dtype: torch.dtype) -> torch.Tensor:
        """New keys and values as one FP8 cache row each: keys then values, each scaled."""
        k_scale, v_scale = self._kv_scales(layer)
        # The kernel's scale is a multiplier: pass the inverse of the dequantization scale.
        k8, _ = self.seam.cast_to_fp8_v2(k, 1.0 / k_scale, False, False, cache_dtype)
        v8, _ = self.seam.cast_to_fp8_v2(v, 1.0 / v_scale, False, False, cache_dtype)
        return torch.cat([k8, v8], dim=-1)

    def _dequantize_kv(self, layer, kv, out_dtype: torch.dtype):
        """Cached FP8 rows [..., 2d] back to keys and values in `out_dtype`."""
        d = self.head_size
        k_scale, v_scale = self._kv_scales(layer)
        k = self.seam.cast_from_fp8(kv[..., :d], k_scale, out_dtype)
        v = self.seam.cast_from_fp8(kv[..., d:], v_scale, out_dtype)
        return k, v

    def _prefill(self, q, k_new, v_new, blocks_view, block_size, md, layer=None):
        p = md.layout.prefill
        rows, qb = p.rows, p.query_bucket
        h, hk, d = self.num_heads, self.num_kv_heads, self.head_size
        window, cap, slopes = self.sliding_window, self.logits_soft_cap, self.alibi_slopes
        q = q.view(rows, qb, h, d).transpose(1, 2)
        k = k_new.reshape(rows, qb, hk, d)
        v = v_new.reshape(rows, qb, hk, d)
        if window is None and cap is None and slopes is None and md.prefill_causal_only():
            # Causal over the row's own tokens: the kernel needs no mask, only each row's length.
            out = self.seam.fused_sdpa(
                q,
                k.transpose(1, 2),
                v.transpose(1, 2),
                is_causal=True,
                scale=self.scale,
                valid_sequence_lengths=md.prefill_valid_lens,
                padding_side="right",
                sinks=self.sinks,
            )
            return out.transpose(1, 2).reshape(rows * qb, h, d)
        blocks, _, _ = md.prefill_keys_for(window, block_size)
        n_ctx = blocks.shape[1] * block_size
        if n_ctx:
            # One gather of whole blocks (keys and values together), then split.
            ctx = blocks_view.index_select(0, blocks.reshape(-1))
            ctx = ctx.view(rows, n_ctx, hk, 2 * d)
            if self.fp8_cache:
                k_ctx, v_ctx = self._dequantize_kv(layer, ctx, q.dtype)
            else:
                ctx = ctx.to(q.dtype)
                k_ctx, v_ctx = ctx[..., :d], ctx[..., d:]
            k = torch.cat([k_ctx, k], dim=1)
            v = torch.cat([v_ctx, v], dim=1)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        out = torch.empty_like(q)
        # Slices of the query bucket (counts and sizes fixed by the bucket): a slice's mask and
        # scores are [rows, heads, slice, keys]. New-token keys after a slice's last column are in
        # every query's future, so each slice reads keys up to its own end only, or to the
        # bucket's end where image spans see ahead: as many keys as its mask has columns.
        # Masks are built by the step's first layer and shared by the others (metadata.derived).
        step = self.query_slice
        for q0 in range(0, qb, step):
            q1 = min(q0 + step, qb)
            if slopes is None:
                mask = md.prefill_slice_mask(q0, q1, window, block_size)
            else:
                mask = md.derived(
                    ("prefill_alibi", self._alibi_key, window, q0, q1),
                    self._alibi_slice_mask,
                    md,
                    q0,
                    q1,
                    window,
                    block_size,
                )
            keys = mask.shape[-1]
            qs, ks, vs = q[:, :, q0:q1], k[:, :, :keys], v[:, :, :keys]
            if cap is None:
                out[:, :, q0:q1] = self.seam.fused_sdpa(
                    qs, ks, vs, attn_mask=mask, scale=self.scale, sinks=self.sinks
                )
            else:
                out[:, :, q0:q1] = _softcapped_attention(qs, ks, vs, mask, self.scale, cap)
        return out.transpose(1, 2).reshape(rows * qb, h, d)

    def _alibi_slice_mask(self, md, q0: int, q1: int, window, block_size: int) -> torch.Tensor:
        """Additive mask of a prefill query slice: the ALiBi bias where attended, -inf
        elsewhere ([rows, heads, q1 - q0, keys], float32)."""
        assert md.prefill_q_pos is not None and self.alibi_slopes is not None
        mask = md.prefill_slice_mask(q0, q1, window, block_size)
        _, _, k_pos = md.prefill_keys_for(window, block_size)
        rel = k_pos[:, None, : mask.shape[-1]] - md.prefill_q_pos[:, q0:q1, None]
        return alibi_bias(self.alibi_slopes, rel).masked_fill(~mask, float("-inf"))

    def _decode(self, q, blocks_view, block_size, md, layer=None):
        bsz = md.layout.decode.batch_bucket
        blocks, groups, bias = md.decode_blocks_for(self.sliding_window, bsz, block_size)
        alibi = None
        if self.alibi_slopes is not None:
            # Blocks are in their unwindowed order here (ALiBi with a window is refused).
            assert md.decode_block_start is not None and md.decode_query_pos is not None
            slot = torch.arange(block_size, device=q.device)
            rel = md.decode_block_start[:, None] + slot - md.decode_query_pos[:, None]
            alibi = (self.alibi_slopes, rel)
        return self.seam.paged_decode(
            q,
            blocks_view,
            blocks,
            groups,
            bias,
            self.scale,
            soft_cap=self.logits_soft_cap,
            alibi=alibi,
            sinks=self.sinks,
            kv_scales=self._kv_scales(layer) if self.fp8_cache else None,
        )
