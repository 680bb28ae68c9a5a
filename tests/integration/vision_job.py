"""Runs offline vision-language jobs in a fresh process and prints the results as JSON.

    python vision_job.py '<json {name: job}>'

Runs each named job in turn (one engine after another in this process) and prints one
`RESULT <name> <json>` line per job. Job keys: model (path), rounds (lists of
tests.integration.vision case names, submitted one list at a time, so a later round can find an
earlier one in the prefix cache), engine (LLM kwargs), stats (bool: the HPU runner's recompile
statistics and the op-family call counts). Prints the greedy tokens and top-5 logprobs of every
case per round, and vLLM's prefix cache counters after each round.
"""

from __future__ import annotations

import gc
import json
import sys


def _prefix_cache(llm) -> dict[str, float]:
    wanted = {"vllm:prefix_cache_queries", "vllm:prefix_cache_hits"}
    return {m.name: m.value for m in llm.get_metrics() if m.name in wanted}


def run(job: dict) -> dict:
    from transformers import AutoProcessor
    from vllm import LLM, SamplingParams

    from tests.integration.engine_job import completion
    from tests.integration.vision import CASES, MAX_TOKENS, prompt_text

    processor = AutoProcessor.from_pretrained(job["model"])
    llm = LLM(model=job["model"], **job["engine"])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5, ignore_eos=True)
    rounds, cache = [], []
    for names in job["rounds"]:
        requests = [
            {
                "prompt": prompt_text(processor, CASES[name]),
                "multi_modal_data": {"image": CASES[name].images()},
            }
            for name in names
        ]
        outs = llm.generate(requests, params, use_tqdm=False)
        rounds.append({name: completion(o) for name, o in zip(names, outs, strict=True)})
        cache.append(_prefix_cache(llm))
    result = {"rounds": rounds, "prefix_cache": cache}
    if job.get("stats"):
        from vllm_gaudi_ops import stats

        result["stats"] = llm.collective_rpc("get_recompile_stats")[0]
        result["seam"] = llm.collective_rpc(_seam_name)[0]
        result["op_counts"] = dict(stats.COUNTS)
        result["platform"] = type(__import__("vllm.platforms").platforms.current_platform).__name__
    return result


def _seam_name(worker) -> str:
    """Which backend the worker's seam is: "gaudi" (seam/gaudi) or "emulated on cpu"."""
    return worker.model_runner.seam.NAME


if __name__ == "__main__":
    for name, job in json.loads(sys.argv[1]).items():
        print(f"RESULT {name} " + json.dumps(run(job)), flush=True)
        gc.collect()  # the finished job's engine shuts down before the next one starts
