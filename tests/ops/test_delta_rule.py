"""Gated delta rule kernels (vllm_gaudi_ops.delta_rule) against the recurrence they compute, token
by token in float64: the chunked prefill over padded rows of different lengths (varlen) from
non-zero initial states, the decode step, prefill then decode handing the state over, and the
causal conv's state carried from a prefill chunk into the next chunk and into decode.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_gaudi_ops import delta_rule, ssm

QK_HEADS, V_HEADS, K_DIM, V_DIM = 2, 4, 16, 8
SCALE = K_DIM**-0.5


def _recurrence(q, k, v, a, b, A_log, dt_bias, state):
    """The definition, one token at a time, float64: q, k [T, H, K]; v [T, HV, V]; a, b [T, HV];
    state [HV, V, K]. Returns (o [T, HV, V], state after the last token)."""
    state = state.double().clone()
    per_qk = V_HEADS // QK_HEADS
    outs = []
    for t in range(q.shape[0]):
        g = -torch.exp(A_log.double()) * F.softplus(a[t].double() + dt_bias.double())
        beta = torch.sigmoid(b[t].double())
        o = []
        for h in range(V_HEADS):
            qh, kh = q[t, h // per_qk].double(), k[t, h // per_qk].double()
            qh = qh / torch.sqrt((qh * qh).sum() + 1e-6) * SCALE
            kh = kh / torch.sqrt((kh * kh).sum() + 1e-6)
            s = state[h] * torch.exp(g[h])
            s = s + beta[h] * torch.outer(v[t, h].double() - s @ kh, kh)
            state[h] = s
            o.append(s @ qh)
        outs.append(torch.stack(o))
    return torch.stack(outs), state


def _params(gen):
    return (
        torch.rand(V_HEADS, generator=gen, dtype=torch.float64) * 2 - 1,  # A_log
        torch.randn(V_HEADS, generator=gen, dtype=torch.float64),  # dt_bias
    )


def _inputs(gen, batch, length):
    def r(*shape):
        return torch.randn(batch, length, *shape, generator=gen, dtype=torch.float64)

    return r(QK_HEADS, K_DIM), r(QK_HEADS, K_DIM), r(V_HEADS, V_DIM), r(V_HEADS), r(V_HEADS)


@pytest.mark.parametrize(("length", "chunk"), [(40, 16), (64, 64), (37, 8)])
def test_chunked_prefill_from_initial_states_matches_the_recurrence_in_float64(length, chunk):
    gen = torch.Generator().manual_seed(length)
    A_log, dt_bias = _params(gen)
    q, k, v, a, b = _inputs(gen, 3, length)
    state0 = torch.randn(3, V_HEADS, V_DIM, K_DIM, generator=gen, dtype=torch.float64)
    state0[1] = 0  # a new sequence beside two continuing ones
    lengths = torch.tensor([length, 1, length - 13])  # varlen: padded rows
    g, beta = delta_rule.gating(a, b, A_log, dt_bias)
    o, final = delta_rule.chunk_gated_delta_rule(
        q.float(), k.float(), v.float(), g, beta, state0.float(), lengths, chunk, SCALE
    )
    assert o.shape == (3, length, V_HEADS, V_DIM) and final.dtype == torch.float32
    for row, n in enumerate(lengths.tolist()):
        ref_o, ref_state = _recurrence(
            q[row, :n], k[row, :n], v[row, :n], a[row, :n], b[row, :n], A_log, dt_bias, state0[row]
        )
        torch.testing.assert_close(o[row, :n].double(), ref_o, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(final[row].double(), ref_state, atol=2e-5, rtol=1e-4)


def test_padding_past_a_row_leaves_its_state_and_other_rows_alone():
    gen = torch.Generator().manual_seed(3)
    A_log, dt_bias = _params(gen)
    q, k, v, a, b = (t.float() for t in _inputs(gen, 2, 24))
    state0 = torch.randn(2, V_HEADS, V_DIM, K_DIM, generator=gen)
    g, beta = delta_rule.gating(a, b, A_log, dt_bias)
    lengths = torch.tensor([10, 24])
    _, final = delta_rule.chunk_gated_delta_rule(q, k, v, g, beta, state0, lengths, 8, SCALE)
    # Garbage in the padded tail of row 0 changes nothing.
    q2, v2 = q.clone(), v.clone()
    q2[0, 10:], v2[0, 10:] = 1e3, -1e3
    o2, final2 = delta_rule.chunk_gated_delta_rule(q2, k, v2, g, beta, state0, lengths, 8, SCALE)
    torch.testing.assert_close(final2, final)
    # Row 1 alone gives the same as row 1 in the batch.
    o1, final1 = delta_rule.chunk_gated_delta_rule(
        q[1:], k[1:], v[1:], g[1:], beta[1:], state0[1:], lengths[1:], 8, SCALE
    )
    torch.testing.assert_close(o1[0], o2[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final1[0], final[1], atol=1e-5, rtol=1e-5)


def test_prefill_in_two_chunks_then_decode_equals_one_pass_over_every_token():
    """A prompt split across two steps (chunked prefill) continues from the first chunk's final
    state, then decode steps continue from the prefill's: the same outputs as the recurrence over
    all the tokens at once."""
    gen = torch.Generator().manual_seed(11)
    A_log, dt_bias = _params(gen)
    total, first, decodes = 30, 17, 4
    q, k, v, a, b = _inputs(gen, 1, total + decodes)
    state0 = torch.zeros(1, V_HEADS, V_DIM, K_DIM, dtype=torch.float64)
    ref_o, ref_state = _recurrence(q[0], k[0], v[0], a[0], b[0], A_log, dt_bias, state0[0])
    g, beta = delta_rule.gating(a, b, A_log, dt_bias)
    qf, kf, vf = q.float(), k.float(), v.float()
    state = state0.float()
    outs = []
    for lo, hi in ((0, first), (first, total)):
        o, state = delta_rule.chunk_gated_delta_rule(
            qf[:, lo:hi],
            kf[:, lo:hi],
            vf[:, lo:hi],
            g[:, lo:hi],
            beta[:, lo:hi],
            state,
            torch.tensor([hi - lo]),
            16,
            SCALE,
        )
        outs.append(o[0])
    for t in range(total, total + decodes):
        o, state = delta_rule.recurrent_step(
            state, qf[:, t], kf[:, t], vf[:, t], g[:, t], beta[:, t], SCALE
        )
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs).double(), ref_o, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(state[0].double(), ref_state, atol=2e-5, rtol=1e-4)


def test_decode_step_matches_the_recurrence_for_a_batch_of_states():
    gen = torch.Generator().manual_seed(5)
    A_log, dt_bias = _params(gen)
    q, k, v, a, b = _inputs(gen, 3, 1)
    state0 = torch.randn(3, V_HEADS, V_DIM, K_DIM, generator=gen, dtype=torch.float64)
    g, beta = delta_rule.gating(a[:, 0], b[:, 0], A_log, dt_bias)
    o, new = delta_rule.recurrent_step(
        state0.float(), q[:, 0].float(), k[:, 0].float(), v[:, 0].float(), g, beta, SCALE
    )
    for row in range(3):
        ref_o, ref_state = _recurrence(
            q[row], k[row], v[row], a[row], b[row], A_log, dt_bias, state0[row]
        )
        torch.testing.assert_close(o[row].double(), ref_o[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(new[row].double(), ref_state, atol=1e-5, rtol=1e-5)


def test_inverse_of_a_unit_lower_triangular_matrix_by_products():
    gen = torch.Generator().manual_seed(2)
    for size in (1, 2, 5, 16, 64):
        strict = (torch.randn(3, size, size, generator=gen, dtype=torch.float64) * 0.3).tril(-1)
        eye = torch.eye(size, dtype=torch.float64)
        inverse = delta_rule._inverse_unit_lower(strict)
        torch.testing.assert_close(inverse @ (eye + strict), eye.expand(3, -1, -1))


def test_conv_state_carries_across_prefill_chunks_and_into_decode():
    """The short causal conv of the gated delta net layers (the Mamba2 one, `ssm`): a prompt in
    two chunks of different rows' lengths and then a decode step, each continuing from the conv
    state the last left, equals the conv over the whole sequence."""
    gen = torch.Generator().manual_seed(9)
    width, dim, total = 4, 12, 21
    x = torch.randn(2, total + 1, dim, generator=gen)
    weight = torch.randn(dim, width, generator=gen)
    bias = torch.randn(dim, generator=gen)
    whole, _ = ssm.causal_conv1d_prefill(
        x, weight, bias, torch.zeros(2, width - 1, dim), torch.tensor([total + 1] * 2)
    )
    cut = torch.tensor([9, 2])  # each row's first chunk
    first, state = ssm.causal_conv1d_prefill(
        x[:, :9], weight, bias, torch.zeros(2, width - 1, dim), cut
    )
    rest = torch.stack([torch.cat([x[0, 9:total], torch.full((7, dim), 9.0)]), x[1, 2:total]])
    second, state = ssm.causal_conv1d_prefill(rest, weight, bias, state, total - cut)
    last, _ = ssm.causal_conv1d_update(x[:, total], weight, bias, state)
    torch.testing.assert_close(first[0], whole[0, :9], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(first[1, :2], whole[1, :2], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(second[0, : total - 9], whole[0, 9:total], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(second[1, : total - 2], whole[1, 2:total], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(last, whole[:, total], atol=1e-5, rtol=1e-5)
