"""Sleep mode end to end in one engine process: generate, sleep, wake the weights, then the KV
cache, generate again, at both levels, and report what the worker held on the device at each point
and its recompile statistics after each run as a RESULT JSON line.

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

    def stats() -> dict:
        return llm.collective_rpc("get_recompile_stats")[0]

    seam = llm.collective_rpc(lambda worker: worker.model_runner.seam.NAME)[0]
    out: dict = {"seam": seam, "before": generate(), "awake": report(), "stats_before": stats()}
    for level in (1, 2):
        out[f"level{level}_before"] = report()
        llm.sleep(level=level)
        out[f"level{level}_asleep"] = report()
        llm.wake_up(tags=["weights"])
        out[f"level{level}_weights_only"] = report()
        llm.wake_up(tags=["kv_cache"])
        out[f"level{level}_woken"] = report()
        out[f"after_level{level}"] = generate()
        out[f"stats_after_level{level}"] = stats()
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(run(sys.argv[1])), flush=True)
