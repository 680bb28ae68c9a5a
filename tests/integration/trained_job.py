"""Runs the trained tiny Llama on one engine in a fresh process and prints the results as JSON.

    python trained_job.py '<json job>'

Job keys: model (path), prompts (text), max_tokens, windows (lists of token ids scored with
prompt logprobs), engine (LLM kwargs). Result keys: platform, completions (text),
logprobs (per window, the log-probability of each token after the first).
"""

from __future__ import annotations

import json
import sys


def run(job: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform

    from vllm_gaudi_platform.commands import demo_model

    llm = LLM(model=job["model"], **job["engine"])
    greedy = llm.generate(
        job["prompts"],
        SamplingParams(temperature=0.0, max_tokens=job["max_tokens"]),
        use_tqdm=False,
    )
    scored = llm.generate(
        [TokensPrompt(prompt_token_ids=w) for w in job["windows"]],
        SamplingParams(max_tokens=1, prompt_logprobs=0),
        use_tqdm=False,
    )
    return {
        "platform": type(current_platform).__name__,
        "completions": [o.outputs[0].text for o in greedy],
        "logprobs": demo_model.vllm_logprobs(scored),
    }


if __name__ == "__main__":
    print("RESULT " + json.dumps(run(json.loads(sys.argv[1]))), flush=True)
