"""Multi-LoRA on the HPU platform (CPU emulation), one engine process for every check
(lora_job.py): two PEFT adapters of different ranks and the base model in the same batches give
the greedy tokens of transformers on the merged weights (base + lora_alpha / r * B @ A), within the
top-5 rule; adapters are unloaded and loaded back at run time; no shape runs after warmup that
warmup did not run (buckets and LoRA kernel shapes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration import lora_adapters
from tests.integration.generation import (
    ENGINE,
    assert_close,
    hf_greedy,
    make_prompts,
    named_job_outputs,
    run_job,
)
from vllm_gaudi_platform import tinymodels

pytestmark = pytest.mark.engine

JOB = Path(__file__).with_name("lora_job.py")
MAX_TOKENS = 8
# name -> (seed, rank, lora_alpha): different ranks, both below max_lora_rank's padding
ADAPTERS = {"alpha": (1, 8, 16), "beta": (2, 4, 4)}


@pytest.fixture(scope="module")
def models() -> dict[str, Path]:
    """The base model and, per adapter, the adapter and its merged model."""
    base = tinymodels.build("llama")
    root = tinymodels.cache_root() / "lora"
    out = {"base": base}
    for name, (seed, rank, alpha) in ADAPTERS.items():
        adapter = lora_adapters.build_adapter(
            base,
            root / f"{base.name}-{name}-{seed}-{rank}-{alpha}",
            seed=seed,
            rank=rank,
            alpha=alpha,
        )
        out[name] = adapter
        out[f"{name}-merged"] = lora_adapters.merge(base, adapter, root / f"{adapter.name}-merged")
    return out


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts()[:6]


@pytest.fixture(scope="module")
def run(models, prompts) -> dict:
    job = {
        "model": str(models["base"]),
        "adapters": {name: str(models[name]) for name in ADAPTERS},
        "prompts": prompts,
        "max_tokens": MAX_TOKENS,
        "engine": {**ENGINE, "enable_lora": True, "max_loras": 2, "max_lora_rank": 8},
    }
    proc = run_job(JOB, json.dumps(job))
    results = named_job_outputs(proc)
    if set(results) != {"mixed", "runtime", "stats"}:
        pytest.fail(
            f"LoRA job incomplete ({sorted(results)}):\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return results


@pytest.fixture(scope="module")
def reference(models, prompts) -> dict[str, list[dict]]:
    refs = {"base": hf_greedy(str(models["base"]), prompts, MAX_TOKENS)}
    for name in ADAPTERS:
        refs[name] = hf_greedy(str(models[f"{name}-merged"]), prompts, MAX_TOKENS)
    return refs


@pytest.mark.parametrize("name", ["base", *ADAPTERS])
def test_mixed_batch_matches_transformers_on_merged_weights(run, reference, name):
    assert_close(run["mixed"][name], reference[name], f"LoRA {name}")


def test_adapters_change_the_output(run):
    base = [r["tokens"] for r in run["mixed"]["base"]]
    for name in ADAPTERS:
        assert [r["tokens"] for r in run["mixed"][name]] != base, f"{name} had no effect"


def test_remove_lora_unloads_the_adapter(run):
    runtime = run["runtime"]
    assert runtime["loaded"] == [1, 2]
    assert runtime["removed"] is True and runtime["after_remove"] == [2]


def test_removed_adapter_reloads_at_run_time_with_the_same_output(run):
    runtime = run["runtime"]
    assert runtime["after_reload"] == [1, 2]
    first, second = runtime["reloaded_outputs"]
    assert first["tokens"] == run["mixed"]["alpha"][0]["tokens"]
    assert second["tokens"] == run["mixed"]["beta"][0]["tokens"]


def test_add_lora_loads_an_adapter_explicitly(run):
    assert run["runtime"]["added"] is True and run["runtime"]["after_add"] == [1, 2]


def test_no_recompiles_after_warmup_with_lora(run):
    stats = run["stats"]
    assert stats["recompiles"] == 0, stats["unwarmed_buckets"]
    assert stats["lora_unwarmed_shapes"] == []
