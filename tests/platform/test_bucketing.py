"""Static-shape bucketing: Intel vllm-gaudi's strategies, settings, bucket file and lookups."""

from __future__ import annotations

import itertools
import logging
import math
import subprocess
import sys

import pytest

from vllm_gaudi_platform.bucketing import (
    BUCKET_VARIABLES,
    Bucket,
    BucketPlan,
    exponential_range,
    linear_range,
    padding_aware_range,
    plan_from_env,
)
from vllm_gaudi_platform.envs import EnvError

# The tiny test model's engine limits.
TINY = dict(max_num_seqs=16, max_num_batched_tokens=2048, max_model_len=512, block_size=128)
STRATEGIES = ("exp", "lin", "pad")
LOGGER = "vllm.vllm_gaudi_platform.bucketing"


def plan(environ: dict[str, str] | None = None, **limits) -> BucketPlan:
    return plan_from_env(**{**TINY, **limits}, environ=environ or {})


def values(buckets, dim: str) -> list[int]:
    return sorted({getattr(b, dim) for b in buckets})


def write_file(tmp_path, text: str) -> str:
    path = tmp_path / "buckets.txt"
    path.write_text(text)
    return str(path)


# ----------------------------------------------------------- ranges: Intel's documented examples


def test_linear_range_ramps_up_by_doubling_below_step():
    assert linear_range(2, 32, 64) == [2, 4, 8, 16, 32, 64]


def test_linear_range_without_ramp_up_is_the_multiples_of_step():
    assert linear_range(128, 128, 512) == [128, 256, 384, 512]


def test_linear_range_with_zero_min_adds_zero_then_starts_at_step():
    assert linear_range(0, 4, 12) == [0, 4, 8, 12]


def test_linear_range_includes_a_max_that_is_not_a_multiple_of_step():
    assert linear_range(1, 32, 48) == [1, 2, 4, 8, 16, 32, 48]


def test_linear_range_includes_a_min_that_is_not_a_multiple_of_step():
    assert linear_range(96, 64, 256) == [96, 128, 192, 256]


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        # (min, step, max, pad_max, pad_percent) from Intel's padding-aware documentation
        ((0, 8, 64, 64, 0), [0, 1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]),
        ((0, 8, 64, 64, 50), [0, 1, 2, 4, 8, 16, 32, 64]),
        ((0, 8, 64, 16, 50), [0, 1, 2, 4, 8, 16, 32, 48, 64]),
        ((16, 16, 128, 32, 25), [16, 32, 48, 64, 80, 96, 128]),
    ],
    ids=["dense-linear", "ratio-limited", "absolute-cap", "no-ramp-up"],
)
def test_padding_aware_range_reproduces_documented_examples(config, expected):
    assert padding_aware_range(*config) == expected


def test_padding_aware_range_with_zero_pad_max_uses_max_as_the_cap():
    assert padding_aware_range(0, 8, 64, 0, 50) == padding_aware_range(0, 8, 64, 64, 50)


def test_padding_aware_range_always_keeps_multiples_of_pad_max():
    kept = padding_aware_range(128, 128, 8192, 2048, 25)
    assert {2048, 4096, 6144} <= set(kept)


def test_padding_aware_range_keeps_more_values_for_a_lower_percent():
    assert len(padding_aware_range(128, 128, 4096, 4096, 10)) > len(
        padding_aware_range(128, 128, 4096, 4096, 40)
    )


def test_exponential_range_reproduces_documented_example():
    # Intel's worked example: min=128, step=128, max=2048, 10 buckets, one duplicate removed.
    assert exponential_range(128, 128, 2048, 10) == [128, 256, 384, 512, 640, 896, 1152, 1536, 2048]


def test_exponential_range_matches_documented_startup_log():
    # Intel's startup log "seq:[128, 128, 1024, 11]" warms query lengths 128, 256, ..., 1024.
    assert exponential_range(128, 128, 1024, 11) == list(range(128, 1025, 128))


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ((1, 2, 4, 3), [1, 2, 4]),
        ((0, 1, 4, 3), [0, 1, 2, 4]),
        ((1, 2, 16, 5), [1, 2, 4, 6, 10, 16]),
    ],
)
def test_exponential_range_keeps_a_min_of_zero_or_one_and_spaces_from_step(config, expected):
    assert exponential_range(*config) == expected


