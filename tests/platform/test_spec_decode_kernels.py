"""The plain-torch stand-ins for vLLM's rejection-sampler Triton kernels compute what the kernels
compute: each is checked against a direct per-request transcription of the kernel's loop, on
batches with padding rows, -1 padded drafts, requests without drafts and mixed greedy/random
rows, and once through vLLM's own `rejection_sample` with the stand-ins registered."""

from __future__ import annotations

import pytest
import torch

from vllm_gaudi_platform.worker.cuda_stand_ins import triton_kernels as to

PLACEHOLDER = -1
MAX_SPEC_LEN = 4
VOCAB = 11


# ------------------------------------------- references (one request at a time)
def ref_rejection(
    out,
    cu,
    drafts,
    bonus,
    rows,
    accept,
    replacement,
):
    """The kernels' walk: accept drafts in order, the first rejection writes its replacement and
    stops; all accepted -> bonus. `accept(t, pos)` and `replacement(t)` are per flat token."""
    out = out.clone()
    start = 0
    for r in range(out.shape[0]):
        end = int(cu[r])
        if rows[r]:
            rejected = False
            for pos in range(end - start):
                t = start + pos
                if accept(t, pos):
                    out[r, pos] = int(drafts[t])
                else:
                    out[r, pos] = int(replacement(t))
                    rejected = True
                    break
            if not rejected:
                out[r, end - start] = int(bonus[r])
        start = end
    return out


