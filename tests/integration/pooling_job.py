"""Runs the offline embedding cases of test_pooling.py in ONE fresh process (vLLM imported once)
and prints one `RESULT <case> <json>` line per case:

    python pooling_job.py '<json job>'

Job: {"cases": {name: {"model": path, "prompts": [[token ids]], "engine": {LLM kwargs},
"task": "embed" (default), "classify" or "reward", "pooler": {PoolerConfig fields} (optional),
"env": {variables set while the case's engine runs} (optional)}}}.
Each case starts `LLM(..., runner="pooling")`, embeds (or classifies: class probabilities; or
rewards: one score per prompt token, vLLM's `token_classify` task) its prompts twice (once all
together, mixed lengths in shared steps, once one prompt per call) and
reports both sets of vectors, the HPU runner's recompile statistics and what became of the
model's `compute_logits` (see `guard_compute_logits`). A case that fails prints its error instead,
so the other cases still report.
"""

from __future__ import annotations

import functools
import gc
import json
import sys
import traceback

from engine_job import environment  # this script's folder is first on sys.path

# What the guard saw for the case running now: whether the loaded model has a compute_logits,
# and how often anything called it (warmup and serving run in this process: the engine core is
# in-process, see generation.run_job).
COMPUTE_LOGITS = {"present": False, "calls": 0}


def guard_compute_logits() -> None:
    """Make every model the HPU runner loads count, then refuse, a `compute_logits` call: a
    pooling model has no LM head to run, and the runner's warmup must skip it."""
    from vllm_gaudi_platform.worker.model_runner import HPUModelRunner

    load_model = HPUModelRunner.load_model

    def load_guarded(self, *args, **kwargs):
        load_model(self, *args, **kwargs)
        if not hasattr(self.model, "compute_logits"):
            return
        COMPUTE_LOGITS["present"] = True

        def refuse(*_args, **_kwargs):
            COMPUTE_LOGITS["calls"] += 1
            raise RuntimeError("compute_logits called on a pooling model")

        self.model.compute_logits = refuse

    HPUModelRunner.load_model = load_guarded


def run_case(case: dict) -> dict:
    from vllm import LLM
    from vllm.config import PoolerConfig
    from vllm.inputs import TokensPrompt

    COMPUTE_LOGITS.update(present=False, calls=0)
    pooler = PoolerConfig(**case["pooler"]) if "pooler" in case else None
    llm = LLM(model=case["model"], runner="pooling", pooler_config=pooler, **case["engine"])
    try:
        prompts = [TokensPrompt(prompt_token_ids=p) for p in case["prompts"]]
        task = case.get("task", "embed")
        if task == "classify":
            pool, vector = llm.classify, lambda o: o.outputs.probs
        elif task == "reward":
            pool = functools.partial(llm.encode, pooling_task="token_classify")
            vector = lambda o: o.outputs.data.flatten().tolist()  # noqa: E731
        else:
            pool, vector = llm.embed, lambda o: o.outputs.embedding
        together = pool(prompts, use_tqdm=False)
        alone = [pool([p], use_tqdm=False)[0] for p in prompts]
        return {
            "together": [vector(o) for o in together],
            "alone": [vector(o) for o in alone],
            "stats": llm.collective_rpc("get_recompile_stats")[0],
            "compute_logits": dict(COMPUTE_LOGITS),
        }
    finally:
        del llm
        gc.collect()


def main(job: dict) -> None:
    guard_compute_logits()
    for name, case in job["cases"].items():
        try:
            with environment(case.get("env", {})):
                result = run_case(case)
        except Exception as exc:  # report, and let the next case run
            traceback.print_exc()
            result = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"RESULT {name} " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