def test_exponential_range_is_not_bumped_by_floating_point_error():
    # 32 ** 0.8 is 16.000000000000004 in floating point; the bucket is 16, not 17.
    assert exponential_range(0, 1, 32, 6) == [0, 1, 2, 4, 8, 16, 32]


def test_exponential_range_spacing_grows_toward_max():
    points = exponential_range(128, 128, 4096, 13)
    gaps = [b - a for a, b in itertools.pairwise(points)]
    assert gaps[-1] > gaps[0]


@pytest.mark.parametrize("bmax", [500, 777, 4096])
def test_exponential_range_ends_exactly_at_max(bmax):
    assert exponential_range(128, 128, bmax, 8)[-1] == bmax


# ----------------------------------------------------------------------------- strategy selection


def test_default_strategy_is_exponential():
    assert plan().strategy == "exp"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategy_is_chosen_by_vllm_bucketing_strategy(strategy):
    assert plan({"VLLM_BUCKETING_STRATEGY": strategy}).strategy == strategy


def test_strategy_name_ignores_case_and_spaces():
    assert plan({"VLLM_BUCKETING_STRATEGY": " LIN "}).strategy == "lin"


@pytest.mark.parametrize(("flag", "expected"), [("true", "exp"), ("false", "lin")])
def test_deprecated_exponential_bucketing_flag_overrides_strategy(flag, expected):
    env = {"VLLM_BUCKETING_STRATEGY": "pad", "VLLM_EXPONENTIAL_BUCKETING": flag}
    assert plan(env).strategy == expected


def test_empty_variable_counts_as_unset():
    assert plan({"VLLM_BUCKETING_STRATEGY": "", "VLLM_DECODE_BS_BUCKET_MAX": " "}) == plan()


def test_plan_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("VLLM_BUCKETING_STRATEGY", "pad")
    assert plan_from_env(**TINY).strategy == "pad"


# ------------------------------------------------------------------------------- default plans


@pytest.mark.parametrize("max_num_seqs", [16, 64])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_default_plan_for_the_tiny_model_stays_under_60_warmup_graphs(strategy, max_num_seqs):
    p = plan({"VLLM_BUCKETING_STRATEGY": strategy}, max_num_seqs=max_num_seqs)
    assert 0 < len(p.prompt) + len(p.decode) < 60


def test_default_exp_plan_for_the_tiny_model():
    p = plan()
    assert values(p.prompt, "query_len") == [128, 256, 384, 512]
    assert values(p.prompt, "ctx_blocks") == [0, 1, 2, 4]
    assert values(p.decode, "batch_size") == [1, 2, 4, 6, 10, 16]
    assert (len(p.prompt), len(p.decode)) == (13, 13)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_prefill_batch_size_defaults_to_one(strategy):
    assert values(plan({"VLLM_BUCKETING_STRATEGY": strategy}).prompt, "batch_size") == [1]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_prompt_bs_bucket_max_sets_the_prefill_batch_size_in_every_strategy(strategy):
    p = plan({"VLLM_BUCKETING_STRATEGY": strategy, "VLLM_PROMPT_BS_BUCKET_MAX": "4"})
    assert max(values(p.prompt, "batch_size")) == 4


def test_documented_example_three_prompts_of_412_tokens_run_as_bucket_4_512_0():
    p = plan({"VLLM_PROMPT_BS_BUCKET_MAX": "4"}, max_model_len=1024)
    assert p.find_prompt(3, 412, 0) == Bucket("prompt", 4, 512, 0)


def test_prompt_query_max_is_capped_by_max_model_len():
    p = plan(max_model_len=500, max_num_batched_tokens=4096)
    assert max(values(p.prompt, "query_len")) == 500