def batch(num_drafts: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor(num_drafts, dtype=torch.int32).cumsum(0).to(torch.int32)
    n = int(cu[-1]) if num_drafts else 0
    target_argmax = torch.randint(0, VOCAB, (n,), generator=g)
    drafts = target_argmax.clone().to(torch.int32)
    # Make about a third of the drafts disagree with the target, and pad some with -1.
    flip = torch.rand(n, generator=g) < 0.35
    drafts[flip] = (drafts[flip] + 1) % VOCAB
    pad = torch.rand(n, generator=g) < 0.15
    drafts[pad] = -1
    bonus = torch.randint(0, VOCAB, (len(num_drafts), 1), generator=g)
    out = torch.full((len(num_drafts), MAX_SPEC_LEN + 1), PLACEHOLDER, dtype=torch.int32)
    return cu, drafts, target_argmax, bonus, out


# Requests with full, partial and zero drafts; the last rows are batch padding (no drafts).
LAYOUTS = [
    [4, 2, 0, 3, 1, 0, 0],
    [0, 0, 0],
    [4, 4, 4, 4],
    [1],
]


@pytest.mark.parametrize("num_drafts", LAYOUTS, ids=str)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_stand_in_keeps_drafts_until_the_first_mismatch(num_drafts, seed):
    cu, drafts, argmax, bonus, out = batch(num_drafts, seed)
    is_greedy = torch.tensor([i % 3 != 1 for i in range(len(num_drafts))])
    expected = ref_rejection(
        out,
        cu,
        drafts,
        bonus.flatten(),
        is_greedy,
        accept=lambda t, pos: int(drafts[t]) == int(argmax[t]),
        replacement=lambda t: argmax[t],
    )

    to.rejection_greedy_sample(
        out, cu, drafts, argmax, bonus, is_greedy, MAX_SPEC_LEN, None, None, False
    )

    assert torch.equal(out, expected)


def test_greedy_stand_in_treats_all_rows_as_greedy_without_a_mask():
    cu, drafts, argmax, bonus, out = batch([3, 0, 2], seed=5)
    expected = ref_rejection(
        out,
        cu,
        drafts,
        bonus.flatten(),
        [True] * 3,
        accept=lambda t, pos: int(drafts[t]) == int(argmax[t]),
        replacement=lambda t: argmax[t],
    )

    to.rejection_greedy_sample(
        out, cu, drafts, argmax, bonus, None, MAX_SPEC_LEN, None, None, False
    )

    assert torch.equal(out, expected)


def test_greedy_stand_in_in_synthetic_mode_accepts_by_rate_and_rejects_padded_drafts():
    cu, drafts, argmax, bonus, out = batch([4, 3, 0, 2], seed=3)
    uniform = torch.rand(drafts.numel(), generator=torch.Generator().manual_seed(9)).double()
    rates = torch.tensor([0.9, 0.6, 0.4, 0.2])
    expected = ref_rejection(
        out,
        cu,
        drafts,
        bonus.flatten(),
        [True] * 4,
        accept=lambda t, pos: float(uniform[t]) < float(rates[pos]) and int(drafts[t]) >= 0,
        replacement=lambda t: argmax[t],
    )

    to.rejection_greedy_sample(
        out, cu, drafts, argmax, bonus, None, MAX_SPEC_LEN, uniform, rates, True
    )

    assert torch.equal(out, expected)


@pytest.mark.parametrize("num_drafts", LAYOUTS, ids=str)
@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_random_stand_in_accepts_by_probability_ratio_on_random_rows(num_drafts, with_draft_probs):
    cu, drafts, _, bonus, out = batch(num_drafts, seed=7)
    g = torch.Generator().manual_seed(11)
    n = drafts.numel()
    target_probs = torch.softmax(torch.randn(n, VOCAB, generator=g) * 3, dim=-1)
    draft_probs = torch.softmax(torch.randn(n, VOCAB, generator=g) * 3, dim=-1)
    if with_draft_probs and n:
        draft_probs[0] = 0.0  # a zero draft probability must reject, not divide by zero
    else:
        draft_probs = draft_probs if with_draft_probs else None
    uniform = torch.rand(n, generator=g, dtype=torch.float64)
    recovered = torch.randint(0, VOCAB, (n,), generator=g, dtype=torch.int32)
    is_greedy = torch.tensor([i % 2 == 0 for i in range(len(num_drafts))])

    def accept(t, pos):
        d = int(drafts[t])
        if d < 0:
            return False
        q = 1.0 if draft_probs is None else float(draft_probs[t, d])
        return q > 0 and float(target_probs[t, d]) / q >= float(uniform[t])

    expected = ref_rejection(
        out, cu, drafts, bonus.flatten(), ~is_greedy, accept, lambda t: recovered[t]
    )

    to.rejection_random_sample(
        out,
        cu,
        drafts,
        draft_probs,
        target_probs,
        bonus,
        recovered,
        uniform,
        is_greedy,
        MAX_SPEC_LEN,
        VOCAB,
        None,
        draft_probs is None,
        False,
    )

    assert torch.equal(out, expected)


def test_random_stand_in_in_synthetic_mode_accepts_by_rate():
    cu, drafts, _, bonus, out = batch([4, 1, 3], seed=4)
    n = drafts.numel()
    uniform = torch.rand(n, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    rates = torch.tensor([0.8, 0.5, 0.5, 0.3])
    recovered = torch.arange(n, dtype=torch.int32) % VOCAB
    is_greedy = torch.tensor([False, False, True])
    expected = ref_rejection(
        out,
        cu,
        drafts,
        bonus.flatten(),
        ~is_greedy,
        accept=lambda t, pos: int(drafts[t]) >= 0 and float(uniform[t]) < float(rates[pos]),
        replacement=lambda t: recovered[t],
    )

    to.rejection_random_sample(
        out,
        cu,
        drafts,
        None,
        torch.full((n, VOCAB), 1.0 / VOCAB),
        bonus,
        recovered,
        uniform,
        is_greedy,
        MAX_SPEC_LEN,
        VOCAB,
        rates,
        True,
        True,
    )

    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64])
def test_expand_stand_in_repeats_each_request_value_over_its_tokens(dtype):
    values = torch.tensor([0, 3, 5, 0], dtype=dtype)
    cu = torch.tensor([2, 2, 5, 6], dtype=torch.int32)  # second request has no tokens
    out = torch.full((8,), 99, dtype=dtype)  # two trailing positions past the last request

    to.expand(out, values, cu, 0, 1, 128)

    assert out.tolist() == [1, 1, 5, 5, 5, 1, 99, 99]


def test_expand_stand_in_writes_at_most_max_num_tokens_per_request():
    out = torch.full((5,), -7, dtype=torch.int64)

    to.expand(out, torch.tensor([4, 6]), torch.tensor([3, 5], dtype=torch.int32), 0, 0, 2)

    assert out.tolist() == [4, 4, -7, 6, 6]


def ref_recovered(cu, drafts, draft_probs, target_probs, inv_q):
    out = []
    start = 0
    for r in range(cu.numel()):
        for t in range(start, int(cu[r])):
            if draft_probs is None:
                p = target_probs[t].clone()
                p[int(drafts[t])] = 0.0 if int(drafts[t]) >= 0 else p[int(drafts[t])]
            else:
                p = torch.clamp(target_probs[t] - draft_probs[t], min=0.0)
            score = (p * inv_q[r]).tolist()
            out.append(max(range(len(score)), key=lambda v: (score[v], -v)))
        start = int(cu[r])
    return out


