"""Chunked local attention (Llama 4's `attention_chunk_size`) on the HPU backend, against the
naive reference of test_attention.py with the chunk rule (a query at position p sees the keys
from (p // chunk) * chunk up to p): prefill rows with cached context in earlier chunks, packed
rows, paged decode across chunk boundaries, chunks that start inside a KV block or are longer
than one, and split steps. Also: the chunked layers' metadata is the step's (one layout for the
whole model), and the masks are not vacuous."""

from __future__ import annotations

import pytest
import torch

from tests.platform.test_attention import BLOCK, _plan, _run

# BLOCK = 16: a chunk of 8 starts inside blocks, 16 is one block, 40 spans blocks unevenly.
CHUNKS = [8, 16, 40]


@pytest.fixture(autouse=True)
def _backend(hpu_backend):
    """Both backends of the seam: the emulation and seam/gaudi over the Habana stand-in."""
    return hpu_backend


@pytest.mark.parametrize("chunk", CHUNKS)
def test_prefill_across_chunks_with_cached_context_matches_reference(chunk):
    plan = _plan(prompt=[(2, 32, 4)])
    out, ref, layout = _run([30, 17], [41, 16], plan, chunk=chunk)
    assert layout.prefill.ctx_bucket > 0
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("chunk", CHUNKS)
def test_prefill_without_context_longer_than_a_chunk_matches_reference(chunk):
    # No context and one prompt per row: the causal fast path would be wrong past one chunk.
    plan = _plan(prompt=[(2, 64, 0)])
    out, ref, layout = _run([50, 33], [0, 0], plan, chunk=chunk)
    assert layout.prefill.ctx_bucket == 0 and not layout.prefill.row_members[0][1:]
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("chunk", CHUNKS)
def test_packed_prefill_keeps_sequences_and_chunks_apart(chunk):
    plan = _plan(prompt=[(1, 64, 4)])
    out, ref, layout = _run([5, 17, 30], [0, 0, 0], plan, chunk=chunk)
    assert layout.prefill.rows == 1
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("chunk", CHUNKS)
def test_paged_decode_sees_only_the_current_chunk(chunk):
    # Positions 3, 20, 40, 50 and 79: first slot of a chunk, middle, last, across blocks.
    plan = _plan(decode=[(8, 1, 16)])
    out, ref, _ = _run([1] * 5, [3, 20, 40, 50, 79], plan, chunk=chunk)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("chunk", [8, 40])
def test_mixed_step_run_in_parts_matches_reference(chunk):
    plan = _plan(prompt=[(1, 32, 4)], decode=[(4, 1, 8)])
    out, ref, layout = _run([1, 20], [45, 30], plan, chunk=chunk, split=True)
    assert layout.parts is not None
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_a_chunk_longer_than_every_sequence_changes_nothing():
    plan = _plan(prompt=[(2, 32, 2)], decode=[(2, 1, 4)])
    chunked, _, _ = _run([1, 1, 9, 20], [15, 30, 0, 17], plan, chunk=4096)
    plain, _, _ = _run([1, 1, 9, 20], [15, 30, 0, 17], plan)
    torch.testing.assert_close(chunked, plain)


def test_a_chunk_that_cuts_changes_the_result():
    # The reference checks above could pass vacuously if no chunk cut anything.
    plan = _plan(prompt=[(2, 32, 4)], decode=[(4, 1, 8)])
    chunked, _, _ = _run([1, 1, 30, 17], [20, 50, 41, 16], plan, chunk=BLOCK)
    plain, _, _ = _run([1, 1, 30, 17], [20, 50, 41, 16], plan)
    assert not torch.allclose(chunked, plain, atol=1e-3)


def test_one_chunked_backend_per_chunk_size_with_the_hpu_attention():
    from vllm_gaudi_platform.attention.backend import HPUAttentionBackend
    from vllm_gaudi_platform.attention.chunked_local import backend_for, chunk_of

    backend = backend_for(64)
    assert backend is backend_for(64)  # one class per chunk: one attention group for its layers
    assert issubclass(backend, HPUAttentionBackend)
    assert backend.get_impl_cls() is HPUAttentionBackend.get_impl_cls()
    assert chunk_of(backend) == 64 and chunk_of(HPUAttentionBackend) is None


@pytest.mark.parametrize("chunk", [8, 16])
def test_prefill_after_a_long_context_gathers_only_the_first_new_tokens_chunk(chunk):
    # 100 cached tokens (7 blocks) in a bucket of 8 context blocks: the row gathers the
    # window_blocks(chunk) blocks that reach into its chunk, not the whole context.
    from vllm_gaudi_platform.attention.metadata import window_blocks

    plan = _plan(prompt=[(1, 32, 8)])
    out, ref, layout = _run([20], [100], plan, chunk=chunk)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    md = _chunked_metadata([20], [100], plan, chunk)
    blocks, _, _ = md.prefill_keys_for(None, BLOCK)
    assert layout.prefill.ctx_bucket == 8
    assert blocks.shape[1] == window_blocks(chunk, BLOCK) < 8


def _chunked_metadata(query_lens, ctx_lens, plan, chunk):
    from vllm_gaudi_platform.attention import step_layout
    from vllm_gaudi_platform.attention.chunked_local import with_chunk
    from vllm_gaudi_platform.attention.metadata_builder import build_metadata

    seq_lens = [c + q for c, q in zip(ctx_lens, query_lens)]
    n_blocks = -(-max(seq_lens) // BLOCK)
    table = torch.arange(1, 1 + len(seq_lens) * n_blocks, dtype=torch.int32)
    layout = step_layout.plan_step(
        query_lens=query_lens, seq_lens=seq_lens, block_size=BLOCK, plan=plan
    )
    md = build_metadata(
        layout=layout,
        seq_lens=seq_lens,
        block_table=table.view(len(seq_lens), n_blocks),
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64),
        block_size=BLOCK,
        device=torch.device("cpu"),
    )
    return with_chunk(md, chunk)


def test_a_chunked_local_layer_makes_packing_a_graph_variant():
    # Its prefill narrows each row's context to the chunk only with one sequence per row, so a
    # packed row with context is another branch: warmup must warm it (HPU graphs and compiled).
    from types import SimpleNamespace

    from vllm_gaudi_platform.worker.hpu_graphs import packing_matters

    plain = SimpleNamespace(impl=SimpleNamespace(sliding_window=None, attn_type="decoder"))
    chunked = SimpleNamespace(attention_chunk_size=64, impl=plain.impl)
    assert not packing_matters([plain])
    assert packing_matters([plain, chunked])
