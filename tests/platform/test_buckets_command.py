"""`vllm-gaudi buckets`: the bucket plans and a trace's padding, without an engine."""

from __future__ import annotations

import json

import pytest

from vllm_gaudi_platform import cli
from vllm_gaudi_platform.commands import buckets

LIMITS = buckets.EngineLimits(
    max_num_seqs=16, max_num_batched_tokens=2048, max_model_len=1024, block_size=128
)
LIMIT_ARGS = ["--max-num-seqs", "16", "--max-num-batched-tokens", "2048", "--max-model-len", "1024"]
# Prefills of 200 and 700 tokens without context, twice and once; decodes of 2 and 6 sequences.
TRACE = """\
prompt 1 200 0 2
prompt 1 700 0 1
decode 2 10 5
decode 6 30 3
"""
# Two prompt buckets (context 1: no packed-prefill variant) and four decode buckets: (4, 64) is
# lowered to (4, 32), the most 4 sequences of 1024 tokens hold, and so is a bucket of its own.
BUCKET_FILE = "(1, [256, 1024], 1)\n([4, 8], 1, [16, 64])\n"


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "steps.trace"
    path.write_text(TRACE)
    return str(path)


def _by_label(table):
    return {row.label.split(" ")[0]: row for row in table}


def test_a_bucket_file_gives_the_padding_counted_by_hand(tmp_path, trace):
    file = tmp_path / "buckets.txt"
    file.write_text(BUCKET_FILE)
    table, shapes = buckets.rows(LIMITS, {"VLLM_BUCKETING_FROM_FILE": str(file)}, trace)
    row = table[0]

    assert row.label == f"configured ({file})"
    assert row.graphs == 6 and row.outside == 0
    # 3 prefills: 2 x 200 + 700 tokens padded to 2 x 256 + 1024; context 0 padded to 1 block.
    # Decodes: 5 x 2 + 3 x 6 sequences padded to 8 x 4 + 3 x 8 slots, 5 x 10 + 3 x 30 blocks to
    # 8 x 16 + 3 x 64.
    tokens, context, slots, blocks = row.padding
    assert tokens == pytest.approx((2 * 256 + 1024) / 1100 - 1)
    assert context is None  # no traced context to relate the 3 padded blocks to
    assert slots == pytest.approx((5 * 4 + 3 * 8) / 28 - 1)
    assert blocks == pytest.approx((5 * 16 + 3 * 64) / 140 - 1)
    assert sum(shapes.values()) == 11


def test_the_configured_row_is_the_strategy_the_environment_names(trace):
    table, _ = buckets.rows(LIMITS, {"VLLM_BUCKETING_STRATEGY": "pad"}, trace)
    rows = _by_label(table)

    assert table[0].label == "configured (pad)"
    assert table[0].plan == rows["pad"].plan
    assert rows["exp"].plan != rows["pad"].plan
    # The generated plans carry the runner's packed-row buckets: more context than one
    # sequence holds (1024 tokens = 8 blocks) in a single row.
    assert max(b.ctx_blocks for b in rows["exp"].plan.prompt if b.batch_size == 1) > 8


def test_fitted_rows_keep_their_graph_budgets_and_hold_every_traced_step(trace):
    table, _ = buckets.rows(LIMITS, {}, trace, fractions=(0.5, 0.25))
    exp = _by_label(table)["exp"]
    fitted = [row for row in table if row.label.startswith("fitted")]

    assert [row.label.split(" ")[0] for row in fitted] == ["fitted", "fitted@0.5", "fitted@0.25"]
    for row, fraction in zip(fitted, (1, 0.5, 0.25)):
        assert row.plan is not None, row.error
        assert row.graphs <= int(fraction * exp.strategy_graphs)
        assert row.outside == 0
    # Fitted to this very trace within exp's count, no column pads more than exp's.
    pairs = [(f, e) for f, e in zip(fitted[0].padding, exp.padding) if e is not None]
    assert len(pairs) == 3 and all(f <= e for f, e in pairs), pairs


def test_a_budget_too_small_for_coverage_is_refused_on_its_row_and_the_others_stay(trace):
    table, _ = buckets.rows(LIMITS, {}, trace, fractions=(0.01,))
    rows = _by_label(table)

    assert rows["fitted@0.01"].plan is None
    assert "VLLM_BUCKETING_GRAPH_BUDGET" in rows["fitted@0.01"].error
    assert rows["fitted"].plan is not None and rows["exp"].plan is not None
    text = buckets.render(LIMITS, table, None, None)
    assert "fitted@0.01" in text and "refused: " in text


def test_the_command_prints_the_table_lists_a_plan_and_writes_json(trace, capsys):
    assert cli.main(["buckets", *LIMIT_ARGS, "--trace", trace, "--list", "exp"]) == 0
    text = capsys.readouterr().out
    assert "configured (exp)" in text and "fitted@0.25" in text
    assert "exp: prompt buckets (batch, query, context blocks)" in text

    assert cli.main(["buckets", *LIMIT_ARGS, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [p["plan"] for p in report["plans"]] == ["configured (exp)", "exp", "lin", "pad"]
    assert all(p["graphs"] >= p["prompt_buckets"] + p["decode_buckets"] for p in report["plans"])


def test_an_unreadable_trace_is_one_error_line_naming_the_setting(tmp_path, capsys):
    missing = str(tmp_path / "none.trace")
    assert cli.main(["buckets", *LIMIT_ARGS, "--trace", missing]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "VLLM_BUCKETING_TRACE" in err and missing in err


@pytest.mark.parametrize("fractions", ["0", "1.5", "half"])
def test_fractions_outside_zero_to_one_are_refused(fractions, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["buckets", *LIMIT_ARGS, "--fractions", fractions])
    assert exit_.value.code == 2
    assert "--fractions" in capsys.readouterr().err


@pytest.mark.process
def test_the_command_imports_neither_vllm_nor_torch(run_python, trace):
    code = (
        "import sys\nfrom vllm_gaudi_platform import cli\n"
        f"status = cli.main(['buckets', *{LIMIT_ARGS!r}, '--trace', {trace!r}])\n"
        "print('LOADED', status, sorted(m for m in ('torch', 'vllm') if m in sys.modules))"
    )
    proc = run_python(code, fresh=True)

    assert proc.stdout.splitlines()[-1] == "LOADED 0 []", proc.stderr[-3000:]
