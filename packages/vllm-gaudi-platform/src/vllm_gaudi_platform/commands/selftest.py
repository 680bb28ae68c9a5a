"""`vllm-gaudi selftest`: the port checked on the machine it runs on, for the active backend (a
Gaudi; the Habana stand-in in CI; the CPU emulation), in a few minutes and without pytest or
downloads.

- kernels (`selftest_kernels.py`): every kernel of the seam's `HpuBackend` Protocol against its
  reference on the same inputs, with the suite's tolerances; a kernel that disagrees (or raises,
  or has no case) makes the exit status non-zero and is named;
- runtime: every other function of the Protocol, called once, its answer recorded;
- probes (`selftest_probes.py`): what the device does where Habana's sources do not say, and
  which of our defaults each observation confirms or contradicts;
- timings (`selftest_timing.py`) as ratios, and device memory figures;
- engine (`selftest_engine.py`): the demo's model generating through the platform, its held-out
  perplexity against transformers' on the host (`--no-engine` skips it).

One screen of results; `--json FILE` writes the report an operator attaches to an issue, and
that the platform reads defaults from (VLLM_HPU_SELFTEST_REPORT, `selftest_defaults.py`).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from typing import Any

from vllm_gaudi_platform.selftest_defaults import REPORT_FORMAT, REPORT_VERSION

WIDTH = 100


def run(*, json_path: str | None = None, engine: bool = True) -> int:
    """Run every part, print the screen, write the report; 0 when every kernel agrees with its
    reference and the engine's perplexity is within its tolerance."""
    from vllm_gaudi_platform import envs
    from vllm_gaudi_platform.seam.probe import gaudi_software_installed

    if envs.VLLM_HPU_EMULATION not in os.environ and not gaudi_software_installed():
        os.environ[envs.VLLM_HPU_EMULATION] = "cpu"
        print("No Gaudi software found: checking the HPU platform in CPU emulation.")
    report = collect(engine=engine)
    print(render(report, json_path))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    return 0 if report["ok"] else 1


def answer_source(kernels: Any) -> dict[str, str]:
    """Where the probes' answers come from: hardware, or one of our models of the device."""
    if kernels.IS_EMULATED:
        return {
            "kind": "emulation",
            "text": "the CPU emulation: answers come from our model of the device, not from "
            "hardware",
        }
    if getattr(sys.modules.get("habana_frameworks"), "STANDIN", False):
        return {
            "kind": "stand-in",
            "text": "the Habana stand-in: answers come from our model of the device (written "
            "from Habana's sources), not from hardware",
        }
    return {"kind": "hardware", "text": f"hardware: {kernels.device_name()}"}


@contextlib.contextmanager
def _emulating_generation(generation: str) -> Iterator[None]:
    """The emulation plays the Gaudi generation of the device it is compared with (FP8 range)."""
    from vllm_gaudi_platform import envs

    saved = os.environ.get(envs.VLLM_HPU_EMULATION_GAUDI)
    if generation in ("2", "3"):
        os.environ[envs.VLLM_HPU_EMULATION_GAUDI] = generation
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(envs.VLLM_HPU_EMULATION_GAUDI, None)
        else:
            os.environ[envs.VLLM_HPU_EMULATION_GAUDI] = saved


# How the selftest calls each device-runtime function of the Protocol (the kernels have cases).
RUNTIME_CALLS: dict[str, Callable[[Any], Any]] = {
    "graphs_supported": lambda k: k.graphs_supported(),
    "current_stream": lambda k: type(k.current_stream()).__name__,
    "stream": lambda k: _enter(k.stream(k.current_stream())),
    "torch_device": lambda k: str(k.torch_device(0)),
    "set_device": lambda k: k.set_device(k.torch_device(0)),
    "device_count": lambda k: k.device_count(),
    "device_name": lambda k: k.device_name(0),
    "mem_get_info": lambda k: list(k.mem_get_info()),
    "memory_allocated": lambda k: k.memory_allocated(),
    "reset_peak_memory_stats": lambda k: k.reset_peak_memory_stats(),
    "max_memory_allocated": lambda k: k.max_memory_allocated(),
    "synchronize": lambda k: k.synchronize(),
    "mark_step": lambda k: k.mark_step(),
}


