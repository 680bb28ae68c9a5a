"""Sleep mode end to end in one engine process: generate, sleep, wake, generate again, at both
levels, and report what the worker held on the device at each point as a RESULT JSON line.

    python sleep_job.py <model>
"""

from __future__ import annotations

import json
import sys


def run(model: str) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=512,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        kv_cache_memory_bytes=32 << 20,
        enable_sleep_mode=True,
        seed=0,
    )
    prompts = [TokensPrompt(prompt_token_ids=[5 + i, 40, 77 + 3 * i, 9, 200 - i]) for i in range(4)]
    prompts.append(TokensPrompt(prompt_token_ids=list(range(3, 200))))  # more than one block
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

    def generate() -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    def report() -> dict:
        return llm.collective_rpc("get_sleep_report")[0]

    out: dict = {"before": generate(), "awake": report()}
    llm.sleep(level=1)
    out["level1_asleep"] = report()
    llm.wake_up()
    out["level1_woken"] = report()
    out["after_level1"] = generate()
    llm.sleep(level=2)
    out["level2_asleep"] = report()
    llm.wake_up(tags=["weights"])
    out["level2_weights_only"] = report()
    llm.wake_up(tags=["kv_cache"])
    out["level2_woken"] = report()
    out["after_level2"] = generate()
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(run(sys.argv[1])), flush=True)
