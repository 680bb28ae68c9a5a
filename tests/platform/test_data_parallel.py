"""Data-parallel ranks agree on one padded layout per step (worker/data_parallel.py)."""

from __future__ import annotations

import pytest
import torch

from tests.platform import test_attention
from vllm_gaudi_platform.attention import step_layout
from vllm_gaudi_platform.bucketing import Bucket, BucketPlan
from vllm_gaudi_platform.worker import data_parallel

BLOCK = test_attention.BLOCK


@pytest.fixture(autouse=True)
def _emulation(monkeypatch):
    monkeypatch.setenv("VLLM_HPU_EMULATION", "cpu")


def _plan() -> BucketPlan:
    """A grid within a budget of 64 prompt tokens per step (no (2, 64, c) bucket)."""
    return BucketPlan(
        strategy="test",
        prompt=tuple(
            Bucket("prompt", bs, q, c)
            for bs in (1, 2, 4)
            for q in (16, 32, 64)
            for c in (0, 2, 4, 8)
            if bs * q <= 64
        ),
        decode=tuple(Bucket("decode", bs, 1, c) for bs in (2, 4, 8) for c in (4, 8, 16)),
    )


def _layout(query_lens: list[int], ctx_lens: list[int], plan: BucketPlan):
    seq_lens = [q + c for q, c in zip(query_lens, ctx_lens)]
    return step_layout.plan_step(
        query_lens=query_lens, seq_lens=seq_lens, block_size=BLOCK, plan=plan
    )


