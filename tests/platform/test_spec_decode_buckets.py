"""Speculative decoding on HPU: which methods run, and the verification buckets (1 + k tokens per
sequence) that warmup covers and verification steps land on."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_gaudi_platform.attention import step_layout
from vllm_gaudi_platform.bucketing import plan_from_env
from vllm_gaudi_platform.worker import spec_decode

LIMITS = dict(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=512, block_size=128)
K = 3


def plan_with_verify(k: int = K):
    plan = step_layout.with_packed_context(plan_from_env(**LIMITS, environ={}))
    buckets = spec_decode.verify_buckets(
        plan,
        num_speculative_tokens=k,
        max_model_len=LIMITS["max_model_len"],
        block_size=LIMITS["block_size"],
        max_num_batched_tokens=LIMITS["max_num_batched_tokens"],
    )
    return plan, spec_decode.with_verify_buckets(plan, buckets)


@pytest.mark.parametrize("method", ["ngram", "eagle", "eagle3", "mtp"])
def test_ngram_eagle_heads_and_mtp_layers_are_accepted(method):
    spec_decode.check_speculative_config(SimpleNamespace(method=method))


@pytest.mark.parametrize("method", ["medusa", "draft_model", "suffix"])
def test_other_methods_are_refused_with_the_method_and_the_supported_ones_named(method):
    with pytest.raises(ValueError) as err:
        spec_decode.check_speculative_config(SimpleNamespace(method=method))

    assert repr(method) in str(err.value)
    assert "supported: ngram, eagle, eagle3, mtp." in str(err.value)


def test_ngram_without_numba_is_refused_naming_the_package(monkeypatch):
    # A Gaudi-style vLLM build installs vLLM's common requirements only, which lack numba.
    real_find_spec = spec_decode.importlib.util.find_spec
    monkeypatch.setattr(
        spec_decode.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "numba" else real_find_spec(name, *a),
    )

    with pytest.raises(ValueError, match="needs numba") as err:
        spec_decode.check_speculative_config(SimpleNamespace(method="ngram"))
    assert "pip install numba" in str(err.value)
    spec_decode.check_speculative_config(SimpleNamespace(method="eagle"))


def test_eagle_with_parallel_drafting_is_refused():
    with pytest.raises(ValueError, match="parallel drafting"):
        spec_decode.check_speculative_config(
            SimpleNamespace(method="eagle", parallel_drafting=True)
        )


def test_no_speculation_adds_no_buckets():
    plain, with_verify = plan_with_verify(k=0)

    assert with_verify == plain


def test_verify_buckets_hold_one_plus_k_tokens_at_every_decode_batch_size():
    plain, plan = plan_with_verify()
    verify = [b for b in plan.prompt if b.phase == "verify"]

    assert {b.query_len for b in verify} == {1 + K}
    assert {b.batch_size for b in verify} == {b.batch_size for b in plain.decode}
    # Context per sequence: up to what a 512-token sequence holds before its last 1 + k tokens.
    assert {b.ctx_blocks for b in verify} == {1, 2, 4}


def test_verify_buckets_stay_within_the_token_budget():
    plain = plan_from_env(**LIMITS, environ={})

    buckets = spec_decode.verify_buckets(
        plain,
        num_speculative_tokens=15,
        max_model_len=512,
        block_size=128,
        max_num_batched_tokens=64,
    )

    assert buckets and all(b.batch_size * b.query_len <= 64 for b in buckets)


def test_a_verification_step_lands_on_a_warmed_verify_bucket():
    _, plan = plan_with_verify()
    # Five sequences with 3, 3, 2 and 3 drafts (queries 1 + drafts), one without drafts (decode).
    query_lens = [4, 4, 3, 1, 4]
    seq_lens = [200, 300, 140, 260, 400]

    layout = step_layout.plan_step(
        query_lens=query_lens, seq_lens=seq_lens, block_size=128, plan=plan
    )

    assert layout.prefill is not None and layout.prefill.bucket.phase == "verify"
    assert layout.prefill.query_bucket == 1 + K and layout.prefill.rows >= 4
    assert layout.prefill.row_members == ((0,), (1,), (2,), (4,))
    assert layout.decode is not None and layout.decode.members == (3,)
    assert layout.warmed
    assert layout.prefill.bucket in plan.prompt  # warmup runs every bucket of the plan


def test_warmup_lays_a_verify_bucket_out_as_prefill_rows_with_context():
    _, plan = plan_with_verify()
    bucket = next(b for b in plan.prompt if b.phase == "verify" and b.batch_size > 1)

    layout, seq_lens = step_layout.layout_for_bucket(bucket, 128)

    assert layout.prefill is not None and layout.decode is None
    assert layout.num_tokens_padded == bucket.batch_size * (1 + K)
    assert seq_lens == [1 + K + bucket.ctx_blocks * 128] * bucket.batch_size


@pytest.mark.process
def test_the_platform_refuses_an_unsupported_method_when_the_config_is_built(run_python):
    code = (
        "from vllm.engine.arg_utils import EngineArgs\n"
        "from gaudi_testkit import tinymodels\n"
        "args = EngineArgs(model=str(tinymodels.build('llama')),\n"
        "    speculative_config={'method': 'ngram_gpu', 'num_speculative_tokens': 2})\n"
        "args.create_engine_config()\n"
    )

    result = run_python(code, {"VLLM_HPU_EMULATION": "cpu"})

    assert result.returncode != 0
    assert "method 'ngram_gpu': it is not supported on HPU; supported: ngram" in result.stderr
