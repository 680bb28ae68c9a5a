"""`vllm-gaudi demo`: a short offline generation on the HPU platform, end to end.

On a Gaudi it uses the device; elsewhere it turns on CPU emulation (VLLM_HPU_EMULATION=cpu)
unless the operator set that variable. The default model is a tiny Llama trained locally on the
Python documentation on first use (`demo_model.py`, about 3 minutes on 2 cores, then cached),
so the demo needs no model hub. It prints greedy completions of prompts from the held-out text,
the model's held-out perplexity measured through the HPU platform (prompt logprobs) next to the
same figure from transformers, the bucket plan, the warmup time and the recompiles after warmup.
"""

from __future__ import annotations

import os

# Held-out windows for the perplexity figure: 16 x 128 tokens keeps the demo quick.
PERPLEXITY_WINDOWS = 16
PERPLEXITY_WINDOW_TOKENS = 128
# The demo's engine (`vllm-gaudi selftest` starts the same one).
ENGINE_ARGS = {
    "max_model_len": 512,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 512,
    "kv_cache_memory_bytes": 64 << 20,
    "seed": 0,
}


def run(*, max_tokens: int = 16, model: str | None = None) -> int:
    """Run the demo; `model` replaces the trained tiny Llama (the held-out perplexity is then
    not printed: its tokenizer and text are not the trained model's)."""
    from vllm_gaudi_platform import envs
    from vllm_gaudi_platform.commands import demo_model
    from vllm_gaudi_platform.seam.probe import gaudi_software_installed

    if envs.VLLM_HPU_EMULATION not in os.environ and not gaudi_software_installed():
        os.environ[envs.VLLM_HPU_EMULATION] = "cpu"
        print("No Gaudi software found: running the HPU platform in CPU emulation.")
    path = model or str(demo_model.build())

    from vllm import LLM
    from vllm.platforms import current_platform

    if type(current_platform).__name__ != "HpuPlatform":
        print(
            f"The HPU platform is not active (vLLM chose {type(current_platform).__name__}); "
            "run `vllm-gaudi doctor` to see why."
        )
        return 1
    dtype = "float32" if current_platform.is_emulated() else "bfloat16"
    llm = LLM(model=path, dtype=dtype, **ENGINE_ARGS)
    try:
        _generate(llm, path, dtype, max_tokens, scored_perplexity=model is None)
    finally:
        # Stop the engine process before this one exits, so that its end is not reported as an
        # engine core that "exited unexpectedly".
        llm.llm_engine.engine_core.shutdown()
    return 0


def _generate(llm, path: str, dtype: str, max_tokens: int, *, scored_perplexity: bool) -> None:
    from vllm import SamplingParams
    from vllm.platforms import current_platform

    from vllm_gaudi_platform.commands import demo_model

    prompts = demo_model.heldout_prompts()
    outputs = llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False
    )
    print(f"\nDevice: {current_platform.get_device_name()}")
    print(f"Model: {path}")
    print("Greedy completions of held-out Python documentation text:")
    for out in outputs:
        print(f"  {out.prompt!r} -> {out.outputs[0].text!r}")

    if scored_perplexity:
        hpu, reference, tokens = heldout_perplexity(llm, path)
        print(
            f"Held-out perplexity ({tokens} tokens): HPU platform ({dtype}) {hpu:.3f}, "
            f"transformers (float32) {reference:.3f}, ratio {hpu / reference:.5f}"
        )

    stats = llm.collective_rpc("get_recompile_stats")[0]
    print(stats["bucket_plan"])
    print(f"Warmup: {stats['warmup_seconds']:.2f} s")
    print(f"Recompiles after warmup: {stats['recompiles']}")
    if stats.get("compiled"):
        graphs = stats["compiled_graphs"]
        breaks = sum(len(found) for found in stats["graph_breaks"].values())
        print(
            f"torch.compile: {graphs['warmup']} graphs in warmup, {graphs['serving']} after, "
            f"{breaks} graph breaks"
        )
    elif stats.get("graphs_enabled"):
        print(f"HPU graphs: {stats['num_graphs']} captured, {stats['graph_replays']} replays")


def heldout_perplexity(
    llm, path: str, windows: int = PERPLEXITY_WINDOWS, length: int = PERPLEXITY_WINDOW_TOKENS
) -> tuple[float, float, int]:
    """(perplexity through the HPU platform, transformers' float32 perplexity on the host, tokens
    scored) of the trained model over `windows` held-out windows of `length` tokens."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_gaudi_platform.commands import demo_model

    held_out = demo_model.heldout_windows(path, windows, length)
    scored = llm.generate(
        [TokensPrompt(prompt_token_ids=w) for w in held_out],
        SamplingParams(max_tokens=1, prompt_logprobs=0),
        use_tqdm=False,
    )
    hpu = demo_model.perplexity(demo_model.vllm_logprobs(scored))
    reference = demo_model.perplexity(demo_model.transformers_logprobs(path, held_out))
    return hpu, reference, sum(len(w) - 1 for w in held_out)
