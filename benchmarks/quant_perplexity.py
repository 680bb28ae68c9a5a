"""Held-out perplexity of the trained tiny Llama per quantized checkpoint format, over float.

A random-weight model has no accuracy to lose; the tiny Llama trained on the Python docs
(`vllm_gaudi_platform.trainedmodel`) does. Each format's checkpoint is written from it by the
test packers (tests/quant/checkpoints.py: every decoder linear quantized, embeddings, norms and
LM head float), and every model, the float one included, is scored through the HPU platform in
CPU emulation (float32 activations) with prompt logprobs over the same held-out windows. The
ratio quantized/float is the accuracy cost of the format (measured: within 0.1% of 1 for every
format here); a bug in scales or packing shows up as a ratio far above that.

    python benchmarks/quant_perplexity.py [--formats NAME ...] [--windows N]

All engines run one after the other in one child process (vLLM resolves its platform once per
process, and imports once). Not covered: INC FP8 (it needs `vllm-gaudi calibrate` first).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Row label -> tests/quant/checkpoints.py format.
FORMATS = {
    "fp8 W8A8 (compressed-tensors)": "ct-fp8-dynamic",
    "awq g32": "awq",
    "gptq g64": "gptq",
    "gptq g32 act-order": "gptq-act-order",
    "wna16 g64 (compressed-tensors)": "ct-wna16-asym",
}
ENGINE = {
    "dtype": "float32",
    "max_model_len": 512,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 512,
    "kv_cache_memory_bytes": 64 << 20,
    "seed": 0,
}


def _score(model: str, windows: list[list[int]]) -> list[list[float]]:
    """Prompt log-probabilities of every window on one engine, stopped before returning."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_gaudi_platform import trainedmodel

    llm = LLM(model=model, **ENGINE)
    try:
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=w) for w in windows],
            SamplingParams(max_tokens=1, prompt_logprobs=0),
            use_tqdm=False,
        )
        return trainedmodel.vllm_logprobs(outs)
    finally:
        # The next model's engine starts in this process: stop this one first.
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def _job(spec: dict) -> None:
    """Child process: score each model, one JSON line each (or its error)."""
    from vllm_gaudi_platform import trainedmodel

    for name, model in spec["models"].items():
        try:
            ppl = trainedmodel.perplexity(_score(model, spec["windows"]))
            result: dict = {"perplexity": ppl}
        except Exception as exc:  # one format failing must not hide the others' numbers
            result = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"RESULT {name} {json.dumps(result)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--windows", type=int, default=16, help="held-out windows of 128 tokens")
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        _job(json.loads(args.job))
        return

    sys.path.insert(0, str(ROOT))  # the checkpoint writers live with the tests
    from tests.quant import checkpoints
    from vllm_gaudi_platform import trainedmodel

    model = trainedmodel.build()
    windows = trainedmodel.heldout_windows(model, args.windows)
    reference = trainedmodel.perplexity(trainedmodel.transformers_logprobs(model, windows))
    with tempfile.TemporaryDirectory() as tmp:
        models = {"float": str(model)}
        for label in args.formats:
            qdir, _ = checkpoints.write(model, Path(tmp), FORMATS[label])
            models[label] = str(qdir)
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
        env["VLLM_HPU_EMULATION"] = "cpu"
        spec = json.dumps({"models": models, "windows": windows})
        proc = subprocess.run(
            [sys.executable, __file__, "--job", spec], capture_output=True, text=True, env=env
        )
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            name, payload = line[len("RESULT ") :].split(" {", 1)
            results[name] = json.loads("{" + payload)
    if "float" not in results:
        sys.exit(f"the engine job failed:\n{proc.stderr[-4000:]}")

    tokens = sum(len(w) - 1 for w in windows)
    print(f"trained tiny Llama {model.name}: held-out perplexity over {tokens} tokens")
    print(f"transformers float32: {reference:.3f}")
    header = f"{'checkpoint':32} {'perplexity':>10} {'/ float':>8}"
    print(header)
    print("-" * len(header))
    base = results["float"].get("perplexity")
    for name in models:
        r = results.get(name, {"error": "no result (the job process died)"})
        if "perplexity" in r and base:
            print(f"{name:32} {r['perplexity']:>10.3f} {r['perplexity'] / base:>7.4f}x")
        else:
            print(f"{name:32} {'failed':>10}  {r.get('error', '')[:200]}")


if __name__ == "__main__":
    main()
