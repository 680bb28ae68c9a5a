"""Held-out perplexity of the trained tiny Llama per quantized checkpoint format, over float.

A random-weight model has no accuracy to lose; the tiny Llama trained on the Python docs
(`vllm_gaudi_platform.commands.demo_model`) does. Each format's checkpoint is written from it by
the test packers (tests/quant/checkpoints.py: every decoder linear quantized, embeddings, norms and
LM head float), and every model, the float one included, is scored through the HPU platform in
CPU emulation (float32 activations) with prompt logprobs over the same held-out windows. The
ratio quantized/float is the accuracy cost of the format (measured on the 2 x 128 model: 1.0015
for FP8 W8A8, 1.0034 for calibrated INC FP8 on neural-compressor's CPU path, 1.0029 / 1.0032 on
its HPU path as Gaudi 2 / Gaudi 3, 1.0053 to 1.0080 for the 4-bit integer formats, 1.0111 for
MXFP4 linears: E2M1 values with one power-of-two scale per 32); a bug in scales or packing shows
up as a ratio far above that.

INC FP8 has no checkpoint: `vllm-gaudi calibrate` measures the float model over training-text
paragraphs (never the held-out ones), and the QUANTIZE config it writes runs the float checkpoint
with `--quantization inc` (weights and activations FP8 in every decoder linear). In emulation that
is neural-compressor's CPU path (quantize-dequantize, arbitrary scales); the rows
"inc fp8 HPU flow, Gaudi 2/3" calibrate and score on its HPU path instead, the one a Gaudi runs
(hardware-aligned `maxabs_hw` scales: Gaudi 2's four scales and 240 range, Gaudi 3's powers of two
and 448; the LM head in FP8 too), with seam/gaudi over the Habana stand-in (tests/habana_standin)
playing that generation.

    python benchmarks/quant_perplexity.py [--formats NAME ...] [--windows N]

The emulated engines run one after the other in one child process (vLLM resolves its platform
once per process, and imports once), each Gaudi-flow row in one of its own; calibration runs
before, in its own `vllm-gaudi calibrate` process.
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

from vllm_gaudi_platform.commands import demo_model

ROOT = Path(__file__).resolve().parent.parent

# Row label -> tests/quant/checkpoints.py format.
FORMATS = {
    "fp8 W8A8 (compressed-tensors)": "ct-fp8-dynamic",
    "awq g32": "awq",
    "gptq g64": "gptq",
    "gptq g32 act-order": "gptq-act-order",
    "wna16 g64 (compressed-tensors)": "ct-wna16-asym",
    "mxfp4 (compressed-tensors)": "ct-mxfp4",
}
INC_FP8 = "inc fp8 (calibrated)"
# INC on neural-compressor's HPU flow (the one a Gaudi runs: maxabs_hw scales, FP8 GEMMs, the LM
# head quantized too), seam/gaudi over the Habana stand-in playing each Gaudi generation.
INC_GAUDI = {"inc fp8 HPU flow, Gaudi 2": 2, "inc fp8 HPU flow, Gaudi 3": 3}
CALIBRATION_SAMPLES = 64
ENGINE = demo_model.ENGINE_ARGS


def _score(
    model: str, windows: list[list[int]], quant_config: str | None = None
) -> list[list[float]]:
    """Prompt log-probabilities of every window on one engine, stopped before returning.

    `quant_config`: an INC QUANTIZE config; the model then runs with `quantization="inc"`."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_gaudi_platform.commands import demo_model

    extra = {}
    if quant_config:
        # Read when the engine starts (its worker inherits this process's environment).
        os.environ["QUANT_CONFIG"] = quant_config
        extra["quantization"] = "inc"
    else:
        os.environ.pop("QUANT_CONFIG", None)
    llm = LLM(model=model, **ENGINE, **extra)
    try:
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=w) for w in windows],
            SamplingParams(max_tokens=1, prompt_logprobs=0),
            use_tqdm=False,
        )
        return demo_model.vllm_logprobs(outs)
    finally:
        # The next model's engine starts in this process: stop this one first.
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def _job(spec: dict) -> None:
    """Child process: score each model, one JSON line each (or its error)."""
    from vllm_gaudi_platform.commands import demo_model

    for name, model in spec["models"].items():
        try:
            quant_config = spec["quant_configs"].get(name)
            ppl = demo_model.perplexity(_score(model, spec["windows"], quant_config))
            result: dict = {"perplexity": ppl}
        except Exception as exc:  # one format failing must not hide the others' numbers
            result = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"RESULT {name} {json.dumps(result)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    choices = [*FORMATS, INC_FP8, *INC_GAUDI]
    parser.add_argument("--formats", nargs="+", default=choices, choices=choices)
    parser.add_argument("--windows", type=int, default=16, help="held-out windows of 128 tokens")
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        _job(json.loads(args.job))
        return

    sys.path.insert(0, str(ROOT))  # the checkpoint writers live with the tests
    from tests.quant import checkpoints
    from vllm_gaudi_platform.commands import demo_model

    model = demo_model.build()
    windows = demo_model.heldout_windows(model, args.windows)
    reference = demo_model.perplexity(demo_model.transformers_logprobs(model, windows))
    with tempfile.TemporaryDirectory() as tmp:
        models = {"float": str(model)}
        quant_configs: dict[str, str] = {}
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
        env.pop("QUANT_CONFIG", None)
        env["VLLM_HPU_EMULATION"] = "cpu"
        for label in args.formats:
            if label == INC_FP8:
                config = _calibrate(model, Path(tmp) / "inc", env)
                if config is not None:
                    models[label], quant_configs[label] = str(model), str(config)
                continue
            if label in INC_GAUDI:
                continue
            qdir, _ = checkpoints.write(model, Path(tmp), FORMATS[label])
            models[label] = str(qdir)
        results, stderr = _run_job(models, quant_configs, windows, env)
        if "float" not in results:
            sys.exit(f"the engine job failed:\n{stderr[-4000:]}")
        for label in (n for n in args.formats if n in INC_GAUDI):
            gaudi_env = _standin_env(env, INC_GAUDI[label])
            config = _calibrate(model, Path(tmp) / f"gaudi{INC_GAUDI[label]}", gaudi_env)
            if config is not None:
                models[label] = str(model)
                found, stderr = _run_job(
                    {label: str(model)}, {label: str(config)}, windows, gaudi_env
                )
                results[label] = found.get(label, {"error": f"the job died: {stderr[-300:]}"})
    for label in (INC_FP8, *INC_GAUDI):
        if label in args.formats and label not in models:
            results[label] = {"error": "vllm-gaudi calibrate failed (its output is printed above)"}

    tokens = sum(len(w) - 1 for w in windows)
    print(f"trained tiny Llama {model.name}: held-out perplexity over {tokens} tokens")
    print(f"transformers float32: {reference:.3f}")
    header = f"{'checkpoint':32} {'perplexity':>10} {'/ float':>8}"
    print(header)
    print("-" * len(header))
    base = results["float"].get("perplexity")
    for name in [*models, *(n for n in args.formats if n not in models)]:
        r = results.get(name, {"error": "no result (the job process died)"})
        if "perplexity" in r and base:
            print(f"{name:32} {r['perplexity']:>10.3f} {r['perplexity'] / base:>7.4f}x")
        else:
            print(f"{name:32} {'failed':>10}  {r.get('error', '')[:200]}")


