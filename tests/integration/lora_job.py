"""Multi-LoRA end to end in one engine process (HPU platform in emulation):

    python lora_job.py '<json job>'

Job keys: model (base model path), adapters ({name: path}), prompts (token id lists),
max_tokens, engine (LLM kwargs). Prints one `RESULT <case> <json>` line per case:
- mixed: every prompt once with the base model and once per adapter, all in ONE generate call
  (steps mix adapters and the base model), greedy tokens with top-5 logprobs per (name, prompt);
- runtime: the adapters loaded after `mixed`, after removing the first one, its output once it is
  loaded back at run time, and after an explicit add_lora;
- stats: the worker's recompile statistics after all of the above.
"""

from __future__ import annotations

import json
import sys


def _result(output) -> dict:
    return {
        "tokens": list(output.outputs[0].token_ids),
        "logprobs": [
            {str(t): lp.logprob for t, lp in step.items()} for step in output.outputs[0].logprobs
        ],
    }


def run(job: dict) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    llm = LLM(model=job["model"], **job["engine"])
    params = SamplingParams(
        temperature=0.0, max_tokens=job["max_tokens"], logprobs=5, ignore_eos=True
    )
    requests = {
        name: LoRARequest(lora_name=name, lora_int_id=i + 1, lora_path=path)
        for i, (name, path) in enumerate(job["adapters"].items())
    }
    names = ["base", *requests]
    prompts, loras = [], []
    for name in names:
        for p in job["prompts"]:
            prompts.append(TokensPrompt(prompt_token_ids=p))
            loras.append(requests.get(name))
    outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    mixed: dict[str, list[dict]] = {name: [] for name in names}
    for i, out in enumerate(outs):
        mixed[names[i // len(job["prompts"])]].append(_result(out))
    print("RESULT mixed " + json.dumps(mixed), flush=True)

    engine = llm.llm_engine
    first, second = list(requests)[:2]
    runtime: dict = {"loaded": sorted(engine.list_loras())}
    runtime["removed"] = engine.remove_lora(requests[first].lora_int_id)
    runtime["after_remove"] = sorted(engine.list_loras())
    again = llm.generate(
        [TokensPrompt(prompt_token_ids=job["prompts"][0])] * 2,
        params,
        lora_request=[requests[first], requests[second]],
        use_tqdm=False,
    )
    runtime["reloaded_outputs"] = [_result(o) for o in again]
    runtime["after_reload"] = sorted(engine.list_loras())
    engine.remove_lora(requests[first].lora_int_id)
    runtime["added"] = engine.add_lora(requests[first])
    runtime["after_add"] = sorted(engine.list_loras())
    print("RESULT runtime " + json.dumps(runtime), flush=True)
    print("RESULT stats " + json.dumps(llm.collective_rpc("get_recompile_stats")[0]), flush=True)


if __name__ == "__main__":
    run(json.loads(sys.argv[1]))
