"""Runs one offline generation job in a fresh process and prints the results as JSON.

vLLM resolves its platform once per process, so each backend under comparison (HPU platform in
emulation, vLLM's own CPU backend) runs in its own process through this script:

    python engine_job.py '<json job>'

Job keys: model (path), prompts (lists of token ids), max_tokens, engine (LLM kwargs),
rounds (how many times to submit the prompts; later rounds hit the prefix cache; each round's
prompt tokens served from the prefix cache come back as `cached_tokens`), stats (bool:
also report the HPU runner's recompile statistics, and as `layer_windows` the sliding window each
attention layer was built with), reallocate_input_ids (bool: then inject a runner bug, a fresh
input_ids buffer after the graphs were captured, generate once more and report the error as
`after_reallocation`; needs the engine in-process, VLLM_ENABLE_V1_MULTIPROCESSING=0,
generation.run_job's default).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """Sets env in os.environ for the engine started inside, then puts back what was there (the
    next engine of a job that runs several sees the job's environment again)."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def completion(output) -> dict:
    """One request's greedy tokens and each step's top logprobs ({token id: logprob}), the form
    generation.assert_close compares (the other job scripts report theirs through this too)."""
    return {
        "tokens": list(output.outputs[0].token_ids),
        "logprobs": [
            {str(t): lp.logprob for t, lp in step.items()} for step in output.outputs[0].logprobs
        ],
    }


def run(job: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=job["model"], **job["engine"])
    params = SamplingParams(
        temperature=0.0, max_tokens=job["max_tokens"], logprobs=5, ignore_eos=True
    )
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    rounds, cached = [], []
    for _ in range(job.get("rounds", 1)):
        outs = llm.generate(prompts, params, use_tqdm=False)
        rounds.append([completion(o) for o in outs])
        cached.append([o.num_cached_tokens for o in outs])
    result = {
        "rounds": rounds,
        "cached_tokens": cached,
        "platform": type(__import__("vllm.platforms").platforms.current_platform).__name__,
    }
    if job.get("stats"):
        result["stats"] = llm.collective_rpc("get_recompile_stats")[0]
        result["layer_windows"] = llm.collective_rpc(_layer_windows)[0]
    if job.get("reallocate_input_ids"):
        llm.collective_rpc(_reallocate_input_ids)
        try:
            llm.generate(prompts[:1], params, use_tqdm=False)
            result["after_reallocation"] = "generated"
        except Exception as exc:
            result["after_reallocation"] = f"{type(exc).__name__}: {exc}"
    return result


def _layer_windows(worker) -> dict[str, int | None]:
    """The sliding window each attention layer's backend was built with (None: global)."""
    context = worker.model_runner.vllm_config.compilation_config.static_forward_context
    return {
        name: getattr(getattr(layer, "impl", None), "sliding_window", None)
        for name, layer in context.items()
    }


def _reallocate_input_ids(worker) -> None:
    """The runner bug HPU graphs must catch: the token-id buffer the graphs captured is replaced
    by a new one, so later steps write their ids where no graph reads them."""
    import torch

    runner = worker.model_runner
    runner.input_ids = runner._make_buffer(runner.max_num_tokens, dtype=torch.int32)


if __name__ == "__main__":
    print("RESULT " + json.dumps(run(json.loads(sys.argv[1]))), flush=True)
