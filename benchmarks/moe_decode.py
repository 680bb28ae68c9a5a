"""Low-batch MoE decode: the routed experts' weights gathered for the MoE kernel, or all of them.

A decode step of a few tokens routes to a few experts, but the dense pass hands the kernel every
local expert, and on a Gaudi the kernel streams all their weights from HBM every step. For a MoE
layer with DeepSeek-V2-Lite's routing scaled down (64 experts, top-6; hidden 512, 384 per expert),
in unquantized bf16, FP8 (W8A8 on the FP8 kernel, per-tensor static scales) and AWQ 4-bit
(dequantized per call), at batch 1, 4, 16 and 64, side by side in one run:

- kernel bytes: expert-weight bytes handed to the seam's MoE kernel, as a fraction of what the
  dense pass hands it (goal at batch 1: at most 1.25 x top_k / experts);
- moved bytes: the same, counting the gather's own copy (it reads and writes the routed experts'
  weights before the kernel reads the copy; 4-bit and block-FP8 experts are gathered packed,
  then dequantized): the HBM traffic a Gaudi pays, which sets the automatic threshold;
- emulated ms per layer call, with the gather and without, in eager mode (the emulated kernel
  already skips unrouted experts, so only the gather's overhead shows) and under torch.compile
  (the kernel runs every expert it is handed, as Gaudi's does). CPU time, not a Gaudi's;
- auto: whether the default threshold (VLLM_MOE_GATHER_MAX_TOKENS unset) gathers at that batch.

Then one engine check: a tiny 16-expert Mixtral, prompts one at a time (decode at batch 1), with
the gather forced off and at its default: greedy tokens must be identical, and the gathered run
must have gathered. The last line is one JSON object of the figures.

    python -m benchmarks.moe_decode [--repeats N] [--no-engine]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks.quant import (
    fp8_config,
    fp8_tensors,
    median_ms,
    moe_layer,
    recording_moe_kernels,
)
from gaudi_testkit.parallel import single_process_parallel

ROOT = Path(__file__).resolve().parents[1]
SHAPE = {"experts": 64, "top_k": 6, "hidden": 512, "inter": 384}
BATCHES = (1, 4, 16, 64)
GATHER = "VLLM_MOE_GATHER_MAX_TOKENS"


def _set_gather(layer: Any, setting: str | None) -> None:
    if setting is None:
        os.environ.pop(GATHER, None)
    else:
        os.environ[GATHER] = setting
    layer.quant_method._gather_max_tokens = None  # each method reads the setting at its next call


def _bf16_tensors(expert: int, proj: str, rows: int, cols: int):
    g = torch.Generator().manual_seed(31 * expert + len(proj) + ord(proj[1]))
    yield "weight", (torch.randn(rows, cols, generator=g) * 0.02).to(torch.bfloat16)


def _awq_tensors(expert: int, proj: str, rows: int, cols: int):
    from tests.quant import packers

    g = torch.Generator().manual_seed(31 * expert + len(proj) + ord(proj[1]))
    weight = torch.randn(rows, cols, generator=g) * 0.02
    yield from packers.pack_awq(packers.quantize(weight, 128, sym=False)).items()


def _layers() -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))  # the 4-bit packers live with the tests
    from tests.quant import packers
    from vllm_gaudi_ops import register
    from vllm_gaudi_quant.methods.awq import HpuAwqConfig

    register.moe()  # the HPU unquantized MoE method, as the hpu_ops_moe entry point installs it

    return {
        "bf16": moe_layer(SHAPE, None, 0, _bf16_tensors),
        "fp8": moe_layer(SHAPE, fp8_config(None), 1, fp8_tensors(None)),
        "awq": moe_layer(SHAPE, HpuAwqConfig.from_config(packers.awq_config(128)), 2, _awq_tensors),
    }


def _kernel_bytes(layer: Any, x: torch.Tensor, logits: torch.Tensor) -> tuple[int, int]:
    """(expert-weight bytes handed to the kernel, experts handed) in one call."""
    handed: list[tuple[int, int]] = []

    def record(name: str, args: tuple) -> None:
        weights = [*args[3], *args[4]]
        handed.append((sum(w.numel() * w.element_size() for w in weights), len(args[3])))

    with recording_moe_kernels(record), torch.no_grad():
        layer.quant_method.apply_monolithic(layer, x, logits)
    ((passed, experts),) = handed
    return passed, experts


def layer_rows(repeats: int) -> dict[str, Any]:
    from vllm.config import VllmConfig, set_current_vllm_config

    from vllm_gaudi_platform.worker.routed_experts import (
        GATHER_COST_AS_STORED,
        dequantized_gather_cost,
        gather_max_tokens,
    )

    e, k = SHAPE["experts"], SHAPE["top_k"]
    costs = {
        "bf16": GATHER_COST_AS_STORED,
        "fp8": GATHER_COST_AS_STORED,
        "awq": dequantized_gather_cost(0.5, 2),
    }
    figures: dict[str, Any] = {}
    header = (
        f"{'experts':6} {'batch':>5} {'handed':>6} {'kernel bytes':>12} {'moved bytes':>11} "
        f"{'auto':>5} {'eager ms':>17} {'compiled ms':>17}"
    )
    print(
        f"MoE layer, {e} experts top-{k}, hidden {SHAPE['hidden']}, {SHAPE['inter']} per expert "
        "(fractions of the dense pass; ms: gathered / dense)"
    )
    print(header)
    print("-" * len(header))
    with set_current_vllm_config(VllmConfig()):
        single_process_parallel()
        layers = _layers()
        for fmt, layer in layers.items():
            _set_gather(layer, None)
            auto = gather_max_tokens(e, k, costs[fmt])
            rows: dict[str, Any] = {"auto_max_tokens": auto}
            for batch in BATCHES:
                gen = torch.Generator().manual_seed(batch)
                x = (torch.randn(batch, SHAPE["hidden"], generator=gen) * 0.5).to(torch.bfloat16)
                logits = torch.randn(batch, e, generator=gen)
                _set_gather(layer, "0")
                dense_bytes, _ = _kernel_bytes(layer, x, logits)
                with torch.no_grad():
                    dense_out = layer.quant_method.apply_monolithic(layer, x, logits)
                _set_gather(layer, str(max(BATCHES)))
                passed, handed = _kernel_bytes(layer, x, logits)
                with torch.no_grad():
                    gathered_out = layer.quant_method.apply_monolithic(layer, x, logits)
                fraction = passed / dense_bytes
                moved = fraction * costs[fmt] if handed < e else 1.0
                times = {}
                torch._dynamo.reset()
                for mode in ("eager", "compiled"):
                    calls = {}
                    method = layer.quant_method
                    fn = method.apply_monolithic
                    if mode == "compiled":
                        fn = torch.compile(fn, backend="eager", dynamic=False)
                    for limit in (0, max(BATCHES)):

                        def call(
                            fn=fn, method=method, limit=limit, layer=layer, x=x, logits=logits
                        ):
                            method._gather_max_tokens = limit  # what the setting resolves to
                            with torch.no_grad():
                                return fn(layer, x, logits)

                        call()  # compile before timing
                        calls[limit] = call
                    times[mode] = median_ms(calls[max(BATCHES)], calls[0], repeats)
                same = bool(torch.equal(gathered_out, dense_out))
                rows[str(batch)] = {
                    "experts_handed": handed,
                    "kernel_bytes_fraction": round(fraction, 4),
                    "moved_bytes_fraction": round(moved, 4),
                    "auto_gathers": batch <= auto and batch * k < e,
                    "eager_ms": [round(t, 3) for t in times["eager"]],
                    "compiled_ms": [round(t, 3) for t in times["compiled"]],
                    "same_output": same,
                }
                eager = "{:.2f} / {:.2f}".format(*times["eager"])
                compiled = "{:.2f} / {:.2f}".format(*times["compiled"])
                print(
                    f"{fmt:6} {batch:>5} {handed:>6} {fraction:>12.3f} {moved:>11.3f} "
                    f"{'yes' if rows[str(batch)]['auto_gathers'] else 'no':>5} "
                    f"{eager:>17} {compiled:>17}" + ("" if same else "  OUTPUT DIFFERS")
                )
            figures[fmt] = rows
        _set_gather(layers["bf16"], None)
    print(
        f"goal at batch 1: kernel bytes <= 1.25 x {k}/{e} = {1.25 * k / e:.3f}; auto gathers "
        "while moved bytes < 1 (the gather's copy included)"
    )
    return figures


# ----------------------------------------------------------------------------- engine check
ENGINE_RUN = r"""
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model runs in this process
from vllm_gaudi_platform.worker import routed_experts
from vllm_gaudi_ops.families import moe

