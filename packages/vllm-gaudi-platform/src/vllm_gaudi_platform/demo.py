"""`vllm-gaudi demo`: a short offline generation on the HPU platform, end to end.

On a Gaudi it uses the device; elsewhere it turns on CPU emulation (VLLM_HPU_EMULATION=cpu)
unless the operator set that variable. The model is a tiny Llama built locally on first use
(`tinymodels.py`), so the demo needs no model hub. It prints the outputs, the bucket plan, the
warmup time and the number of recompiles after warmup.
"""

from __future__ import annotations

import os

PROMPTS = [
    "Intel Gaudi accelerators run",
    "The quick brown fox",
    "Hello world! How are you",
    "A paged key value cache stores attention keys and values in fixed size blocks, and",
]


def run(*, max_tokens: int = 16, model: str | None = None) -> int:
    from vllm_gaudi_platform import envs, tinymodels
    from vllm_gaudi_platform.seam.probe import gaudi_software_installed

    if envs.VLLM_HPU_EMULATION not in os.environ and not gaudi_software_installed():
        os.environ[envs.VLLM_HPU_EMULATION] = "cpu"
        print("No Gaudi software found: running the HPU platform in CPU emulation.")
    path = model or str(tinymodels.build("llama"))

    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    if type(current_platform).__name__ != "HpuPlatform":
        print(
            f"The HPU platform is not active (vLLM chose {type(current_platform).__name__}); "
            "run `vllm-gaudi doctor` to see why."
        )
        return 1
    llm = LLM(
        model=path,
        dtype="float32" if current_platform.is_emulated() else "bfloat16",
        max_model_len=512,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        kv_cache_memory_bytes=64 << 20,
        seed=0,
    )
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    stats = llm.collective_rpc("get_recompile_stats")[0]
    print(f"\nDevice: {current_platform.get_device_name()}")
    print("Outputs (greedy, tiny model with random weights, so the text is noise):")
    for out in outputs:
        print(f"  {out.prompt!r} -> {out.outputs[0].text!r}")
    print(stats["bucket_plan"])
    print(f"Warmup: {stats['warmup_seconds']:.2f} s")
    print(f"Recompiles after warmup: {stats['recompiles']}")
    return 0
