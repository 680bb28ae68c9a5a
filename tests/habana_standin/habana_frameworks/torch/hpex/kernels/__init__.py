"""habana_frameworks.torch.hpex.kernels: FusedSDPA and the rotary embedding kernel."""

from __future__ import annotations

import enum

import torch

from habana_frameworks.torch._kernels import HabanaRuleError, _require, broadcasts_over

_PADDING_SIDES = ("left", "right")
_SOFTMAX_MODES = ("None", "fast", "fp32")


class FusedSDPA:
    """Fused scaled-dot-product attention, called as FusedSDPA.apply(q, k, v, attn_mask,
    dropout_p, is_causal, scale, softmax_mode, recompute_mode, valid_sequence_lengths,
    padding_side).

    Facts the stand-in enforces (bridge: hpex/kernels/FusedSDPA.py, sdpa_gen.cpp; Intel's call
    sites in vllm-gaudi):
    - layouts are [batch, heads, seq, head_dim]. A 4-D query with more heads than the keys (and
      more than one key head) is grouped-query attention: the wrapper views the query as
      [batch, kv_heads, q_per_kv, seq, d] (consecutive query heads share a key head), keys and
      values as [batch, kv_heads, 1, seq, d], and a mask with one slice per query head the same
      way (any other mask gets unit axes). 5-D inputs and single-key-head inputs go to the
      kernel as given, which broadcasts the leading axes;
    - `valid_sequence_lengths` (int32 in Intel's calls, one per batch row) is taken only with
      is_causal=True and no mask: keys past a row's length on `padding_side` are masked;
    - `softmax_mode="fast"` is only for causal attention;
    - `attn_mask` must broadcast to the scores without growing them. Intel passes only additive
      masks in the query's dtype; whether the kernel takes bool masks, or float32 masks under
      bf16 queries, could not be established, so the stand-in refuses both;
    - `is_causal` masks key j > query i (top-left aligned); dropout is 0 at inference.
    """

    @staticmethod
    def apply(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        softmax_mode: str = "None",
        recompute_mode: bool | None = None,
        valid_sequence_lengths: torch.Tensor | None = None,
        padding_side: str = "left",
    ) -> torch.Tensor:
        _require(q.dim() in (4, 5), f"FusedSDPA: query must be 4-D or 5-D, got {q.dim()}-D")
        _require(k.dim() == q.dim() and v.dim() == q.dim(), "FusedSDPA: q, k, v ranks differ")
        if q.dim() == 4 and q.shape[1] != k.shape[1] and k.shape[1] != 1:
            b, hq, s, d = q.shape
            hkv = k.shape[1]
            _require(hq % hkv == 0, f"FusedSDPA: {hq} query heads over {hkv} key heads")
            if attn_mask is not None and attn_mask.dim() == 4 and attn_mask.shape[1] == hq:
                attn_mask = attn_mask.reshape(
                    attn_mask.shape[0], hkv, hq // hkv, *attn_mask.shape[2:]
                )
            elif attn_mask is not None:
                attn_mask = attn_mask.unsqueeze(1)
            out = FusedSDPA.apply(
                q.reshape(b, hkv, hq // hkv, s, d),
                k.unsqueeze(2),
                v.unsqueeze(2),
                attn_mask,
                dropout_p,
                is_causal,
                scale,
                softmax_mode,
                recompute_mode,
                valid_sequence_lengths,
                padding_side,
            )
            return out.reshape(b, hq, s, v.shape[-1])
        _require(
            softmax_mode != "fast" or is_causal, "FusedSDPA: softmax_mode='fast' needs is_causal"
        )
        _require(dropout_p == 0.0, "FusedSDPA: dropout at inference")
        _require(softmax_mode in _SOFTMAX_MODES, f"FusedSDPA: softmax_mode {softmax_mode!r}")
        _require(padding_side in _PADDING_SIDES, f"FusedSDPA: padding_side {padding_side!r}")
        q_len, kv_len = q.shape[-2], k.shape[-2]
        scores_shape = (*q.shape[:-1], kv_len)
        bias = torch.zeros((), dtype=torch.float32, device=q.device)
        if valid_sequence_lengths is not None:
            _require(
                is_causal and attn_mask is None,
                "FusedSDPA: valid_sequence_lengths is taken only with is_causal=True and no "
                "attn_mask",
            )
            _require(
                valid_sequence_lengths.dtype == torch.int32,
                f"FusedSDPA: valid_sequence_lengths is {valid_sequence_lengths.dtype}, not int32",
            )
            _require(
                valid_sequence_lengths.shape == (q.shape[0],),
                "FusedSDPA: one valid length per batch row",
            )
            pos = torch.arange(kv_len, device=q.device)
            lens = valid_sequence_lengths.long().view(-1, 1)
            valid = pos >= kv_len - lens if padding_side == "left" else pos < lens
            valid = valid.view(q.shape[0], *([1] * (q.dim() - 2)), kv_len)
            bias = bias + torch.zeros(valid.shape, device=q.device).masked_fill(
                ~valid, float("-inf")
            )
        if attn_mask is not None:
            _require(
                attn_mask.dtype == q.dtype,
                f"FusedSDPA: attn_mask is {attn_mask.dtype}; pass an additive bias in the "
                f"query's dtype ({q.dtype})",
            )
            _require(
                broadcasts_over(attn_mask, scores_shape),
                f"FusedSDPA: attn_mask {tuple(attn_mask.shape)} does not broadcast over the "
                f"scores {scores_shape}",
            )
            bias = bias + attn_mask.float()
        if is_causal:
            causal = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device).tril()
            bias = bias + torch.zeros(q_len, kv_len, device=q.device).masked_fill(
                ~causal, float("-inf")
            )
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        scores = (q.float() @ k.float().transpose(-2, -1)) * scale + bias
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        return (probs @ v.float()).to(q.dtype)


class RotaryPosEmbeddingMode(enum.Enum):
    """Fact: BLOCKWISE (0) rotates the two halves of the head (GPT-NeoX); PAIRWISE (1) rotates
    adjacent pairs (GPT-J)."""

    BLOCKWISE = 0
    PAIRWISE = 1


def apply_rotary_pos_emb(
    p: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    offset: int = 0,
    mode: RotaryPosEmbeddingMode = RotaryPosEmbeddingMode.BLOCKWISE,
) -> torch.Tensor:
    """p * cos + rotate(p) * sin over the last axis, cos/sin full width and broadcasting."""
    if not isinstance(mode, RotaryPosEmbeddingMode):
        raise HabanaRuleError(f"apply_rotary_pos_emb: mode {mode!r} is not RotaryPosEmbeddingMode")
    # position_ids / offset index into cos/sin tables inside the kernel; what exactly they index
    # could not be established without hardware, so the stand-in takes pre-gathered cos/sin only.
    _require(
        position_ids is None and offset == 0,
        "apply_rotary_pos_emb: the stand-in takes gathered cos/sin only",
    )
    _require(
        cos.shape[-1] == p.shape[-1] and sin.shape[-1] == p.shape[-1],
        "apply_rotary_pos_emb: cos/sin must be as wide as the head",
    )
    dtype = torch.float32 if torch.float32 in (p.dtype, cos.dtype, sin.dtype) else p.dtype
    x, c, s = p.to(dtype), cos.to(dtype), sin.to(dtype)
    if mode is RotaryPosEmbeddingMode.BLOCKWISE:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    else:
        rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).reshape(x.shape)
    return x * c + rotated * s
