"""Runs the speculative-decoding checks in one process and prints the results as JSON.

    python spec_decode_job.py '<json job>'

One process, several engines one after the other on the HPU platform (CPU emulation): the same
greedy prompts without speculation, then with each drafter of the job (n-gram, EAGLE, EAGLE-3,
MTP);
each speculative run also samples a few requests at temperature 1 in the same batch (mixed
greedy/random verification). It reports the plain run's tokens and, per drafter, its tokens,
vLLM's spec-decode counters (the metrics vLLM logs and exports) and the runner's recompile
statistics.

Job keys: model (path), prompts (token id lists), max_tokens, engine (LLM kwargs),
speculative_configs (name -> LLM's speculative_config), targets (optional, name -> the model
path that drafter's run serves instead of `model`: the same weights in a checkpoint that carries
the drafter, e.g. MTP layers), random_prompts (how many prompts to also sample at temperature 1 in
the speculative runs).
"""

from __future__ import annotations

import gc
import json
import sys
import time


def _generate(llm, prompts, max_tokens, random_prompts=0):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    random = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True)
        for i in range(random_prompts)
    ]
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    requests += [TokensPrompt(prompt_token_ids=p) for p in prompts[:random_prompts]]
    outs = llm.generate(requests, [greedy] * len(prompts) + random, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return tokens[: len(prompts)], tokens[len(prompts) :]


def _spec_metrics(llm) -> dict:
    counters: dict = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            value = getattr(metric, "value", None)
            counters[metric.name] = value if value is not None else list(metric.values)
    return counters


def run(job: dict) -> dict:
    from vllm import LLM

    engine = {**job["engine"], "disable_log_stats": False}
    llm = LLM(model=job["model"], **engine)
    plain, _ = _generate(llm, job["prompts"], job["max_tokens"])
    del llm
    gc.collect()

    runs = {}
    for name, config in job["speculative_configs"].items():
        start = time.perf_counter()
        # A drafter may need its own checkpoint of the target (MTP layers ride in the target's).
        model = job.get("targets", {}).get(name, job["model"])
        llm = LLM(model=model, speculative_config=config, **engine)
        spec, sampled = _generate(
            llm, job["prompts"], job["max_tokens"], job.get("random_prompts", 0)
        )
        runs[name] = {
            "spec": spec,
            "sampled": sampled,
            "metrics": _spec_metrics(llm),
            "stats": llm.collective_rpc("get_recompile_stats")[0],
            "seconds": time.perf_counter() - start,
        }
        del llm
        gc.collect()
    return {"plain": plain, "runs": runs}


if __name__ == "__main__":
    print("RESULT " + json.dumps(run(json.loads(sys.argv[1]))), flush=True)
