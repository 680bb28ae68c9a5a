"""The HPU graphs' memory is bounded in the profile run from a few sampled graphs
(worker/graph_memory.py), and the worker keeps the bound back from the KV cache.

The bound's claim: if what a graph holds is a + p * tokens + q * work with a, p, q >= 0, the
estimate from the two samples of each phase is at least the sum over the plan (and, being the
most any such model fitting the samples gives, within 2x of it on these models). It is checked
here on the plan the default strategy builds, with held bytes from such models (the samples'
held bytes computed by the same model), and on runs outside the sampled range. The engine-level
check, against what warmup's graphs really hold, is in test_gaudi_standin_engine.py.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from tests.platform.test_profile_memory import fake_worker
from vllm_gaudi_platform.bucketing import Bucket, plan_from_env
from vllm_gaudi_platform.worker import graph_memory
from vllm_gaudi_platform.worker.graph_memory import Sample

BLOCK = 128


def _plan_runs() -> list[graph_memory.Run]:
    plan = plan_from_env(
        max_num_seqs=32,
        max_num_batched_tokens=2048,
        max_model_len=4096,
        block_size=BLOCK,
        environ={},
    )
    runs = [(b, False) for b in (*plan.prompt, *plan.decode)]
    runs += [(b, True) for b in plan.prompt if b.batch_size == 1 and b.ctx_blocks == 0]
    return runs


def _held(model: tuple[int, int, int], run: graph_memory.Run) -> int:
    a, p, q = model
    tokens, work = graph_memory.sizes(run, BLOCK)
    return a + p * tokens + q * work


@pytest.mark.parametrize("seed", range(8))
def test_the_estimate_bounds_every_plan_graph_held_as_a_linear_model(seed):
    rng = random.Random(seed)
    model = (rng.randrange(0, 1 << 24), rng.randrange(0, 1 << 14), rng.randrange(0, 64))
    runs = _plan_runs()
    chosen = graph_memory.samples_to_take(runs, BLOCK)
    samples = [Sample(run, _held(model, run)) for run in chosen]
    truth = [_held(model, run) for run in runs]
    for run, held in zip(runs, truth):
        assert graph_memory.bound(run, samples, BLOCK) >= held, run
    for sample in samples:  # a sampled run is bounded by what it held
        assert abs(graph_memory.bound(sample.run, samples, BLOCK) - sample.held) <= 1
    total = graph_memory.estimate(runs, samples, BLOCK)
    assert sum(truth) <= total <= 2 * sum(truth), (sum(truth), total)


def test_two_captures_per_phase_the_least_and_the_most_work():
    runs = _plan_runs()
    chosen = graph_memory.samples_to_take(runs, BLOCK)
    assert [b.phase for b, _ in chosen] == ["prompt", "prompt", "decode", "decode"]
    for phase, (small, large) in (("prompt", chosen[:2]), ("decode", chosen[2:])):
        work = [graph_memory.sizes(r, BLOCK)[1] for r in runs if r[0].phase == phase]
        assert graph_memory.sizes(small, BLOCK)[1] == min(work)
        assert graph_memory.sizes(large, BLOCK)[1] == max(work)
    # On a tie the packed variant (its mask on top) is the sample.
    one = Bucket("prompt", 1, 128, 0)
    assert graph_memory.samples_to_take([(one, False), (one, True)], BLOCK) == [
        (one, False),
        (one, True),
    ]


def test_a_run_beyond_the_samples_gets_the_most_a_fitting_model_gives_it():
    small = Sample((Bucket("decode", 4, 1, 8), False), 1000)  # 4 tokens, work 1024
    large = Sample((Bucket("decode", 4, 1, 64), False), 5000)  # 4 tokens, work 8192
    # Twice the batch. The models fitting both: q = 4000 / 7168 and a + 4p = 1000 - 1024q;
    # the most at 8 tokens is where a = 0: 2 * (1000 - 1024q) + 8192q = 5428.57...
    beyond = (Bucket("decode", 8, 1, 64), False)
    assert graph_memory.bound(beyond, [small, large], BLOCK) == 5429
    # Samples no model with a, p, q >= 0 fits (the larger run held less: noise): the larger
    # held bytes scaled by the run's largest size ratio (tokens: 8 / 4).
    noisy = [Sample(small.run, 5000), Sample(large.run, 1000)]
    assert graph_memory.bound(beyond, noisy, BLOCK) == 10000
    with pytest.raises(ValueError, match="'prompt'"):
        graph_memory.bound((Bucket("prompt", 1, 128, 0), False), [small, large], BLOCK)


def _graph_worker(estimate: int, monkeypatch, share: str | None = None):
    from vllm_gaudi_platform.worker.profiling import ProfileMemory

    if share is not None:
        monkeypatch.setenv("VLLM_GRAPH_RESERVED_MEM", share)
    else:
        monkeypatch.delenv("VLLM_GRAPH_RESERVED_MEM", raising=False)
    from vllm_gaudi_platform.seam import emulated

    worker = fake_worker(emulated, 0)
    worker.model_runner.graphs = SimpleNamespace(enabled=True)
    worker.model_runner.profile_run = lambda: ProfileMemory(
        graphs_estimate=estimate, graph_runs=12, graph_samples=[{}] * 4
    )
    return worker


def test_the_kv_cache_leaves_the_sampled_graphs_bound_when_above_the_share(monkeypatch):
    share_only = _graph_worker(0, monkeypatch)
    kv_share = share_only.determine_available_memory()
    usable = kv_share + share_only.profile_memory.graph_reserve
    assert share_only.profile_memory.graph_reserve == int(usable * 0.1)
    big = int(usable * 0.3)
    sampled = _graph_worker(big, monkeypatch)
    kv = sampled.determine_available_memory()
    assert sampled.profile_memory.graph_reserve == big
    # The resident set moves by a few MiB between the two workers' readings.
    assert abs(kv - (usable - big)) < 64 << 20, (kv, usable, big)


def test_graphs_bound_above_the_usable_memory_is_refused_naming_the_fixes(monkeypatch):
    worker = _graph_worker(1 << 50, monkeypatch, share="0.05")
    with pytest.raises(ValueError) as err:
        worker.determine_available_memory()
    message = str(err.value)
    for part in (
        "VLLM_GRAPH_RESERVED_MEM=0.05",
        "12 graphs",
        "gpu_memory_utilization",
        "enforce_eager=True",
        "kv_cache_memory_bytes",
    ):
        assert part in message, part
