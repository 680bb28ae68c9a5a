"""Mamba2 kernels (vllm_gaudi_ops.ssm) against the recurrence they compute, token by token in
float64: the chunked scan over padded rows of different lengths and with initial states, the
decode step, the causal conv in both forms, and the prefill-then-decode hand-over of both states.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_gaudi_ops import ssm

HEADS, HEAD_DIM, GROUPS, STATE = 4, 8, 2, 16
WIDTH, CONV_DIM = 4, 24


def _params(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "A": -torch.exp(torch.rand(HEADS, generator=gen, dtype=torch.float64) * 2),
        "D": torch.randn(HEADS, generator=gen, dtype=torch.float64),
        "dt_bias": torch.randn(HEADS, generator=gen, dtype=torch.float64) * 0.5,
    }


def _inputs(gen: torch.Generator, batch: int, length: int) -> dict[str, torch.Tensor]:
    return {
        "x": torch.randn(batch, length, HEADS, HEAD_DIM, generator=gen, dtype=torch.float64),
        "dt": torch.randn(batch, length, HEADS, generator=gen, dtype=torch.float64),
        "B": torch.randn(batch, length, GROUPS, STATE, generator=gen, dtype=torch.float64),
        "C": torch.randn(batch, length, GROUPS, STATE, generator=gen, dtype=torch.float64),
    }


def _recurrence(x, dt, A, B, C, D, dt_bias, state):
    """The definition, one token at a time, float64: x [T, H, P], dt [T, H], B/C [T, G, N],
    state [H, P, N]. Returns (y [T, H, P], state after the last token)."""
    state = state.double().clone()
    per_group = HEADS // GROUPS
    ys = []
    for t in range(x.shape[0]):
        step = F.softplus(dt[t].double() + dt_bias.double())
        for h in range(HEADS):
            g = h // per_group
            decay = torch.exp(step[h] * A[h].double())
            state[h] = decay * state[h] + step[h] * torch.outer(x[t, h].double(), B[t, g].double())
        y = torch.stack([state[h] @ C[t, h // per_group].double() for h in range(HEADS)])
        ys.append(y + D.double()[:, None] * x[t].double())
    return torch.stack(ys), state


def _conv_reference(x, weight, bias, state):
    """x [T, D], state [W-1, D] -> (silu(conv) [T, D], last W-1 inputs), float64."""
    padded = torch.cat([state.double(), x.double()])
    out = torch.stack(
        [(padded[t : t + WIDTH] * weight.double().T).sum(0) for t in range(x.shape[0])]
    )
    return F.silu(out + bias.double()), padded[-(WIDTH - 1) :]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_size", [4, 8])
def test_chunked_scan_equals_the_recurrence_on_padded_rows_with_initial_states(dtype, chunk_size):
    gen = torch.Generator().manual_seed(0)
    params = _params(gen)
    length, lengths = 24, torch.tensor([24, 13, 1])  # full, mid-chunk, a single token
    inputs = _inputs(gen, len(lengths), length)
    initial = torch.randn(len(lengths), HEADS, HEAD_DIM, STATE, generator=gen, dtype=torch.float64)
    initial[1] = 0  # a new sequence

    y, final = ssm.ssd_chunk_scan(
        **{k: v.to(dtype) for k, v in inputs.items()},
        **{k: v.float() for k, v in params.items()},
        initial_state=initial.float(),
        lengths=lengths,
        chunk_size=chunk_size,
    )

    assert y.dtype == dtype and y.shape == inputs["x"].shape
    assert final.dtype == torch.float32 and final.shape == initial.shape
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for row, n in enumerate(lengths.tolist()):
        # the reference sees the same (rounded) inputs the kernel saw
        seen = {k: v[row, :n].to(dtype).double() for k, v in inputs.items()}
        want_y, want_state = _recurrence(**seen, **params, state=initial[row])
        scale = want_y.abs().max()
        assert (y[row, :n].double() - want_y).abs().max() <= tol * scale, row
        assert (final[row].double() - want_state).abs().max() <= tol * want_state.abs().max()


def test_a_scan_continued_from_its_final_state_equals_one_scan_of_the_whole():
    gen = torch.Generator().manual_seed(1)
    params = {k: v.float() for k, v in _params(gen).items()}
    inputs = {k: v.float() for k, v in _inputs(gen, 1, 16).items()}
    zeros = torch.zeros(1, HEADS, HEAD_DIM, STATE)
    whole_y, whole_state = ssm.ssd_chunk_scan(
        **inputs, **params, initial_state=zeros, lengths=torch.tensor([16]), chunk_size=8
    )
    first = {k: v[:, :8] for k, v in inputs.items()}
    second = {k: v[:, 8:] for k, v in inputs.items()}
    y1, s1 = ssm.ssd_chunk_scan(
        **first, **params, initial_state=zeros, lengths=torch.tensor([8]), chunk_size=8
    )
    y2, s2 = ssm.ssd_chunk_scan(
        **second, **params, initial_state=s1, lengths=torch.tensor([8]), chunk_size=8
    )
    torch.testing.assert_close(torch.cat([y1, y2], dim=1), whole_y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s2, whole_state, atol=1e-5, rtol=1e-5)


def test_a_length_that_is_not_a_multiple_of_the_chunk_is_refused():
    gen = torch.Generator().manual_seed(2)
    params = {k: v.float() for k, v in _params(gen).items()}
    inputs = {k: v.float() for k, v in _inputs(gen, 1, 10).items()}
    with pytest.raises(ValueError, match="not a multiple of 8"):
        ssm.ssd_chunk_scan(
            **inputs,
            **params,
            initial_state=torch.zeros(1, HEADS, HEAD_DIM, STATE),
            lengths=torch.tensor([10]),
            chunk_size=8,
        )


def test_decode_steps_after_a_prefill_continue_the_recurrence():
    gen = torch.Generator().manual_seed(3)
    params = _params(gen)
    inputs = _inputs(gen, 2, 12)  # rows: 8 prompt tokens + 4 decode steps
    lengths = torch.tensor([8, 5])
    _, state = ssm.ssd_chunk_scan(
        **{k: v[:, :8].float() for k, v in inputs.items()},
        **{k: v.float() for k, v in params.items()},
        initial_state=torch.zeros(2, HEADS, HEAD_DIM, STATE),
        lengths=lengths,
        chunk_size=4,
    )
    for step in range(4):
        # row 1's prompt was 5 tokens: its decode tokens are its positions 5, 6, ...
        at = torch.tensor([8 + step, 5 + step])
        token = {k: v[torch.arange(2), at].float() for k, v in inputs.items()}
        y, state = ssm.selective_state_update(
            state,
            token["x"],
            token["dt"],
            **{k: v.float() for k, v in params.items()},
            B=token["B"],
            C=token["C"],
        )
        for row in range(2):
            seen = {k: v[row, : at[row] + 1] for k, v in inputs.items()}
            want_y, want_state = _recurrence(
                **seen, **params, state=torch.zeros(HEADS, HEAD_DIM, STATE)
            )
            torch.testing.assert_close(y[row].double(), want_y[-1], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(state[row].double(), want_state, atol=1e-4, rtol=1e-4)


def test_causal_conv_prefill_and_updates_equal_the_convolution_over_the_whole_sequence():
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(CONV_DIM, WIDTH, generator=gen)
    bias = torch.randn(CONV_DIM, generator=gen)
    x = torch.randn(3, 12, CONV_DIM, generator=gen)
    lengths = torch.tensor([9, 2, 6])  # row 1 is shorter than the kernel's reach
    state = torch.randn(3, WIDTH - 1, CONV_DIM, generator=gen)
    state[2] = 0  # a new sequence

    out, new_state = ssm.causal_conv1d_prefill(x[:, :9], weight, bias, state, lengths)

    for row, n in enumerate(lengths.tolist()):
        want, want_state = _conv_reference(x[row, :n], weight, bias, state[row])
        torch.testing.assert_close(out[row, :n].double(), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(new_state[row].double(), want_state)
    # three decode tokens continue each row where its prompt ended
    for step in range(3):
        at = lengths + step
        token = x[torch.arange(3), at]
        out_d, new_state = ssm.causal_conv1d_update(token, weight, bias, new_state)
        for row in range(3):
            want, _ = _conv_reference(x[row, : at[row] + 1], weight, bias, state[row])
            torch.testing.assert_close(out_d[row].double(), want[-1], atol=1e-5, rtol=1e-5)


def test_causal_conv_without_activation_or_bias_is_the_plain_convolution():
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(CONV_DIM, WIDTH, generator=gen)
    x = torch.randn(1, 8, CONV_DIM, generator=gen)
    out, _ = ssm.causal_conv1d_prefill(
        x, weight, None, torch.zeros(1, WIDTH - 1, CONV_DIM), torch.tensor([8]), silu=False
    )
    # torch's conv1d is a cross-correlation: left padding W-1 makes it causal
    want = F.conv1d(x.transpose(1, 2), weight[:, None], padding=WIDTH - 1, groups=CONV_DIM)
    torch.testing.assert_close(out, want[..., :8].transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_the_scan_uses_the_conventions_of_transformers_mamba2():
    """The same numbers as transformers' own torch Mamba2 scan (the fallback its Granite 4.0-H
    runs without the CUDA kernels): head-to-group mapping, [H, P, N] state, D and dt_bias."""
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (
        mamba2_chunk_scan,
        mamba2_selective_state_update,
    )

    gen = torch.Generator().manual_seed(6)
    params = {k: v.float() for k, v in _params(gen).items()}
    inputs = {k: v.float() for k, v in _inputs(gen, 2, 16).items()}
    initial = torch.randn(2, HEADS, HEAD_DIM, STATE, generator=gen)
    ours_y, ours_state = ssm.ssd_chunk_scan(
        **inputs, **params, initial_state=initial, lengths=torch.tensor([16, 16]), chunk_size=8
    )
    theirs_y, theirs_state = mamba2_chunk_scan(
        inputs["x"], inputs["dt"], params["A"], inputs["B"], inputs["C"], 8,
        D=params["D"], dt_bias=params["dt_bias"], initial_states=initial, dt_softplus=True,
        return_final_states=True,
    )  # fmt: skip
    torch.testing.assert_close(ours_y, theirs_y, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours_state, theirs_state, atol=1e-4, rtol=1e-4)

    token = {k: v[:, 0] for k, v in inputs.items()}
    ours_y, ours_next = ssm.selective_state_update(
        initial, token["x"], token["dt"], **params, B=token["B"], C=token["C"]
    )
    theirs = initial.clone()  # updated in place
    per_channel = HEAD_DIM  # transformers takes dt, dt_bias and D per channel, A per (P, N)
    theirs_y = mamba2_selective_state_update(
        theirs,
        token["x"],
        token["dt"][..., None].expand(-1, -1, per_channel),
        params["A"][:, None, None].expand(-1, per_channel, STATE),
        token["B"],
        token["C"],
        D=params["D"][:, None].expand(-1, per_channel),
        dt_bias=params["dt_bias"][:, None].expand(-1, per_channel),
        dt_softplus=True,
    )
    torch.testing.assert_close(ours_y, theirs_y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_next, theirs, atol=1e-5, rtol=1e-5)
