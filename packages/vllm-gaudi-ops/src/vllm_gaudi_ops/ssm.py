"""Mamba2 state-space kernels in torch, with the static shapes HPU graphs need.

vLLM's Mamba2 mixer calls Triton kernels (chunked SSD scan, single-step state update, causal
conv1d) and, on its own CPU backend only, C++ ones from `vllm._C`. Neither exists on Gaudi, where
these are ordinary torch ops (elementwise, cumsum, batched matmul) on the TPC and MME, so they are
written here once and run the same on the emulation and on a Gaudi: there is no Habana kernel to
put behind the seam.

Shapes are fixed by the caller's bucket, never by the data. A prefill batch is [B, L, ...] with L
a multiple of `chunk_size` and `lengths[b]` real tokens in row b; positions past a row's length
get a zero step (dt = 0: decay 1, input 0), so the state passes through them unchanged and the
final state is the state after the last real token, with no data-dependent slicing.

Notation (Mamba2): H heads of P channels, G groups of N-dim B/C projections (head h reads group
h // (H / G)), A = -exp(A_log) per head, dt' = softplus(dt + dt_bias). Per token, per head:
    S <- exp(dt' * A) * S + dt' * x ⊗ B        (S: [P, N])
    y  = S @ C + D * x
The chunked scan computes the same recurrence (Mamba2's state-space duality): within a chunk a
masked quadratic form, across chunks the recurrence over chunk-end states.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state: torch.Tensor,
    lengths: torch.Tensor,
    *,
    silu: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over padded rows, continuing from each row's conv state.

    x [B, L, D]; weight [D, W]; bias [D] or None; state [B, W-1, D]: the W-1 inputs before the
    row's first token (zeros for a new sequence); lengths [B] (int). Returns (out [B, L, D],
    new state [B, W-1, D]: the row's last W-1 real inputs, taken before the activation).
    Outputs at padded positions are not meaningful.
    """
    width = weight.shape[1]
    seq_len = x.shape[1]
    padded = torch.cat([state.to(x.dtype), x], dim=1)  # [B, W-1+L, D]
    out = _conv_taps(padded, weight, bias, seq_len)
    # Token t sits at padded[t + W - 1]; the last W-1 real ones start at padded[length].
    index = lengths.to(torch.long)[:, None] + torch.arange(width - 1, device=x.device)
    new_state = torch.gather(padded, 1, index[:, :, None].expand(-1, -1, x.shape[2]))
    return (F.silu(out) if silu else out), new_state


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state: torch.Tensor,
    *,
    silu: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token per row: x [B, D], state [B, W-1, D] -> (out [B, D], new state)."""
    padded = torch.cat([state.to(x.dtype), x[:, None]], dim=1)  # [B, W, D]
    out = _conv_taps(padded, weight, bias, 1)[:, 0]
    return (F.silu(out) if silu else out), padded[:, 1:]


def _conv_taps(
    padded: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_len: int
) -> torch.Tensor:
    """out[:, t] = bias + sum_k weight[:, k] * padded[:, t + k], accumulated in float32."""
    acc = torch.zeros(
        padded.shape[0], out_len, padded.shape[2], dtype=torch.float32, device=padded.device
    )
    w = weight.float()
    for k in range(weight.shape[1]):  # the kernel width (4 in every Mamba2 model): unrolled
        acc = acc + padded[:, k : k + out_len].float() * w[:, k]
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(padded.dtype)


def _per_head(groups: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[..., G, N] -> [..., H, N]: head h reads group h // (H / G)."""
    return groups.repeat_interleave(num_heads // groups.shape[-2], dim=-2)


def _segment_sums(a: torch.Tensor) -> torch.Tensor:
    """a [..., Q] -> [..., Q, Q]: out[i, j] = a[j+1] + ... + a[i] for j <= i, -inf above the
    diagonal (so exp() gives the decay from step j to step i, and 0 where j > i)."""
    q = a.shape[-1]
    cumsum = torch.cumsum(a, dim=-1)
    sums = cumsum[..., :, None] - cumsum[..., None, :]
    upper = torch.ones(q, q, dtype=torch.bool, device=a.device).triu(1)
    return sums.masked_fill(upper, float("-inf"))


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    initial_state: torch.Tensor,
    lengths: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba2's chunked scan over padded prefill rows.

    x [B, L, H, P]; dt [B, L, H] (before softplus and dt_bias); A [H] (negative); B, C
    [B, L, G, N]; D [H]; dt_bias [H]; initial_state [B, H, P, N] (zeros for a new sequence);
    lengths [B]; L a multiple of chunk_size. Returns (y [B, L, H, P] in x's dtype, final state
    [B, H, P, N] in float32: the state after each row's last real token).
    """
    batch, seq_len, heads, _ = x.shape
    if seq_len % chunk_size:
        raise ValueError(f"ssd_chunk_scan: length {seq_len} is not a multiple of {chunk_size}")
    chunks = seq_len // chunk_size
    real = torch.arange(seq_len, device=x.device)[None, :] < lengths.to(x.device)[:, None]
    step = F.softplus(dt.float() + dt_bias.float()) * real[:, :, None]  # [B, L, H]
    xs = x.float() * real[:, :, None, None]
    bh = _per_head(B.float(), heads)
    ch = _per_head(C.float(), heads)

    def chunked(t: torch.Tensor) -> torch.Tensor:  # [B, L, ...] -> [B, chunks, Q, ...]
        return t.reshape(batch, chunks, chunk_size, *t.shape[2:])

    xs, step, bh, ch = chunked(xs), chunked(step), chunked(bh), chunked(ch)
    log_decay = (step * A.float()).permute(0, 3, 1, 2)  # [B, H, chunks, Q]
    cum = torch.cumsum(log_decay, dim=-1)

    # Within each chunk: y_i = sum_{j<=i} (C_i . B_j) exp(cum_i - cum_j) dt_j x_j.
    decay_in = torch.exp(_segment_sums(log_decay))  # [B, H, chunks, Q, Q]
    scores = torch.einsum("bcihn,bcjhn->bhcij", ch, bh) * decay_in
    y = torch.einsum("bhcij,bcjh,bcjhp->bcihp", scores, step, xs)

    # Each chunk's own contribution to the state at its end.
    to_end = torch.exp(cum[..., -1:] - cum)  # [B, H, chunks, Q]
    chunk_states = torch.einsum("bcjhn,bhcj,bcjh,bcjhp->bchpn", bh, to_end, step, xs)

    # Across chunks: the state entering chunk c (sequential over the few chunks of a bucket).
    chunk_decay = torch.exp(cum[..., -1])  # [B, H, chunks]
    state = initial_state.float()
    entering = []
    for c in range(chunks):
        entering.append(state)
        state = chunk_decay[:, :, c, None, None] * state + chunk_states[:, c]
    states_in = torch.stack(entering, dim=1)  # [B, chunks, H, P, N]

    # The entering state's share of each output: C_i . (exp(cum_i) * S_in).
    y = y + torch.einsum("bcihn,bchpn,bhci->bcihp", ch, states_in, torch.exp(cum))
    y = y.reshape(batch, seq_len, heads, -1) + D.float()[:, None] * x.float()
    return y.to(x.dtype), state


def selective_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step per row: state [B, H, P, N]; x [B, H, P]; dt [B, H]; B, C [B, G, N].
    Returns (y [B, H, P] in x's dtype, new state in state's dtype)."""
    heads = x.shape[1]
    step = F.softplus(dt.float() + dt_bias.float())  # [B, H]
    decay = torch.exp(step * A.float())[:, :, None, None]
    bh = _per_head(B.float(), heads)
    ch = _per_head(C.float(), heads)
    new = decay * state.float() + (step[:, :, None] * x.float())[..., None] * bh[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", new, ch) + D.float()[:, None] * x.float()
    return y.to(x.dtype), new.to(state.dtype)