@pytest.mark.parametrize("with_draft_probs", [False, True])
@pytest.mark.parametrize("fp64", [False, True])
def test_recovered_tokens_stand_in_takes_the_argmax_of_residual_times_inverse_noise(
    with_draft_probs, fp64
):
    num_drafts = [3, 0, 4, 1, 0]
    cu, drafts, _, _, _ = batch(num_drafts, seed=8)
    drafts = drafts.clamp(min=0)  # draft ids are real tokens where recovered tokens are sampled
    g = torch.Generator().manual_seed(13)
    n = drafts.numel()
    target_probs = torch.softmax(torch.randn(n, VOCAB, generator=g) * 2, dim=-1)
    draft_probs = (
        torch.softmax(torch.randn(n, VOCAB, generator=g) * 2, dim=-1) if with_draft_probs else None
    )
    q = torch.empty(len(num_drafts), VOCAB, dtype=torch.float64 if fp64 else torch.float32)
    inv_q = q.exponential_(generator=g).reciprocal()
    out = torch.full((n,), -5, dtype=torch.int32)

    to.sample_recovered_tokens(
        out, cu, drafts, draft_probs, target_probs, inv_q, VOCAB, 8192, draft_probs is None, fp64
    )

    assert out.tolist() == ref_recovered(cu, drafts, draft_probs, target_probs, inv_q)


def test_recovered_tokens_stand_in_breaks_ties_towards_the_lowest_token_id():
    cu = torch.tensor([2], dtype=torch.int32)
    drafts = torch.tensor([0, 3], dtype=torch.int32)
    target_probs = torch.tensor([[0.5, 0.25, 0.25, 0.0], [0.0, 0.0, 0.0, 1.0]])
    out = torch.full((2,), -5, dtype=torch.int32)

    to.sample_recovered_tokens(
        out, cu, drafts, None, target_probs, torch.ones(1, 4), 4, 8192, True, False
    )

    # Row 0: the draft (token 0) is excluded, tokens 1 and 2 tie -> 1. Row 1: all zero -> 0.
    assert out.tolist() == [1, 0]


# ------------------------------------------------------------------ through vLLM's sampler
def test_vllm_rejection_sample_runs_on_the_stand_ins_for_a_mixed_batch():
    """Registered, the stand-ins take vLLM's launches by name: vLLM's `rejection_sample` on a batch
    of greedy and random rows gives what the kernels' walk gives."""
    from vllm.v1.sample import rejection_sampler as rs

    to.register()
    from vllm.v1.sample.metadata import SamplingMetadata

    num_drafts = [3, 0, 2, 3]
    cu, drafts, _, bonus, _ = batch(num_drafts, seed=21)
    drafts = drafts.clamp(min=0)
    n = drafts.numel()
    logits = torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(4)) * 4
    # Make the greedy rows' drafts partly right so acceptance is exercised.
    argmax = logits.argmax(-1)
    drafts[:2] = argmax[:2].to(torch.int32)
    temperature = torch.tensor([0.0, 1.0, 0.0, 1.0])
    metadata = SamplingMetadata(
        temperature=temperature,
        all_greedy=False,
        all_random=False,
        top_p=None,
        top_k=None,
        generators={},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(4),
        presence_penalties=torch.zeros(4),
        repetition_penalties=torch.ones(4),
        output_token_ids=[[] for _ in range(4)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=None,  # type: ignore[arg-type]
    )
    torch.manual_seed(0)

    result = rs.rejection_sample(
        drafts, num_drafts, MAX_SPEC_LEN - 1, cu, None, logits.clone(), bonus, metadata
    )

    # Greedy rows follow the argmax walk exactly.
    greedy = ref_rejection(
        torch.full((4, MAX_SPEC_LEN), PLACEHOLDER, dtype=torch.int32),
        cu,
        drafts,
        bonus.flatten(),
        [True, False, True, False],
        accept=lambda t, pos: int(drafts[t]) == int(argmax[t]),
        replacement=lambda t: argmax[t],
    )
    assert torch.equal(result[[0, 2]], greedy[[0, 2]])
    # Random rows hold accepted drafts, then one recovered or bonus token, then placeholders.
    for r in (1, 3):
        row = result[r].tolist()
        filled = [x for x in row if x != PLACEHOLDER]
        assert row[: len(filled)] == filled and 1 <= len(filled) <= num_drafts[r] + 1
        assert all(0 <= x < VOCAB for x in filled)
