"""Runs each case in one engine that compiles (PT_HPU_LAZY_MODE=0, as a Gaudi runs by default),
first through torch.compile, then op by op in the same engine (the worker's
`set_compiled_forward(False)`, prefix cache reset in between, so both runs meet the same steps
and buckets), and prints one JSON line per case.

    python compile_job.py '<json job>'

Job keys: cases ({name: {"model": path, "engine": extra LLM kwargs, "adapters": {name: PEFT
path} (optional: the prompts run once per adapter and once on the base model, in one batch),
"pooler": {PoolerConfig fields} (optional: an embedding model, whose vectors are compared),
"prompts": the case's own prompts (optional), "env": environment variables set while the
case's engine runs, e.g. its bucketing strategy (optional)}}),
prompts (token id lists), max_tokens, engine (LLM kwargs shared by every case). For each case:
`RESULT <name> <json>` with each run's greedy tokens and top-5 logprobs (or embeddings) and the
worker's `get_recompile_stats` after it (graphs per phase, graph breaks, compiles per bucket,
compiled passes); or `{"error": ...}` if the engine failed.
"""

from __future__ import annotations

import gc
import json
import sys
import traceback
from pathlib import Path


def run_case(model: str, engine: dict, job: dict, case: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if "pooler" in case:
        llm = LLM(model=model, runner="pooling", pooler_config=case["pooler"], **engine)
    else:
        llm = LLM(model=model, **engine)
    try:
        token_lists = case.get("prompts", job["prompts"])
        prompts = [TokensPrompt(prompt_token_ids=p) for p in token_lists]
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
            for request in requests:
                loras += [request] * len(token_lists)
            prompts = prompts * (1 + len(requests))

        def once(llm: LLM) -> dict:
            if "pooler" in case:
                outs = llm.embed(prompts, use_tqdm=False)
                result: dict = {"embeddings": [list(o.outputs.embedding) for o in outs]}
            else:
                outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
                result = {
                    "outputs": [
                        {
                            "tokens": list(o.outputs[0].token_ids),
                            "logprobs": [
                                {str(t): lp.logprob for t, lp in step.items()}
                                for step in o.outputs[0].logprobs
                            ],
                        }
                        for o in outs
                    ]
                }
            result["stats"] = llm.collective_rpc("get_recompile_stats")[0]
            return result

        compiled = once(llm)
        llm.reset_prefix_cache()
        llm.collective_rpc("set_compiled_forward", args=(False,))
        eager = once(llm)
        return {"compiled": compiled, "eager": eager}
    finally:
        del llm
        gc.collect()


# ---------------------------------------------------------------- checks of a case's result
def ran_both_ways(result: dict) -> tuple[dict, dict]:
    """The compiled run and the uncompiled run of a case, checked to be what they claim: the
    first ran compiled passes, the second none (its compiled pass counts did not move)."""
    assert "error" not in result, result.get("error")
    compiled, eager = result["compiled"], result["eager"]
    assert compiled["stats"]["compiled_forward_on"] is True
    assert eager["stats"]["compiled_forward_on"] is False
    passes = compiled["stats"]["compiled_serving_passes"]
    assert passes.get("model", 0) > 0, passes
    assert eager["stats"]["compiled_serving_passes"] == passes
    return compiled, eager


def assert_matches_eager(name: str, result: dict, logprob_tolerance: float) -> dict:
    """The compiled run of a case gave the uncompiled run's greedy tokens, with the sampled tokens'
    logprobs within `logprob_tolerance`; returns the compiled run's stats."""
    compiled, eager = ran_both_ways(result)
    for i, (c, e) in enumerate(zip(compiled["outputs"], eager["outputs"], strict=True)):
        assert c["tokens"] == e["tokens"], f"{name}: prompt {i}: compiled {c} vs eager {e}"
        for pos, (c_top, e_top) in enumerate(zip(c["logprobs"], e["logprobs"], strict=True)):
            token = str(c["tokens"][pos])
            assert abs(c_top[token] - e_top[token]) <= logprob_tolerance, (
                f"{name}: prompt {i} token {pos}: logprob {c_top[token]} vs eager {e_top[token]}"
            )
    return compiled["stats"]


def assert_compiled_only_in_warmup(stats: dict) -> None:
    """No graph break, every graph compiled in warmup, once per bucket (label)."""
    assert stats["graph_breaks"] == {"warmup": [], "serving": []}
    assert stats["compiled_graphs"]["serving"] == 0, stats["recompiled_buckets"]
    assert stats["compile_recompiles"] == 0
    by_bucket = stats["compiles_by_bucket"]
    assert sum(by_bucket.values()) == stats["compiled_graphs"]["warmup"]
    assert all(n == 1 for n in by_bucket.values()), by_bucket


# ---------------------------------------------------------------- the buckets a case warms
# `fitted` to the step shapes make_prompts()[:6] give under COMPILE_ENGINE (compile_steps.trace,
# recorded from the llama case with VLLM_BUCKETING_RECORD_TRACE), at most GRAPH_BUDGET graphs,
# instead of exp's default plan (13-19 graphs a case here). What the compile tests check, that a
# compiled engine traces each warmed bucket once, without a graph break, and serves from those
# graphs only, holds for any bucket shapes; exp's plan is warmed and checked by the eager and
# stand-in engine tests and test_warmup.py. The fitted plan's coverage buckets (the largest prompt
# and decode buckets within the limits) serve any step the trace did not foresee, so a case whose
# steps differ (other prompts, more tokens) still recompiles nothing.
STEP_TRACE = Path(__file__).with_name("compile_steps.trace")
GRAPH_BUDGET = 6


def fitted_plan_env() -> dict[str, str]:
    """The variables that give a case the fitted plan above."""
    return {
        "VLLM_BUCKETING_STRATEGY": "fitted",
        "VLLM_BUCKETING_TRACE": str(STEP_TRACE),
        "VLLM_BUCKETING_GRAPH_BUDGET": str(GRAPH_BUDGET),
    }


def main(job: dict) -> None:
    from engine_job import environment  # this script's folder is first on sys.path

    for name, case in job["cases"].items():
        engine = {**job["engine"], **case.get("engine", {})}
        try:
            with environment(case.get("env", {})):
                result = run_case(case["model"], engine, job, case)
        except Exception:
            result = {"error": traceback.format_exc()[-6000:]}
        print(f"RESULT {name} " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
