"""Pipeline parallelism 2 and data parallelism 2 with expert parallelism on the HPU platform (CPU
emulation, gloo): greedy tokens equal the single-process run of the same engine settings (top-5
rule at a divergence), the DP ranks really split the experts, and no worker meets a shape that
warmup did not run.

The model is the tiny Mixtral: vLLM runs offline data parallelism only for mixture-of-experts
models (dense DP ranks are independent engines), and there the DP ranks exchange tokens in every
MoE layer, so they must agree on one padded bucket each step, idle ranks included. With expert
parallelism each rank holds half of the experts and computes only their share of every token, so
equal tokens also mean the exchange (all-gather in, reduce-scatter out) and the HPU MoE method's
expert map are right. One job process runs the single-process and PP engines one after the
other, then the two DP ranks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gaudi_testkit import tinymodels
from tests.integration.generation import ENGINE, assert_close, make_prompts, named_job_outputs
from tests.integration.generation import run_job as run_job_process

pytestmark = pytest.mark.engine

JOB = Path(__file__).with_name("parallel_job.py")
CASES = ("single", "pp2", "dp2ep")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    job = {
        "model": str(tinymodels.build("mixtral")),
        "prompts": make_prompts()[:8],
        "max_tokens": 8,
        "engine": {**ENGINE, "max_num_seqs": 8},
        "cases": CASES,
        # The single-process and PP runs record their step shapes (VLLM_BUCKETING_RECORD_TRACE).
        "trace_dir": str(tmp_path_factory.mktemp("traces")),
    }
    # The job inspects the workers' MoE layers with a function sent over collective_rpc.
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    proc = run_job_process(JOB, json.dumps(job), env, timeout=1200)
    found = named_job_outputs(proc)
    if set(found) != set(CASES):
        pytest.fail(
            f"parallel job printed {sorted(found)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}"
        )
    return found


@pytest.mark.parametrize("case", ["pp2", "dp2ep"])
def test_greedy_tokens_equal_the_single_process_run(results, case):
    diverged = assert_close(
        results[case]["outputs"], results["single"]["outputs"], f"{case} vs single process"
    )
    assert diverged <= 1, f"{diverged} of 8 prompts hit near-ties; expected at most 1"


def test_pipeline_parallelism_runs_two_stages(results):
    # One recompile report per worker: two pipeline stages.
    assert len(results["pp2"]["stats"]) == 2


def _traced_decode_tokens(trace: list[str]) -> int:
    """Decode tokens a trace counts: batch x count over its 'decode batch blocks count' lines."""
    fields = [line.split() for line in trace]
    return sum(int(f[1]) * int(f[3]) for f in fields if f[0] == "decode")


@pytest.mark.parametrize("case", ["single", "pp2"])
def test_the_trace_counts_every_decode_step_once(results, case):
    # Both pipeline stages run every step; only the first records it. Each request's first token
    # comes from its prefill step, every other from one decode step (ignore_eos: no early stop).
    expected = sum(len(o["tokens"]) - 1 for o in results[case]["outputs"])
    assert expected > 0
    assert _traced_decode_tokens(results[case]["trace"]) == expected


def test_data_parallelism_runs_two_ranks(results):
    assert len(results["dp2ep"]["stats"]) == 2


def test_the_dp_rank_with_fewer_prompts_runs_padding_only_steps(results):
    # parallel_job.dp_shares gives rank 1 two prompts of eight: it runs out of requests while
    # rank 0 still has some, and must run idle steps (the agreed buckets on padding only) so
    # that rank 0's MoE token exchange meets a partner in every layer.
    first, second = results["dp2ep"]["stats"]
    assert second["idle_dp_steps"] > 0, (first["idle_dp_steps"], second["idle_dp_steps"])


def _moe_layers(worker_layers: list[dict]) -> dict[str, dict]:
    assert worker_layers, "the worker reported no MoE layer"
    return {layer["layer"]: layer for layer in worker_layers}


def test_without_expert_parallelism_the_worker_holds_every_expert(results):
    # The contrast for the DP case: the same report on the single-process engine.
    (worker,) = results["single"]["experts"]
    for layer in _moe_layers(worker).values():
        experts = layer["global_num_experts"]
        assert not layer["use_ep"]
        assert layer["local_num_experts"] == layer["kernel_experts"] == experts
        assert layer["owned_experts"] == list(range(experts))


def test_each_dp_rank_holds_half_of_the_experts_in_its_weights(results):
    ranks = [_moe_layers(worker) for worker in results["dp2ep"]["experts"]]
    assert len(ranks) == 2
    # DP rank r is expert-parallel rank r in every MoE layer.
    assert [{layer["ep_rank"] for layer in layers.values()} for layers in ranks] == [{0}, {1}]
    for layers in ranks:
        for layer in layers.values():
            half = layer["global_num_experts"] // 2
            assert layer["method"] == "HpuUnquantizedFusedMoEMethod"
            assert layer["use_ep"] and layer["ep_size"] == 2
            assert layer["local_num_experts"] == half
            assert len(layer["owned_experts"]) == half
            # The expert weights themselves, and what the HPU method hands the kernel.
            assert layer["w13_shape"][0] == layer["w2_shape"][0] == half
            assert layer["kernel_experts"] == half


def test_the_dp_ranks_hold_disjoint_experts_covering_all(results):
    first, second = (_moe_layers(worker) for worker in results["dp2ep"]["experts"])
    assert first.keys() == second.keys()
    for name, layer in first.items():
        mine, theirs = set(layer["owned_experts"]), set(second[name]["owned_experts"])
        assert not mine & theirs, name
        assert mine | theirs == set(range(layer["global_num_experts"])), name


@pytest.mark.parametrize("case", CASES)
def test_no_recompiles_after_warmup(results, case):
    for stats in results[case]["stats"]:
        assert stats["recompiles"] == 0, stats["unwarmed_buckets"]
