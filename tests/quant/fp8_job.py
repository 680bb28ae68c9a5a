"""Runs one offline generation of an FP8 checkpoint in a fresh process, prints JSON.

    python fp8_job.py '<json job>'

Job keys: model, prompts (token id lists), max_tokens, engine (LLM kwargs). Besides the greedy
tokens and top-5 logprobs, it reports the quantization method vLLM resolved and, for every
quantized layer of the worker's model (linears and MoE experts; not the float embeddings,
LM head and MoE router), its quant method class and the dtype its weights are stored in.
"""

from __future__ import annotations

import json
import sys


def _inspect(worker) -> dict:
    model = worker.model_runner.model
    layers = {}
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        weight = getattr(module, "weight", None)
        if weight is None:
            weight = getattr(module, "w13_weight", None)
        if method is None or weight is None or name.endswith(("lm_head", "embed_tokens", ".gate")):
            continue
        layers[name] = {"method": type(method).__name__, "dtype": str(weight.dtype)}
    return layers


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
        "layers": llm.collective_rpc(_inspect)[0],
    }


if __name__ == "__main__":
    print("RESULT " + json.dumps(run(json.loads(sys.argv[1]))), flush=True)
