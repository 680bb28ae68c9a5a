"""Runs one offline generation of a quantized checkpoint in a fresh process, prints JSON.

    python quant_job.py '<json job>'

Job keys: model, prompts (token id lists), max_tokens, engine (LLM kwargs). Besides the greedy
tokens and top-5 logprobs, it reports the quantization method vLLM resolved and what every
linear layer of the worker's model runs (its compressed-tensors scheme, or its quant method).
"""

from __future__ import annotations

import json
import sys


def _inspect(worker) -> dict:
    model = worker.model_runner.model
    return {
        name: type(getattr(m, "scheme", None) or m.quant_method).__name__
        for name, m in model.named_modules()
        if name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    }


def run(job: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=job["model"], **job["engine"])
    params = SamplingParams(
        temperature=0.0, max_tokens=job["max_tokens"], logprobs=5, ignore_eos=True
    )
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    results = [
        {
            "tokens": list(o.outputs[0].token_ids),
            "logprobs": [
                {str(t): lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs
            ],
        }
        for o in outs
    ]
    return {
        "results": results,
        "quantization": llm.llm_engine.vllm_config.model_config.quantization,
        "linears": llm.collective_rpc(_inspect)[0],
    }


if __name__ == "__main__":
    print("RESULT " + json.dumps(run(json.loads(sys.argv[1]))), flush=True)
