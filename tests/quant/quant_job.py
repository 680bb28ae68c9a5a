"""Runs offline generations of quantized checkpoints, one engine after the other in this one
process, and prints one JSON line per checkpoint.

    python quant_job.py '<json job>'

Job keys: checkpoints ({name: model path}), prompts (token id lists), max_tokens, engine (LLM
kwargs), engine_overrides (optional {name: LLM kwargs} over `engine` for that checkpoint; a None
value drops the key), stats (bool: also report the HPU runner's recompile statistics). For each
checkpoint, as soon as its engine is done: `RESULT <name> <json>` with the greedy tokens and
top-5 logprobs, the quantization method vLLM resolved, what every linear layer of the worker's
model runs (its compressed-tensors scheme, or its quant method), what every MoE layer runs, and
the KV cache (dtype vLLM configured; per attention layer the backend's cache dtype and the k/v
scales); or `{"error": ...}` if that engine failed. One process for all of them: vLLM and torch
are imported once.
"""

from __future__ import annotations

import gc
import json
import sys
import traceback


def _inspect(worker) -> dict:
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    model = worker.model_runner.model
    linears, experts, attention = {}, {}, {}
    for name, m in model.named_modules():
        if name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj")):
            linears[name] = type(getattr(m, "scheme", None) or m.quant_method).__name__
        elif isinstance(m, RoutedExperts):
            experts[name] = type(m.quant_method).__name__
        elif hasattr(m, "impl") and hasattr(m, "_k_scale"):
            attention[name] = {
                "kv_cache_dtype": m.impl.kv_cache_dtype,
                "k_scale": float(m._k_scale),
                "v_scale": float(m._v_scale),
            }
    seam = worker.model_runner.seam.NAME
    # Where the engine's tensors live: the weights' and the KV cache's devices.
    caches = [t for t in worker.model_runner.kv_caches if hasattr(t, "device")]
    devices = sorted({str(t.device.type) for t in [*model.parameters(), *caches]})
    return {
        "linears": linears,
        "experts": experts,
        "attention": attention,
        "seam": seam,
        "devices": devices,
    }


def run(model: str, job: dict, name: str = "") -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    engine = {**job["engine"], **job.get("engine_overrides", {}).get(name, {})}
    llm = LLM(model=model, **{k: v for k, v in engine.items() if v is not None})
    try:
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
        config = llm.llm_engine.vllm_config
        result = {
            "results": results,
            "quantization": config.model_config.quantization,
            "kv_cache_dtype": config.cache_config.cache_dtype,
            **llm.collective_rpc(_inspect)[0],
        }
        if job.get("stats"):
            result["stats"] = llm.collective_rpc("get_recompile_stats")[0]
        return result
    finally:
        # The next checkpoint's engine starts in this process: stop this one's first.
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


if __name__ == "__main__":
    job = json.loads(sys.argv[1])
    for name, model in job["checkpoints"].items():
        try:
            result = run(model, job, name)
        except Exception:  # reported per checkpoint; the others still run
            result = {"error": traceback.format_exc()}
        print(f"RESULT {name} " + json.dumps(result), flush=True)
