"""Runs each case twice in this one process, through torch.compile (PT_HPU_LAZY_MODE=0, as a
Gaudi runs by default) and eagerly (enforce_eager=True), and prints one JSON line per case.

    python compile_job.py '<json job>'

Job keys: cases ({name: {"model": path, "engine": extra LLM kwargs}}), prompts (token id lists),
max_tokens, engine (LLM kwargs shared by every case). For each case, as soon as both engines are
done: `RESULT <name> <json>` with each run's greedy tokens and top-5 logprobs and the compiled
run's `get_recompile_stats` (graphs per phase, graph breaks, compiles per bucket); or
`{"error": ...}` if an engine failed.
"""

from __future__ import annotations

import gc
import json
import sys
import traceback


def generate(model: str, engine: dict, job: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, **engine)
    try:
        params = SamplingParams(
            temperature=0.0, max_tokens=job["max_tokens"], logprobs=5, ignore_eos=True
        )
        prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
        outs = llm.generate(prompts, params, use_tqdm=False)
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
                "compiled": generate(case["model"], {**engine, "enforce_eager": False}, job),
                "eager": generate(case["model"], {**engine, "enforce_eager": True}, job),
            }
        except Exception:
            result = {"error": traceback.format_exc()[-6000:]}
        print(f"RESULT {name} " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
