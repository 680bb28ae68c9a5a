"""The platform's side of models with Mamba2 state layers (worker/hybrid.py,
attention/mamba_state.py): prompts never share a prefill row, each row and decode cell names its
request's state slot, attention layers' metadata carries no slots, and a state layer without an
HPU implementation is refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec

from vllm_gaudi_platform.attention import step_layout
from vllm_gaudi_platform.attention.metadata_builder import build_metadata
from vllm_gaudi_platform.bucketing import Bucket, BucketPlan
from vllm_gaudi_platform.worker import hybrid

BLOCK = 128


def _plan(pack: bool) -> BucketPlan:
    prompt = (Bucket("prompt", 1, 256, 0), Bucket("prompt", 1, 512, 0))
    plan = BucketPlan("exp", prompt, (Bucket("decode", 4, 1, 8),))
    return plan if pack else hybrid.plan_without_packing(plan)


def test_two_prompts_pack_into_one_row_unless_the_plan_forbids_packing():
    kwargs = dict(query_lens=[100, 60], seq_lens=[100, 60], block_size=BLOCK)
    packed = step_layout.plan_step(**kwargs, plan=_plan(pack=True))
    unpacked = step_layout.plan_step(**kwargs, plan=_plan(pack=False))

    assert packed.prefill.row_members == ((0, 1),) and packed.prefill.warmed
    # No two-row bucket in this plan: the step runs at its exact shape, counted as not warmed.
    assert unpacked.prefill.row_members == ((0,), (1,))
    assert (unpacked.prefill.rows, unpacked.prefill.query_bucket) == (2, 100)
    assert not unpacked.prefill.warmed


def _metadata(layout, seq_lens, slots):
    width = max(-(-s // BLOCK) for s in seq_lens)
    return build_metadata(
        layout=layout,
        seq_lens=seq_lens,
        block_table=torch.zeros(len(seq_lens), width, dtype=torch.int32),
        slot_mapping=torch.zeros(sum(layout.query_lens), dtype=torch.int64),
        block_size=BLOCK,
        device=torch.device("cpu"),
        state_slots=slots,
    )


def test_each_prefill_row_and_decode_cell_names_its_requests_state_slot():
    # Request 0 decodes (context 40), 1 is a new prompt, 2 continues a chunked prompt (context
    # 128), 3 is a one-token prompt (a decode cell with no stored state).
    query_lens, seq_lens = [1, 30, 50, 1], [41, 30, 178, 1]
    plan = BucketPlan(
        "exp", (Bucket("prompt", 4, 64, 2),), (Bucket("decode", 4, 1, 8),), pack_prefills=False
    )
    layout = step_layout.plan_step(
        query_lens=query_lens, seq_lens=seq_lens, block_size=BLOCK, plan=plan
    )
    md = _metadata(layout, seq_lens, slots=[7, 3, 9, 5])

    assert md.state_slots_prefill.tolist() == [3, 9, 0, 0]  # padding rows: the null block
    assert md.state_lens_prefill.tolist() == [30, 50, 0, 0]
    assert md.state_initial_prefill.tolist() == [0.0, 1.0, 0.0, 0.0]
    assert md.state_slots_decode.tolist() == [7, 5, 0, 0]
    assert md.state_initial_decode.tolist() == [1.0, 0.0, 0.0, 0.0]
    # The rows' cells hold the requests' tokens in order: request 1's 30, then request 2's 50.
    starts = np.cumsum([0, *query_lens])
    cells = md.cell_to_token[: 4 * 64].view(4, 64)
    assert cells[0, :30].tolist() == list(range(starts[1], starts[1] + 30))
    assert cells[1, :50].tolist() == list(range(starts[2], starts[2] + 50))


def test_prompts_whose_padded_rows_exceed_every_bucket_share_a_row_unwarmed_named_per_request():
    # Rows of 400 tokens for three prompts: 1,200 padded tokens, past the largest bucket (512).
    query_lens, seq_lens = [400, 10, 30], [400, 10, 158]
    layout = step_layout.plan_step(
        query_lens=query_lens, seq_lens=seq_lens, block_size=BLOCK, plan=_plan(pack=False)
    )
    md = _metadata(layout, seq_lens, slots=[4, 6, 8])

    assert layout.prefill.row_members == ((0, 1, 2),) and not layout.prefill.warmed
    assert layout.prefill.query_bucket == 440  # the exact shape, not the 512 bucket
    # (row, first column, new tokens, slot, continues from a stored state) per request
    assert md.state_packed == ((0, 0, 400, 4, False), (0, 400, 10, 6, False), (0, 410, 30, 8, True))
    assert md.state_slots_prefill is None


def _rows_plan(pack: bool) -> BucketPlan:
    plan = BucketPlan(
        "exp",
        (Bucket("prompt", 2, 128, 0), Bucket("prompt", 2, 128, 2), Bucket("prompt", 1, 512, 0)),
        (Bucket("decode", 4, 1, 8),),
    )
    return plan if pack else hybrid.plan_without_packing(plan)


def test_prompts_no_bucket_holds_row_by_row_run_in_passes_of_rows_buckets_hold():
    # Five prompts (one continuing from a block of context) and a decode; buckets of two rows
    # and of one long row.
    query_lens, seq_lens = [100, 50, 1, 120, 300, 90], [100, 50, 40, 248, 300, 90]
    plan = _rows_plan(pack=False)
    layout = step_layout.plan_step(
        query_lens=query_lens, seq_lens=seq_lens, block_size=BLOCK, plan=plan
    )
    # As one pass: five rows of 300 exceed every bucket, so one packed row at its exact shape.
    assert layout.prefill.row_members == ((0, 1, 3, 4, 5),) and not layout.warmed

    split = step_layout.split_passes(layout, seq_lens, BLOCK, plan)
    passes = split.parts.passes
    # First fit in batch order: request 3 (with context) cannot join 0 and 1 (two rows at most)
    # and starts a group, 4 (300 tokens) needs the one-row bucket, 5 joins 3; the decode last.
    assert [p.requests for p in passes] == [(0, 1), (3, 5), (4,), (2,)]
    assert split.buckets == (
        Bucket("prompt", 2, 128, 0),
        Bucket("prompt", 2, 128, 2),
        Bucket("prompt", 1, 512, 0),
        Bucket("decode", 4, 1, 8),
    )
    assert split.warmed
    starts = np.cumsum([0, *query_lens])
    for one in passes:
        assert one.layout.query_lens == tuple(query_lens[r] for r in one.requests)
        assert one.tokens == tuple(t for r in one.requests for t in range(starts[r], starts[r + 1]))
        assert one.layout.num_tokens_padded <= split.num_tokens_padded
    for one in passes[:3]:  # one request per row, renumbered within the pass
        assert one.layout.prefill.row_members == tuple((k,) for k in range(len(one.requests)))
    assert sorted(r for one in passes for r in one.requests) == list(range(len(query_lens)))


def test_prompts_run_in_one_pass_when_rows_may_be_packed_or_one_fits_no_bucket_alone():
    query_lens, seq_lens = [100, 50, 120, 300], [100, 50, 248, 300]
    packs = step_layout.plan_step(
        query_lens=query_lens, seq_lens=seq_lens, block_size=BLOCK, plan=_rows_plan(pack=True)
    )
    # Packing allowed (attention only): one packed row, not passes of rows.
    assert step_layout.split_passes(packs, seq_lens, BLOCK, _rows_plan(pack=True)).parts is None
    # Request 2 continues from 4 blocks of context: no bucket holds it, even alone.
    seq_lens[2] = 120 + 4 * BLOCK
    plan = _rows_plan(pack=False)
    alone = step_layout.plan_step(
        query_lens=query_lens, seq_lens=seq_lens, block_size=BLOCK, plan=plan
    )
    assert step_layout.split_passes(alone, seq_lens, BLOCK, plan).parts is None
    assert not alone.warmed


def test_attention_groups_get_warmups_metadata_without_the_state_slots():
    layout, seq_lens = step_layout.layout_for_bucket(Bucket("decode", 2, 1, 2), BLOCK)
    md = _metadata(layout, seq_lens, slots=[0, 0])
    attention = KVCacheGroupSpec(
        ["attn"],
        FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32),
    )
    mamba = KVCacheGroupSpec(
        ["mamba"],
        MambaSpec(block_size=512, shapes=((3, 8), (2, 4, 4)), dtypes=(torch.float32,) * 2),
    )

    assert hybrid.for_group(md, mamba) is md
    stripped = hybrid.for_group(md, attention)
    assert all(getattr(stripped, name) is None for name in hybrid.STATE_FIELDS)
    assert stripped.decode_block_list is md.decode_block_list
    assert hybrid.attention_block_size([mamba, attention]) == BLOCK


def _state_layer(name: str) -> torch.nn.Module:
    """A state-space layer class named `name` that keeps vLLM's own backend (CUDA kernels), as a
    layer does when no op family of the ops wheel replaced it."""
    from vllm.model_executor.layers.mamba.abstract import MambaBase
    from vllm.v1.attention.backends.mamba2_attn import Mamba2AttentionBackend

    def get_state_shape(self):
        return ((3, 8),)

    def get_state_dtype(self):
        return (torch.float32,)

    cls = type(
        name,
        (MambaBase, torch.nn.Module),
        {
            "get_state_shape": get_state_shape,
            "get_state_dtype": get_state_dtype,
            "mamba_type": property(lambda self: "short_conv"),
            "get_attn_backend": lambda self: Mamba2AttentionBackend,
        },
    )
    return cls()


def test_a_state_layer_without_hpu_kernels_is_refused_naming_it():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), _state_layer("ShortConv"))
    with pytest.raises(
        ValueError, match=r"ShortConv layers have no HPU implementation.*no HPU kernels yet"
    ):
        hybrid.check_state_layers(model)
    hybrid.check_state_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))  # nothing to refuse


@pytest.mark.parametrize(
    ("layer", "family"),
    [("MambaMixer2", "hpu_ops_mamba"), ("QwenGatedDeltaNetAttention", "hpu_ops_gdn")],
)
def test_a_state_layer_whose_family_did_not_load_is_refused_naming_the_family(layer, family):
    model = torch.nn.Sequential(_state_layer(layer))
    with pytest.raises(ValueError, match=rf"{layer} needs the op family {family}.*VLLM_PLUGINS"):
        hybrid.check_state_layers(model)


def _config(speculative=None, prefix_caching=True, chunked_prefill=True):
    from types import SimpleNamespace

    return SimpleNamespace(
        model_config=SimpleNamespace(
            is_hybrid=True, architecture="GraniteMoeHybridForCausalLM", max_model_len=512
        ),
        speculative_config=speculative,
        cache_config=SimpleNamespace(
            enable_prefix_caching=prefix_caching,
            mamba_cache_mode="none",
            mamba_block_size=None,
            block_size=128,
        ),
        scheduler_config=SimpleNamespace(enable_chunked_prefill=chunked_prefill),
    )


def test_a_hybrid_with_prefix_caching_caches_mamba_state_per_block():
    config = _config()

    assert hybrid.check_vllm_config(config) is True
    cache = config.cache_config
    assert (cache.enable_prefix_caching, cache.mamba_cache_mode) == (True, "align")
    assert cache.mamba_block_size == 128


def test_a_hybrid_without_prefix_caching_keeps_one_state_per_request():
    config = _config(prefix_caching=False)
    config.cache_config.mamba_cache_mode = "align"

    assert hybrid.check_vllm_config(config) is True
    cache = config.cache_config
    assert (cache.enable_prefix_caching, cache.mamba_cache_mode) == (False, "none")
    assert cache.mamba_block_size == 512


def test_mamba_prefix_caching_without_chunked_prefill_is_refused_naming_both_fixes():
    with pytest.raises(ValueError, match=r"chunked prefill.*--no-enable-prefix-caching"):
        hybrid.check_vllm_config(_config(chunked_prefill=False))


def test_speculative_decoding_on_a_hybrid_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match=r"GraniteMoeHybrid.*--speculative-config"):
        hybrid.check_vllm_config(_config(speculative=object()))
