"""Host time per decode step: the HPU runner (CPU emulation) vs vLLM's CPU runner, side by side.

What a Gaudi cannot hide is the host work around each forward pass: scheduling, input
preparation, attention metadata, bucket padding, sampling and output processing. This measures
it with a model so small that the forward pass is a small share of the step: the tiny Llama of
``gaudi_testkit.tinymodels`` (2 layers, hidden 128), at 1, 32 and 256 decode sequences
with 2k-token contexts.

Each backend runs in its own process (vLLM picks its platform once per process), with the engine
core in that process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the model's forward can be timed
from outside. Per batch size: every sequence is a shared 2048-token prefix (computed once, then
a prefix-cache hit) plus a distinct 8-token tail. ``generate(max_tokens=1)`` and
``generate(max_tokens=1 + D)`` are both timed; their difference over ``D`` is one decode step.
The device work of those steps (wrappers around the model's ``forward`` and ``compute_logits``
and the sampler's ``forward``: what runs on a Gaudi's device) is subtracted to give the host
time. HPU warmup is skipped (``VLLM_SKIP_WARMUP``), so steps run without HPU graphs: this
measures the runner's host work, not graph replay.

Two HPU runs: vLLM's default async scheduling (what serves on a Gaudi, where the host prepares
step N+1 while the device runs step N; on a CPU nothing overlaps, so it only adds bookkeeping),
and async scheduling off, which is how vLLM's CPU runner always runs (its platform forces it
off): that row is the like-for-like ratio. Sampling is random (temperature 1) by default; there
vLLM's CPU backend draws with a fused C++ kernel (``fused_gumbel_argmax``) where the HPU platform
runs vLLM's torch sampler; both count as device work, and ``--greedy`` runs argmax on both.

    python benchmarks/host_overhead.py [--batches 1,32,256] [--decode-steps 16] [--greedy]
    python benchmarks/host_overhead.py --breakdown  # + ms per step in each runner phase
    python benchmarks/host_overhead.py --profile    # + cProfile of the largest batch's decode steps

Run it alone (it loads both cores). Goal: HPU host ms per step <= 1.0x vLLM's CPU runner.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# (label, backend, engine arguments): the runs of one benchmark, side by side.
RUNS = (
    ("hpu async", "hpu-emulation", {}),
    ("hpu sync", "hpu-emulation", {"async_scheduling": False}),
    ("cpu", "cpu", {}),
)
CONTEXT = 2048  # default prefix length (--context)
TAIL = 8
TARGET = 1.0


def run_worker(job: dict) -> None:
    """One backend: for each batch size, (step ms, device ms) of a decode step."""
    import random

    from vllm import LLM, SamplingParams

    max_batch = max(job["batches"])
    llm = LLM(
        model=job["model"],
        dtype="float32",
        max_model_len=job["context"] + TAIL + job["decode_steps"] + 8,
        max_num_seqs=max_batch,
        max_num_batched_tokens=max(job["context"] + TAIL, max_batch * TAIL),
        kv_cache_memory_bytes=1 << 30,
        enable_prefix_caching=True,
        hf_overrides={"max_position_embeddings": 4 * max(job["context"], CONTEXT)},
        seed=0,
        **job["engine"],
    )
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    # Device work, on a Gaudi: the model's forward, the LM head and the sampler's kernels. The
    # sampler differs most: vLLM's CPU backend draws with its fused C++ kernel, the HPU platform
    # runs vLLM's torch sampler (as on a Gaudi). Both sides subtract the same three.
    device_seconds: dict[str, float] = {"device": 0.0}
    for owner, name in (
        (runner.model, "forward"),
        (runner.model, "compute_logits"),
        (runner.sampler, "forward"),
    ):
        _wrap(owner, name, device_seconds, "device")
    phases = _instrument(llm, runner) if job.get("breakdown") else {}
    decode_profiler = _decode_profiler(llm) if job.get("profile") else None

    rng = random.Random(0)
    prefix = [rng.randrange(3, 500) for _ in range(job["context"])]

    def timed(prompts: list, max_tokens: int) -> tuple[float, float, dict[str, float]]:
        params = SamplingParams(
            max_tokens=max_tokens,
            ignore_eos=True,
            detokenize=False,
            temperature=job["temperature"],
        )
        p0 = dict(phases)
        f0, t0 = device_seconds["device"], time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        spent = {k: v - p0.get(k, 0.0) for k, v in phases.items()}
        return time.perf_counter() - t0, device_seconds["device"] - f0, spent

    results = {}
    for batch in job["batches"]:
        prompts = [
            {"prompt_token_ids": prefix + [rng.randrange(3, 500) for _ in range(TAIL)]}
            for _ in range(batch)
        ]
        # Untimed: caches the prompts' blocks (both timed runs then hit the cache) and meets every
        # step shape once (vLLM's CPU backend compiles its model for new shapes on first use).
        timed(prompts, 1 + job["decode_steps"])
        t1, f1, p1 = timed(prompts, 1)
        profile = decode_profiler if batch == max_batch else None
        if profile is not None:
            profile.armed = True
        t2, f2, p2 = timed(prompts, 1 + job["decode_steps"])
        if profile is not None:
            profile.profiler.disable()
            _print_profile(profile.profiler, batch, job["decode_steps"])
        d = job["decode_steps"]
        step = (t2 - t1) / d
        device = (f2 - f1) / d
        results[str(batch)] = {
            "step_ms": 1e3 * step,
            "device_ms": 1e3 * device,
            "phases_ms": {k: 1e3 * (p2[k] - p1.get(k, 0.0)) / d for k in p2},
        }
    print("RESULT " + json.dumps(results), flush=True)


# Phases of a step, timed by wrapping the named method of the runner (or of the engine core's
# scheduler, or of the output processor). Nested: execute_model holds the runner phases before
# the forward; sample_tokens holds sampling and bookkeeping.
RUNNER_PHASES = (
    "execute_model",
    "_update_states",
    "_prepare_inputs",
    "_determine_batch_execution_and_padding",
    "_get_slot_mappings",
    "_build_attention_metadata",
    "_preprocess",
    "_model_forward",
    "sample_tokens",
    "_sample",
    "_bookkeeping_sync",
)


def _wrap(obj, name: str, seconds: dict[str, float], key: str) -> None:
    """Add the seconds spent in obj.name to seconds[key] (an instance attribute wraps the
    method; the class is untouched)."""
    original = getattr(obj, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - start

    setattr(obj, name, timed)


def _instrument(llm, runner) -> dict[str, float]:
    """Seconds spent in each phase of the step, summed over every step (benchmark-only
    wrappers on instance attributes; the classes are untouched)."""
    phases: dict[str, float] = {}
    for name in RUNNER_PHASES:
        if hasattr(runner, name):
            _wrap(runner, name, phases, name)
    _wrap(runner.model, "compute_logits", phases, "compute_logits")
    core = llm.llm_engine.engine_core.engine_core
    _wrap(core.scheduler, "schedule", phases, "scheduler.schedule")
    _wrap(core.scheduler, "update_from_output", phases, "scheduler.update_from_output")
    _wrap(llm.llm_engine.output_processor, "process_outputs", phases, "process_outputs")
    _wrap(core, "step_fn", phases, "engine_core.step")
    return phases


class _DecodeProfiler:
    """cProfile over the decode steps of one generate() call: armed before the call, it starts
    when the first step's (the prefill's) update_from_output returns and is stopped by the
    caller after the call, so the prompt's prefill and its attention masks stay out of it."""

    def __init__(self) -> None:
        import cProfile

        self.profiler = cProfile.Profile()
        self.armed = False


