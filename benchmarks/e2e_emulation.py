"""End-to-end throughput: the HPU platform in CPU emulation vs vLLM's own CPU backend.

Same tiny Llama, same seeded workload, same engine settings; each backend runs in its own fresh
process (vLLM resolves its platform once per process): this script re-invokes itself with
`--worker <backend>`. Only `LLM.generate()` is timed, after the engine is up and after one small
warm-up generate; each engine runs `--rounds` workloads (distinct seeds, so no prefix-cache hits
between them) and the table reports the last. It gives requests/s, output tokens/s and the ratio
HPU emulation / CPU backend; the target is >= 0.8 (emulation runs the Gaudi kernel API in plain
torch under the bucketed static-shape runner, and should cost little more than vLLM's CPU path).

    python benchmarks/e2e_emulation.py [--prompts 64] [--max-tokens 32] [--seed 0] [--rounds 2]
    python benchmarks/e2e_emulation.py --omp-threads 1   # pin intra-op threads for both sides
    python benchmarks/e2e_emulation.py --profile   # + cProfile of the HPU side, in one process

With --profile the HPU worker runs the engine core and the model runner in its own process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) under cProfile and prints the functions that take the time;
its throughput is then not comparable with the table's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time

BACKENDS = ("hpu-emulation", "cpu")
ENGINE = {
    "dtype": "float32",
    "max_model_len": 512,
    "max_num_seqs": 32,
    "max_num_batched_tokens": 512,
    "kv_cache_memory_bytes": 256 << 20,
    "seed": 0,
}
MIN_LEN, MAX_LEN = 8, 400
TARGET = 0.8


def make_workload(num_prompts: int, seed: int, vocab: int) -> list[list[int]]:
    """Prompts with log-normal lengths (median ~90 tokens) clipped to [MIN_LEN, MAX_LEN]."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        n = int(min(max(rng.lognormvariate(math.log(90), 0.8), MIN_LEN), MAX_LEN))
        prompts.append([rng.randrange(3, vocab) for _ in range(n)])  # 0-2 are special tokens
    return prompts


# ---------------------------------------------------------------------------------- worker side
def _print_profile(profiler, top: int) -> None:
    import io
    import pstats

    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out)
        stats.sort_stats(key).print_stats(top)
        print(f"\n===== HPU side, top {top} by {key} =====", file=sys.stderr)
        print(out.getvalue(), file=sys.stderr)


def run_worker(job: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    profile = job.get("profile", False)
    t0 = time.perf_counter()
    llm = LLM(model=job["model"], **job["engine"])
    startup = time.perf_counter() - t0

    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate(_token_prompts(job["rounds"][0][:2]), warm, use_tqdm=False)

    rounds = []
    for i, workload in enumerate(job["rounds"]):
        prompts = _token_prompts(workload)
        profiler = None
        if profile and i == len(job["rounds"]) - 1:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        if profiler is not None:
            profiler.disable()
            _print_profile(profiler, job.get("profile_top", 40))
        rounds.append(
            {
                "elapsed_s": elapsed,
                "requests": len(outs),
                "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
                "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            }
        )

    result = {
        "platform": type(current_platform).__name__,
        "startup_s": startup,
        "rounds": rounds,
    }
    if current_platform.device_name == "hpu":
        stats = llm.collective_rpc("get_recompile_stats")[0]
        result["recompiles"] = stats["recompiles"]
        result["warmup_s"] = stats["warmup_seconds"]
    return result


def _token_prompts(workload: list[list[int]]) -> list:
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=p) for p in workload]


# ---------------------------------------------------------------------------------- driver side
def run_backend(backend: str, job: dict, timeout: int, omp_threads: int | None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    if omp_threads is not None:
        env["OMP_NUM_THREADS"] = str(omp_threads)
    if backend == "hpu-emulation":
        env["VLLM_HPU_EMULATION"] = "cpu"
        if job.get("profile"):
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core + runner in this process
    else:
        env["VLLM_PLUGINS"] = ""  # vLLM's own CPU backend, no plugin at all
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--worker", backend],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    if job.get("profile"):
        start = proc.stderr.find("===== HPU side")
        if start >= 0:
            print(proc.stderr[start:])
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise SystemExit(f"{backend} worker failed (rc={proc.returncode}):\n{proc.stderr[-6000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2, help="workloads per engine; last timed")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per backend")
    parser.add_argument(
        "--omp-threads",
        type=int,
        help="OMP_NUM_THREADS for both backends' processes (default: inherited / vLLM's choice)",
    )
    parser.add_argument("--profile", action="store_true", help="cProfile the HPU side only")
    parser.add_argument("--profile-top", type=int, default=40)
    parser.add_argument("--worker", choices=BACKENDS, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        result = run_worker(json.load(sys.stdin))
        print("RESULT " + json.dumps(result), flush=True)
        return

    from vllm_gaudi_platform import tinymodels

    model = str(tinymodels.build("llama"))
    # One workload per round, each with its own seed: no prefix-cache hits across rounds. The
    # table reports the last round; earlier ones warm up what one engine start does not (the
    # CPU backend's torch.compile meets new shapes on first use).
    rounds = [
        make_workload(args.prompts, args.seed + i, tinymodels.VOCAB_SIZE)
        for i in range(args.rounds)
    ]
    job = {
        "model": model,
        "rounds": rounds,
        "max_tokens": args.max_tokens,
        "engine": ENGINE,
        "profile": args.profile,
        "profile_top": args.profile_top,
    }
    lens = sorted(len(p) for p in rounds[-1])
    print(
        f"tiny llama, {len(lens)} prompts of {lens[0]}..{lens[-1]} tokens (median "
        f"{lens[len(lens) // 2]}), max_tokens {args.max_tokens}, greedy, ignore_eos; "
        f"{args.rounds} round(s), seeds {args.seed}..{args.seed + args.rounds - 1}, the last "
        f"one timed\nengine {ENGINE}; OMP_NUM_THREADS "
        f"{args.omp_threads or os.environ.get('OMP_NUM_THREADS', 'not set (vLLM chooses)')}"
    )
    backends = ("hpu-emulation",) if args.profile else BACKENDS
    results = {b: run_backend(b, job, args.timeout, args.omp_threads) for b in backends}
    if args.profile:
        return

    def tok_s(r: dict) -> float:
        return r["output_tokens"] / r["elapsed_s"]

    print(
        f"\n{'backend':<14} {'platform':<12} {'req/s':>7} {'out tok/s':>10} {'gen s':>6} "
        f"{'start s':>7}  notes"
    )
    for backend, res in results.items():
        last = res["rounds"][-1]
        notes = "out tok/s per round: " + ", ".join(f"{tok_s(r):.0f}" for r in res["rounds"])
        if "recompiles" in res:
            notes += f"; warmup {res['warmup_s']:.1f} s, recompiles {res['recompiles']}"
        print(
            f"{backend:<14} {res['platform']:<12} {last['requests'] / last['elapsed_s']:>7.2f} "
            f"{tok_s(last):>10.1f} {last['elapsed_s']:>6.2f} {res['startup_s']:>7.1f}  {notes}"
        )
    ratio = tok_s(results["hpu-emulation"]["rounds"][-1]) / tok_s(results["cpu"]["rounds"][-1])
    verdict = "meets" if ratio >= TARGET else "BELOW"
    print(
        f"\nratio HPU emulation / CPU backend (output tokens/s): {ratio:.2f} "
        f"({verdict} target {TARGET})"
    )


if __name__ == "__main__":
    main()
