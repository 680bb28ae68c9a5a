"""Bidirectional attention within images (vLLM's "mm prefix LMs", Gemma 3): a query inside an
image's token span attends every key of that span, later ones included, on top of the causal
(and windowed) mask; compared with a float64 reference that applies vLLM's rule literally:
(causal and window) or same span.

The spans reach the backend as vLLM passes them (`mm_req_doc_ranges`: request index -> inclusive
position ranges); the prefill then takes the masked path in query slices, each reading keys to
the bucket's end."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.platform.test_attention import BLOCK, _plan, _run
from vllm_gaudi_platform import envs


@pytest.fixture(autouse=True)
def _backend(hpu_backend):
    """Every test runs on both backends of the seam: the emulation, and seam/gaudi (over the Habana
    stand-in off Gaudi)."""
    return hpu_backend


# (query_lens, ctx_lens, spans, prompt bucket); spans in absolute positions of each request.
CASES = {
    "one image in a grid row": ([20], [0], {0: [(3, 12)]}, (1, 32, 0)),
    "two images, two rows": ([20, 30], [0, 0], {0: [(0, 4), (8, 15)], 1: [(10, 29)]}, (2, 32, 0)),
    "packed rows": ([9, 14, 6], [0, 0, 0], {1: [(2, 9)], 2: [(0, 5)]}, (1, 32, 0)),
    # The image's first tokens are in the cache (a prefix hit that ends inside the image): the
    # rest of the span still sees them, and they see nothing new.
    "image across cached context": ([12], [20], {0: [(16, 25)]}, (1, 16, 2)),
    "image at the chunk's end": ([16], [0], {0: [(10, 15)]}, (1, 16, 0)),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("query_slice", [4, 64])
def test_image_tokens_attend_their_whole_span(monkeypatch, case, query_slice):
    monkeypatch.setenv(envs.VLLM_PREFILL_QUERY_SLICE, str(query_slice))
    query_lens, ctx_lens, spans, bucket = CASES[case]
    out, ref, layout = _run(query_lens, ctx_lens, _plan(prompt=[bucket]), image_spans=spans)
    assert layout.warmed
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    # The spans matter: the causal reference differs where a span has later keys.
    _, causal, _ = _run(query_lens, ctx_lens, _plan(prompt=[bucket]))
    assert not torch.allclose(ref, causal, atol=1e-3)


@pytest.mark.parametrize("window", [8, 40])
def test_image_spans_with_a_sliding_window(window):
    # vLLM drops spans longer than the window before they reach the backend; within one, every
    # key of the span is inside the window of every query of it.
    spans = {0: [(5, 12)], 1: [(20, 27)]}
    out, ref, _ = _run(
        [16, 30], [0, 0], _plan(prompt=[(2, 32, 0)]), window=window, image_spans=spans
    )
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_a_mixed_step_in_parts_keeps_each_requests_spans():
    # The prefill pass's metadata renumbers its requests; their spans follow them.
    plan = _plan(prompt=[(2, 32, 2)], decode=[(2, 1, 4)])
    spans = {2: [(1, 6)], 3: [(20, 30)]}
    out, ref, layout = _run([1, 1, 9, 20], [15, 30, 0, 17], plan, split=True, image_spans=spans)
    assert layout.parts is not None
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_text_only_steps_of_an_mm_prefix_model_take_the_masked_path():
    # The branch is fixed per model, not per step (a graph serves both): with no spans, the
    # reach is each query's own position and the result is plain causal attention.
    from vllm_gaudi_platform.attention.metadata_builder import build_metadata

    out, ref, _ = _run([5, 17], [0, 0], _plan(prompt=[(2, 32, 0)]), image_spans={})
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    layout = step_layout_of([5, 17])
    md = build_metadata(
        layout=layout,
        seq_lens=[5, 17],
        block_table=torch.arange(1, 5, dtype=torch.int32).view(2, 2),
        slot_mapping=torch.zeros(22, dtype=torch.int64),
        block_size=BLOCK,
        device=torch.device("cpu"),
        image_spans={},
    )
    assert not md.prefill_causal_only()
    assert torch.equal(md.prefill_q_reach, md.prefill_q_pos)


def step_layout_of(query_lens):
    from vllm_gaudi_platform.attention import step_layout

    return step_layout.plan_step(
        query_lens=query_lens,
        seq_lens=list(query_lens),
        block_size=BLOCK,
        plan=_plan(prompt=[(2, 32, 0)]),
    )


def test_query_reach_marks_each_span_end():
    from vllm_gaudi_platform.attention.metadata_builder import _query_reach

    # One row, two members back to back: request 0 (ctx 0, 5 new), request 1 (ctx 4, 6 new).
    q_pos = np.array([[0, 1, 2, 3, 4, 4, 5, 6, 7, 8, 9, 0]])
    reach = _query_reach(
        q_pos,
        {0: [(1, 2)], 1: [(2, 6), (8, 9)]},
        members=np.array([0, 1]),
        row_of=np.array([0, 0]),
        col=np.array([0, 5]),
        ctx=np.array([0, 4]),
        new=np.array([5, 6]),
    )
    assert reach.tolist() == [[0, 2, 2, 3, 4, 6, 6, 6, 7, 9, 9, 0]]


def test_the_platform_keeps_each_image_in_one_prefill_chunk():
    from types import SimpleNamespace

    from vllm_gaudi_platform.config_checks import whole_images_for_mm_prefix

    def config(prefix_lm: bool, multimodal: bool = True):
        return SimpleNamespace(
            model_config=SimpleNamespace(is_mm_prefix_lm=prefix_lm, model="m"),
            scheduler_config=SimpleNamespace(
                is_multimodal_model=multimodal, disable_chunked_mm_input=False
            ),
        )

    gemma, llava, text_only = config(True), config(False), config(True, multimodal=False)
    for c in (gemma, llava, text_only):
        whole_images_for_mm_prefix(c)
    assert gemma.scheduler_config.disable_chunked_mm_input
    assert not llava.scheduler_config.disable_chunked_mm_input
    assert not text_only.scheduler_config.disable_chunked_mm_input
