"""Runs one offline generation job in a fresh process and prints the results as JSON.

vLLM resolves its platform once per process, so each backend under comparison (HPU platform in
emulation, vLLM's own CPU backend) runs in its own process through this script:

    python engine_job.py '<json job>'

Job keys: model (path), prompts (lists of token ids), max_tokens, engine (LLM kwargs),
rounds (how many times to submit the prompts; later rounds hit the prefix cache), stats (bool:
also report the HPU runner's recompile statistics).
"""

from __future__ import annotations

import json
import sys


def run(job: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=job["model"], **job["engine"])
    params = SamplingParams(
        temperature=0.0, max_tokens=job["max_tokens"], logprobs=5, ignore_eos=True
    )
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    rounds = []
    for _ in range(job.get("rounds", 1)):
        outs = llm.generate(prompts, params, use_tqdm=False)
        rounds.append(
            [
                {
                    "tokens": list(o.outputs[0].token_ids),
                    "logprobs": [
                        {str(t): lp.logprob for t, lp in step.items()}
                        for step in o.outputs[0].logprobs
                    ],
                }
                for o in outs
            ]
        )
    result = {
        "rounds": rounds,
        "platform": type(__import__("vllm.platforms").platforms.current_platform).__name__,
    }
    if job.get("stats"):
        result["stats"] = llm.collective_rpc("get_recompile_stats")[0]
    return result


if __name__ == "__main__":
    print("RESULT " + json.dumps(run(json.loads(sys.argv[1]))), flush=True)
