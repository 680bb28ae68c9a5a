"""Host syncs per engine step on the Gaudi backend, beside what vLLM's GPU runner does per step.

A Gaudi's device runs ahead of the host only while the host does not wait for it: every
device-to-host read (`.item()`, `.tolist()`, a blocking copy) and every wait for the device
(`synchronize` of the device, a stream or an event) stalls the host until the device has caught
up. This counts them on seam/gaudi over the Habana stand-in (tests/habana_standin), whose
torch device "hpu" holds every tensor as a Gaudi does and counts each read itself
(tests/integration/host_sync_job.py does the counting; tests/integration/test_host_syncs.py
holds the goals). The tiny Llama, HPU graphs in lazy mode, greedy, with vLLM's async scheduling
(how it serves) and without, at batch 1 and 64 (prompts of 16 to 48 tokens, 8 tokens each).

Per step kind (prefill, mixed, decode): device-to-host reads per step (the non_blocking ones
included), the blocking ones among them, and waits per step by phase. Beside them, vLLM's GPU
runner per step, read from its code (vllm/v1/worker/gpu_model_runner.py, vLLM 0.32.0):
- async scheduling: the sampled ids leave as a non_blocking copy on a side stream
  (`AsyncGPUModelRunnerOutput.__init__`, line 300), the engine waits for it when it takes the
  output (`get_output`, line 324), and the next step waits for its previous input copies
  (`synchronize_input_prep`, line 3614): 1 read, 0 blocking, 2 waits;
- without it: the sampled ids copied into pinned memory and an event waited on (`_to_list`,
  lines 7183-7196): 1 read, 1 blocking (the copy and its wait).
The ratio column is ours over the GPU runner's reads per step: the goal is 1.0 in decode.

    python benchmarks/host_syncs.py [--batches 1,64]

Run it alone (it loads both cores).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_TOKENS = 8
# vLLM's GPU runner per step, from its code (see above): (reads, blocking reads, waits).
GPU_RUNNER = {"async": (1, 0, 2), "sync": (1, 1, 0)}
KINDS = ("prefill", "mixed", "decode")


def engines(max_batch: int) -> dict[str, dict]:
    engine = {
        "dtype": "float32",
        "max_model_len": 256,
        "max_num_seqs": max_batch,
        "max_num_batched_tokens": max(256, 16 * max_batch),  # batch 64: chunked, mixed steps
        "kv_cache_memory_bytes": 64 << 20,
        "seed": 0,
    }
    return {"async": engine, "sync": {**engine, "async_scheduling": False}}


def measure(batches: list[int]) -> dict[str, dict]:
    sys.path.insert(0, str(ROOT))  # the job, the stand-in's environment and the tiny models
    from gaudi_testkit import tinymodels
    from tests.conftest import STANDIN_ENGINE_ENV
    from tests.integration.generation import named_job_outputs, run_job

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(16, 49))] for _ in range(64)]
    job = {
        "model": str(tinymodels.build("llama")),
        "engines": engines(max(batches)),
        "runs": {
            f"batch{n}": {"prompts": (prompts * (n // 64 + 1))[:n], "max_tokens": MAX_TOKENS}
            for n in batches
        },
    }
    env = {
        **STANDIN_ENGINE_ENV,
        "PT_HPU_LAZY_MODE": "1",
        "PYTHONPATH": os.pathsep.join([str(STANDIN_ENGINE_ENV["PYTHONPATH"]), str(ROOT)]),
    }
    job_script = ROOT / "tests" / "integration" / "host_sync_job.py"
    proc = run_job(job_script, json.dumps(job), env, timeout=3600)
    outputs = named_job_outputs(proc)
    if not outputs:
        raise SystemExit(f"the job printed no result:\n{proc.stderr[-4000:]}")
    return outputs


def per_step(kind: dict, test) -> float:
    return sum(n for key, n in kind["phases"].items() if test(key)) / kind["steps"]


def is_read(key: str) -> bool:
    return key.endswith((" value", " copy"))


def is_blocking(key: str) -> bool:
    return key.endswith(" value") or (key.endswith(" copy") and not key.endswith("async copy"))


def table(outputs: dict[str, dict]) -> list[str]:
    header = (
        f"{'scheduling':<10} {'batch':>5} {'step':<8} {'steps':>5} {'reads':>6} "
        f"{'blocking':>8} {'waits (phase)':<32} {'GPU runner':>10} {'ratio':>6}"
    )
    lines = [header, "-" * len(header)]
    for name, result in outputs.items():
        scheduling, run = name.split("/")
        gpu_reads, gpu_blocking, gpu_waits = GPU_RUNNER[scheduling]
        assert result["reads"] == result["standin_reads"], (name, result)
        for kind_name in KINDS:
            kind = result["kinds"].get(kind_name)
            if kind is None:
                continue
            reads = per_step(kind, is_read)
            waits = {
                key.split()[0]: n / kind["steps"]
                for key, n in kind["phases"].items()
                if key.endswith(" wait")
            }
            where = ", ".join(f"{w:g} {phase}" for phase, w in sorted(waits.items())) or "0"
            batch = run.removeprefix("batch")
            lines.append(
                f"{scheduling:<10} {batch:>5} {kind_name:<8} {kind['steps']:>5} "
                f"{reads:>6.2f} {per_step(kind, is_blocking):>8.2f} {where:<32} "
                f"{f'{gpu_reads}/{gpu_blocking}/{gpu_waits}':>10} {reads / gpu_reads:>6.2f}"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,64", help="comma-separated batch sizes")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    print("Host syncs per step: seam/gaudi over the stand-in's device, HPU graphs (lazy mode)")
    print("GPU runner: reads/blocking/waits per step from vLLM's code; ratio: our reads / its")
    for line in table(measure(batches)):
        print(line)


if __name__ == "__main__":
    main()