def _vector(query_lens: list[int], ctx_lens: list[int], plan: BucketPlan):
    layout = _layout(query_lens, ctx_lens, plan)
    return layout, data_parallel.shape_vector(layout, [-(-c // BLOCK) for c in ctx_lens])


def test_idle_rank_contributes_zeros():
    assert data_parallel.shape_vector(None) == data_parallel.IDLE == (0,) * 7


def test_ranks_with_different_steps_end_up_with_the_same_warmed_buckets():
    plan = _plan()
    prefill_only = _vector([20], [0], plan)  # prefill bucket (1, 32, 0)
    decode_only = _vector([1, 1, 1], [30, 40, 3], plan)  # decode bucket (4, 1, 8)
    mixed = _vector([40, 1], [20, 10], plan)  # prefill (1, 64, 2) + decode (2, 1, 4)
    ranks = [prefill_only, decode_only, mixed, (None, data_parallel.IDLE)]
    layouts = [layout for layout, _ in ranks]
    maxima = data_parallel.combine([vector for _, vector in ranks])
    agreed = [data_parallel.pad_to_agreed(x, maxima, plan) for x in layouts]
    assert {a.buckets for a in agreed} == {(Bucket("prompt", 1, 64, 2), Bucket("decode", 4, 1, 8))}
    assert all(a.warmed for a in agreed)
    assert {a.num_tokens_padded for a in agreed} == {64 + 4}


def test_padding_keeps_each_ranks_own_requests():
    plan = _plan()
    own = _layout([20, 5, 1], [0, 0, 17], plan)
    maxima = (2, 32, 2, 8, 16, 25, 0)
    padded = data_parallel.pad_to_agreed(own, maxima, plan)
    assert padded.query_lens == own.query_lens
    assert padded.prefill.row_members == own.prefill.row_members
    assert padded.decode.members == own.decode.members


def test_agreed_shape_outside_the_plan_runs_exactly_and_counts_as_not_warmed():
    plan = _plan()
    padded = data_parallel.pad_to_agreed(None, (8, 64, 0, 0, 0, 512, 0), plan)
    assert padded.prefill.bucket == Bucket("prompt", 1, 512, 0)
    assert not padded.warmed


def test_ranks_whose_prefill_maxima_form_no_bucket_all_pack_into_one_row():
    plan = _plan()
    two_rows, two_rows_vector = _vector([16, 16, 16, 16], [0, 0, 0, 0], plan)  # (4, 16, 0)
    packed, packed_vector = _vector([40, 20], [40, 0], plan)  # no (2, 64, 4): packed (1, 64, 4)
    assert packed.prefill.rows == 1 and two_rows.prefill.rows == 4
    maxima = data_parallel.combine([two_rows_vector, packed_vector])  # (4, 64, 4): no bucket
    agreed = [data_parallel.pad_to_agreed(x, maxima, plan) for x in (two_rows, packed)]
    assert {a.buckets for a in agreed} == {(Bucket("prompt", 1, 64, 4),)}
    assert agreed[0].prefill.row_members == ((0, 1, 2, 3),)
    assert all(a.warmed for a in agreed)


def test_agreement_without_a_part_this_rank_has_is_refused():
    plan = _plan()
    own = _layout([1], [5], plan)
    with pytest.raises(ValueError, match="no decode part"):
        data_parallel.pad_to_agreed(own, (1, 16, 0, 0, 0, 16, 0), plan)


@pytest.mark.parametrize(
    "maxima",
    [
        (4, 64, 4, 8, 16, 64, 4),
        (2, 32, 4, 0, 0, 32, 4),
        (0, 0, 0, 8, 16, 0, 0),
        (8, 64, 4, 0, 0, 64, 8),
    ],
)
def test_attention_of_real_tokens_is_unchanged_by_the_agreed_padding(monkeypatch, maxima):
    plan = _plan()
    if maxima[3] == 0:
        query_lens, ctx_lens = [7, 16], [40, 16]
    elif maxima[0] == 0:
        query_lens, ctx_lens = [1, 1, 1], [3, 20, 33]
    else:
        query_lens, ctx_lens = [1, 9, 20], [15, 0, 17]
    own, _, _ = test_attention._run(query_lens, ctx_lens, plan)
    plan_step = step_layout.plan_step

    def agreed_step(**kwargs):
        return data_parallel.pad_to_agreed(plan_step(**kwargs), maxima, plan)

    monkeypatch.setattr(step_layout, "plan_step", agreed_step)
    out, ref, layout = test_attention._run(query_lens, ctx_lens, plan)
    assert layout.warmed
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out, own, atol=1e-5, rtol=1e-5)


def test_idle_rank_metadata_is_all_padding():
    from vllm_gaudi_platform.attention.metadata_builder import build_metadata

    plan = _plan()
    layout = data_parallel.pad_to_agreed(None, (2, 32, 2, 4, 8, 0, 0), plan)
    md = build_metadata(
        layout=layout,
        seq_lens=[],
        block_table=torch.zeros(0, 1, dtype=torch.int32),
        slot_mapping=torch.zeros(0, dtype=torch.int64),
        block_size=BLOCK,
        device=torch.device("cpu"),
    )
    total = layout.num_tokens_padded
    assert md.num_actual_tokens == 0
    assert sorted(md.cell_to_token.tolist()) == list(range(total))
    assert (md.decode_block_groups == layout.decode.batch_bucket).all()  # no real sequence


class _IdleRank:
    """What HPUModelRunner.execute_idle_dp_step touches: the agreed layout comes from
    `maxima` (the other ranks' all-reduce), the forward pass is recorded, not run."""

    def __init__(self, maxima: tuple[int, ...], has_state_layers: bool = False) -> None:
        from vllm_gaudi_platform.worker.recompiles import RecompileTracker

        self.maxima = maxima
        self.has_state_layers = has_state_layers  # Mamba layers
        self.recompiles = RecompileTracker(strict=False)
        self.block_size = BLOCK
        self.device = torch.device("cpu")
        self.idle_dp_steps = 0
        self.is_mm_prefix_lm = False
        self.forwards: list[tuple[int, int]] = []
        self.metadata: list = []

    def _agree_across_dp(self, layout):
        assert layout is None  # an idle rank has no requests of its own
        return data_parallel.pad_to_agreed(layout, self.maxima, _plan())

    def _forward_with_metadata(self, metadata, total, n, *, capture=None):
        self.forwards.append((total, metadata.num_actual_tokens))
        self.metadata.append(metadata)


def test_idle_rank_counts_each_padding_only_step_it_runs():
    from vllm_gaudi_platform.worker.model_runner import HPUModelRunner

    rank = _IdleRank((2, 32, 2, 4, 8, 0, 0))  # another rank prefills and decodes
    HPUModelRunner.execute_idle_dp_step(rank)
    HPUModelRunner.execute_idle_dp_step(rank)
    assert rank.idle_dp_steps == 2
    assert rank.forwards == [(2 * 32 + 4, 0)] * 2  # the agreed buckets, no real token


def test_a_padding_only_prefill_after_warmup_is_recorded_as_no_packed_row():
    from vllm_gaudi_platform.worker.recompiles import RecompileTracker

    tracker = RecompileTracker(strict=False)
    agreed = data_parallel.pad_to_agreed(None, (2, 32, 2, 4, 8, 0, 0), _plan())
    tracker.warmed.update(tracker.shape(b, False) for b in agreed.buckets)
    tracker.warmup_done = True
    tracker.record(agreed)  # its prefill part has no rows of requests
    assert agreed.prefill.row_members == ()
    assert (tracker.count, tracker.packed_prefills, tracker.hits["prompt"]) == (0, 0, 1)


def test_an_idle_rank_of_a_mamba_hybrid_reads_and_writes_only_the_null_state_slot():
    from vllm_gaudi_platform.worker.model_runner import HPUModelRunner

    rank = _IdleRank((2, 32, 2, 4, 8, 0, 0), has_state_layers=True)
    HPUModelRunner.execute_idle_dp_step(rank)
    (md,) = rank.metadata
    assert md.state_slots_prefill.tolist() == [0, 0]
    assert md.state_lens_prefill.tolist() == [0, 0]
    assert md.state_slots_decode.tolist() == [0] * 4
    assert md.state_initial_decode.tolist() == [0.0] * 4


def test_step_where_every_rank_is_idle_runs_nothing_and_is_not_counted():
    from vllm_gaudi_platform.worker.model_runner import HPUModelRunner

    rank = _IdleRank(data_parallel.IDLE)
    HPUModelRunner.execute_idle_dp_step(rank)
    assert rank.idle_dp_steps == 0 and rank.forwards == []
