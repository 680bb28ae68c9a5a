"""Runs one offline generation with INC FP8 in a fresh process and prints the results as JSON.

    python inc_job.py '<json job>'

Job keys: model, prompts (token id lists), max_tokens, engine (LLM kwargs). Besides the greedy
tokens and top-5 logprobs, it reports what the worker really runs: the class and weight dtype of
every linear layer neural-compressor patched and of the LM head, the KV cache dtype and each
attention layer's k/v scales.
"""

from __future__ import annotations

import json
import sys


def _inspect(worker) -> dict:
    model = worker.model_runner.model
    linears = {
        name: {"class": type(m).__name__, "weight_dtype": str(m.weight.dtype)}
        for name, m in model.named_modules()
        if name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    }
    scales = {
        name: [float(m._k_scale), float(m._v_scale)]
        for name, m in model.named_modules()
        if name.endswith(".attn") and hasattr(m, "_k_scale")
    }
    head = model.lm_head
    caches = worker.model_runner.kv_caches
    return {
        "linears": linears,
        "lm_head": {"class": type(head).__name__, "weight_dtype": str(head.weight.dtype)},
        "kv_scales": scales,
        "kv_cache_dtype": str(caches[0].dtype),
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
    return {"results": results, "worker": llm.collective_rpc(_inspect)[0]}


if __name__ == "__main__":
    print("RESULT " + json.dumps(run(json.loads(sys.argv[1]))), flush=True)