calls = {"gathered": 0, "dense": 0}
select = moe.select_experts

def counting(*args, **kwargs):
    chosen = select(*args, **kwargs)
    calls["gathered" if chosen.gathered else "dense"] += 1
    return chosen

moe.select_experts = counting

if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], max_num_seqs=1, max_model_len=512, block_size=128,
              num_gpu_blocks_override=64, enforce_eager=True, dtype="float32")
    prompts = [[5 + i, 17, 29 + 2 * i, 41] * (1 + i) for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = []
    for p in prompts:  # one at a time: every decode step is a batch of one
        (out,) = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
        tokens.append(list(out.outputs[0].token_ids))
    print("RESULT " + json.dumps({"tokens": tokens, "calls": calls}))
"""


def engine_check() -> dict[str, Any]:
    from gaudi_testkit import tinymodels

    model = str(tinymodels.build("mixtral-16"))
    results = {}
    for label, setting in (("dense", "0"), ("default", None)):
        env = {**os.environ, "VLLM_HPU_EMULATION": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1"}
        env.pop(GATHER, None)
        if setting is not None:
            env[GATHER] = setting
        proc = subprocess.run(
            [sys.executable, "-c", ENGINE_RUN, model],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if not lines:
            raise SystemExit(f"engine run ({label}) failed:\n{proc.stderr[-4000:]}")
        results[label] = json.loads(lines[-1][len("RESULT ") :])
    same = results["dense"]["tokens"] == results["default"]["tokens"]
    calls = {label: r["calls"] for label, r in results.items()}
    print(
        f"\nengine, tiny Mixtral (16 experts, top-2), prompts one at a time: greedy tokens "
        f"{'identical' if same else 'DIFFER'}; MoE calls gathered/dense: forced off "
        f"{calls['dense']['gathered']}/{calls['dense']['dense']}, default "
        f"{calls['default']['gathered']}/{calls['default']['dense']}"
    )
    return {"same_tokens": same, "engine_calls": calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-engine", action="store_true", help="skip the engine check")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_HPU_EMULATION", "cpu")
    os.environ.pop(GATHER, None)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    figures = layer_rows(args.repeats)
    summary: dict[str, Any] = {
        "expert_bytes_fraction": {
            str(b): figures["bf16"][str(b)]["kernel_bytes_fraction"] for b in BATCHES
        },
        "top_k": SHAPE["top_k"],
        "num_experts": SHAPE["experts"],
        "same_output": all(
            row["same_output"]
            for f in figures.values()
            for row in f.values()
            if isinstance(row, dict)
        ),
        "formats": figures,
    }
    if not args.no_engine:
        summary.update(engine_check())
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
