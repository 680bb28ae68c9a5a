"""Host time per decode step: the HPU runner (CPU emulation) vs vLLM's CPU runner, side by side.

What a Gaudi cannot hide is the host work around each forward pass: scheduling, input
preparation, attention metadata, bucket padding, sampling and output processing. This measures
it with a model so small that the forward pass is a small share of the step: the tiny Llama of
``vllm_gaudi_platform.tinymodels`` (2 layers, hidden 128), at 1, 32 and 256 decode sequences
with 2k-token contexts.

Each backend runs in its own process (vLLM picks its platform once per process), with the engine
core in that process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the model's forward can be timed
from outside. Per batch size: every sequence is a shared 2048-token prefix (computed once, then
a prefix-cache hit) plus a distinct 8-token tail. ``generate(max_tokens=1)`` and
``generate(max_tokens=1 + D)`` are both timed; their difference over ``D`` is one decode step,
and the model forward's own time (a wrapper around ``model.forward``) over the same steps is
subtracted to give the host time. HPU warmup is skipped (``VLLM_SKIP_WARMUP``): it changes no
host work per step, only the start-up time.

    python benchmarks/host_overhead.py [--batches 1,32,256] [--decode-steps 16]
    python benchmarks/host_overhead.py --profile   # + where the HPU side's host time goes

Run it alone (it loads both cores). Goal: HPU host ms per step <= 1.0x vLLM's CPU runner.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

BACKENDS = ("hpu-emulation", "cpu")
CONTEXT = 2048
TAIL = 8
TARGET = 1.0


def run_worker(job: dict) -> None:
    """One backend: for each batch size, (step ms, forward ms) of a decode step."""
    import random

    from vllm import LLM, SamplingParams

    max_batch = max(job["batches"])
    llm = LLM(
        model=job["model"],
        dtype="float32",
        max_model_len=CONTEXT + TAIL + job["decode_steps"] + 8,
        max_num_seqs=max_batch,
        max_num_batched_tokens=max(CONTEXT + TAIL, max_batch * TAIL),
        kv_cache_memory_bytes=1 << 30,
        enable_prefix_caching=True,
        hf_overrides={"max_position_embeddings": 4 * CONTEXT},
        seed=0,
    )
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    model = runner.model
    forward_seconds = [0.0]
    original = model.forward

    def timed_forward(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            forward_seconds[0] += time.perf_counter() - start

    model.forward = timed_forward

    rng = random.Random(0)
    prefix = [rng.randrange(3, 500) for _ in range(CONTEXT)]

    def timed(prompts: list, max_tokens: int) -> tuple[float, float]:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        f0, t0 = forward_seconds[0], time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0, forward_seconds[0] - f0

    results = {}
    for batch in job["batches"]:
        prompts = [
            {"prompt_token_ids": prefix + [rng.randrange(3, 500) for _ in range(TAIL)]}
            for _ in range(batch)
        ]
        # Untimed: caches the prompts' blocks (both timed runs then hit the cache) and meets every
        # step shape once (vLLM's CPU backend compiles its model for new shapes on first use).
        timed(prompts, 1 + job["decode_steps"])
        t1, f1 = timed(prompts, 1)
        profiler = None
        if job.get("profile") and batch == max_batch:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        t2, f2 = timed(prompts, 1 + job["decode_steps"])
        if profiler is not None:
            profiler.disable()
            _print_profile(profiler, batch)
        step = (t2 - t1) / job["decode_steps"]
        forward = (f2 - f1) / job["decode_steps"]
        results[str(batch)] = {"step_ms": 1e3 * step, "forward_ms": 1e3 * forward}
    print("RESULT " + json.dumps(results), flush=True)


def _print_profile(profiler, batch: int) -> None:
    import io
    import pstats

    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(30)
    print(f"PROFILE batch {batch}, top 30 by own time\n{out.getvalue()}", file=sys.stderr)


def run_backend(backend: str, job: dict) -> dict:
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
        print(f"===== {backend} =====\n" + proc.stderr[proc.stderr.index("PROFILE") :])
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.exit(f"{backend} worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,32,256")
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--profile", action="store_true", help="cProfile the largest batch")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(json.loads(args.worker))
        return

    from vllm_gaudi_platform import tinymodels

    job = {
        "model": str(tinymodels.build("llama")),
        "batches": [int(b) for b in args.batches.split(",")],
        "decode_steps": args.decode_steps,
        "profile": args.profile,
    }
    results = {backend: run_backend(backend, job) for backend in BACKENDS}
    hpu, cpu = results["hpu-emulation"], results["cpu"]
    print(f"host ms per decode step, {CONTEXT}-token contexts (tiny Llama, forward subtracted)")
    print(
        f"{'batch':>6} {'hpu step':>9} {'hpu fwd':>8} {'hpu host':>9} "
        f"{'cpu step':>9} {'cpu fwd':>8} {'cpu host':>9} {'ratio':>6}"
    )
    for batch in job["batches"]:
        h, c = hpu[str(batch)], cpu[str(batch)]
        h_host, c_host = h["step_ms"] - h["forward_ms"], c["step_ms"] - c["forward_ms"]
        ratio = h_host / c_host if c_host > 0 else float("inf")
        print(
            f"{batch:>6} {h['step_ms']:>9.2f} {h['forward_ms']:>8.2f} {h_host:>9.2f} "
            f"{c['step_ms']:>9.2f} {c['forward_ms']:>8.2f} {c_host:>9.2f} {ratio:>5.2f}x"
        )
    print(f"goal: host ratio <= {TARGET:.1f}x (HPU emulation / vLLM CPU runner)")


if __name__ == "__main__":
    main()
