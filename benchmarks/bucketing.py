"""Bucketing strategies side by side on a synthetic serving trace.

For each strategy and a few engine configurations (up to a long-context one: max_model_len
131072, max_num_seqs 128) it prints the number of warmup graphs (prompt + decode buckets + the
packed-prefill variants of the single-row prompt buckets without context, which a model without
windowed layers captures too; see hpu_graphs.py), the
padding waste (padded / real, minus one: prompt tokens, prompt context blocks, decode batch slots,
decode KV blocks), the share of steps that fit no bucket (each would be a graph compilation while
serving) and the time to build the plan.

Strategies: exp, lin, pad (generated from the engine limits) and fitted, twice: ``fitted`` is fitted
to the very trace it is measured on (the step shapes a VLLM_BUCKETING_RECORD_TRACE recording of
this load gives), ``fitted/ho`` to a trace of the same load with another seed (held out: how the
buckets do on steps they were not fitted to). Both within the default budget: exp's graph count;
``fitted@0.5`` (and ``fitted@0.5/ho``) within half of it, ``fitted@0.25`` (and
``fitted@0.25/ho``) within a quarter (VLLM_BUCKETING_GRAPH_BUDGET). Each engine's summary line
says which of issue 31's and issue 55's padding goals its rows meet (a quarter of the graphs, no
column worse than exp, fitted and held out), and for a column a quarter cannot hold, the
smallest graph fraction of NEEDED_FRACTIONS at which it does; the last line is one
JSON object of every row's figures (graphs, the four padding ratios, outside share, plan seconds)
for scripts.

The trace is seeded and simulates a simple Gaudi-style scheduler: requests arrive at random
(Poisson), prompt and output lengths are log-normal, some prompts hit a cached prefix, prefills
run in their own steps (up to VLLM_PROMPT_BS_BUCKET_MAX sequences, chunked to share the token
budget) and every running sequence decodes one token per decode step.

    python benchmarks/bucketing.py [--requests N] [--long-requests N] [--seed S]
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import os
import random
import tempfile
import time
from collections import Counter, deque
from dataclasses import dataclass

from vllm_gaudi_platform.bucketing import Bucket, BucketPlan, can_pack, plan_from_env
from vllm_gaudi_platform.observability.step_trace import TracedShape, format_line

STRATEGIES = (
    "exp",
    "lin",
    "pad",
    "fitted",
    "fitted/ho",
    "fitted@0.5",
    "fitted@0.5/ho",
    "fitted@0.25",
    "fitted@0.25/ho",
)
# Graph fractions tried, smallest first, when a quarter of exp's graphs leaves a padding column
# worse than exp's: the report names the column and the fraction it needs.
NEEDED_FRACTIONS = (0.3, 0.35, 0.4, 0.45, 0.5)
COLUMNS = ("prompt", "ctx", "bs", "blocks")  # the padding columns, in the table's order


@dataclass(frozen=True)
class Engine:
    name: str
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int | None
    prefill_batch: int  # VLLM_PROMPT_BS_BUCKET_MAX
    long: bool = False  # trace length from --long-requests


ENGINES = (
    Engine("tiny", 16, 2048, 512, 128, None, 1),
    Engine("tiny-64", 64, 2048, 512, 128, None, 1),
    Engine("medium", 64, 4096, 4096, 128, 2048, 4),
    Engine("long", 128, 8192, 131072, 128, None, 4, long=True),
)


@dataclass
class Request:
    arrival: float
    prompt_len: int
    output_len: int
    computed: int = 0  # prompt tokens already in the KV cache
    generated: int = 0


@dataclass(frozen=True)
class Step:
    phase: str
    batch_size: int
    query_len: int  # longest query of the batch (1 for decode)
    ctx_blocks: int  # prompt: largest context of a sequence; decode: blocks of the whole batch
    real_tokens: int


def _requests(engine: Engine, rng: random.Random, count: int) -> list[Request]:
    mml = engine.max_model_len
    mean_output = mml / 8
    # Arrival rate that keeps the batch well below full most of the time, so batch sizes vary.
    rate = 0.6 * engine.max_num_seqs / mean_output
    t, out = 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate)
        prompt = min(max(1, int(rng.lognormvariate(math.log(mml / 6), 0.8))), mml - 2)
        output = min(max(1, int(rng.lognormvariate(math.log(mean_output), 0.9))), mml - prompt)
        req = Request(t, prompt, output)
        full_blocks = (prompt - 1) // engine.block_size
        if full_blocks and rng.random() < 0.3:  # prefix-cache hit on whole blocks
            req.computed = rng.randint(1, full_blocks) * engine.block_size
        out.append(req)
    return out


def synthetic_trace(engine: Engine, seed: int, count: int) -> list[Step]:
    rng = random.Random(seed)
    pending = deque(_requests(engine, rng, count))
    waiting: deque[Request] = deque()
    running: list[Request] = []
    steps: list[Step] = []
    clock = 0
    bs = engine.block_size
    while pending or waiting or running:
        clock += 1
        while pending and pending[0].arrival <= clock:
            waiting.append(pending.popleft())
        free = engine.max_num_seqs - len(running)
        if waiting and free > 0:
            batch = list(waiting)[: min(rng.randint(1, engine.prefill_batch), free)]
            share = engine.max_num_batched_tokens // len(batch)
            queries = [min(r.prompt_len - r.computed, share) for r in batch]
            ctx = max(math.ceil(r.computed / bs) for r in batch)
            steps.append(Step("prompt", len(batch), max(queries), ctx, sum(queries)))
            for r, q in zip(batch, queries):
                r.computed += q
                if r.computed == r.prompt_len:
                    waiting.remove(r)
                    running.append(r)
        if running:
            blocks = sum(math.ceil((r.prompt_len + r.generated + 1) / bs) for r in running)
            steps.append(Step("decode", len(running), 1, blocks, len(running)))
            for r in running:
                r.generated += 1
            running = [r for r in running if r.generated < r.output_len]
    return steps


def write_trace(steps: list[Step], path: str) -> None:
    """The trace file VLLM_BUCKETING_RECORD_TRACE would have written for these steps."""
    counts = Counter(TracedShape(s.phase, s.batch_size, s.query_len, s.ctx_blocks) for s in steps)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(format_line(shape, n) for shape, n in counts.items())


class Finder:
    """The plan's own lookups; for plans too large to scan per step (lin at long context), the
    same answer through the grid: there the fitting bucket with the least padding is the one that
    rounds each dimension up (the plan's lookup ranks by a cost monotone in every dimension)."""

    SCAN_LIMIT = 5000

    def __init__(self, plan: BucketPlan) -> None:
        self.plan = plan
        self.grid = len(plan.prompt) + len(plan.decode) > self.SCAN_LIMIT
        if self.grid:
            self.p_bs = sorted({b.batch_size for b in plan.prompt})
            self.p_q = sorted({b.query_len for b in plan.prompt})
            self.p_ctx: dict[tuple[int, int], list[int]] = {}
            for b in plan.prompt:
                self.p_ctx.setdefault((b.batch_size, b.query_len), []).append(b.ctx_blocks)
            self.d_bs = sorted({b.batch_size for b in plan.decode})
            self.d_blocks: dict[int, list[int]] = {}
            for b in plan.decode:
                self.d_blocks.setdefault(b.batch_size, []).append(b.ctx_blocks)
            for values in (*self.p_ctx.values(), *self.d_blocks.values()):
                values.sort()

    @staticmethod
    def _up(values: list[int], x: int) -> int | None:
        i = bisect.bisect_left(values, x)
        return values[i] if i < len(values) else None

    def prompt(self, batch: int, query: int, ctx: int) -> Bucket | None:
        if not self.grid:
            return self.plan.find_prompt(batch, query, ctx)
        b, q = self._up(self.p_bs, batch), self._up(self.p_q, query)
        c = self._up(self.p_ctx.get((b, q), []), ctx) if b and q else None
        if c is None:  # the round-up bucket is over the token budget: none fits
            return self.plan.find_prompt(batch, query, ctx)
        return Bucket("prompt", b, q, c)  # type: ignore[arg-type]

    def decode(self, batch: int, blocks: int) -> Bucket | None:
        if not self.grid:
            return self.plan.find_decode(batch, blocks)
        b = self._up(self.d_bs, batch)
        c = self._up(self.d_blocks.get(b, []), blocks) if b else None
        if c is None:
            return self.plan.find_decode(batch, blocks)
        return Bucket("decode", b, 1, c)  # type: ignore[arg-type]


def graphs(m: dict[str, float]) -> int:
    """Warmup graphs of a measured plan (``graph_count``)."""
    return int(m["prompt_graphs"] + m["decode_graphs"] + m["packed_graphs"])


def plan_for(
    engine: Engine, strategy: str, fit_to: list[Step], exp_graphs: int | None = None
) -> BucketPlan:
    """The plan of ``strategy`` (a strategy name; ``fitted`` may carry ``@F``, a graph budget of F
    times ``exp_graphs``) for ``engine``; fitted plans are fitted to the steps ``fit_to``."""
    name, _, budget = strategy.partition("@")
    environ = {
        "VLLM_BUCKETING_STRATEGY": name,
        "VLLM_PROMPT_BS_BUCKET_MAX": str(engine.prefill_batch),
    }
    if budget:
        assert exp_graphs is not None, "a fractional budget needs exp's graph count"
        environ["VLLM_BUCKETING_GRAPH_BUDGET"] = str(int(float(budget) * exp_graphs))
    with tempfile.TemporaryDirectory() as tmp:
        if name == "fitted":
            path = os.path.join(tmp, "trace.txt")
            write_trace(fit_to, path)
            environ["VLLM_BUCKETING_TRACE"] = path
        return plan_from_env(
            max_num_seqs=engine.max_num_seqs,
            max_num_batched_tokens=engine.max_num_batched_tokens,
            max_model_len=engine.max_model_len,
            block_size=engine.block_size,
            num_kv_blocks=engine.num_kv_blocks,
            environ=environ,
        )


def measure(
    engine: Engine,
    strategy: str,
    steps: list[Step],
    held_out: list[Step],
    exp_graphs: int | None = None,
) -> dict[str, float]:
    """One row: ``strategy`` is a strategy name; ``fitted`` may carry ``@F`` (a graph budget of F
    times ``exp_graphs``, default exp's count) and ``/ho`` (fitted to ``held_out``, measured on
    ``steps``)."""
    start = time.perf_counter()
    plan = plan_for(
        engine,
        strategy.split("/")[0],
        held_out if strategy.endswith("/ho") else steps,
        exp_graphs,
    )
    plan_seconds = time.perf_counter() - start
    find = Finder(plan)
    real = {"prompt": 0, "ctx": 0, "bs": 0, "blocks": 0}
    padded = {"prompt": 0, "ctx": 0, "bs": 0, "blocks": 0}
    outside = {"prompt": 0, "decode": 0}
    for s in steps:
        if s.phase == "prompt":
            bucket = find.prompt(s.batch_size, s.query_len, s.ctx_blocks)
            if bucket is None:
                outside["prompt"] += 1
                continue
            real["prompt"] += s.real_tokens
            padded["prompt"] += bucket.batch_size * bucket.query_len
            real["ctx"] += s.batch_size * s.ctx_blocks
            padded["ctx"] += bucket.batch_size * bucket.ctx_blocks
        else:
            bucket = find.decode(s.batch_size, s.ctx_blocks)
            if bucket is None:
                outside["decode"] += 1
                continue
            real["bs"] += s.batch_size
            padded["bs"] += bucket.batch_size
            real["blocks"] += s.ctx_blocks
            padded["blocks"] += bucket.ctx_blocks
    waste = {k: (padded[k] / real[k] - 1) if real[k] else float("nan") for k in real}
    return {
        "prompt_graphs": len(plan.prompt),
        "decode_graphs": len(plan.decode),
        "packed_graphs": sum(can_pack(b) and b.ctx_blocks == 0 for b in plan.prompt),
        **{f"waste_{k}": v for k, v in waste.items()},
        "outside": sum(outside.values()) / len(steps),
        "outside_prompt": outside["prompt"],
        "outside_decode": outside["decode"],
        "plan_seconds": plan_seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000, help="requests per engine trace")
    parser.add_argument(
        "--long-requests", type=int, default=200, help="requests of the long-context trace"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the measured trace")
    args = parser.parse_args()

    header = (
        f"{'engine':<8} {'strategy':<13} {'graphs (P+D+packed)':>20} {'prompt tok pad':>15} "
        f"{'prompt ctx pad':>15} {'decode bs pad':>14} {'decode blk pad':>15} "
        f"{'outside (P/D steps)':>20} {'plan s':>7}"
    )
    print(header)
    print("-" * len(header))
    figures: dict[str, dict[str, dict[str, float]]] = {}
    for engine in ENGINES:
        count = args.long_requests if engine.long else args.requests
        steps = synthetic_trace(engine, args.seed, count)
        held_out = synthetic_trace(engine, args.seed + 1, count)
        rows = figures[engine.name] = {}
        exp_graphs = None
        for strategy in STRATEGIES:
            m = measure(engine, strategy, steps, held_out, exp_graphs)
            if strategy == "exp":
                exp_graphs = graphs(m)
            p, d, k = m["prompt_graphs"], m["decode_graphs"], m["packed_graphs"]
            rows[strategy] = {
                "graphs": graphs(m),
                **{f"pad_{c}": round(m[f"waste_{c}"], 4) for c in COLUMNS},
                "outside": round(m["outside"], 6),
                "plan_seconds": round(m["plan_seconds"], 3),
            }
            outside = f"{m['outside']:.2%} ({m['outside_prompt']}/{m['outside_decode']})"
            print(
                f"{engine.name:<8} {strategy:<13} {f'{graphs(m)} ({p}+{d}+{k})':>20} "
                f"{m['waste_prompt']:>+15.1%} {m['waste_ctx']:>+15.1%} {m['waste_bs']:>+14.1%} "
                f"{m['waste_blocks']:>+15.1%} {outside:>20} {m['plan_seconds']:>7.3f}"
            )
        assert exp_graphs is not None
        needed = needed_fractions(engine, steps, held_out, rows, exp_graphs)
        if needed:
            rows["needed_fraction"] = needed  # type: ignore[assignment]
        prompts = sum(s.phase == "prompt" for s in steps)
        print(
            f"{'':<8} {engine.name}: max_num_seqs={engine.max_num_seqs} "
            f"max_num_batched_tokens={engine.max_num_batched_tokens} "
            f"max_model_len={engine.max_model_len} block_size={engine.block_size} "
            f"num_kv_blocks={engine.num_kv_blocks}\n{'':<9}"
            f"VLLM_PROMPT_BS_BUCKET_MAX={engine.prefill_batch}; {len(steps)} steps "
            f"({prompts} prompt); {goals(rows)}"
        )
        for column, fraction in needed.items():
            at = f"{fraction} of exp's graphs" if fraction else f"more than {NEEDED_FRACTIONS[-1]}"
            print(f"{'':<9}{column} padding is no worse than exp's at {at}")
    print(
        "pad = padded / real - 1 over the steps that fit a bucket (prompt ctx: batch * context\n"
        "blocks of the bucket vs of the step); outside = steps that fit no bucket (a\n"
        "multi-sequence prefill whose padded batch_size * query_len exceeds the token budget\n"
        "fits none: the runner must split it); plan s = seconds to build the plan (fitted:\n"
        "reading the trace file and fitting). fitted: fitted to the measured trace within exp's\n"
        "graph count; fitted@0.5 / @0.25: within a half / a quarter of it; /ho: fitted to a\n"
        "trace of the same load with seed + 1 (held out) and measured on this one. Goals:\n"
        "fitted <= exp/2 in every column, fitted/ho <= exp, fitted@0.5 <= exp (issue 31);\n"
        "fitted@0.25 and fitted@0.25/ho <= exp (issue 55; medium and long)."
    )
    print(json.dumps({"bucketing": figures}, sort_keys=True))


def worse_columns(rows: dict[str, dict[str, float]], strategy: str, factor: float = 1) -> list[str]:
    """The padding columns in which ``strategy``'s row pads more than ``factor`` times exp's."""
    exp = rows["exp"]
    return [c for c in COLUMNS if rows[strategy][f"pad_{c}"] > factor * exp[f"pad_{c}"]]


def goals(rows: dict[str, dict[str, float]]) -> str:
    """Which of issue 31's and 55's padding goals an engine's rows meet, e.g.
    ``fitted<=exp/2 yes``; a goal missed names its columns."""

    def within(strategy: str, factor: float) -> str:
        worse = worse_columns(rows, strategy, factor)
        return "yes" if not worse else f"no ({'/'.join(worse)})"

    return (
        f"fitted<=exp/2 {within('fitted', 0.5)}, fitted/ho<=exp {within('fitted/ho', 1)}, "
        f"fitted@0.5<=exp {within('fitted@0.5', 1)}, fitted@0.25<=exp "
        f"{within('fitted@0.25', 1)}, fitted@0.25/ho<=exp {within('fitted@0.25/ho', 1)}"
    )


def needed_fractions(
    engine: Engine,
    steps: list[Step],
    held_out: list[Step],
    rows: dict[str, dict[str, float]],
    exp_graphs: int,
) -> dict[str, float | None]:
    """For each column a quarter of exp's graphs pads more than exp does (fitted to the measured
    trace or to the held-out one): the smallest fraction of NEEDED_FRACTIONS at which neither
    does (None: not even at the largest)."""
    worse = set(worse_columns(rows, "fitted@0.25") + worse_columns(rows, "fitted@0.25/ho"))
    needed: dict[str, float | None] = {c: None for c in COLUMNS if c in worse}
    for fraction in NEEDED_FRACTIONS:
        if all(v is not None for v in needed.values()):
            break
        trial = dict(rows)
        for suffix in ("", "/ho"):
            m = measure(engine, f"fitted@{fraction}{suffix}", steps, held_out, exp_graphs)
            trial[f"trial{suffix}"] = {f"pad_{c}": m[f"waste_{c}"] for c in COLUMNS}
        still = set(worse_columns(trial, "trial") + worse_columns(trial, "trial/ho"))
        for c in needed:
            if needed[c] is None and c not in still:
                needed[c] = fraction
    return needed


if __name__ == "__main__":
    main()
