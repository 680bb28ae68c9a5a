"""Float64 references of the seam's kernels, for `vllm-gaudi selftest` in emulation.

When the active backend IS the emulation, checking it against itself proves nothing, so the
selftest's kernel cases run against these instead: each function has the name and signature of
the seam kernel it checks (only the arguments the cases use), is written from the kernel's
documented semantics (seam/contract.py and the backends' docstrings) in plain float64 torch, and
shares no code with `seam/emulated*.py`. Results are float64 (the comparison allows one rounding
of the kernel's output dtype on top of the suite's tolerance).
"""

from __future__ import annotations

import math

import torch

NAME = "float64 reference"
F64 = torch.float64

# E2M1 magnitudes by the low three bits of a nibble (OCP Microscaling v1.0); bit 3 is the sign.
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=F64)
_FP8_MAX = {"e4m3": {"3": 448.0, "2": 240.0}, "e5m2": {"3": 57344.0, "2": 57344.0}}


class Reference:
    """The references as a backend-like object: `generation` is the Gaudi ("2" or "3") whose
    FP8 range the FP8 references use."""

    NAME = NAME

    def __init__(self, generation: str) -> None:
        self.generation = generation

    # ------------------------------------------------------------------ attention
    def fused_sdpa(self, query, key, value, attn_mask=None, is_causal=False, scale=None,
                   sinks=None):  # fmt: skip
        q, k, v = query.to(F64), key.to(F64), value.to(F64)
        if k.shape[-3] != q.shape[-3]:
            repeat = q.shape[-3] // k.shape[-3]
            k, v = k.repeat_interleave(repeat, -3), v.repeat_interleave(repeat, -3)
        scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
        scores = q @ k.transpose(-1, -2) * scale
        allowed = torch.ones(scores.shape[-2:], dtype=torch.bool)
        if is_causal:
            allowed = allowed.tril()
        scores = scores.masked_fill(~allowed, -math.inf)
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                scores = scores.masked_fill(~attn_mask, -math.inf)
            else:
                scores = scores + attn_mask.to(F64)
        return _softmax_values(
            scores, v, None if sinks is None else sinks.to(F64).view(1, -1, 1, 1)
        )

    def paged_decode(self, query, cache, block_list, block_groups, block_bias, scale, *,
                     sinks=None, kv_scales=None):  # fmt: skip
        batch, heads, d = query.shape
        kv_heads = cache.shape[2]
        out = torch.zeros(batch, heads, d, dtype=F64)
        for seq in range(batch):
            entries = (block_groups == seq).nonzero().squeeze(1)
            if entries.numel() == 0:
                continue
            blocks = cache[block_list[entries]].to(F64)  # [n, block, kv_heads, 2d]
            keys = blocks[..., :d].reshape(-1, kv_heads, d)
            values = blocks[..., d:].reshape(-1, kv_heads, d)
            if kv_scales is not None:
                keys = keys * float(kv_scales[0])
                values = values * float(kv_scales[1])
            keys = keys.repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
            values = values.repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
            q = query[seq].to(F64).unsqueeze(1)  # [heads, 1, d]
            scores = q @ keys.transpose(-1, -2) * scale + block_bias[entries].reshape(-1).to(F64)
            sink = None if sinks is None else sinks.to(F64).view(heads, 1, 1)
            out[seq] = _softmax_values(scores, values, sink).squeeze(1)
        return out

    def mla_prefill(self, query, latent, attn_mask, scale, kv_lora_rank):
        keys = latent.to(F64).unsqueeze(1)
        scores = query.to(F64) @ keys.transpose(-1, -2) * scale
        scores = scores.masked_fill(~attn_mask, -math.inf)
        return _softmax_values(scores, keys[..., :kv_lora_rank], None)

    def mla_paged_decode(self, query, cache, block_list, block_groups, block_bias, scale,
                         kv_lora_rank):  # fmt: skip
        batch, heads, width = query.shape
        out = torch.zeros(batch, heads, kv_lora_rank, dtype=F64)
        for seq in range(batch):
            entries = (block_groups == seq).nonzero().squeeze(1)
            latent = cache[block_list[entries]].to(F64).reshape(-1, width)
            scores = query[seq].to(F64) @ latent.t() * scale
            scores = scores + block_bias[entries].reshape(-1).to(F64)
            out[seq] = _softmax_values(scores, latent[:, :kv_lora_rank], None)
        return out

    # ------------------------------------------------------------------ dense op families
    def rms_norm(self, x, weight, epsilon):
        x = x.to(F64)
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + epsilon) * weight.to(F64)

    def linear(self, x, weight, bias=None):
        out = x.to(F64) @ weight.to(F64).t()
        return out if bias is None else out + bias.to(F64)

    def apply_rotary_pos_emb(self, p, cos, sin, position_ids=None, offset=0, mode=0):
        p, cos, sin = p.to(F64), cos.to(F64), sin.to(F64)
        if mode == 0:  # halves: rotate(x) = [-x2, x1]
            half = p.shape[-1] // 2
            rotated = torch.cat((-p[..., half:], p[..., :half]), dim=-1)
        else:  # pairs: rotate(x)[2i] = -x[2i+1], rotate(x)[2i+1] = x[2i]
            rotated = torch.empty_like(p)
            rotated[..., 0::2] = -p[..., 1::2]
            rotated[..., 1::2] = p[..., 0::2]
        return p * cos + rotated * sin

    def lora_shrink(self, x, lora_a, token_lora, scale):
        out = torch.zeros(x.shape[0], lora_a.shape[1], dtype=F64)
        for t, slot in enumerate(token_lora.tolist()):
            if slot >= 0:
                out[t] = scale * (lora_a[slot].to(F64) @ x[t].to(F64))
        return out

    def lora_expand(self, x, lora_b, token_lora):
        out = torch.zeros(x.shape[0], lora_b.shape[1], dtype=F64)
        for t, slot in enumerate(token_lora.tolist()):
            if slot >= 0:
                out[t] = lora_b[slot].to(F64) @ x[t].to(F64)
        return out

    # ------------------------------------------------------------------ mixture of experts
    def mixture_of_experts(self, hidden_states, expert_routing_table, router_weights, w12, w3,
                           permuted_weights, activation, experts_min, experts_max):  # fmt: skip
        def expert(x, e):
            return _gated(x, w12[e].to(F64), w3[e].to(F64), activation, None)

        return _route(hidden_states.to(F64), expert_routing_table, router_weights, experts_min,
                      experts_max, expert)  # fmt: skip

    def mixture_of_experts_fp8(self, hidden_states, expert_routing_table, router_weights, w12,
                               w3, d_scale_hidden_states, d_scale_intermediate_hidden_states,
                               d_scale_w12, d_scale_w3, permuted_weights, activation,
                               experts_min, experts_max):  # fmt: skip
        x = hidden_states.to(F64) * d_scale_hidden_states.to(F64)
        fp8 = hidden_states.dtype
        limit = self.fp8_max(fp8)

        def dequant(w, s):
            s = s.to(F64)
            return w.to(F64) * (s.reshape(-1, 1) if s.numel() > 1 else s.reshape(()))

        def expert(rows, e):
            inter = d_scale_intermediate_hidden_states[e].to(F64).reshape(())

            def quantize(h):  # the intermediate through FP8 with its expert's static scale
                return (h / inter).clamp(-limit, limit).to(torch.float32).to(fp8).to(F64) * inter

            up, down = dequant(w12[e], d_scale_w12[e]), dequant(w3[e], d_scale_w3[e])
            return _gated(rows, up, down, activation, quantize)

        return _route(x, expert_routing_table, router_weights, experts_min, experts_max, expert)

    def mixture_of_experts_mxfp4(self, hidden_states, expert_routing_table, router_weights, w12,
                                 w3, w12_bias, w3_bias, d_scale_w12, d_scale_w3, experts_min,
                                 experts_max, alpha, limit):  # fmt: skip
        def expert(x, e):
            gate_up = x @ _mxfp4(w12[e], d_scale_w12[e]).t() + w12_bias[e].to(F64)
            gate = gate_up[:, 0::2].clamp(max=limit)
            up = gate_up[:, 1::2].clamp(-limit, limit)
            h = (up + 1) * gate * torch.sigmoid(alpha * gate)
            return h @ _mxfp4(w3[e], d_scale_w3[e]).t() + w3_bias[e].to(F64)

        return _route(hidden_states.to(F64), expert_routing_table, router_weights, experts_min,
                      experts_max, expert)  # fmt: skip

    # ------------------------------------------------------------------ copies and 4-bit
    def copy_blocks(self, src, dst, src_block_indices, dst_block_indices):
        for s, d in zip(src_block_indices.tolist(), dst_block_indices.tolist()):
            dst.view(torch.uint8)[d] = src.view(torch.uint8)[s]

    def convert_from_uint4(self, qweight, scales, qzeros, out_dtype, g_idx=None):
        def nibbles(words):  # column 8j + i is nibble i (lowest first) of word j
            w = words.to(torch.int64) & 0xFFFFFFFF
            return torch.stack([(w >> (4 * i)) & 0xF for i in range(8)], -1).flatten(-2)

        q, z = nibbles(qweight), nibbles(qzeros)
        rows, groups = q.shape[0], scales.shape[0]
        group = torch.arange(rows) // (rows // groups) if g_idx is None else g_idx.long()
        return ((q - z[group]).to(F64) * scales[group].to(F64)).to(out_dtype).to(F64)

    # ------------------------------------------------------------------ FP8
    def fp8_max(self, dtype=torch.float8_e4m3fn):
        kind = "e5m2" if dtype == torch.float8_e5m2 else "e4m3"
        return _FP8_MAX[kind][self.generation]

    def cast_to_fp8_v2(self, x, scale=None, stochastic_rounding=False, is_amax=False,
                       dtype=torch.float8_e4m3fn):  # fmt: skip
        # The product is formed in float32, as the device's TPC forms it, then rounded once.
        y = x.float() if scale is None else x.float() * _as_float(scale)
        limit = self.fp8_max(dtype)
        out = y.clamp(-limit, limit).to(dtype)
        amax = x.to(F64).abs().max().float() if is_amax else torch.empty(0)
        return out, amax

    def cast_from_fp8(self, x, scale, out_dtype):
        return x.to(F64) * (1.0 if scale is None else _as_f64(scale))

    def fp8_gemm_v2(self, A, trans_A, B, trans_B, D, out_dtype, A_scale_inv=None,
                    B_scale_inv=None, bias=None, accumulate=False):  # fmt: skip
        a = A.to(F64).t() if trans_A else A.to(F64)
        b = B.to(F64).t() if trans_B else B.to(F64)
        out = a @ b
        for s in (A_scale_inv, B_scale_inv):
            if s is not None:
                out = out * _as_f64(s)
        if bias is not None:
            out = out + bias.to(F64)
        if accumulate:
            out = out + D.to(F64)
        return out


