"""Gated delta rule kernels (the linear attention of gated delta net layers) in torch, with the
static shapes HPU graphs need.

vLLM runs the gated delta net layers of Qwen3-Next and Qwen3.5 through flash-linear-attention's
Triton kernels (a chunked prefill scan, a fused recurrent decode step) and, on its own CPU
backend, C++ ones from `vllm._C`. Neither exists on Gaudi; the math is elementwise ops, cumsum
and batched matmuls, written here once for the emulation and a Gaudi alike.

Notation (per value head; q and k heads are shared by HV / H value heads, head h reading q/k
head h // (HV / H)): q and k are L2-normalized (eps 1e-6), q scaled by `scale` (K ** -0.5);
g = -exp(A_log) * softplus(a + dt_bias) is the step's log decay, beta = sigmoid(b). The state S
is stored [V, K] per head, as vLLM's state cache holds it. Per token:
    S <- exp(g) * S
    S <- S + beta * (v - S k) ⊗ k
    o  = S q
Prefill rows are [B, L, ...] with `lengths[b]` real tokens in row b; positions past a row's
length get g = 0 and beta = 0, so the state passes through them unchanged and the final state is
the state after the row's last real token, with no data-dependent slicing.

The chunked form (flash-linear-attention's, with its WY representation): inside a chunk with
cumulative log decays G and entering state S0 (as [K, V]), the new values u_i = beta_i (v_i -
S_{i-1} k_i) solve a unit lower triangular system (I + A) u = beta v - beta exp(G) k S0 with
A_ij = beta_i (k_i . k_j) exp(G_i - G_j) for j < i. Its inverse is a finite product of matmuls
(A is nilpotent), so no triangular solve is needed on the device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

L2_EPS = 1e-6


def gating(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) in float32 from the layer's a and b projections ([..., HV] each)."""
    g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float())


def l2norm(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in float32."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _per_value_head(t: torch.Tensor, value_heads: int) -> torch.Tensor:
    """[..., H, K] -> [..., HV, K]: value head h reads q/k head h // (HV / H)."""
    return t.repeat_interleave(value_heads // t.shape[-2], dim=-2)


def _inverse_unit_lower(strict: torch.Tensor) -> torch.Tensor:
    """(I + strict)^-1 for strictly lower triangular `strict` [..., C, C]: with N = -strict
    nilpotent, (I - N)^-1 = (I + N)(I + N^2)(I + N^4)... up to the power C (matmuls only)."""
    size = strict.shape[-1]
    eye = torch.eye(size, dtype=strict.dtype, device=strict.device)
    power = -strict
    inverse = eye + power
    reach = 2
    while reach < size:
        power = power @ power
        inverse = inverse + inverse @ power
        reach *= 2
    return inverse


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    lengths: torch.Tensor,
    chunk_size: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over padded prefill rows, chunk by chunk.

    q, k [B, L, H, K] (before the L2 norm); v [B, L, HV, V]; g, beta [B, L, HV] (from
    `gating`); initial_state [B, HV, V, K] (zeros for a new sequence); lengths [B]. L need not be
    a multiple of chunk_size (the rows are padded to one). Returns (o [B, L, HV, V] in float32,
    final state [B, HV, V, K] in float32).
    """
    batch, seq_len, _, _ = q.shape
    value_heads = v.shape[2]
    real = torch.arange(seq_len, device=q.device)[None, :] < lengths.to(q.device)[:, None]
    g = g.float() * real[:, :, None]
    beta = beta.float() * real[:, :, None]
    qs = _per_value_head(l2norm(q), value_heads) * scale
    ks = _per_value_head(l2norm(k), value_heads)
    vs = v.float()
    pad = -seq_len % chunk_size
    if pad:  # zero steps past every row's end: decay 1, no update
        qs, ks, vs = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (qs, ks, vs))
        g, beta = (F.pad(t, (0, 0, 0, pad)) for t in (g, beta))
    chunks = (seq_len + pad) // chunk_size

    def by_chunk(t: torch.Tensor) -> torch.Tensor:  # [B, L, HV, ...] -> [B, HV, N, C, ...]
        t = t.reshape(batch, chunks, chunk_size, value_heads, *t.shape[3:])
        return t.movedim(3, 1)

    qs, ks, vs, g, beta = (by_chunk(t) for t in (qs, ks, vs, g, beta))
    cum = torch.cumsum(g, dim=-1)  # [B, HV, N, C]
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # exp(G_i - G_j) for j <= i, 0 above the diagonal (masked before exp: no overflow)
    decay = torch.exp((cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")))
    strict = (beta[..., :, None] * (ks @ ks.transpose(-1, -2)) * decay).tril(-1)
    inverse = _inverse_unit_lower(strict)
    u_free = inverse @ (beta[..., None] * vs)  # [B, HV, N, C, V]: u with S0 = 0
    w = inverse @ ((beta * torch.exp(cum))[..., None] * ks)  # [B, HV, N, C, K]: u's S0 share
    scores = (qs @ ks.transpose(-1, -2)) * decay  # [B, HV, N, C, C]
    to_end = torch.exp(cum[..., -1:] - cum)[..., None]  # [B, HV, N, C, 1]
    q_in = qs * torch.exp(cum)[..., None]

    state = initial_state.float().transpose(-1, -2)  # [B, HV, K, V]
    outputs = []
    for c in range(chunks):  # the few chunks of a bucket's row, in order
        u = u_free[:, :, c] - w[:, :, c] @ state
        outputs.append(q_in[:, :, c] @ state + scores[:, :, c] @ u)
        state = torch.exp(cum[:, :, c, -1])[..., None, None] * state + (
            (ks[:, :, c] * to_end[:, :, c]).transpose(-1, -2) @ u
        )
    o = torch.stack(outputs, dim=2)  # [B, HV, N, C, V]
    o = o.movedim(1, 3).reshape(batch, chunks * chunk_size, value_heads, -1)
    return o[:, :seq_len], state.transpose(-1, -2)


def recurrent_step(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token per row: state [B, HV, V, K]; q, k [B, H, K]; v [B, HV, V]; g, beta
    [B, HV]. Returns (o [B, HV, V] in float32, new state [B, HV, V, K] in float32)."""
    value_heads = v.shape[1]
    qs = _per_value_head(l2norm(q), value_heads) * scale
    ks = _per_value_head(l2norm(k), value_heads)
    s = state.float() * torch.exp(g.float())[..., None, None]
    delta = (v.float() - (s @ ks[..., None])[..., 0]) * beta.float()[..., None]  # [B, HV, V]
    s = s + delta[..., None] * ks[:, :, None, :]
    return (s @ qs[..., None])[..., 0], s
