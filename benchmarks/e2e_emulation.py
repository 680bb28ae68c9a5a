"""End-to-end throughput: the HPU platform in CPU emulation vs vLLM's own CPU backend.

The HPU platform runs three ways, side by side: `hpu-emulation` as a Gaudi runs by default
(PT_HPU_LAZY_MODE=0, steps through torch.compile, each bucket compiled in warmup), `hpu-eager`
(the same with enforce_eager=True: nothing compiled) and `hpu-lazy` (lazy mode, HPU graphs
replayed); their warmup seconds and compiled graph counts are in the notes, for information.

Same tiny Llama, same seeded workload, same engine settings; each backend runs in its own
process (vLLM resolves its platform once per process): this script re-invokes itself with
`--worker <backend>`. Both engines start first (one after the other); then the rounds alternate,
round i on one engine and then on the other, so both meet the machine in the same state (a small
shared machine drifts by tens of percent over minutes, and an idle engine takes no CPU). Only
`LLM.generate()` is timed. Each round is a new workload (distinct seeds, so no prefix-cache hits
between rounds); the first only warms up and the table adds up the others. It gives requests/s,
output tokens/s and the ratio HPU emulation / CPU backend, as information (no target: emulated
kernels check Gaudi's semantics, their speed only matters for CI time).

Two models: the tiny Llama (2 layers, hidden 128: host work dominates) and a mid-size Llama
(8 layers, hidden 1024, random weights, built once next to the tiny models: compute dominates),
with its own, smaller workload (--mid-prompts, --mid-max-tokens, --mid-rounds).

    python benchmarks/e2e_emulation.py [--prompts 64] [--max-tokens 32] [--seed 0] [--rounds 4]
    python benchmarks/e2e_emulation.py --models mid --mid-prompts 16 --mid-rounds 2  # quicker
    python benchmarks/e2e_emulation.py --omp-threads 1   # pin intra-op threads for both sides
    python benchmarks/e2e_emulation.py --profile   # + cProfile of the HPU side, in one process

With --profile the HPU worker runs the engine core and the model runner in its own process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) under cProfile and prints the functions that take the time;
its throughput is then not comparable with the table's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time

# hpu-emulation: the Gaudi default, eager mode with steps through torch.compile (compiled once
# per bucket in warmup); hpu-eager: the same with enforce_eager=True (nothing compiled); hpu-lazy:
# lazy mode, HPU graphs replayed (the emulated tape).
BACKENDS = ("hpu-emulation", "hpu-eager", "hpu-lazy", "cpu")
HPU_BACKENDS = {
    "hpu-emulation": ({"PT_HPU_LAZY_MODE": "0"}, {}),
    "hpu-eager": ({"PT_HPU_LAZY_MODE": "0"}, {"enforce_eager": True}),
    "hpu-lazy": ({"PT_HPU_LAZY_MODE": "1"}, {}),
}
ENGINE = {
    "dtype": "float32",
    "max_model_len": 512,
    "max_num_seqs": 32,
    "max_num_batched_tokens": 512,
    "kv_cache_memory_bytes": 256 << 20,
    "seed": 0,
}
MIN_LEN, MAX_LEN = 8, 400
# The mid-size model: the tiny Llama's tokenizer and architecture, sized so compute dominates.
MID_SIZE = {
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 64,
}


def build_mid_model(tiny: str) -> str:
    """The mid-size Llama (seeded random weights), built on first use beside the tiny model."""
    import shutil
    from pathlib import Path

    tiny_path = Path(tiny)
    # The folder name changes with MID_SIZE (and with the tiny model's own key), never stale.
    size_key = hashlib.sha256(json.dumps(MID_SIZE, sort_keys=True).encode()).hexdigest()[:8]
    path = tiny_path.with_name(tiny_path.name.replace("tiny-", f"mid{size_key}-", 1))
    if (path / "config.json").exists():
        return str(path)
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(tiny_path)
    for key, value in MID_SIZE.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    for f in tiny_path.iterdir():  # tokenizer files
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, tmp / f.name)
    tmp.rename(path)
    return str(path)


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


def run_worker(job: dict) -> None:
    """Start one engine, then run the rounds the driver asks for, one line per command."""
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    t0 = time.perf_counter()
    engine = {**job["engine"], **HPU_BACKENDS.get(job["backend"], ({}, {}))[1]}
    llm = LLM(model=job["model"], **engine)
    startup = time.perf_counter() - t0

    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate(_token_prompts(job["rounds"][0][:2]), warm, use_tqdm=False)
    _reply("READY", {"platform": type(current_platform).__name__, "startup_s": startup})

    for line in sys.stdin:
        command = line.split()
        if command[0] == "ROUND":
            i = int(command[1])
            profiler = None
            if job.get("profile") and i == len(job["rounds"]) - 1:
                import cProfile

                profiler = cProfile.Profile()
                profiler.enable()
            t0 = time.perf_counter()
            outs = llm.generate(_token_prompts(job["rounds"][i]), params, use_tqdm=False)
            elapsed = time.perf_counter() - t0
            if profiler is not None:
                profiler.disable()
                _print_profile(profiler, job.get("profile_top", 40))
            _reply(
                "ROUND",
                {
                    "elapsed_s": elapsed,
                    "requests": len(outs),
                    "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
                    "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                },
            )
        elif command[0] == "DONE":
            extra = {}
            if current_platform.device_name == "hpu":
                stats = llm.collective_rpc("get_recompile_stats")[0]
                extra = {
                    "recompiles": stats["recompiles"],
                    "warmup_s": stats["warmup_seconds"],
                    "compiled_graphs": stats.get("compiled_graphs"),
                    "padding": {
                        part: padding_ratio(stats["step_metrics"], part)
                        for part in ("prompt_tokens", "decode_batch", "decode_blocks")
                    },
                }
            _reply("DONE", extra)
            return


def padding_ratio(snapshot: dict, part: str) -> float:
    """Work the buckets ran beyond the work needed, over the whole run (warmup excluded)."""
    from vllm_gaudi_platform.observability import metrics

    return metrics.padding_ratio(snapshot[f"{part}_real"], snapshot[f"{part}_padded"])


def _reply(tag: str, payload: dict) -> None:
    print(f"@@{tag} {json.dumps(payload)}", flush=True)


def _token_prompts(workload: list[list[int]]) -> list:
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=p) for p in workload]


# ---------------------------------------------------------------------------------- driver side
class Engine:
    """One backend's worker process: vLLM resolves its platform once per process."""

    def __init__(self, backend: str, job: dict, omp_threads: int | None) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
        if omp_threads is not None:
            env["OMP_NUM_THREADS"] = str(omp_threads)
        if backend in HPU_BACKENDS:
            env["VLLM_HPU_EMULATION"] = "cpu"
            env.update(HPU_BACKENDS[backend][0])
            if job.get("profile"):
                env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core + runner in-process
        else:
            env["VLLM_PLUGINS"] = ""  # vLLM's own CPU backend, no plugin at all
        self.backend = backend
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (lives as long as the engine)
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", backend],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
        )
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()

    def expect(self, tag: str) -> dict:
        for line in self.proc.stdout:
            if line.startswith(f"@@{tag} "):
                return json.loads(line[len(tag) + 3 :])
        self.proc.wait()
        self.log.seek(0)
        raise SystemExit(
            f"{self.backend} worker failed (rc={self.proc.returncode}):\n{self.log.read()[-6000:]}"
        )

    def send(self, command: str) -> None:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def stderr_text(self) -> str:
        self.log.seek(0)
        return self.log.read()