def _enter(context: Any) -> str:
    with context:
        return "entered and left"


def runtime_names() -> list[str]:
    """The Protocol's functions that are not kernels: the device runtime."""
    import inspect

    from vllm_gaudi_platform.commands.selftest_kernels import kernel_names
    from vllm_gaudi_platform.seam.contract import HpuBackend

    kernels = set(kernel_names())
    return [
        name
        for name, member in vars(HpuBackend).items()
        if not name.startswith("_") and inspect.isfunction(member) and name not in kernels
    ]


def _runtime(kernels: Any) -> list[dict[str, Any]]:
    results = []
    for name in runtime_names():
        call = RUNTIME_CALLS.get(name)
        if call is None:
            results.append({"function": name, "ok": False, "error": "no selftest call"})
            continue
        try:
            results.append({"function": name, "ok": True, "answer": call(kernels)})
        except Exception as exc:
            results.append({"function": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"})
    return results


def collect(*, engine: bool = True) -> dict[str, Any]:
    from vllm_gaudi_platform.commands import selftest_kernels, selftest_probes, selftest_timing
    from vllm_gaudi_platform.commands.selftest_reference import Reference
    from vllm_gaudi_platform.seam import backend, emulated

    started = time.perf_counter()
    kernels = backend()
    gen = selftest_kernels.generation(kernels)
    reference: Any = Reference(gen) if kernels.IS_EMULATED else emulated
    with _emulating_generation(gen):
        cases = selftest_kernels.run_cases(kernels, reference, gen)
    runtime = _runtime(kernels)
    timings = selftest_timing.run_timings(kernels)
    memory = selftest_probes.memory_figures(kernels, kernels.torch_device(0))
    source = answer_source(kernels)
    probes = selftest_probes.run_probes(kernels, {"moe": timings["moe_batch1"], "memory": memory})
    for probe in probes:
        probe["source"] = source["kind"]
    decided = {
        name: {"value": value, "probe": p["id"], "observed": p["observed"]}
        for p in probes
        for name, value in p.get("decides", {}).items()
    }
    e2e = selftest_engine_result(engine)
    failed = sorted({c["kernel"] for c in cases if not c["ok"]})
    ok = not failed and e2e.get("ok", True) and all(r["ok"] for r in runtime)
    return {
        "format": REPORT_FORMAT,
        "version": REPORT_VERSION,
        "backend": {
            "name": kernels.NAME,
            "device": kernels.device_name(0),
            "generation": gen,
            "emulated": kernels.IS_EMULATED,
            "answers_from": source,
        },
        "versions": _versions(),
        "reference": reference.NAME,
        "kernels": cases,
        "failed_kernels": failed,
        "runtime": runtime,
        "probes": probes,
        "decided_defaults": decided,
        "timings": timings,
        "memory": memory,
        "engine": e2e,
        "seconds": round(time.perf_counter() - started, 1),
        "ok": ok,
    }


def selftest_engine_result(engine: bool) -> dict[str, Any]:
    if not engine:
        return {"skipped": "--no-engine"}
    from vllm_gaudi_platform.commands import selftest_engine

    try:
        return selftest_engine.run_engine()
    except Exception as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


def _versions() -> dict[str, str | None]:
    from importlib import metadata

    found: dict[str, str | None] = {}
    for name in ("vllm-gaudi-platform", "vllm", "torch"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


# ----------------------------------------------------------------------------- the screen
def _wrap(text: str, label: str) -> list[str]:
    return textwrap.wrap(
        text, WIDTH, initial_indent=f"{label:<10}", subsequent_indent=" " * 12,
        break_on_hyphens=False,
    )  # fmt: skip


def render(report: dict[str, Any], json_path: str | None = None) -> str:
    b = report["backend"]
    lines = [f"vllm-gaudi selftest: {b['name']} ({b['device']}, Gaudi {b['generation']})"]
    cases = report["kernels"]
    agree = sum(c["ok"] for c in cases)
    against = (
        "an independent float64 reference (the active backend IS the emulation: it is not "
        "checked against itself)"
        if b["emulated"]
        else "the CPU emulation"
    )
    lines += _wrap(
        f"{agree}/{len(cases)} cases of {len(report_kernels(report))} kernels agree with "
        f"{against}, at the suite's tolerances",
        "kernels",
    )
    for c in cases:
        if not c["ok"]:
            where = f"{c.get('dtype', '')} {c.get('shape', '')} {c.get('generation', '')}".strip()
            lines += _wrap(f"DISAGREES {c['kernel']} ({where}): {c.get('error')}", "")
    runtime = report["runtime"]
    bad = [r for r in runtime if not r["ok"]]
    lines += _wrap(
        f"{len(runtime) - len(bad)}/{len(runtime)} device-runtime functions answered"
        + "".join(f"; {r['function']} FAILED: {r['error']}" for r in bad),
        "runtime",
    )
    lines += _wrap(f"answers from {b['answers_from']['text']}", "probes")
    for p in report["probes"]:
        advice = f" -> {p['advice']}" if p["verdict"] == "contradicts" and p["advice"] else ""
        answer = p["answer"] if len(p["answer"]) <= 60 else p["answer"][:57] + "..."
        lines += _wrap(f"{p['id']}: {answer} ({p['verdict']} the default){advice}", "")
    lines += _wrap(_timing_line(report["timings"]), "timings")
    m = report["memory"]
    lines += _wrap(
        f"total {m['total_bytes'] / 2**30:.2f} GiB, free {m['free_bytes'] / 2**30:.2f} GiB, "
        f"allocated {m['allocated_bytes'] / 2**20:.1f} MiB; a 64 MiB allocation: free "
        f"-{m['free_drop_bytes'] / 2**20:.1f} MiB, allocated +"
        f"{m['allocated_rise_bytes'] / 2**20:.1f} MiB",
        "memory",
    )
    lines += _wrap(_engine_line(report["engine"]), "engine")
    for name, d in report["decided_defaults"].items():
        value = "unset (automatic)" if d["value"] is None else d["value"]
        lines += _wrap(f"{name}={value}, decided by {d['probe']}", "defaults")
    if report["ok"]:
        lines.append(f"result    OK ({report['seconds']} s)")
    else:
        failed = ", ".join(report["failed_kernels"]) or "none"
        lines += _wrap(
            f"FAILED: kernels disagreeing with their reference: {failed}"
            + ("" if report["engine"].get("ok", True) else "; the engine check failed"),
            "result",
        )
    if json_path:
        lines += _wrap(
            f"written to {json_path}: attach it to an issue on the project's tracker; "
            f"VLLM_HPU_SELFTEST_REPORT={json_path} lets this machine's platform take the "
            "defaults it decided",
            "report",
        )
    return "\n".join(lines)


def report_kernels(report: dict[str, Any]) -> set[str]:
    return {c["kernel"] for c in report["kernels"]}


def _timing_line(t: dict[str, Any]) -> str:
    moe, gemm = t["moe_batch1"], t["fp8_gemm"]
    buckets = t["sdpa_buckets"]["buckets"]
    per_token = ", ".join(
        f"{r['query_tokens']}: {r['per_token_vs_smallest']:.2f}x" for r in buckets[1:]
    )
    return (
        f"MoE batch 1 ({moe['experts']} experts, top-{moe['topk']}): dense/routed "
        f"{moe['dense_over_routed']:.2f}x, gathered/dense {moe['gathered_over_dense']:.2f}x; "
        f"SDPA per token vs the {buckets[0]['query_tokens']}-token bucket: {per_token}; "
        f"mask/causal at {buckets[-1]['query_tokens']}: {buckets[-1]['mask_over_causal']:.2f}x; "
        f"FP8 GEMM/bf16 {gemm['fp8_over_bf16']:.2f}x"
    )


def _engine_line(e: dict[str, Any]) -> str:
    if "skipped" in e:
        return f"skipped ({e['skipped']})"
    if "ratio" not in e:
        return f"FAILED: {e.get('error')}"
    verdict = "ok" if e["ok"] else "FAILED"
    first = e["completions"][0] if e["completions"] else ["", ""]
    return (
        f"held-out perplexity through the platform ({e['dtype']}) {e['perplexity_platform']:.3f}"
        f", transformers (float32, host) {e['perplexity_reference']:.3f}: ratio "
        f"{e['ratio']:.5f}, tolerance {e['tolerance']:g}: {verdict}; {first[0]!r} -> "
        f"{first[1]!r}"
    )