def _decode_profiler(llm) -> _DecodeProfiler:
    state = _DecodeProfiler()
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    update = scheduler.update_from_output

    def update_then_start(*args, **kwargs):
        try:
            return update(*args, **kwargs)
        finally:
            if state.armed:
                state.armed = False
                state.profiler.enable()

    scheduler.update_from_output = update_then_start
    return state


def _print_profile(profiler, batch: int, steps: int) -> None:
    import io
    import pstats

    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)
    print(
        f"PROFILE batch {batch}, its {steps} decode steps (from the end of the prefill step), "
        f"top 30 by own time, top 40 cumulative\n{out.getvalue()}",
        file=sys.stderr,
    )


def run_backend(label: str, backend: str, job: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if backend == "hpu-emulation":
        env["VLLM_HPU_EMULATION"] = "cpu"
        env["VLLM_SKIP_WARMUP"] = "true"
    else:
        env["VLLM_PLUGINS"] = ""  # vLLM's own CPU platform, none of ours
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(job)],
        env=env,
        capture_output=True,
        text=True,
    )
    if job.get("profile") and "PROFILE" in proc.stderr:
        print(f"===== {label} =====\n" + proc.stderr[proc.stderr.index("PROFILE") :])
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.exit(f"{label} worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def _host_ms(row: dict) -> float:
    return row["step_ms"] - row["device_ms"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,32,256")
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument(
        "--context",
        type=int,
        default=CONTEXT,
        help="shared prefix tokens per sequence; a short one shows how much of the HPU gap is "
        "the emulated attention's memory traffic slowing the host code that follows it",
    )
    parser.add_argument(
        "--greedy", action="store_true", help="greedy sampling (default: random, temperature 1)"
    )
    parser.add_argument(
        "--profile", action="store_true", help="cProfile the largest batch's decode-only steps"
    )
    parser.add_argument(
        "--breakdown", action="store_true", help="ms per decode step in each runner phase"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(json.loads(args.worker))
        return

    from gaudi_testkit import tinymodels

    job = {
        "model": str(tinymodels.build("llama")),
        "batches": [int(b) for b in args.batches.split(",")],
        "decode_steps": args.decode_steps,
        "context": args.context,
        "temperature": 0.0 if args.greedy else 1.0,
        "profile": args.profile,
        "breakdown": args.breakdown,
    }
    results = {
        label: run_backend(label, backend, {**job, "engine": engine})
        for label, backend, engine in RUNS
    }
    cpu = results["cpu"]
    sampling = "greedy" if args.greedy else "random (temperature 1)"
    print(
        f"host ms per decode step, {job['context']}-token contexts, {sampling} sampling "
        "(tiny Llama; device work subtracted: forward, LM head, sampler)"
    )
    print(f"{'batch':>6} {'run':<10} {'step':>8} {'device':>8} {'host':>8} {'ratio':>6}")
    for batch in job["batches"]:
        c_host = _host_ms(cpu[str(batch)])
        for label, _, _ in RUNS:
            row = results[label][str(batch)]
            ratio = _host_ms(row) / c_host if c_host > 0 else float("inf")
            print(
                f"{batch:>6} {label:<10} {row['step_ms']:>8.2f} {row['device_ms']:>8.2f} "
                f"{_host_ms(row):>8.2f} {ratio:>5.2f}x"
            )
    print(
        f"goal: host ratio <= {TARGET:.1f}x (HPU emulation / vLLM CPU runner); like for like is "
        "'hpu sync', since vLLM's CPU runner never schedules asynchronously"
    )
    if args.breakdown:
        _print_breakdown(job["batches"], results)


def _print_breakdown(batches: list[int], results: dict[str, dict]) -> None:
    """Per phase, ms per decode step (difference of the two generate runs over D steps)."""
    names: list[str] = []
    for label, _, _ in RUNS:
        names += [n for n in results[label][str(batches[0])]["phases_ms"] if n not in names]
    print("\nms per decode step by phase (nested: execute_model holds the runner phases up to")
    print("and including _model_forward; sample_tokens holds _sample and _bookkeeping_sync)")
    head = "".join(f" {label + ' ' + str(b):>14}" for b in batches for label, _, _ in RUNS)
    print(f"{'phase':<40}{head}")
    for name in names:
        row = "".join(
            f" {results[label][str(b)]['phases_ms'].get(name, float('nan')):>14.2f}"
            for b in batches
            for label, _, _ in RUNS
        )
        print(f"{name:<40}{row}")


if __name__ == "__main__":
    main()
