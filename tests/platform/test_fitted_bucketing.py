"""The fitted bucketing strategy and the step-shape traces it reads (pure Python, no engine)."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest

from benchmarks import bucketing as bucketing_benchmark
from vllm_gaudi_platform.attention import step_layout
from vllm_gaudi_platform.bucketing import (
    Bucket,
    BucketPlan,
    fit_buckets,
    graph_count,
    plan_from_env,
)
from vllm_gaudi_platform.envs import EnvError
from vllm_gaudi_platform.observability.step_trace import (
    TracedShape,
    TraceRecorder,
    format_line,
    read_trace,
    step_shapes,
)

MEDIUM = dict(
    max_num_seqs=64, max_num_batched_tokens=4096, max_model_len=4096, block_size=128,
    num_kv_blocks=2048,
)  # fmt: skip
PER_SEQ = 32  # blocks of one max_model_len sequence


def random_trace(seed: int, steps: int = 3000, prefill_batch: int = 4) -> Counter[TracedShape]:
    """Legal step shapes of the MEDIUM engine: prefill batches within the token budget, decode
    batches holding one to PER_SEQ blocks a sequence."""
    rng = random.Random(seed)
    trace: Counter[TracedShape] = Counter()
    for _ in range(steps):
        if rng.random() < 0.3:
            batch = rng.randint(1, prefill_batch)
            query = rng.randint(2, 4096 // batch)
            ctx = rng.choice([0, 0, rng.randint(1, PER_SEQ - 1)])
            trace[TracedShape("prompt", batch, query, ctx)] += 1
        else:
            batch = rng.randint(1, 64)
            blocks = sum(rng.randint(1, PER_SEQ) for _ in range(batch))
            trace[TracedShape("decode", batch, 1, blocks)] += 1
    return trace


def fit(trace, budget: int, prefill_batch: int = 4) -> BucketPlan:
    return fit_buckets(trace, **MEDIUM, budget=budget, max_prefill_batch=prefill_batch)


def bucket_for(plan: BucketPlan, s: TracedShape) -> Bucket | None:
    if s.phase == "prompt":
        return plan.find_prompt(s.batch_size, s.query_len, s.ctx_blocks)
    return plan.find_decode(s.batch_size, s.ctx_blocks)


def write_trace(tmp_path, trace: Counter[TracedShape]) -> str:
    path = tmp_path / "trace.txt"
    path.write_text("".join(format_line(s, n) for s, n in trace.items()))
    return str(path)


# ------------------------------------------------------------------------------ the fitted plan


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fitted_plan_gives_every_traced_shape_a_bucket_that_holds_it(seed):
    trace = random_trace(seed)
    plan = fit(trace, budget=120)

    for s in trace:
        b = bucket_for(plan, s)
        assert b is not None, s
        assert (b.batch_size, b.query_len, b.ctx_blocks) >= (s.batch_size, 1, 0)
        assert b.batch_size >= s.batch_size and b.query_len >= s.query_len
        assert b.ctx_blocks >= s.ctx_blocks


@pytest.mark.parametrize("budget", [6, 7, 20, 60, 215])
def test_fitted_plan_never_exceeds_the_graph_budget(budget):
    plan = fit(random_trace(3), budget=budget)

    # Graphs, not buckets: a single-row prompt bucket without context has a packed variant.
    assert graph_count(plan.prompt, plan.decode) <= budget


def test_fitted_plan_has_a_bucket_for_every_legal_step_not_only_traced_ones():
    plan = fit(random_trace(4, steps=200), budget=30)
    rng = random.Random(5)
    for _ in range(2000):
        batch = rng.randint(1, 4)
        assert plan.find_prompt(batch, rng.randint(1, 4096 // batch), rng.randint(0, 31))
        n = rng.randint(1, 64)
        assert plan.find_decode(n, rng.randint(n, n * PER_SEQ))


def test_fitted_buckets_respect_the_engine_limits():
    plan = fit(random_trace(6), budget=100)

    assert all(b.batch_size * b.query_len <= 4096 for b in plan.prompt)
    assert all(b.batch_size <= b.ctx_blocks <= b.batch_size * PER_SEQ for b in plan.decode)
    assert all(b.batch_size <= 64 and b.ctx_blocks <= 3 * 2048 for b in plan.decode)


def test_fitted_plan_with_room_for_every_traced_shape_pads_none():
    trace = Counter(
        {
            TracedShape("prompt", 1, 300, 0): 40,
            TracedShape("prompt", 1, 1000, 2): 10,
            TracedShape("prompt", 2, 700, 0): 5,
            TracedShape("decode", 3, 1, 20): 100,
            TracedShape("decode", 17, 1, 200): 50,
            TracedShape("decode", 40, 1, 600): 70,
        }
    )
    # 6 coverage buckets (prefill batch 1..4, the packed row, the largest decode) + 6 shapes,
    # + the packed-prefill graph variant of the single-row bucket without context (1, 300, 0).
    plan = fit(trace, budget=13)

    for s in trace:
        assert bucket_for(plan, s) == Bucket(s.phase, s.batch_size, s.query_len, s.ctx_blocks)


def decode_objective(
    plan: BucketPlan, trace: Counter[TracedShape], prices: tuple[float, ...]
) -> float:
    """The documented decode objective at the fit's ``prices`` (``BucketPlan.prices``): padded
    slots and blocks, each at its price, each step counted as often as it was traced."""
    total = 0.0
    for s, n in trace.items():
        b = bucket_for(plan, s)
        assert b is not None
        total += n * ((b.batch_size - s.batch_size) * prices[2])
        total += n * ((b.ctx_blocks - s.ctx_blocks) * prices[3])
    return total


def brute_force_optimum(
    trace: Counter[TracedShape], fixed: set[Bucket], extra: int, prices: tuple[float, ...]
) -> float:
    """The best decode objective over every choice of `extra` buckets besides `fixed`: an optimal
    bucket is the largest of the shapes it serves, so each coordinate is a traced one."""
    batches = sorted({s.batch_size for s in trace})
    blocks = sorted({s.ctx_blocks for s in trace})
    candidates = [Bucket("decode", b, 1, k) for b in batches for k in blocks if b <= k]
    best = float("inf")
    for extra_set in itertools.combinations(candidates, extra):
        plan = BucketPlan("test", (), (*fixed, *extra_set), prices=(1.0, 1.0, *prices[2:]))
        best = min(best, decode_objective(plan, trace, prices))
    return best


# Greedy choice plus single swaps has no exactness guarantee. Measured on these 20 instances, at
# the prices of each fit (relative to exp's padding, after the balancing round): the optimum on
# 18, 1.11x the optimal padding on the other two (seeds 7 and 9).
OPTIMAL_AT_LEAST = 18
WORST_RATIO = 1.15


def test_fitted_decode_padding_matches_the_brute_force_optimum_within_the_stated_bound():
    ratios = []
    for seed in range(20):
        rng = random.Random(seed)
        trace: Counter[TracedShape] = Counter()
        for _ in range(8):
            batch = rng.randint(1, 12)
            trace[TracedShape("decode", batch, 1, batch * rng.randint(1, 8))] += rng.randint(1, 50)
        extra = 3
        # Coverage takes 2 (the packed prompt row, the largest decode), the one traced prompt
        # shape 1 and its packed-prefill graph variant 1 (its exact bucket saves far more than
        # any decode bucket), 3 remain for decode.
        prompt = TracedShape("prompt", 1, 64, 0)
        plan = fit_buckets(
            {**trace, prompt: 1}, **MEDIUM, budget=2 + 2 + extra, max_prefill_batch=1
        )
        assert plan.prices is not None
        fixed = {Bucket("decode", 64, 1, 64 * PER_SEQ)}
        optimum = brute_force_optimum(trace, fixed, extra, plan.prices)
        ratios.append(decode_objective(plan, trace, plan.prices) / optimum)

    assert sum(r <= 1 + 1e-9 for r in ratios) >= OPTIMAL_AT_LEAST, ratios
    assert max(ratios) <= WORST_RATIO, ratios


def test_fitted_lookup_ranks_buckets_by_the_trace_prices_not_by_batch_first():
    # A batch of 8 with 90 blocks: (8, 1000) holds it with 910 padded blocks, (16, 100) with 8
    # padded slots; with equal-weight ratios over this trace the second is far cheaper.
    plan = BucketPlan(
        "fitted",
        (),
        (Bucket("decode", 8, 1, 1000), Bucket("decode", 16, 1, 100)),
        prices=(1.0, 1.0, 1 / 8, 1 / 90),
    )
    assert plan.find_decode(8, 90) == Bucket("decode", 16, 1, 100)


def test_packed_context_extension_keeps_a_fitted_plan_and_its_prices():
    plan = fit(random_trace(7, steps=300), budget=40)

    assert step_layout.with_packed_context(plan) is plan


# ------------------------------------------------------------------------- through plan_from_env


def test_fitted_strategy_reads_the_trace_and_defaults_to_exps_graph_count(tmp_path):
    env = {"VLLM_PROMPT_BS_BUCKET_MAX": "4"}
    exp = plan_from_env(**MEDIUM, environ=env)
    trace = random_trace(8)
    env |= {
        "VLLM_BUCKETING_STRATEGY": "fitted",
        "VLLM_BUCKETING_TRACE": write_trace(tmp_path, trace),
    }

    plan = plan_from_env(**MEDIUM, environ=env)

    assert plan.strategy == "fitted"
    assert graph_count(plan.prompt, plan.decode) <= graph_count(exp.prompt, exp.decode)
    assert all(bucket_for(plan, s) is not None for s in trace)


def test_graph_budget_variable_caps_the_fitted_plan(tmp_path):
    env = {
        "VLLM_BUCKETING_STRATEGY": "fitted",
        "VLLM_BUCKETING_TRACE": write_trace(tmp_path, random_trace(9)),
        "VLLM_BUCKETING_GRAPH_BUDGET": "25",
    }
    plan = plan_from_env(**MEDIUM, environ=env)

    assert graph_count(plan.prompt, plan.decode) <= 25


def test_graph_budget_below_the_coverage_buckets_fails_naming_the_variable(tmp_path):
    env = {
        "VLLM_BUCKETING_STRATEGY": "fitted",
        "VLLM_BUCKETING_TRACE": write_trace(tmp_path, random_trace(10)),
        "VLLM_BUCKETING_GRAPH_BUDGET": "2",
        "VLLM_PROMPT_BS_BUCKET_MAX": "4",
    }
    with pytest.raises(EnvError, match=r"VLLM_BUCKETING_GRAPH_BUDGET=2 .* at least 5"):
        plan_from_env(**MEDIUM, environ=env)


def test_graph_budget_that_is_not_a_number_fails_under_any_strategy():
    with pytest.raises(EnvError, match="VLLM_BUCKETING_GRAPH_BUDGET"):
        plan_from_env(**MEDIUM, environ={"VLLM_BUCKETING_GRAPH_BUDGET": "many"})


def test_fitted_without_a_trace_fails_naming_the_variable():
    with pytest.raises(EnvError, match="VLLM_BUCKETING_TRACE=<file>"):
        plan_from_env(**MEDIUM, environ={"VLLM_BUCKETING_STRATEGY": "fitted"})


def test_missing_trace_file_fails_naming_the_variable_and_the_file(tmp_path):
    missing = str(tmp_path / "nowhere.txt")
    env = {"VLLM_BUCKETING_STRATEGY": "fitted", "VLLM_BUCKETING_TRACE": missing}
    with pytest.raises(EnvError, match=r"VLLM_BUCKETING_TRACE='.*nowhere\.txt' cannot be read"):
        plan_from_env(**MEDIUM, environ=env)


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("warmup 1 2 3", "is not prompt or decode"),
        ("prompt 1 128", "2 numbers after prompt"),
        ("decode 4 x", "not a whole number"),
        ("decode 8 4", "at least one block each"),
        ("prompt 0 128 0", "must be >= 1"),
    ],
)
def test_malformed_trace_line_fails_naming_the_variable_file_and_line(tmp_path, line, problem):
    path = tmp_path / "trace.txt"
    path.write_text(f"# a comment\ndecode 2 4 7\n{line}\n")
    with pytest.raises(EnvError, match=r"VLLM_BUCKETING_TRACE='.*trace\.txt', line 3") as err:
        read_trace(str(path))
    assert problem in str(err.value)


def test_trace_without_shapes_fails_naming_the_variable(tmp_path):
    path = tmp_path / "trace.txt"
    path.write_text("# nothing recorded yet\n")
    with pytest.raises(EnvError, match=r"VLLM_BUCKETING_TRACE=.* holds no step shapes"):
        read_trace(str(path))


def test_trace_reader_adds_up_repeated_lines_and_defaults_counts_to_one(tmp_path):
    path = tmp_path / "trace.txt"
    path.write_text("prompt 1 512 0 3\ndecode 4 9\nprompt 1 512 0 2  # again\ndecode 4 9 5\n")

    assert read_trace(str(path)) == {
        TracedShape("prompt", 1, 512, 0): 5,
        TracedShape("decode", 4, 1, 9): 6,
    }


def test_traced_shapes_beyond_the_engine_limits_are_dropped_with_a_warning(caplog):
    trace = Counter({TracedShape("decode", 2, 1, 5000): 3, TracedShape("decode", 2, 1, 10): 1})
    plan = fit(trace, budget=10)

    assert "dropped 1 traced shape(s) (3 steps)" in caplog.text
    assert plan.find_decode(2, 10) == Bucket("decode", 2, 1, 10)


def test_packed_rows_longer_than_max_model_len_are_fitted_not_dropped(caplog):
    # max_model_len 1024 under a 4096-token budget: a row packing several prompts can hold up to
    # 4096 new tokens. Traced, such rows are kept; untraced, the coverage bucket holds them.
    limits = {**MEDIUM, "max_model_len": 1024, "num_kv_blocks": None}
    trace = Counter({TracedShape("prompt", 1, 3000, 0): 5, TracedShape("decode", 4, 1, 20): 5})
    plan = fit_buckets(trace, **limits, budget=12, max_prefill_batch=1)
    assert "dropped" not in caplog.text
    traced = plan.find_prompt(1, 3000, 0)
    assert traced is not None and traced.query_len < 4096
    assert step_layout.packed_only(traced, 1024)
    assert plan.find_prompt(1, 4096, 0) is not None


# ------------------------------------------------------------------------------- the recorder


def test_step_shapes_split_prefill_and_decode_as_the_runner_looks_them_up():
    # Two prefills (300 new tokens on 200 cached, 100 new) and two decodes; block size 128.
    shapes = step_shapes([300, 100, 1, 1], [500, 100, 129, 40], 128, 4096, 4)

    assert shapes == [TracedShape("prompt", 2, 300, 2), TracedShape("decode", 2, 1, 3)]


def test_step_shapes_record_a_prefill_batch_the_runner_packs_as_one_row():
    # Two prefills of 3000 tokens cannot be a batch within 4096 tokens: one packed row.
    over_budget = step_shapes([3000, 3000], [3000, 3256], 128, 4096, 4)
    # With VLLM_PROMPT_BS_BUCKET_MAX=1 any two prefills are packed.
    over_batch = step_shapes([100, 200], [100, 456], 128, 4096, 1)

    assert over_budget == [TracedShape("prompt", 1, 6000, 2)]
    assert over_batch == [TracedShape("prompt", 1, 300, 2)]


def test_recorder_appends_counts_that_read_back_as_the_recorded_steps(tmp_path):
    path = str(tmp_path / "rec.txt")
    rec = TraceRecorder(path, block_size=128, max_num_batched_tokens=4096, max_prefill_batch=1)
    for _ in range(3):
        rec.record([1, 1], [10, 300])
    rec.record([512], [512])
    rec.close()

    assert read_trace(path) == {
        TracedShape("decode", 2, 1, 4): 3,
        TracedShape("prompt", 1, 512, 0): 1,
    }


def test_recorder_flushes_every_n_steps_and_appends_to_an_existing_trace(tmp_path):
    path = tmp_path / "rec.txt"
    path.write_text("decode 1 1 7\n")
    rec = TraceRecorder(
        str(path), block_size=16, max_num_batched_tokens=256, max_prefill_batch=1, flush_steps=2
    )
    rec.record([1], [5])
    assert read_trace(str(path)) == {TracedShape("decode", 1, 1, 1): 7}  # not flushed yet
    rec.record([1], [5])
    assert read_trace(str(path)) == {TracedShape("decode", 1, 1, 1): 9}
    rec.close()


def test_recorder_on_an_unwritable_path_fails_at_startup_naming_the_variable(tmp_path):
    with pytest.raises(EnvError, match=r"VLLM_BUCKETING_RECORD_TRACE=.* cannot be opened"):
        TraceRecorder(
            str(tmp_path / "no" / "such" / "dir.txt"),
            block_size=16,
            max_num_batched_tokens=256,
            max_prefill_batch=1,
        )


def test_a_recorded_trace_fits_a_plan_that_holds_every_recorded_step(tmp_path):
    path = str(tmp_path / "rec.txt")
    rec = TraceRecorder(path, block_size=128, max_num_batched_tokens=4096, max_prefill_batch=4)
    rng = random.Random(11)
    steps = []
    for _ in range(200):
        n = rng.randint(1, 8)
        queries = [rng.choice([1, 1, rng.randint(2, 400)]) for _ in range(n)]
        seqs = [q + rng.randint(0, 2000) for q in queries]
        rec.record(queries, seqs)
        steps.append((queries, seqs))
    rec.close()
    env = {
        "VLLM_BUCKETING_STRATEGY": "fitted",
        "VLLM_BUCKETING_TRACE": path,
        "VLLM_PROMPT_BS_BUCKET_MAX": "4",
    }
    plan = plan_from_env(**MEDIUM, environ=env)

    for queries, seqs in steps:
        layout = step_layout.plan_step(query_lens=queries, seq_lens=seqs, block_size=128, plan=plan)
        assert layout.warmed


def test_graph_count_adds_the_packed_variant_of_single_row_prompt_buckets_without_context():
    prompt = [
        Bucket("prompt", 1, 128, 0),  # + its packed variant
        Bucket("prompt", 1, 128, 4),  # packing shares the masked path with context: none
        Bucket("prompt", 2, 128, 0),  # several rows: none
        Bucket("prompt", 1, 1, 0),  # one token holds one sequence: none
        Bucket("prompt", 1, 128, 0),  # listed twice, warmed once
    ]
    decode = [Bucket("decode", 4, 1, 16)]

    assert graph_count(prompt, decode) == 4 + 1 + 1


def test_a_fit_whose_packed_variants_overrun_the_budget_gives_up_buckets_for_them():
    trace = Counter({TracedShape("prompt", 1, q, 0): 10 for q in (100, 300, 700, 1500, 2500)})
    trace[TracedShape("decode", 8, 1, 40)] = 100
    # Coverage: prefill batch 1 (the packed row), the largest decode: 2 buckets, no variant.
    plan = fit_buckets(trace, **MEDIUM, budget=6, max_prefill_batch=1)

    assert graph_count(plan.prompt, plan.decode) <= 6
    singles = [b for b in plan.prompt if b.batch_size == 1 and b.ctx_blocks == 0]
    assert singles and graph_count(plan.prompt, plan.decode) > len(plan.prompt) + len(plan.decode)


# ---------------------------------------------------- against exp on the benchmark's serving load

# The engines and the seeded serving simulation of benchmarks/bucketing.py (issue 31's goals).
ENGINE = {e.name: e for e in bucketing_benchmark.ENGINES}
COLUMNS = [f"waste_{c}" for c in bucketing_benchmark.COLUMNS]


def benchmark_rows(name: str, *strategies: str) -> dict[str, dict[str, float]]:
    """exp's row and each strategy's on the benchmark's trace of ``name`` (its 1000 requests:
    held out, a fit to fewer steps sees too few prefills with context)."""
    engine = ENGINE[name]
    steps = bucketing_benchmark.synthetic_trace(engine, 0, 1000)
    held_out = bucketing_benchmark.synthetic_trace(engine, 1, 1000)
    exp = bucketing_benchmark.measure(engine, "exp", steps, held_out)
    rows = {"exp": exp}
    for strategy in strategies:
        rows[strategy] = bucketing_benchmark.measure(
            engine, strategy, steps, held_out, bucketing_benchmark.graphs(exp)
        )
    return rows


@pytest.mark.parametrize("name", ["tiny", "tiny-64", "medium"])
def test_fitted_at_exps_graph_count_pads_every_column_at_most_half_as_much_as_exp(name):
    rows = benchmark_rows(name, "fitted")

    assert bucketing_benchmark.graphs(rows["fitted"]) <= bucketing_benchmark.graphs(rows["exp"])
    # Prompt context included: exp pads it by ~1% (tiny) to ~24% (medium).
    worse = {c: (rows["fitted"][c], rows["exp"][c]) for c in COLUMNS}
    assert all(f <= e / 2 for f, e in worse.values()), worse


def test_fitted_to_a_held_out_trace_pads_no_column_more_than_exp():
    rows = benchmark_rows("medium", "fitted/ho")

    worse = {c: (rows["fitted/ho"][c], rows["exp"][c]) for c in COLUMNS}
    assert all(f <= e for f, e in worse.values()), worse


def test_fitted_within_half_of_exps_graphs_pads_no_column_more_than_exp():
    rows = benchmark_rows("medium", "fitted@0.5")

    assert (
        bucketing_benchmark.graphs(rows["fitted@0.5"])
        <= bucketing_benchmark.graphs(rows["exp"]) // 2
    )
    worse = {c: (rows["fitted@0.5"][c], rows["exp"][c]) for c in COLUMNS}
    assert all(f <= e for f, e in worse.values()), worse


def test_an_untraced_prefill_context_pads_to_the_context_ladder_not_the_coverage_bucket():
    # Traced prefills have no context; one with 5 cached blocks (and the largest query) fits
    # the ladder's (1, 4096, 16), not the packed row's coverage bucket (1, 4096, 128).
    trace = Counter({TracedShape("prompt", 1, q, 0): 10 for q in (100, 300, 700, 1500)})
    trace[TracedShape("decode", 8, 1, 40)] = 100
    plan = fit_buckets(trace, **MEDIUM, budget=40, max_prefill_batch=1)

    assert plan.find_prompt(1, 4096, 5) == Bucket("prompt", 1, 4096, 16)
    assert plan.find_prompt(1, 4096, 17) == Bucket("prompt", 1, 4096, 64)


def test_the_context_ladder_gives_way_to_a_small_budget():
    trace = Counter({TracedShape("prompt", 1, 300, 0): 10, TracedShape("decode", 8, 1, 40): 10})
    # 2 coverage buckets and 4 left: too few for the ladder's 4 (contexts 1, 4, 16, 64) or 2
    # (1, 16) within a quarter of them; the traced shapes get theirs.
    plan = fit_buckets(trace, **MEDIUM, budget=6, max_prefill_batch=1)

    assert all(b.ctx_blocks in (0, 128) for b in plan.prompt), plan.prompt
    assert plan.find_prompt(1, 300, 0) == Bucket("prompt", 1, 300, 0)