def test_prompt_query_max_is_capped_by_max_num_batched_tokens():
    p = plan(max_model_len=4096, max_num_batched_tokens=1024)
    assert max(values(p.prompt, "query_len")) == 1024


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_prompt_buckets_fit_the_token_budget(strategy):
    p = plan({"VLLM_BUCKETING_STRATEGY": strategy, "VLLM_PROMPT_BS_BUCKET_MAX": "16"})
    assert max(values(p.prompt, "batch_size")) > 1
    assert all(b.batch_size * b.query_len <= TINY["max_num_batched_tokens"] for b in p.prompt)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_prompt_buckets_no_legal_step_can_reach_are_dropped(strategy):
    # A 512-token query bucket is reached only by queries over 384 tokens, which leave room for
    # one context block at most within max_model_len=512.
    p = plan({"VLLM_BUCKETING_STRATEGY": strategy})
    assert max(b.ctx_blocks for b in p.prompt if b.query_len == 512) == 1


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_decode_buckets_hold_one_to_max_model_len_blocks_per_sequence(strategy):
    p = plan({"VLLM_BUCKETING_STRATEGY": strategy})
    per_seq = math.ceil(TINY["max_model_len"] / TINY["block_size"])
    assert all(b.batch_size <= b.ctx_blocks <= b.batch_size * per_seq for b in p.decode)
    assert all(b.query_len == 1 and b.phase == "decode" for b in p.decode)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_decode_block_max_is_capped_at_three_times_the_kv_blocks(strategy):
    p = plan({"VLLM_BUCKETING_STRATEGY": strategy}, num_kv_blocks=10)
    assert max(values(p.decode, "ctx_blocks")) == 30


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_plan_covers_the_maximum_of_every_dimension(strategy):
    p = plan({"VLLM_BUCKETING_STRATEGY": strategy})
    assert p.find_prompt(1, 512, 0) is not None
    assert p.find_prompt(1, 1, 4) is not None
    assert p.find_decode(16, 64) is not None


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_legal_single_sequence_prompt_step_has_a_bucket(strategy):
    p = plan({"VLLM_BUCKETING_STRATEGY": strategy})
    bs, mml = TINY["block_size"], TINY["max_model_len"]
    missing = [
        (q, c)
        for c in range(math.ceil((mml - 1) / bs) + 1)
        for q in range(1, mml + 1)
        if q + (0 if c == 0 else (c - 1) * bs + 1) <= mml and p.find_prompt(1, q, c) is None
    ]
    assert missing == []


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_legal_decode_step_has_a_bucket(strategy):
    p = plan({"VLLM_BUCKETING_STRATEGY": strategy})
    per_seq = math.ceil(TINY["max_model_len"] / TINY["block_size"])
    missing = [
        (b, c)
        for b in range(1, TINY["max_num_seqs"] + 1)
        for c in range(b, b * per_seq + 1)
        if p.find_decode(b, c) is None
    ]
    assert missing == []


# ------------------------------------------------------------------------------- user settings


def test_lin_uses_user_min_step_max():
    env = {
        "VLLM_BUCKETING_STRATEGY": "lin",
        "VLLM_DECODE_BS_BUCKET_MIN": "2",
        "VLLM_DECODE_BS_BUCKET_STEP": "4",
        "VLLM_DECODE_BS_BUCKET_MAX": "16",
    }
    assert values(plan(env).decode, "batch_size") == [2, 4, 8, 12, 16]


def test_pad_uses_user_pad_limits():
    env = {
        "VLLM_BUCKETING_STRATEGY": "pad",
        "VLLM_PROMPT_QUERY_BUCKET_MIN": "16",
        "VLLM_PROMPT_QUERY_BUCKET_STEP": "16",
        "VLLM_PROMPT_QUERY_BUCKET_MAX": "128",
        "VLLM_PROMPT_QUERY_BUCKET_PAD_MAX": "32",
        "VLLM_PROMPT_QUERY_BUCKET_PAD_PERCENT": "25",
    }
    p = plan(env, max_model_len=128, max_num_batched_tokens=128, block_size=16)
    assert values(p.prompt, "query_len") == [16, 32, 48, 64, 80, 96, 128]


def test_lin_ignores_pad_limits():
    base = {"VLLM_BUCKETING_STRATEGY": "lin"}
    assert plan({**base, "VLLM_DECODE_BS_BUCKET_PAD_PERCENT": "0"}) == plan(base)


def test_pad_decode_block_pad_max_defaults_to_a_quarter_of_the_block_max():
    # max = 256 blocks/sequence * 4 sequences = 1024, so PAD_MAX defaults to 256 and its
    # multiples are kept.
    p = plan({"VLLM_BUCKETING_STRATEGY": "pad"}, max_num_seqs=4, max_model_len=4096, block_size=16)
    assert {256, 512, 768} <= set(values(p.decode, "ctx_blocks"))


