"""Runs KV-offloading engine jobs in a fresh process and prints the results as JSON.

    python offload_job.py '<json {name: job}>'

Each job (keys: model, engine (LLM kwargs), rounds: lists of prompts, each a list of token ids,
submitted one list at a time) runs in its own engine, one after the other; prints one
`RESULT <name> <json>` line per job: the greedy tokens and top-5 logprobs of every prompt per
round, and vLLM's prefix-cache and KV-offload counters after each round.
"""

from __future__ import annotations

import gc
import json
import sys

COUNTERS = (
    "vllm:prefix_cache_hits",
    "vllm:external_prefix_cache_hits",
    "vllm:kv_offload_store_bytes",
    "vllm:kv_offload_load_bytes",
    "vllm:kv_offload_allocation_failure",
    "vllm:kv_offload_tiering_read_bytes",
    "vllm:kv_offload_tiering_write_bytes",
)


def run(job: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from tests.integration.engine_job import completion

    llm = LLM(model=job["model"], **job["engine"])
    params = SamplingParams(
        temperature=0.0, max_tokens=job["max_tokens"], logprobs=5, ignore_eos=True
    )
    rounds, counters = [], []
    for prompts in job["rounds"]:
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )
        rounds.append([completion(o) for o in outs])
        values: dict[str, float] = {}
        for m in llm.get_metrics():  # labelled counters (per tier) add up
            values[m.name] = values.get(m.name, 0) + getattr(m, "value", 0)
        counters.append({name: values.get(name, 0) for name in COUNTERS})
    return {"rounds": rounds, "counters": counters}


if __name__ == "__main__":
    for name, job in json.loads(sys.argv[1]).items():
        print(f"RESULT {name} " + json.dumps(run(job)), flush=True)
        gc.collect()  # the finished job's engine shuts down before the next one starts
