"""A packed prefill row (several prompts in one row) is a shape of its own wherever it takes
another attention branch than one prompt per row: without cached context for every model, and
at every bucket for windowed and encoder-only layers. The runner's HPU graphs capture that
variant, warmup runs it, and the recompile count counts it when warmup did not
(worker/hpu_graphs.py, worker/recompiles.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.v1.attention.backend import AttentionType

from vllm_gaudi_platform.attention import step_layout
from vllm_gaudi_platform.bucketing import Bucket, BucketPlan
from vllm_gaudi_platform.worker import hpu_graphs
from vllm_gaudi_platform.worker.recompiles import RecompileError, RecompileTracker

BLOCK = 128
ENCODER = AttentionType.ENCODER_ONLY
# A plan whose only prompt bucket has a context block, as a fitted plan made from a generation
# trace has: an encoder's prompts (no context) are padded into it.
WITH_CONTEXT = Bucket("prompt", 1, 512, 1)
PLAN = BucketPlan("fitted", (WITH_CONTEXT,), (Bucket("decode", 4, 1, 8),))


def _layer(attn_type: str = AttentionType.DECODER, window: int | None = None):
    return SimpleNamespace(impl=SimpleNamespace(attn_type=attn_type, sliding_window=window))


def _graphs(layers) -> hpu_graphs.BucketGraphs:
    graphs = hpu_graphs.BucketGraphs(enabled=True)
    graphs.packing_matters = hpu_graphs.packing_matters(layers)
    return graphs


def _tracker(layers, *, strict: bool = False) -> RecompileTracker:
    tracker = RecompileTracker(strict=strict)
    tracker.distinct_packed = _graphs(layers).needs_packed_variant
    return tracker


def _packed_step() -> step_layout.StepLayout:
    layout = step_layout.plan_step(
        query_lens=[100, 60], seq_lens=[100, 60], block_size=BLOCK, plan=PLAN
    )
    assert layout.prefill.row_members == ((0, 1),) and layout.prefill.bucket == WITH_CONTEXT
    return layout


def test_windowed_and_encoder_only_layers_branch_on_packing_with_context_too():
    assert not hpu_graphs.packing_matters([_layer(), _layer()])
    assert hpu_graphs.packing_matters([_layer(), _layer(window=256)])
    assert hpu_graphs.packing_matters([_layer(ENCODER)])
    assert not hpu_graphs.packing_matters([SimpleNamespace(), _layer()])  # no impl: a state layer


def test_an_encoder_bucket_with_context_blocks_gets_a_packed_variant():
    assert _graphs([_layer(ENCODER)]).needs_packed_variant(WITH_CONTEXT)
    assert not _graphs([_layer()]).needs_packed_variant(WITH_CONTEXT)
    assert _graphs([_layer()]).needs_packed_variant(Bucket("prompt", 1, 512, 0))


@pytest.mark.parametrize(("layers", "count"), [([_layer()], 0), ([_layer(ENCODER)], 1)])
def test_a_packed_row_on_a_bucket_warmed_only_unpacked_counts_where_packing_matters(layers, count):
    layout = _packed_step()
    tracker = _tracker(layers)
    tracker.warmed.add(tracker.shape(WITH_CONTEXT, False))  # warmup ran it one prompt per row
    tracker.warmup_done = True
    tracker.record(layout)
    tracker.record(layout)
    assert (tracker.count, tracker.packed_prefills, tracker.hits["prompt"]) == (count, 2, 2)
    expected = {"phase": "prompt", "batch_size": 1, "query_len": 512, "ctx_blocks": 1}
    assert tracker.seen == [{**expected, "packed": True}] * count


def test_a_warmed_packed_variant_is_no_recompile_and_strict_mode_names_an_unwarmed_one():
    layout = _packed_step()
    tracker = _tracker([_layer(ENCODER)], strict=True)
    tracker.warmed.add(tracker.shape(WITH_CONTEXT, True))
    tracker.warmup_done = True
    tracker.record(layout)
    assert tracker.count == 0
    strict = _tracker([_layer(ENCODER)], strict=True)
    strict.warmed.add(strict.shape(WITH_CONTEXT, False))
    strict.warmup_done = True
    with pytest.raises(RecompileError, match=r"packed-prefill variant.*VLLM_FULL_WARMUP"):
        strict.record(layout)
