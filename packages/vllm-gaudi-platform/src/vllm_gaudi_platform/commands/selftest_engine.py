"""`vllm-gaudi selftest`'s end-to-end part: the demo's engine and model (`demo.py`,
`demo_model.py`: the tiny Llama trained on first use, then cached) on the HPU platform, a few
greedy completions, and the held-out perplexity through the platform against transformers'
float32 figure on the host.

The ratio must stay within `PERPLEXITY_RATIO_TOLERANCE` of 1 for the engine's dtype: float32
(emulation) to the demo's own bound; bfloat16 (a Gaudi, the stand-in) within 1 %, the bound the
suite gives FP8 W8A8 against float.
"""

from __future__ import annotations

from typing import Any

PERPLEXITY_RATIO_TOLERANCE = {"float32": 1e-3, "bfloat16": 1e-2}
# Fewer held-out windows than the demo's 16: the selftest's figure is a check, not a benchmark.
WINDOWS, WINDOW_TOKENS = 8, 128


def run_engine(max_tokens: int = 8) -> dict[str, Any]:
    from vllm_gaudi_platform.commands import demo, demo_model

    path = str(demo_model.build(progress=False))

    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    if type(current_platform).__name__ != "HpuPlatform":
        return {
            "ok": False,
            "error": f"the HPU platform is not active (vLLM chose "
            f"{type(current_platform).__name__}); run `vllm-gaudi doctor` to see why",
        }
    dtype = "float32" if current_platform.is_emulated() else "bfloat16"
    llm = LLM(model=path, dtype=dtype, **demo.ENGINE_ARGS)
    try:
        outputs = llm.generate(
            demo_model.heldout_prompts(),
            SamplingParams(temperature=0.0, max_tokens=max_tokens),
            use_tqdm=False,
        )
        hpu, reference, tokens = demo.heldout_perplexity(llm, path, WINDOWS, WINDOW_TOKENS)
        stats = llm.collective_rpc("get_recompile_stats")[0]
    finally:
        llm.llm_engine.engine_core.shutdown()
    ratio = hpu / reference
    tolerance = PERPLEXITY_RATIO_TOLERANCE[dtype]
    ok = abs(ratio - 1) <= tolerance
    return {
        "ok": ok,
        "device": current_platform.get_device_name(),
        "model": path,
        "dtype": dtype,
        "completions": [[o.prompt, o.outputs[0].text] for o in outputs],
        "perplexity_platform": hpu,
        "perplexity_reference": reference,
        "tokens_scored": tokens,
        "ratio": ratio,
        "tolerance": tolerance,
        "recompiles_after_warmup": stats["recompiles"],
        "warmup_seconds": stats["warmup_seconds"],
        **({} if ok else {"error": f"perplexity ratio {ratio:.5f} is beyond 1 +- {tolerance:g}"}),
    }