def _as_float(scale):
    return scale.float() if isinstance(scale, torch.Tensor) else scale


def _as_f64(scale):
    return scale.to(F64) if isinstance(scale, torch.Tensor) else scale


def _softmax_values(scores, values, sinks):
    """softmax(scores) @ values, with an optional sink logit in every denominator; a row with no
    key to attend gives zeros."""
    top = scores.amax(-1, keepdim=True)
    if sinks is not None:
        top = torch.maximum(top, sinks.expand_as(top))
    top = torch.nan_to_num(top, neginf=0.0)
    weights = (scores - top).exp()
    denom = weights.sum(-1, keepdim=True)
    if sinks is not None:
        denom = denom + (sinks.expand_as(top) - top).exp()
    return (weights @ values) / denom.clamp_min(1e-300)


def _gated(x, up, down, activation, intermediate):
    gate, lin = (x @ up.t()).chunk(2, dim=-1)
    if activation == "silu":
        act = gate * torch.sigmoid(gate)
    elif activation == "gelu":  # the tanh approximation, Gaudi's gelu
        act = 0.5 * gate * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3)))
    else:
        act = gate.clamp_min(0)
    h = act * lin
    return (h if intermediate is None else intermediate(h)) @ down.t()


def _route(x, table, router_weights, experts_min, experts_max, expert):
    out = torch.zeros(x.shape, dtype=F64)
    for t in range(x.shape[0]):
        for slot, e in enumerate(table[t].tolist()):
            if experts_min <= e <= experts_max:
                y = expert(x[t : t + 1], e - experts_min)[0]
                out[t] += float(router_weights[t, slot]) * y
    return out


def _mxfp4(blocks, scales):
    low, high = blocks.to(torch.int64) & 0xF, blocks.to(torch.int64) >> 4
    codes = torch.stack((low, high), -1).flatten(-2)  # element 2j in the low nibble
    values = _E2M1[codes & 7] * torch.where(codes >= 8, -1.0, 1.0).to(F64)
    exponent = scales.to(F64) - 127
    return values * torch.pow(2.0, exponent).repeat_interleave(32, dim=-1)