def test_exp_ignores_user_ranges_and_warns(caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        p = plan({"VLLM_DECODE_BS_BUCKET_STEP": "1", "VLLM_DECODE_BLOCK_BUCKET_MAX": "8"})
    assert p == plan()
    assert "VLLM_DECODE_BS_BUCKET_STEP" in caplog.text
    assert "VLLM_DECODE_BLOCK_BUCKET_MAX" in caplog.text


def test_exp_with_query_min_one_adds_a_one_token_prompt_bucket():
    p = plan({"VLLM_PROMPT_QUERY_BUCKET_MIN": "1"})
    assert values(p.prompt, "query_len")[:2] == [1, 128]


def test_legacy_seq_variables_stand_in_for_unset_query_variables(caplog):
    env = {"VLLM_BUCKETING_STRATEGY": "lin", "VLLM_PROMPT_SEQ_BUCKET_STEP": "256"}
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        p = plan(env)
    assert values(p.prompt, "query_len") == [128, 256, 512]
    assert "VLLM_PROMPT_SEQ_BUCKET_STEP is deprecated" in caplog.text


def test_query_variables_win_over_legacy_seq_variables():
    env = {
        "VLLM_BUCKETING_STRATEGY": "lin",
        "VLLM_PROMPT_SEQ_BUCKET_STEP": "256",
        "VLLM_PROMPT_QUERY_BUCKET_STEP": "128",
    }
    assert values(plan(env).prompt, "query_len") == [128, 256, 384, 512]


def test_unknown_bucket_variable_is_warned_with_a_suggestion(caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        plan({"VLLM_DECODE_BLOCKS_BUCKET_MAX": "64"})
    assert "did you mean VLLM_DECODE_BLOCK_BUCKET_MAX" in caplog.text


def test_every_documented_combination_is_declared():
    assert len(BUCKET_VARIABLES) == 25
    assert "VLLM_DECODE_BLOCK_BUCKET_PAD_PERCENT" in BUCKET_VARIABLES
    assert "VLLM_DECODE_CTX_BUCKET_MAX" not in BUCKET_VARIABLES


# ------------------------------------------------------------------------------------- lookups

HAND_MADE = BucketPlan(
    "file",
    prompt=(
        Bucket("prompt", 1, 2048, 0),
        Bucket("prompt", 2, 256, 0),
        Bucket("prompt", 1, 128, 0),
        Bucket("prompt", 1, 512, 4),
    ),
    decode=(Bucket("decode", 4, 1, 64), Bucket("decode", 1, 1, 4), Bucket("decode", 4, 1, 16)),
)


def test_find_prompt_returns_the_smallest_fitting_bucket():
    assert HAND_MADE.find_prompt(1, 100, 0) == Bucket("prompt", 1, 128, 0)


def test_find_prompt_prefers_fewest_padded_tokens_then_fewest_context_blocks():
    # (1, 2048, 0) wastes more tokens; (1, 512, 4) ties on tokens but adds context.
    assert HAND_MADE.find_prompt(1, 200, 0) == Bucket("prompt", 2, 256, 0)


def test_find_prompt_takes_context_into_account():
    assert HAND_MADE.find_prompt(1, 100, 3) == Bucket("prompt", 1, 512, 4)


@pytest.mark.parametrize(
    "step", [(3, 128, 0), (1, 4096, 0), (1, 128, 5)], ids=["bs", "query", "ctx"]
)
def test_find_prompt_returns_none_outside_every_bucket(step):
    assert HAND_MADE.find_prompt(*step) is None


def test_find_decode_returns_the_smallest_fitting_bucket():
    assert HAND_MADE.find_decode(2, 3) == Bucket("decode", 4, 1, 16)
    assert HAND_MADE.find_decode(1, 3) == Bucket("decode", 1, 1, 4)


@pytest.mark.parametrize("step", [(5, 8), (1, 65)], ids=["bs", "ctx"])
def test_find_decode_returns_none_outside_every_bucket(step):
    assert HAND_MADE.find_decode(*step) is None


def test_describe_names_the_strategy_counts_and_ranges():
    text = plan().describe()
    assert "strategy exp" in text
    assert "26 warmup graphs (13 prompt, 13 decode)" in text
    assert "query_len [128, 256, 384, 512]" in text
    assert len(text.splitlines()) <= 5


def test_describe_abbreviates_long_value_lists():
    text = plan({"VLLM_BUCKETING_STRATEGY": "lin"}, max_num_seqs=256, max_model_len=8192).describe()
    assert max(len(line) for line in text.splitlines()) < 160
    assert "values)" in text


@pytest.mark.process
def test_bucketing_imports_neither_torch_nor_vllm():
    code = (
        "import sys, vllm_gaudi_platform.bucketing; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ----------------------------------------------------------------------------------- bucket file

FILE_LIMITS = dict(max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=2048, block_size=128)


def test_file_precise_buckets_are_used_as_given(tmp_path):
    path = write_file(tmp_path, "(1, 2048, 0)\n(64, 1, 1024)\n")
    p = plan({"VLLM_BUCKETING_FROM_FILE": path}, **FILE_LIMITS)
    assert (p.strategy, p.prompt, p.decode) == (
        "file",
        (Bucket("prompt", 1, 2048, 0),),
        (Bucket("decode", 64, 1, 1024),),
    )


def test_file_list_items_expand_to_their_cartesian_product(tmp_path):
    path = write_file(tmp_path, "(1, [256, 512], [0, 4, 8])\n(1, 1, 4)\n")
    p = plan({"VLLM_BUCKETING_FROM_FILE": path}, **FILE_LIMITS)
    assert {(b.query_len, b.ctx_blocks) for b in p.prompt} == {
        (q, c) for q in (256, 512) for c in (0, 4, 8)
    }


def test_file_range_excludes_its_stop_like_python(tmp_path):
    path = write_file(tmp_path, "(64, 1, range(256, 512, 128))\n(1, 128, 0)\n")
    p = plan({"VLLM_BUCKETING_FROM_FILE": path}, **FILE_LIMITS)
    assert values(p.decode, "ctx_blocks") == [256, 384]


def test_file_comments_and_blank_lines_are_skipped(tmp_path):
    path = write_file(tmp_path, "# prompt\n\n(1, 128, 0)  # one bucket\n   \n(1, 1, 4)\n")
    p = plan({"VLLM_BUCKETING_FROM_FILE": path}, **FILE_LIMITS)
    assert len(p.prompt) + len(p.decode) == 2


def test_file_takes_precedence_over_the_strategy(tmp_path):
    path = write_file(tmp_path, "(1, 128, 0)\n(1, 1, 4)\n")
    env = {"VLLM_BUCKETING_FROM_FILE": path, "VLLM_BUCKETING_STRATEGY": "lin"}
    assert plan(env, **FILE_LIMITS).strategy == "file"


def test_file_buckets_no_step_can_use_are_dropped_with_a_warning(tmp_path, caplog):
    path = write_file(tmp_path, "(1, 128, 0)\n(4, 1024, 0)\n(8, 1, 4)\n(2, 1, 4)\n")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        p = plan({"VLLM_BUCKETING_FROM_FILE": path}, **FILE_LIMITS)
    assert p.prompt == (Bucket("prompt", 1, 128, 0),)
    assert p.decode == (Bucket("decode", 2, 1, 4),)
    assert "dropped 2 bucket(s)" in caplog.text


def test_file_decode_context_is_lowered_to_what_the_batch_can_hold(tmp_path):
    path = write_file(tmp_path, "(1, 128, 0)\n(2, 1, 1000)\n")
    p = plan({"VLLM_BUCKETING_FROM_FILE": path}, **FILE_LIMITS)
    assert p.decode == (Bucket("decode", 2, 1, 32),)


# ---------------------------------------------------------------------------------- bad settings


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        ({"VLLM_BUCKETING_STRATEGY": "exponential"}, "VLLM_BUCKETING_STRATEGY"),
        ({"VLLM_EXPONENTIAL_BUCKETING": "maybe"}, "VLLM_EXPONENTIAL_BUCKETING"),
        ({"VLLM_DECODE_BS_BUCKET_MIN": "abc"}, "VLLM_DECODE_BS_BUCKET_MIN"),
        ({"VLLM_DECODE_BS_BUCKET_STEP": "1.5"}, "VLLM_DECODE_BS_BUCKET_STEP"),
        ({"VLLM_PROMPT_QUERY_BUCKET_STEP": "0"}, "VLLM_PROMPT_QUERY_BUCKET_STEP"),
        ({"VLLM_DECODE_BLOCK_BUCKET_STEP": "-128"}, "VLLM_DECODE_BLOCK_BUCKET_STEP"),
        ({"VLLM_DECODE_BLOCK_BUCKET_MAX": "-5"}, "VLLM_DECODE_BLOCK_BUCKET_MAX"),
        ({"VLLM_PROMPT_CTX_BUCKET_MIN": "-1"}, "VLLM_PROMPT_CTX_BUCKET_MIN"),
        ({"VLLM_PROMPT_BS_BUCKET_MAX": "0"}, "VLLM_PROMPT_BS_BUCKET_MAX"),
        ({"VLLM_PROMPT_QUERY_BUCKET_PAD_MAX": "-1"}, "VLLM_PROMPT_QUERY_BUCKET_PAD_MAX"),
        ({"VLLM_DECODE_BS_BUCKET_PAD_PERCENT": "60"}, "VLLM_DECODE_BS_BUCKET_PAD_PERCENT"),
        ({"VLLM_PROMPT_SEQ_BUCKET_MAX": "big"}, "VLLM_PROMPT_SEQ_BUCKET_MAX"),
        (
            {
                "VLLM_BUCKETING_STRATEGY": "lin",
                "VLLM_DECODE_BS_BUCKET_MIN": "32",
                "VLLM_DECODE_BS_BUCKET_MAX": "8",
            },
            "VLLM_DECODE_BS_BUCKET_MIN",
        ),
        (
            {"VLLM_BUCKETING_STRATEGY": "pad", "VLLM_DECODE_BS_BUCKET_MIN": "100"},
            "VLLM_DECODE_BS_BUCKET_MIN",
        ),
        (
            {
                "VLLM_BUCKETING_STRATEGY": "lin",
                "VLLM_PROMPT_CTX_BUCKET_MIN": "3",
                "VLLM_PROMPT_CTX_BUCKET_MAX": "1",
            },
            "VLLM_PROMPT_CTX_BUCKET_MAX",
        ),
    ],
)
def test_invalid_setting_raises_env_error_naming_the_variable(env, variable):
    with pytest.raises(EnvError, match=variable) as info:
        plan(env)
    assert "set" in str(info.value) or "raise" in str(info.value) or "lower" in str(info.value)


def test_unreadable_bucket_file_raises_env_error(tmp_path):
    missing = str(tmp_path / "missing.txt")
    with pytest.raises(EnvError, match=r"VLLM_BUCKETING_FROM_FILE=.*cannot be read"):
        plan({"VLLM_BUCKETING_FROM_FILE": missing})


@pytest.mark.parametrize(
    "line",
    [
        "(1, 128)",
        "1, 128, 0, 4",
        "[1, 128, 0]",
        "(1, 128, 0",
        "(1, 'a', 0)",
        "(1, 128, foo)",
        "(1, [128, x], 0)",
        "(1, 128, open('f'))",
        "(1, range(512, 256), 0)",
        "(1, range(1, 10, 0), 0)",
        "(1, range(1, 2, 3, 4), 0)",
        "(0, 128, 0)",
        "(1, 128, -1)",
        "(1, 1.5, 0)",
        "(True, 128, 0)",
    ],
)
def test_malformed_bucket_file_line_raises_env_error_with_its_line_number(tmp_path, line):
    path = write_file(tmp_path, f"(1, 1, 4)\n{line}\n")
    with pytest.raises(EnvError, match=r"VLLM_BUCKETING_FROM_FILE=.*line 2") as info:
        plan({"VLLM_BUCKETING_FROM_FILE": path}, **FILE_LIMITS)
    assert "fix the line" in str(info.value)


@pytest.mark.parametrize(
    ("text", "phase"), [("(1, 128, 0)\n", "decode"), ("(1, 1, 4)\n", "prompt"), ("# empty\n", "")]
)
def test_bucket_file_without_a_usable_phase_raises_env_error(tmp_path, text, phase):
    path = write_file(tmp_path, text)
    with pytest.raises(EnvError, match=f"VLLM_BUCKETING_FROM_FILE=.*no usable {phase}"):
        plan({"VLLM_BUCKETING_FROM_FILE": path}, **FILE_LIMITS)


def test_user_ranges_leaving_no_prompt_bucket_raise_env_error():
    # Every query bucket exceeds the 2048-token budget.
    env = {"VLLM_BUCKETING_STRATEGY": "lin", "VLLM_PROMPT_QUERY_BUCKET_MIN": "4096"}
    env["VLLM_PROMPT_QUERY_BUCKET_MAX"] = "4096"
    with pytest.raises(EnvError, match="VLLM_PROMPT_"):
        plan(env)


@pytest.mark.parametrize("limit", ["max_num_seqs", "max_num_batched_tokens", "max_model_len"])
def test_non_positive_engine_limit_raises_value_error(limit):
    with pytest.raises(ValueError, match=limit):
        plan(**{limit: 0})
