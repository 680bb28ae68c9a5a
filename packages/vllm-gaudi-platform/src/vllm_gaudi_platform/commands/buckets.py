"""`vllm-gaudi buckets`: the buckets each strategy would warm for a set of engine limits, how
many graphs that is, and the padding a recorded trace would see with each, without an engine.

An operator picks a strategy and a graph budget here before a warmup that takes half an hour on
a Gaudi. The first row is the plan the engine would build with the current environment (its
VLLM_BUCKETING_* and VLLM_PROMPT_* settings, a bucket file included); the others are exp, lin
and pad with the same settings, and, given a trace (VLLM_BUCKETING_RECORD_TRACE writes one while
serving), fitted within exp's graph count and within each fraction of it. Imports neither vllm
nor torch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from vllm_gaudi_platform.attention import step_layout
from vllm_gaudi_platform.bucketing import (
    DEFAULT_STRATEGY,
    FITTED_STRATEGY,
    Bucket,
    BucketPlan,
    can_pack,
    graph_count,
    padding_ratios,
    plan_from_env,
    trace_padding,
)
from vllm_gaudi_platform.envs import (
    VLLM_BUCKETING_FROM_FILE,
    VLLM_BUCKETING_GRAPH_BUDGET,
    VLLM_BUCKETING_STRATEGY,
    VLLM_BUCKETING_TRACE,
    EnvError,
)
from vllm_gaudi_platform.observability.step_trace import TracedShape, read_trace

GENERATED = ("exp", "lin", "pad")
COLUMNS = ("prompt tok", "prompt ctx", "decode bs", "decode blk")
# Settings a row sets itself (the configured row keeps the environment's).
ROW_SETTINGS = (
    VLLM_BUCKETING_FROM_FILE,
    VLLM_BUCKETING_STRATEGY,
    VLLM_BUCKETING_GRAPH_BUDGET,
    VLLM_BUCKETING_TRACE,
)


FOOTER = """
graphs: what warmup compiles for a decoder without state layers: prompt and decode buckets (the
runner's packed-row buckets included) and the packed-prefill variants of single-row prompt
buckets without context; speculative decoding adds its verification buckets.
fitted (N), fitted@F (N): fitted to the trace within N graphs (VLLM_BUCKETING_STRATEGY=fitted
VLLM_BUCKETING_TRACE=<trace> VLLM_BUCKETING_GRAPH_BUDGET=<N>); N is exp's count, or F times it,
before the runner's packed-row buckets (a fitted plan holds its own).
pad: padded / traced - 1 per column (-: the trace has none); outside: trace steps no bucket
holds, each a graph compiled while serving."""


@dataclass(frozen=True)
class EngineLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int = 128
    num_kv_blocks: int | None = None

    def __str__(self) -> str:
        kv = self.num_kv_blocks if self.num_kv_blocks is not None else "not capped"
        return (
            f"max_num_seqs={self.max_num_seqs} max_num_batched_tokens="
            f"{self.max_num_batched_tokens} max_model_len={self.max_model_len} block_size="
            f"{self.block_size} num_kv_blocks={kv}"
        )


@dataclass
class Row:
    """One plan: its buckets, and on the trace its padding per column and the steps no bucket
    holds (each would compile a graph while serving)."""

    label: str
    plan: BucketPlan | None
    error: str | None = None
    padding: list[float | None] = field(default_factory=list)  # None: the trace has none
    outside: int = 0
    strategy_graphs: int = 0  # before the runner's packed-row buckets: what budgets count

    @property
    def graphs(self) -> int:
        return graph_count(self.plan.prompt, self.plan.decode) if self.plan else 0

    def to_json(self) -> dict:
        if self.plan is None:
            return {"plan": self.label, "error": self.error}
        p = self.plan
        return {
            "plan": self.label,
            "graphs": self.graphs,
            "prompt_buckets": len(p.prompt),
            "decode_buckets": len(p.decode),
            "packed_variants": sum(can_pack(b) and b.ctx_blocks == 0 for b in p.prompt),
            "padding": dict(zip(COLUMNS, self.padding)) if self.padding else None,
            "outside_steps": self.outside,
            "prompt": [[b.batch_size, b.query_len, b.ctx_blocks] for b in p.prompt],
            "decode": [[b.batch_size, b.ctx_blocks] for b in p.decode],
        }


def _row(label: str, limits: EngineLimits, environ: Mapping[str, str]) -> Row:
    """The plan as the model runner warms it for a decoder without state layers: the strategy's
    buckets, and for a generated plan the packed-prefill rows' buckets the runner adds."""
    try:
        plan = plan_from_env(
            max_num_seqs=limits.max_num_seqs,
            max_num_batched_tokens=limits.max_num_batched_tokens,
            max_model_len=limits.max_model_len,
            block_size=limits.block_size,
            num_kv_blocks=limits.num_kv_blocks,
            environ=environ,
        )
    except EnvError as exc:  # this row's settings do not make a plan: say why, keep the others
        return Row(label, None, str(exc))
    warmed = step_layout.with_packed_context(
        plan, packed_rows=(limits.max_num_batched_tokens, limits.max_model_len)
    )
    return Row(label, warmed, strategy_graphs=graph_count(plan.prompt, plan.decode))


def _trace_figures(
    plan: BucketPlan, shapes: Counter[TracedShape]
) -> tuple[list[float | None], int]:
    """The plan's padding per column on the trace (None where the trace has none of a column's
    units) and the trace's steps no bucket holds, in one pass of lookups."""
    missed: list[int] = []

    def find_prompt(batch: int, query: int, ctx: int) -> Bucket | None:
        bucket = plan.find_prompt(batch, query, ctx)
        if bucket is None:
            missed.append(shapes[TracedShape("prompt", batch, query, ctx)])
        return bucket

    def find_decode(batch: int, blocks: int) -> Bucket | None:
        bucket = plan.find_decode(batch, blocks)
        if bucket is None:
            missed.append(shapes[TracedShape("decode", batch, 1, blocks)])
        return bucket

    real, padded = trace_padding(shapes, find_prompt, find_decode)
    ratios = padding_ratios(real, padded)
    return [r if units else None for r, units in zip(ratios, real)], sum(missed)


def rows(
    limits: EngineLimits,
    environ: Mapping[str, str],
    trace: str | None = None,
    fractions: Sequence[float] = (0.5, 0.25),
) -> tuple[list[Row], Counter[TracedShape] | None]:
    """Every row, measured on the trace at ``trace`` when given (EnvError when it is unusable)."""
    shapes = read_trace(trace) if trace else None
    configured = environ.get(VLLM_BUCKETING_FROM_FILE) or environ.get(
        VLLM_BUCKETING_STRATEGY, DEFAULT_STRATEGY
    )
    base = {k: v for k, v in environ.items() if k not in ROW_SETTINGS}
    result = [_row(f"configured ({configured})", limits, environ)]
    result += [_row(name, limits, {**base, VLLM_BUCKETING_STRATEGY: name}) for name in GENERATED]
    exp_graphs = result[1].strategy_graphs
    if trace and exp_graphs:
        fitted = {**base, VLLM_BUCKETING_STRATEGY: FITTED_STRATEGY, VLLM_BUCKETING_TRACE: trace}
        result.append(_row(f"fitted ({exp_graphs})", limits, fitted))
        for fraction in fractions:
            budget = int(fraction * exp_graphs)
            env = {**fitted, VLLM_BUCKETING_GRAPH_BUDGET: str(budget)}
            result.append(_row(f"fitted@{fraction:g} ({budget})", limits, env))
    if shapes is not None:
        for row in result:
            if row.plan is not None:
                row.padding, row.outside = _trace_figures(row.plan, shapes)
    return result, shapes


def render(
    limits: EngineLimits,
    table: list[Row],
    shapes: Counter[TracedShape] | None,
    trace: str | None,
    listed: str | None = None,
) -> str:
    lines = [f"Bucket plans for {limits}"]
    if shapes is not None:
        prompts = sum(n for s, n in shapes.items() if s.phase == "prompt")
        total = sum(shapes.values())
        lines.append(f"trace {trace}: {total} steps ({prompts} prompt, {total - prompts} decode)")
    head = f"{'plan':<22} {'graphs':>6} {'prompt':>6} {'decode':>6} {'packed':>6}"
    if shapes is not None:
        head += "".join(f" {c + ' pad':>15}" for c in COLUMNS) + f" {'outside':>8}"
    lines += ["", head, "-" * len(head)]
    for row in table:
        if row.plan is None:
            lines.append(f"{row.label:<22} refused: {row.error}")
            continue
        packed = row.graphs - len(row.plan.prompt) - len(row.plan.decode)
        line = (
            f"{row.label:<22} {row.graphs:>6} {len(row.plan.prompt):>6} "
            f"{len(row.plan.decode):>6} {packed:>6}"
        )
        if row.padding:
            cells = (f"{p:+.1%}" if p is not None else "-" for p in row.padding)
            line += "".join(f" {c:>15}" for c in cells) + f" {row.outside:>8}"
        lines.append(line)
    lines.append(FOOTER)
    if listed is not None:
        chosen = [r for r in table if r.plan is not None and r.label.split(" ")[0] == listed]
        if not chosen:
            names = sorted({r.label.split(" ")[0] for r in table if r.plan is not None})
            lines.append(f"\nno plan named {listed!r} to list; one of: {', '.join(names)}")
        for row in chosen:
            assert row.plan is not None
            lines.append(f"\n{row.label}: prompt buckets (batch, query, context blocks)")
            lines += [f"  {b.batch_size} {b.query_len} {b.ctx_blocks}" for b in row.plan.prompt]
            lines.append(f"{row.label}: decode buckets (batch, blocks of the batch)")
            lines += [f"  {b.batch_size} {b.ctx_blocks}" for b in row.plan.decode]
    return "\n".join(lines)
