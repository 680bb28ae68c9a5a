"""Runs each case twice in this one process, through torch.compile (PT_HPU_LAZY_MODE=0, as a
Gaudi runs by default) and eagerly (enforce_eager=True), and prints one JSON line per case.

    python compile_job.py '<json job>'

Job keys: cases ({name: {"model": path, "engine": extra LLM kwargs, "adapters": {name: PEFT
path} (optional: the prompts run once per adapter and once on the base model, in one batch),
"pooler": {PoolerConfig fields} (optional: an embedding model, whose vectors are compared),
"prompts": the case's own prompts (optional)}}),
prompts (token id lists), max_tokens, engine (LLM kwargs shared by every case). For each case,
as soon as both engines are done: `RESULT <name> <json>` with each run's greedy tokens and top-5
logprobs (or embeddings) and the compiled run's `get_recompile_stats` (graphs per phase, graph
breaks, compiles per bucket); or `{"error": ...}` if an engine failed.
"""

from __future__ import annotations

import gc
import json
import sys
import traceback


def generate(model: str, engine: dict, job: dict, case: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if "pooler" in case:
        llm = LLM(model=model, runner="pooling", pooler_config=case["pooler"], **engine)
    else:
        llm = LLM(model=model, **engine)
    try:
        token_lists = case.get("prompts", job["prompts"])
        prompts = [TokensPrompt(prompt_token_ids=p) for p in token_lists]
        if "pooler" in case:
            outs = llm.embed(prompts, use_tqdm=False)
            return {
                "embeddings": [list(o.outputs.embedding) for o in outs],
                "stats": llm.collective_rpc("get_recompile_stats")[0],
            }
        params = SamplingParams(
            temperature=0.0, max_tokens=job["max_tokens"], logprobs=5, ignore_eos=True
        )
        loras: list = [None] * len(prompts)
        if case.get("adapters"):
            from vllm.lora.request import LoRARequest

            requests = [
                LoRARequest(lora_name=name, lora_int_id=i + 1, lora_path=path)
                for i, (name, path) in enumerate(case["adapters"].items())
            ]
            loras = [None] * len(prompts)
            for request in requests:
                loras += [request] * len(token_lists)
            prompts = prompts * (1 + len(requests))
        outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        return {
            "outputs": [
                {
                    "tokens": list(o.outputs[0].token_ids),
                    "logprobs": [
                        {str(t): lp.logprob for t, lp in step.items()}
                        for step in o.outputs[0].logprobs
                    ],
                }
                for o in outs
            ],
            "stats": llm.collective_rpc("get_recompile_stats")[0],
        }
    finally:
        del llm
        gc.collect()


def main(job: dict) -> None:
    for name, case in job["cases"].items():
        engine = {**job["engine"], **case.get("engine", {})}
        try:
            result = {
                "compiled": generate(case["model"], {**engine, "enforce_eager": False}, job, case),
                "eager": generate(case["model"], {**engine, "enforce_eager": True}, job, case),
            }
        except Exception:
            result = {"error": traceback.format_exc()[-6000:]}
        print(f"RESULT {name} " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
