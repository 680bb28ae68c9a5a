"""Bucketing strategies side by side on a synthetic serving trace.

For each strategy (exp, lin, pad) and a few engine configurations it prints the number of warmup
graphs (prompt + decode buckets), the padding waste (padded / real, minus one: prompt tokens,
decode batch slots, decode KV blocks) and the share of steps that fit no bucket (each would be a
graph compilation while serving).

The trace is seeded and simulates a simple Gaudi-style scheduler: requests arrive at random
(Poisson), prompt and output lengths are log-normal, some prompts hit a cached prefix, prefills
run in their own steps (up to VLLM_PROMPT_BS_BUCKET_MAX sequences, chunked to share the token
budget) and every running sequence decodes one token per decode step.

    python benchmarks/bucketing.py [--requests N] [--seed S]
"""

from __future__ import annotations

import argparse
import math
import random
from collections import deque
from dataclasses import dataclass

from vllm_gaudi_platform.bucketing import plan_from_env

STRATEGIES = ("exp", "lin", "pad")


@dataclass(frozen=True)
class Engine:
    name: str
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int | None
    prefill_batch: int  # VLLM_PROMPT_BS_BUCKET_MAX


ENGINES = (
    Engine("tiny", 16, 2048, 512, 128, None, 1),
    Engine("tiny-64", 64, 2048, 512, 128, None, 1),
    Engine("medium", 64, 4096, 4096, 128, 2048, 4),
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


def measure(engine: Engine, strategy: str, steps: list[Step]) -> dict[str, float]:
    plan = plan_from_env(
        max_num_seqs=engine.max_num_seqs,
        max_num_batched_tokens=engine.max_num_batched_tokens,
        max_model_len=engine.max_model_len,
        block_size=engine.block_size,
        num_kv_blocks=engine.num_kv_blocks,
        environ={
            "VLLM_BUCKETING_STRATEGY": strategy,
            "VLLM_PROMPT_BS_BUCKET_MAX": str(engine.prefill_batch),
        },
    )
    real = {"prompt": 0, "bs": 0, "blocks": 0}
    padded = {"prompt": 0, "bs": 0, "blocks": 0}
    outside = {"prompt": 0, "decode": 0}
    for s in steps:
        if s.phase == "prompt":
            bucket = plan.find_prompt(s.batch_size, s.query_len, s.ctx_blocks)
            if bucket is None:
                outside["prompt"] += 1
                continue
            real["prompt"] += s.real_tokens
            padded["prompt"] += bucket.batch_size * bucket.query_len
        else:
            bucket = plan.find_decode(s.batch_size, s.ctx_blocks)
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
        **{f"waste_{k}": v for k, v in waste.items()},
        "outside": sum(outside.values()) / len(steps),
        "outside_prompt": outside["prompt"],
        "outside_decode": outside["decode"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000, help="requests per engine trace")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    header = (
        f"{'engine':<8} {'strategy':<8} {'graphs (P+D)':>13} {'prompt tok pad':>15} "
        f"{'decode bs pad':>14} {'decode blk pad':>15} {'outside (P/D steps)':>20}"
    )
    print(header)
    print("-" * len(header))
    for engine in ENGINES:
        steps = synthetic_trace(engine, args.seed, args.requests)
        for strategy in STRATEGIES:
            m = measure(engine, strategy, steps)
            p, d = m["prompt_graphs"], m["decode_graphs"]
            graphs = f"{p + d} ({p}+{d})"
            outside = f"{m['outside']:.2%} ({m['outside_prompt']}/{m['outside_decode']})"
            print(
                f"{engine.name:<8} {strategy:<8} {graphs:>13} {m['waste_prompt']:>+15.1%} "
                f"{m['waste_bs']:>+14.1%} {m['waste_blocks']:>+15.1%} {outside:>20}"
            )
        prompts = sum(s.phase == "prompt" for s in steps)
        print(
            f"{'':<8} {engine.name}: max_num_seqs={engine.max_num_seqs} "
            f"max_num_batched_tokens={engine.max_num_batched_tokens} "
            f"max_model_len={engine.max_model_len} block_size={engine.block_size} "
            f"num_kv_blocks={engine.num_kv_blocks}\n{'':<9}"
            f"VLLM_PROMPT_BS_BUCKET_MAX={engine.prefill_batch}; {len(steps)} steps "
            f"({prompts} prompt)"
        )
    print(
        "pad = padded / real - 1 over the steps that fit a bucket; outside = steps that fit no\n"
        "bucket (a multi-sequence prefill whose padded batch_size * query_len exceeds the token\n"
        "budget fits none: the runner must split it)"
    )


if __name__ == "__main__":
    main()