def _run_job(
    models: dict[str, str], quant_configs: dict[str, str], windows: list, env: dict[str, str]
) -> tuple[dict[str, dict], str]:
    """Score `models` in one child process under `env`: {name: result}, and its stderr."""
    spec = json.dumps({"models": models, "quant_configs": quant_configs, "windows": windows})
    proc = subprocess.run(
        [sys.executable, __file__, "--job", spec], capture_output=True, text=True, env=env
    )
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            name, payload = line[len("RESULT ") :].split(" {", 1)
            results[name] = json.loads("{" + payload)
    return results, proc.stderr


def _standin_env(env: dict[str, str], generation: int) -> dict[str, str]:
    """A process whose "Gaudi" is the Habana stand-in of that generation, its tensors on the
    stand-in's torch device "hpu" (tests/quant/test_inc_engine.py runs the same)."""
    from tests.conftest import STANDIN_ENGINE_ENV

    out = {k: v for k, v in env.items() if k != "VLLM_HPU_EMULATION"}
    out.update({k: v for k, v in STANDIN_ENGINE_ENV.items() if v is not None})
    out["PYTHONPATH"] = os.pathsep.join([out["PYTHONPATH"], str(ROOT)])
    out.update(
        HABANA_STANDIN_GENERATION=str(generation),
        PT_HPU_LAZY_MODE="1",
    )
    return out


def _calibrate(model: Path, tmp: Path, env: dict[str, str]) -> Path | None:
    """`vllm-gaudi calibrate` over training paragraphs; the QUANTIZE config, or None on failure
    (printed, so that the other formats' numbers still come)."""
    from vllm_gaudi_platform.commands import demo_model

    tmp.mkdir(parents=True, exist_ok=True)
    dataset = tmp / "calibration.jsonl"
    paragraphs = [p for p in demo_model.split()[0].split("\n\n") if len(p) > 200]
    with dataset.open("w") as f:
        for text in paragraphs[:: max(1, len(paragraphs) // CALIBRATION_SAMPLES)]:
            f.write(json.dumps({"text": text[:1500]}) + "\n")  # < max_model_len tokens
    out = tmp / "inc-calibration"
    proc = subprocess.run(
        [
            str(Path(sys.executable).with_name("vllm-gaudi")),
            "calibrate",
            str(model),
            "--dataset",
            str(dataset),
            "--out",
            str(out),
            "--num-samples",
            str(CALIBRATION_SAMPLES),
            "--dtype",
            ENGINE["dtype"],
            "--max-model-len",
            str(ENGINE["max_model_len"]),
            "--kv-cache-memory-bytes",
            str(ENGINE["kv_cache_memory_bytes"]),
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode != 0:
        print(f"{INC_FP8}: vllm-gaudi calibrate failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    return out / "quant_config.json"


if __name__ == "__main__":
    main()
