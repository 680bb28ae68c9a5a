"""HPU graphs in emulation: the seam's Graph replays the tensor ops its capture recorded (Python
inside the captured region does not run again, as on a Gaudi), refuses a replay whose inputs are
not the captured buffers (a Gaudi would silently replay stale data), and a bucket's static
attention metadata, filled in place from a step, gives that step's attention output."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_gaudi_platform.attention import step_layout
from vllm_gaudi_platform.bucketing import Bucket, BucketPlan
from vllm_gaudi_platform.seam.contract import GraphInputError

BLOCK = 16
HEADS, KV_HEADS, DIM = 4, 2, 32
NUM_BLOCKS = 32


def _counting_graph(emulated, inputs):
    calls = []

    def fn():
        calls.append(1)
        return inputs["x"] * 2

    graph = emulated.Graph("test")
    graph.capture(fn, inputs)
    return graph, calls


def test_replay_runs_the_recorded_ops_on_the_captured_buffers_and_not_the_python(emulated):
    x = torch.arange(4.0)
    graph, calls = _counting_graph(emulated, {"x": x})
    captured = graph.replay({"x": x})
    x.copy_(torch.tensor([5.0, 6.0, 7.0, 8.0]))  # updated in place: allowed
    out = graph.replay({"x": x})
    assert out is captured and out.tolist() == [10.0, 12.0, 14.0, 16.0]
    # The side effect (a callback, a counter) ran at capture only: a Gaudi replays device ops.
    assert len(calls) == 1


def test_a_value_read_into_python_at_capture_is_frozen_in_the_graph(emulated):
    # A branch or scalar taken from a tensor with .item() is fixed at capture, as on a Gaudi: the
    # reason a graph's branch-deciding values must be fixed per bucket.
    x = torch.tensor([1.0, 2.0])
    graph = emulated.Graph("frozen")
    graph.capture(lambda: x * float(x.sum()), {"x": x})
    x.copy_(torch.tensor([10.0, 20.0]))
    assert graph.replay({"x": x}).tolist() == [30.0, 60.0]  # 3.0, the sum at capture


def test_seam_kernels_rerun_whole_at_replay_on_the_replay_data(emulated):
    # A fused kernel is one entry of the recording: its own data-dependent work (the MoE's
    # routing, here) follows the replay's inputs, as the kernel on a Gaudi does.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 8, generator=g)
    table = torch.zeros(6, 1, dtype=torch.int64)
    weights = torch.ones(6, 1)
    w12 = [torch.randn(8, 8, generator=g) for _ in range(3)]
    w3 = [torch.randn(8, 4, generator=g) for _ in range(3)]

    def forward():
        return emulated.mixture_of_experts(x, table, weights, w12, w3, True, "silu", 0, 2) + 1

    graph = emulated.Graph("moe")
    graph.capture(forward, {"x": x, "table": table})
    table.copy_(torch.tensor([[2], [1], [0], [2], [1], [1]]))
    x.mul_(3)

    out = graph.replay({"x": x, "table": table})

    torch.testing.assert_close(out, forward())


def test_intermediates_are_not_kept_between_replays(emulated):
    x = torch.ones(1000)
    graph = emulated.Graph("free")
    graph.capture(lambda: ((x * 2).exp() + 1).sum(), {"x": x})
    referenced = [
        leaf for _, args, _, _ in graph._entries for leaf in args if isinstance(leaf, torch.Tensor)
    ]
    # Only the captured input is referenced by the recording; the products are numbered slots.
    assert referenced and all(leaf is x for leaf in referenced)
    assert graph.num_ops == 4


def test_replay_with_a_reallocated_input_fails_naming_the_input(emulated):
    x = torch.arange(4.0)
    graph, calls = _counting_graph(emulated, {"x": x})
    with pytest.raises(GraphInputError, match=r"x is a different buffer than at capture"):
        graph.replay({"x": x.clone()})
    assert len(calls) == 1  # not run


def test_replay_with_another_shape_or_dtype_fails_naming_both(emulated):
    buf = torch.zeros(8)
    graph, _ = _counting_graph(emulated, {"x": buf[:4]})
    with pytest.raises(GraphInputError, match=r"x is torch.float32 \[6\], captured as"):
        graph.replay({"x": buf[:6]})
    with pytest.raises(GraphInputError, match=r"x is torch.int32 \[8\], captured as"):
        graph.replay({"x": buf.view(torch.int32)})


def test_tensors_inside_attention_metadata_are_checked_by_their_path(emulated):
    md = _metadata([1, 1], [20, 40], _plan(decode=[(2, 1, 4)]))
    graph = emulated.Graph("decode")
    graph.capture(lambda: None, {"attn_metadata": [md]})
    graph.replay({"attn_metadata": [md]})
    md.decode_block_list = md.decode_block_list.clone()  # a runner bug: re-allocated
    with pytest.raises(GraphInputError, match=r"attn_metadata\[0\]\.decode_block_list is a diff"):
        graph.replay({"attn_metadata": [md]})


def _plan(prompt=(), decode=()):
    return BucketPlan(
        strategy="test",
        prompt=tuple(Bucket("prompt", *b) for b in prompt),
        decode=tuple(Bucket("decode", *b) for b in decode),
    )


def _metadata(query_lens, ctx_lens, plan, table=None):
    from vllm_gaudi_platform.attention.metadata_builder import build_metadata

    seq_lens = [c + q for c, q in zip(ctx_lens, query_lens)]
    n = len(query_lens)
    max_blocks = max(-(-s // BLOCK) for s in seq_lens)
    if table is None:
        table = torch.arange(1, 1 + n * max_blocks, dtype=torch.int32).view(n, max_blocks)
    layout = step_layout.plan_step(
        query_lens=query_lens, seq_lens=seq_lens, block_size=BLOCK, plan=plan
    )
    slots = torch.cat(
        [
            table[i, torch.arange(c, s) // BLOCK].long() * BLOCK + torch.arange(c, s) % BLOCK
            for i, (c, s) in enumerate(zip(ctx_lens, seq_lens))
        ]
    )
    return build_metadata(
        layout=layout,
        seq_lens=seq_lens,
        block_table=table,
        slot_mapping=slots,
        block_size=BLOCK,
        device=torch.device("cpu"),
    )


def _attention(md, window, real, seed=0):
    """One attention layer over a random KV cache and random new q/k/v; returns the output of
    the `real` tokens and the cache after the step's writes (blocks 1.., block 0 being the null
    block)."""
    from vllm_gaudi_platform.attention.impl import HPUAttentionImpl

    gen = torch.Generator().manual_seed(seed)
    impl = HPUAttentionImpl(
        HEADS, DIM, 1 / math.sqrt(DIM), num_kv_heads=KV_HEADS, sliding_window=window
    )
    total = md.layout.num_tokens_padded
    kv = torch.randn(NUM_BLOCKS, KV_HEADS, BLOCK, 2 * DIM, generator=gen)
    q = torch.randn(total, HEADS * DIM, generator=gen)
    k = torch.randn(total, KV_HEADS * DIM, generator=gen)
    v = torch.randn(total, KV_HEADS * DIM, generator=gen)
    out = torch.zeros(total, HEADS * DIM)
    impl.forward(None, q, k, v, kv, md, out)
    return out[:real], kv[1:]


@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize(
    "warm, step, plan",
    [
        # warmup's sequences vs a step's: other lengths, same decode bucket
        (([1, 1], [5, 5]), ([1, 1], [30, 17]), _plan(decode=[(2, 1, 4)])),
        # a prompt bucket: padding tokens, cached context
        (([8], [0]), ([5], [18]), _plan(prompt=[(1, 8, 2)])),
    ],
)
def test_static_metadata_filled_from_a_step_gives_the_step_output(
    emulated, warm, step, plan, window
):
    from vllm_gaudi_platform.worker.hpu_graphs import copy_metadata, static_metadata

    step_md = _metadata(*step, plan)
    warm_md = _metadata(*warm, plan, table=torch.zeros(len(warm[0]), 4, dtype=torch.int32))
    assert step_md.layout.buckets == warm_md.layout.buckets
    static = static_metadata(warm_md)
    buffers = {f: getattr(static, f) for f in ("cell_to_token", "slot_mapping")}
    copy_metadata(static, step_md)
    assert all(getattr(static, f) is t for f, t in buffers.items())  # written in place
    real = sum(step[0])
    out, cache = _attention(static, window, real)
    expected, expected_cache = _attention(step_md, window, real)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(cache, expected_cache)  # padding writes only touch block 0


def test_a_step_of_another_bucket_is_refused(emulated):
    from vllm_gaudi_platform.worker.hpu_graphs import GraphStepError, copy_metadata, static_metadata

    plan = _plan(decode=[(2, 1, 4), (4, 1, 8)])
    static = static_metadata(_metadata([1, 1], [5, 5], plan))
    with pytest.raises(GraphStepError, match="differ from the graph's"):
        copy_metadata(static, _metadata([1, 1, 1], [5, 5, 5], plan))


def test_a_step_on_another_attention_branch_does_not_replay_the_graph(emulated):
    from vllm_gaudi_platform.worker.hpu_graphs import BucketGraph, BucketGraphs, static_metadata

    plan = _plan(prompt=[(1, 16, 0)])
    one = _metadata([8], [0], plan)  # one sequence in the row: causal fast path
    packed = _metadata([5, 5], [0, 0], plan)  # two sequences share the row: masked path
    assert one.layout.buckets == packed.layout.buckets
    assert packed.prefill_packed and not one.prefill_packed
    graphs = BucketGraphs(enabled=True)
    entry = BucketGraph(graph=None, metadata={"layer": static_metadata(one)})
    assert graphs.fits(entry, {"layer": _metadata([6], [0], plan)})
    assert not graphs.fits(entry, {"layer": packed})
    assert graphs.stats.eager_steps == 1 and graphs.stats.variant_misses == 1


@pytest.mark.parametrize("window", [None, 24])
def test_a_packed_row_with_context_replays_the_one_sequence_graph_when_no_layer_has_a_window(
    emulated, window
):
    # With cached context both layouts take the masked path; only window narrowing tells them
    # apart, so a runner whose model has no window keeps one graph for both.
    from vllm_gaudi_platform.worker.hpu_graphs import BucketGraph, BucketGraphs, static_metadata

    plan = _plan(prompt=[(1, 16, 4)])
    one = _metadata([8], [30], plan)
    packed = _metadata([5, 5], [10, 12], plan)
    assert one.layout.buckets == packed.layout.buckets and packed.prefill_packed
    graphs = BucketGraphs(enabled=True)
    graphs.packing_matters = window is not None
    static = static_metadata(one)
    entry = BucketGraph(graph=None, metadata={"layer": static})
    assert graphs.fits(entry, {"layer": packed}) == (window is None)
    if window is None:
        from vllm_gaudi_platform.worker.hpu_graphs import copy_metadata

        copy_metadata(static, packed, packing_matters=False)
        out, cache = _attention(static, window, 10)
        expected, expected_cache = _attention(packed, window, 10)
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(cache, expected_cache)


@pytest.mark.parametrize(
    ("ctx_blocks", "packing_matters", "expected"),
    [(0, False, True), (0, True, True), (4, False, False), (4, True, True)],
)
def test_a_single_row_prompt_bucket_gets_a_packed_variant_where_packing_changes_the_branch(
    ctx_blocks, packing_matters, expected
):
    from vllm_gaudi_platform.worker.hpu_graphs import BucketGraphs

    graphs = BucketGraphs(enabled=True)
    graphs.packing_matters = packing_matters
    assert graphs.needs_packed_variant(Bucket("prompt", 1, 16, ctx_blocks)) == expected
    # A row of several prompts, a one-token row and decode buckets have no packed variant.
    assert not graphs.needs_packed_variant(Bucket("prompt", 2, 16, ctx_blocks))
    assert not graphs.needs_packed_variant(Bucket("prompt", 1, 1, ctx_blocks))
    assert not graphs.needs_packed_variant(Bucket("decode", 1, 1, ctx_blocks))


@pytest.mark.parametrize("ctx_blocks", [0, 1, 3])
def test_warmup_layout_of_a_packed_variant_fills_the_bucket_with_two_sequences(
    emulated, ctx_blocks
):
    from vllm_gaudi_platform.attention.metadata_builder import build_metadata

    bucket = Bucket("prompt", 1, 16, ctx_blocks)
    layout, seq_lens = step_layout.layout_for_bucket(bucket, BLOCK, packed=True)
    assert layout.buckets == (bucket,) and layout.num_tokens_padded == 16
    assert sum(layout.query_lens) == 16 and len(seq_lens) == 2
    ctx = [s - q for s, q in zip(seq_lens, layout.query_lens)]
    assert all(c % BLOCK == 0 for c in ctx) and sum(ctx) == ctx_blocks * BLOCK
    table = torch.zeros(2, max(-(-s // BLOCK) for s in seq_lens), dtype=torch.int32)
    md = build_metadata(
        layout=layout,
        seq_lens=seq_lens,
        block_table=table,
        slot_mapping=torch.zeros(16, dtype=torch.int64),
        block_size=BLOCK,
        device=torch.device("cpu"),
    )
    assert md.prefill_packed
    with pytest.raises(ValueError, match="no packed variant"):
        step_layout.layout_for_bucket(Bucket("prompt", 2, 16, 0), BLOCK, packed=True)


def test_a_packed_step_replays_the_packed_graph_and_a_one_sequence_step_the_other(emulated):
    from vllm_gaudi_platform.worker.hpu_graphs import BucketGraph, BucketGraphs, static_metadata

    plan = _plan(prompt=[(1, 16, 0)])
    one = _metadata([8], [0], plan)
    packed = _metadata([5, 5], [0, 0], plan)
    graphs = BucketGraphs(enabled=True)
    plain_entry = BucketGraph(graph=None, metadata={"layer": static_metadata(one)})
    packed_entry = BucketGraph(graph=None, metadata={"layer": static_metadata(packed)})
    graphs.graphs[(one.layout.buckets, False)] = plain_entry
    # Only the one-sequence graph: a packed step runs eagerly, counted as a variant miss.
    assert graphs.lookup(packed.layout, {"layer": packed}) is None
    assert graphs.stats.variant_misses == 1
    graphs.graphs[(packed.layout.buckets, True)] = packed_entry
    assert graphs.lookup(packed.layout, {"layer": _metadata([6, 4], [0, 0], plan)}) is packed_entry
    assert graphs.lookup(one.layout, {"layer": _metadata([7], [0], plan)}) is plain_entry
    assert graphs.stats.eager_steps == 1 and graphs.stats.variant_misses == 1


def test_in_place_ops_on_captured_buffers_replay_in_place(emulated):
    # An in-place op on a buffer from outside the graph returns that buffer: the recording must
    # keep reading the buffer itself, and later ops see its updated contents.
    x = torch.tensor([1.0, 2.0])
    acc = torch.zeros(2)
    graph = emulated.Graph("in place")
    graph.capture(lambda: acc.add_(x).mul(2), {"x": x, "acc": acc})
    x.copy_(torch.tensor([10.0, 20.0]))

    out = graph.replay({"x": x, "acc": acc})

    assert acc.tolist() == [11.0, 22.0] and out.tolist() == [22.0, 44.0]
