"""End to end: tensor parallelism 2 through vLLM's Ray executor (`distributed_executor_backend=
"ray"`) on the HPU platform in emulation, on a local Ray cluster that declares two "HPU"
resources, generates the greedy tokens of a single worker with no recompiles after warmup."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gaudi_testkit import tinymodels
from tests.integration.generation import ENGINE, make_prompts, named_job_outputs, run_job

pytestmark = pytest.mark.engine

JOB = Path(__file__).with_name("ray_job.py")


@pytest.fixture(scope="module")
def runs() -> dict:
    job = {
        "model": str(tinymodels.build("llama")),
        "prompts": make_prompts(),
        "max_tokens": 12,
        "engine": ENGINE,
        "stats": True,
        "tensor_parallel_size": 2,
        "ray_cpus": 1,
    }
    # One process runs both engines in-process (no engine-core process): one worker, then the
    # Ray cluster and its two actor workers.
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = run_job(JOB, json.dumps(job), env, timeout=900)
    results = named_job_outputs(proc)
    if set(results) != {"tp1", "ray"}:
        pytest.fail(
            f"ray_job.py printed {sorted(results)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return results


def test_the_cluster_declares_one_hpu_resource_per_worker(runs):
    assert runs["ray"]["cluster_resources"]["HPU"] == 2
    assert runs["ray"]["platform"] == runs["tp1"]["platform"] == "HpuPlatform"


def test_tensor_parallel_2_over_ray_gives_the_greedy_tokens_of_one_worker(runs):
    single, over_ray = runs["tp1"]["rounds"][0], runs["ray"]["rounds"][0]
    assert [r["tokens"] for r in over_ray] == [r["tokens"] for r in single]
    for a, b in zip(over_ray, single):
        for step_a, step_b in zip(a["logprobs"], b["logprobs"]):
            top_a, top_b = max(step_a, key=step_a.get), max(step_b, key=step_b.get)
            assert top_a == top_b and abs(step_a[top_a] - step_b[top_b]) < 1e-3


def test_mixed_lengths_over_ray_cause_no_recompiles_after_warmup(runs):
    stats = runs["ray"]["stats"]
    assert stats["num_prompt_buckets"] > 1
    assert stats["recompiles"] == 0, stats["unwarmed_buckets"]
