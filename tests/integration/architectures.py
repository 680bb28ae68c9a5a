"""The architectures the HPU engine tests cover, each as ONE engine run shared by every test that
needs it: the architecture's own test (vs transformers) and the cross-check with vLLM's CPU
backend (test_cpu_backend.py) read the same HPU outputs, whichever asks first starts the runs.

Both sides run all architectures one after another in a single process each (`hpu_run`,
`cpu_runs`): one process start per side plus one engine per architecture.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gaudi_testkit import tinymodels
from tests.integration.generation import (
    ENGINE,
    make_prompts,
    named_job_outputs,
    run_job,
)

SEQUENTIAL_JOB = Path(__file__).with_name("sequential_job.py")


def fp16_checkpoint() -> Path:
    """The tiny Llama saved as a float16 checkpoint (weights and config.json's torch_dtype),
    next to the tiny models and reused like them."""
    source = tinymodels.build("llama")
    path = source.with_name(source.name + "-fp16")
    if (path / "config.json").exists():
        return path
    import torch
    from safetensors.torch import load_file, save_file

    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    weights = load_file(tmp / "model.safetensors")
    half = {name: w.to(torch.float16) for name, w in weights.items()}
    save_file(half, tmp / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp / "config.json").read_text())
    config.pop("dtype", None)
    config["torch_dtype"] = "float16"
    (tmp / "config.json").write_text(json.dumps(config))
    tmp.rename(path)
    return path


@dataclass(frozen=True)
class Case:
    """One architecture's shared engine run."""

    build: Callable[[], Path]
    prompts: int = 10  # the first n of make_prompts()
    rounds: int = 1
    hpu_engine: dict[str, Any] = field(default_factory=dict)  # LLM kwargs over generation.ENGINE
    # vLLM's CPU backend: the same computation (fp16 runs in bf16 on HPU, so bf16 here too).
    cpu_engine: dict[str, Any] = field(default_factory=dict)


HYBRID_ENGINE = {
    "max_num_seqs": 4,
    "max_num_batched_tokens": 512,
    "long_prefill_token_threshold": 128,
}

CASES: dict[str, Case] = {
    "llama": Case(lambda: tinymodels.build("llama"), rounds=2),
    "gemma2": Case(lambda: tinymodels.build("gemma2")),  # window 64 + soft-capping
    "mistral": Case(lambda: tinymodels.build("mistral")),  # window 48
    "qwen2": Case(lambda: tinymodels.build("qwen2")),  # window 40 on every layer, q/k/v biases
    # two local layers (window 32, rotary base 1e4) and a global one (base 1e6), q/k norms
    "gemma3": Case(lambda: tinymodels.build("gemma3")),
    "llama-fp16": Case(
        fp16_checkpoint,
        prompts=6,
        hpu_engine={"dtype": "float16"},
        cpu_engine={"dtype": "bfloat16"},
    ),
    "bloom": Case(lambda: tinymodels.build("bloom")),  # ALiBi
    # attention sinks, window 40 on layer 0, biased swigluoai experts
    "gpt-oss": Case(lambda: tinymodels.build("gpt-oss")),
    # Granite 4.0-H's shape: Mamba2 layers around an attention layer (test_hybrid.py): at most
    # 4 prompts per step (the default prompt rows: one pass per step) of at most 128 new tokens
    # each, so longer ones continue from their stored state in the next step.
    # vLLM's CPU backend: without prefix caching (its default "align" Mamba cache mode fails on
    # this model at vLLM 0.32 with an IndexError in the mixer's state update).
    "granitemoehybrid": Case(
        lambda: tinymodels.build("granitemoehybrid"),
        hpu_engine=HYBRID_ENGINE,
        cpu_engine={"enable_prefix_caching": False},
    ),
    # Nemotron-H's shape: Mamba2 with two groups, attention and MLP blocks as separate layers
    "nemotron-h": Case(
        lambda: tinymodels.build("nemotron-h"),
        hpu_engine=HYBRID_ENGINE,
        cpu_engine={"enable_prefix_caching": False},
    ),
    # Falcon-H1's shape: attention and a Mamba2 mixer side by side in every layer, muP multipliers
    "falcon-h1": Case(
        lambda: tinymodels.build("falcon-h1"),
        hpu_engine=HYBRID_ENGINE,
        cpu_engine={"enable_prefix_caching": False},
    ),
}
# Not cross-checked: the tiny DeepSeek-V2 (MLA, test_mla.py). vLLM 0.32's CPU backend runs it but
# its greedy tokens differ from transformers' on all 10 prompts (the one-token prompt from its
# fourth token on), while the HPU platform's equal transformers' exactly, so vLLM's CPU backend
# is no reference for this model.

_HPU_RUNS: dict[str, tuple[subprocess.CompletedProcess[str], dict | None]] = {}


def prompts(name: str) -> list[list[int]]:
    return make_prompts()[: CASES[name].prompts]


def hpu_run(name: str) -> tuple[subprocess.CompletedProcess[str], dict | None]:
    """(process, result) of the architecture's HPU engine run. The first call runs every case,
    one engine after another in ONE process (vLLM imported once, as `cpu_runs` does); later calls
    read its results. A case that failed has None, and the process's stderr tells why."""
    if name not in _HPU_RUNS:
        jobs = {
            case_name: {
                "model": str(case.build()),
                "prompts": prompts(case_name),
                "max_tokens": 12,
                "engine": {**ENGINE, **case.hpu_engine},
                "rounds": case.rounds,
                "stats": True,
            }
            for case_name, case in CASES.items()
        }
        proc = run_job(SEQUENTIAL_JOB, json.dumps(jobs), emulate=True, timeout=300 * len(jobs))
        results = named_job_outputs(proc)
        for case_name in jobs:
            result = results.get(case_name)
            _HPU_RUNS[case_name] = (proc, None if result is None or "error" in result else result)
    return _HPU_RUNS[name]


def cpu_runs(names: list[str], timeout: float = 1200) -> tuple[subprocess.CompletedProcess, dict]:
    """Greedy outputs of vLLM's own CPU backend for each architecture, all in one process, one
    engine after another (eager: torch.compile would cost more than the few tokens it runs)."""
    jobs = {
        name: {
            "model": str(CASES[name].build()),
            "prompts": prompts(name),
            "max_tokens": 12,
            "engine": {**ENGINE, "enforce_eager": True, **CASES[name].cpu_engine},
            "rounds": 1,
        }
        for name in names
    }
    proc = run_job(SEQUENTIAL_JOB, json.dumps(jobs), emulate=False, timeout=timeout)
    return proc, named_job_outputs(proc)