def run_interleaved(backends: tuple[str, ...], job: dict, omp_threads: int | None) -> dict:
    """Start every engine (one at a time, so start-up does not overlap), then run round i on each
    engine in turn: both backends meet the machine in the same state, round after round."""
    engines = {}
    results = {}
    for backend in backends:
        engines[backend] = Engine(backend, job, omp_threads)
        results[backend] = {**engines[backend].expect("READY"), "rounds": []}
    for i in range(len(job["rounds"])):
        for backend, engine in engines.items():
            engine.send(f"ROUND {i}")
            results[backend]["rounds"].append(engine.expect("ROUND"))
    for backend, engine in engines.items():
        engine.send("DONE")
        results[backend].update(engine.expect("DONE"))
        engine.proc.wait()
        if job.get("profile"):
            text = engine.stderr_text()
            start = text.find("===== HPU side")
            if start >= 0:
                print(text[start:])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--rounds", type=int, default=4, help="workloads per engine; all but the first timed"
    )
    parser.add_argument(
        "--omp-threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="OMP_NUM_THREADS for both backends' processes (default: the cores this process may "
        "use, which is what vLLM's CPU backend binds anyway; the HPU worker otherwise drops to "
        "one intra-op thread after loading, as vLLM's GPU-style workers do)",
    )
    parser.add_argument("--models", default="tiny,mid", help="tiny, mid or tiny,mid")
    # 32 x 32 tokens over 3 timed rounds: with one round of 16 x 16 the ratio moved by 0.15
    # between runs.
    parser.add_argument("--mid-prompts", type=int, default=32)
    parser.add_argument("--mid-max-tokens", type=int, default=32)
    parser.add_argument("--mid-rounds", type=int, default=4)
    parser.add_argument("--profile", action="store_true", help="cProfile the HPU side only")
    parser.add_argument("--profile-top", type=int, default=40)
    parser.add_argument("--worker", choices=BACKENDS, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        run_worker({**json.loads(sys.stdin.readline()), "backend": args.worker})
        return

    from gaudi_testkit import tinymodels

    tiny = str(tinymodels.build("llama"))
    models = args.models.split(",")
    ratios = {}
    for name in models:
        if name == "tiny":
            model, prompts, max_tokens, n_rounds = (
                tiny,
                args.prompts,
                args.max_tokens,
                args.rounds,
            )
        elif name == "mid":
            model, prompts, max_tokens, n_rounds = (
                build_mid_model(tiny),
                args.mid_prompts,
                args.mid_max_tokens,
                args.mid_rounds,
            )
        else:
            sys.exit(f"--models: unknown model {name!r}; use tiny, mid or tiny,mid")
        ratio = run_model(name, model, prompts, max_tokens, n_rounds, args)
        if ratio is not None:
            ratios[name] = ratio
    if ratios:
        print("\nratio HPU emulation / CPU backend (output tokens/s), information only:")
        for name, ratio in ratios.items():
            print(f"  {name:<5} {ratio:.2f}")


def run_model(
    name: str, model: str, num_prompts: int, max_tokens: int, num_rounds: int, args
) -> float | None:
    """One model's side-by-side table; its ratio (None when profiling)."""
    from gaudi_testkit import tinymodels

    # One workload per round, each with its own seed: no prefix-cache hits across rounds. The
    # table adds up all rounds but the first, which warms up what one engine start does not (the
    # CPU backend's torch.compile meets new shapes on first use).
    rounds = [
        make_workload(num_prompts, args.seed + i, tinymodels.VOCAB_SIZE) for i in range(num_rounds)
    ]
    job = {
        "model": model,
        "rounds": rounds,
        "max_tokens": max_tokens,
        "engine": ENGINE,
        "profile": args.profile,
        "profile_top": args.profile_top,
    }
    lens = sorted(len(p) for p in rounds[-1])
    print(
        f"\n{name} llama, {len(lens)} prompts of {lens[0]}..{lens[-1]} tokens (median "
        f"{lens[len(lens) // 2]}), max_tokens {max_tokens}, greedy, ignore_eos; "
        f"{num_rounds} round(s), seeds {args.seed}..{args.seed + num_rounds - 1}, all but the "
        f"first timed\nengine {ENGINE}; OMP_NUM_THREADS {args.omp_threads} on both sides"
    )
    backends = ("hpu-emulation",) if args.profile else BACKENDS
    results = run_interleaved(backends, job, args.omp_threads)
    if args.profile:
        return None

    def tok_s(r: dict) -> float:
        return r["output_tokens"] / r["elapsed_s"]

    def timed(res: dict) -> dict:
        """All rounds but the warm-up one, added up."""
        kept = res["rounds"][1:] or res["rounds"]
        return {k: sum(r[k] for r in kept) for k in ("elapsed_s", "requests", "output_tokens")}

    print(
        f"{'backend':<14} {'platform':<12} {'req/s':>7} {'out tok/s':>10} {'gen s':>6} "
        f"{'start s':>7}  notes"
    )
    for backend, res in results.items():
        agg = timed(res)
        notes = "out tok/s per round: " + ", ".join(f"{tok_s(r):.0f}" for r in res["rounds"])
        if "recompiles" in res:
            notes += f"; warmup {res['warmup_s']:.1f} s, recompiles {res['recompiles']}"
            if res.get("compiled_graphs"):
                graphs = res["compiled_graphs"]
                notes += f", compiled {graphs['warmup']} + {graphs['serving']} graphs"
            pads = res["padding"]
            notes += "; padding " + ", ".join(f"{k} +{v:.0%}" for k, v in pads.items())
        print(
            f"{backend:<14} {res['platform']:<12} {agg['requests'] / agg['elapsed_s']:>7.2f} "
            f"{tok_s(agg):>10.1f} {agg['elapsed_s']:>6.2f} {res['startup_s']:>7.1f}  {notes}"
        )
    return tok_s(timed(results["hpu-emulation"])) / tok_s(timed(results["cpu"]))


if __name__ == "__main__":
    main()
