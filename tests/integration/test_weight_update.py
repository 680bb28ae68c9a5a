"""In-place weight updates from a trainer process (weight_transfer_config={"backend": "hpu"}), end
to end: one engine per backend and mode runs every check (weight_update_job.py), in CPU emulation
and on seam/gaudi over the Habana stand-in (weights on its torch device "hpu"), with HPU graphs
(PT_HPU_LAZY_MODE=1) and with torch.compile (PT_HPU_LAZY_MODE=0).

A trainer process (weight_trainer.py, through vllm_gaudi_platform.distributed.weight_sender)
perturbs the tiny Llama's weights and sends them twice (packed buckets, then one tensor per
broadcast); after each round the engine's greedy output equals transformers' with that round's
weights, on the graphs and compiled buckets warmup made (none recaptured, none recompiled,
every parameter in its old storage). Then a trainer dies after one bucket of a round: the update
fails with an error that says so, quickly (the broadcast sees the closed sockets; no timeout
wait), and the engine goes on serving the previous round's weights.

Tensor parallelism 2 (HPU graphs, on both backends; on the stand-in the workers' collectives
are its "hccl" group's, recorded in the graphs): both workers join the trainer's group, each loads
its shards of every round, and the dying trainer's round is written on neither (the workers vote
before writing). An update during traffic (HPU graphs, both backends; weight_update_async_job.py):
AsyncLLM with its engine core in a process of its own, as vLLM serves; vLLM's
pause_generation(mode="wait", clear_cache=True) lets the requests in flight finish on the old
weights while new ones queue, the round is written, and after resume the queued requests run on
the new weights; no request is lost. Every engine of CASES ends with sleep(level=1) and
wake_up(): it serves the last round's weights, not the checkpoint's.

An fp8 checkpoint (block-scaled; compiled on the emulation, HPU graphs over the stand-in) takes
one round of float weights from a trainer holding the float original and re-quantizes it in
place: FP8 weights and per-channel scales rewritten in their storage, greedy output
transformers' on the round's weights quantized per channel and dequantized (the engine's own FP8
activations are what vLLM's top-5 rule absorbs; the float round itself would be a looser
reference), no recompile.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gaudi_testkit import tinymodels
from tests.conftest import REAL_GAUDI_SOFTWARE, STANDIN_ENGINE_ENV
from tests.integration.compile_job import assert_compiled_only_in_warmup, fitted_plan_env
from tests.integration.generation import (
    COMPILE_ENGINE,
    assert_close,
    hf_greedy,
    job_result,
    make_prompts,
    run_job,
)

pytestmark = pytest.mark.engine

JOB = Path(__file__).with_name("weight_update_job.py")
MAX_TOKENS = 6
TIMEOUT_S = 60.0  # the transfer group's; the dying trainer must fail the round far sooner
PROMPTS = make_prompts()[:6]  # one to three blocks, a shared prefix: prefix caching matters
# (backend, mode, tensor-parallel size). Each backend's HPU-graph case runs once with one worker
# and once with two; on the stand-in the two-worker engine is its only graphs case (it runs every
# check the one-worker engine would, plus the shards and the vote), to keep the suite small.
CASES = [
    ("emulated", "graphs", 1),
    ("emulated", "compile", 1),
    ("gaudi", "compile", 1),
    ("emulated", "graphs", 2),
    ("gaudi", "graphs", 2),
]


@pytest.fixture(
    scope="module",
    params=CASES,
    ids=[f"{b}-{m}" + (f"-tp{tp}" if tp > 1 else "") for b, m, tp in CASES],
)
def run(request, tmp_path_factory) -> dict:
    backend, mode, tp = request.param
    env: dict[str, str | None] = {
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # the job's collective_rpc lambdas
        "PT_HPU_LAZY_MODE": "1" if mode == "graphs" else "0",
    }
    if mode == "compile":
        env.update(fitted_plan_env())
    if backend == "gaudi":
        if REAL_GAUDI_SOFTWARE:
            pytest.skip("the stand-in does not load beside a real Gaudi stack")
        env.update(STANDIN_ENGINE_ENV)
    model = str(tinymodels.build("llama"))
    workdir = tmp_path_factory.mktemp(f"weights-{backend}-{mode}-tp{tp}")
    job = {
        "model": model,
        "prompts": PROMPTS,
        "max_tokens": MAX_TOKENS,
        "engine": {**COMPILE_ENGINE, "tensor_parallel_size": tp, "enable_sleep_mode": True},
        "workdir": str(workdir),
        "timeout_s": TIMEOUT_S,
        "sleep": True,  # at the end: sleep at level 1, wake up, generate
    }
    label = f"weight update job ({backend}, {mode}, TP {tp})"
    result = job_result(run_job(JOB, json.dumps(job), env), label)
    result["case"] = (backend, mode, tp)
    result["references"] = {
        f"round{i}": hf_greedy(str(workdir / f"round{i}"), PROMPTS, MAX_TOKENS) for i in (0, 1)
    }
    result["reference_before"] = hf_greedy(model, PROMPTS, MAX_TOKENS)
    return result


def test_the_engine_ran_where_the_case_says(run):
    backend, mode, tp = run["case"]
    # Every worker joined the trainer's group, after the trainer (rank 0).
    assert run["report_after_rounds"]["ranks"] == list(range(1, tp + 1))
    stats = run["stats_before"]
    assert stats["seam"] == ("gaudi" if backend == "gaudi" else "emulated on cpu")
    if mode == "graphs":
        assert stats["graphs_enabled"] and stats["num_graphs"] > 0
    else:
        assert stats["compiled"] and stats["compiled_forward_on"]


@pytest.mark.parametrize("name", ["round0", "round1"])
def test_after_an_update_greedy_output_is_transformers_with_the_new_weights(run, name):
    assert_close(run[name], run["references"][name], f"{run['case']} {name}")
    # The perturbation is large enough that the old weights would not pass.
    assert [o["tokens"] for o in run[name]] != [o["tokens"] for o in run["before"]]
    assert run["trainer_rc"] == 0, run["trainer_log"]


def test_before_the_update_the_engine_served_the_checkpoint(run):
    assert_close(run["before"], run["reference_before"], f"{run['case']} before")


def test_both_rounds_were_applied_in_place(run):
    report = run["report_after_rounds"]
    assert report["rounds_applied"] == 2 and report["last_round"] == 1
    assert report["rebinds_restored"] == 0  # Llama's loaders write into the storage themselves
    assert run["same_storage"] and run["same_storage_after_failure"]


@pytest.mark.parametrize("name", ["round0", "round1", "after_failed_round"])
def test_updates_run_on_the_warmed_buckets_with_no_recompile(run, name):
    before, after = run["stats_before"], run[f"stats_{name}"]
    assert after["recompiles"] == 0, after["unwarmed_buckets"]
    assert after["warmup_seconds"] == before["warmup_seconds"]  # no second warmup
    if run["case"][1] == "graphs":
        # The graphs warmup captured replay the new weights: none recaptured, no eager step.
        assert after["num_graphs"] == before["num_graphs"]
        assert after["graph_capture_seconds"] == before["graph_capture_seconds"]
        assert after["graph_replays"] > before["graph_replays"]
        assert after["eager_steps"] == 0, after["eager_buckets"]
    else:
        assert after["compiled_graphs"]["serving"] == 0, after["recompiled_buckets"]
        assert after["compile_recompiles"] == 0
        assert after["compiled_graphs"]["warmup"] == before["compiled_graphs"]["warmup"]
        passes = after["compiled_serving_passes"].get("model", 0)
        assert passes > before["compiled_serving_passes"].get("model", 0)


def test_a_trainer_dying_mid_round_fails_the_update_quickly_and_clearly(run):
    error = run["failed_round_error"]
    assert error is not None and "no parameter was written" in error
    assert "init_weight_transfer_engine again" in error
    assert run["failed_round_seconds"] < TIMEOUT_S / 2  # the closed sockets, not the timeout
    assert run["dying_trainer_rc"] == 3
    # Every worker wrote both earlier rounds and none wrote this one; every end of the group is
    # closed.
    report = run["report_after_failure"]
    tp = run["case"][2]
    assert report["rounds_per_worker"] == [2] * tp
    assert report["connected_per_worker"] == [False] * tp


def test_after_a_failed_round_the_engine_serves_the_previous_weights(run):
    # Tokens as after round 1 (logprobs may move in the last bits: this run hits the prefix
    # cache round 1 filled), and transformers' with round 1's weights.
    tokens = [o["tokens"] for o in run["after_failed_round"]]
    assert tokens == [o["tokens"] for o in run["round1"]]
    assert_close(run["after_failed_round"], run["references"]["round1"], f"{run['case']} failed")


def test_sleeping_at_level_1_keeps_the_updated_weights(run):
    # vLLM's level 1 offloads the weights to the host and restores them: the ones written in
    # place by the updates, not the checkpoint's (waking the KV cache had reloaded those).
    assert [o["tokens"] for o in run["after_sleep"]] == [o["tokens"] for o in run["round1"]]
    assert_close(run["after_sleep"], run["references"]["round1"], f"{run['case']} after sleep")


# ---------------------------------------------------------------- an update during traffic
ASYNC_JOB = Path(__file__).with_name("weight_update_async_job.py")
LONG_TOKENS = 48  # the in-flight requests: still generating when the pause begins


@pytest.fixture(scope="module", params=["emulated", "gaudi"])
def served(request, tmp_path_factory) -> dict:
    """AsyncLLM (its engine core in a process of its own, as vLLM serves), HPU graphs."""
    backend = request.param
    model = str(tinymodels.build("llama"))
    workdir = tmp_path_factory.mktemp(f"weights-served-{backend}")
    job = {
        "model": model,
        "prompts": PROMPTS,
        "max_tokens": MAX_TOKENS,
        "long_tokens": LONG_TOKENS,
        "engine": COMPILE_ENGINE,
        "workdir": str(workdir),
        "timeout_s": TIMEOUT_S,
    }
    env = {
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",  # pause_generation(mode="wait") needs it
        "PT_HPU_LAZY_MODE": "1",
    }
    if backend == "gaudi":
        if REAL_GAUDI_SOFTWARE:
            pytest.skip("the stand-in does not load beside a real Gaudi stack")
        env.update(STANDIN_ENGINE_ENV)
    label = f"served weight update job ({backend})"
    result = job_result(run_job(ASYNC_JOB, json.dumps(job), env), label)
    result["backend"] = backend
    result["reference_old"] = hf_greedy(model, PROMPTS, LONG_TOKENS)
    result["reference_new"] = hf_greedy(str(workdir / "round0"), PROMPTS, MAX_TOKENS)
    return result


def test_an_update_during_traffic_waits_for_the_requests_in_flight(served):
    assert served["unfinished_at_pause"] > 0  # the pause met requests still generating
    assert served["in_flight_done_when_paused"]  # mode="wait": they finished first ...
    assert served["queued_done_when_paused"] == 0  # ... and the new ones waited: queued by
    # vLLM 0.32, refused by 0.33 with its retryable error until resume (the job retries then).
    refused = 0 if served["vllm"].startswith("0.32") else len(PROMPTS)
    assert served["refused_while_paused"] == refused
    # ... on the weights they started with.
    assert_close(served["in_flight"], served["reference_old"], "in flight during the update")
    assert all(len(o["tokens"]) == LONG_TOKENS for o in served["in_flight"])


def test_requests_queued_during_the_update_run_on_the_new_weights_and_none_is_lost(served):
    assert len(served["queued"]) == len(PROMPTS)
    assert all(len(o["tokens"]) == MAX_TOKENS for o in served["queued"])
    assert_close(served["queued"], served["reference_new"], "queued during the update")
    assert served["trainer_rc"] == 0
    stats = served["stats"]
    assert stats["seam"] == ("gaudi" if served["backend"] == "gaudi" else "emulated on cpu")
    assert stats["recompiles"] == 0 and stats["eager_steps"] == 0, stats["eager_buckets"]


# ---------------------------------------------------------------- an FP8 checkpoint
FP8_FORMAT = "llama-fp8-block"  # block-scaled: per-channel FP8 after loading, as every fp8 linear
FP8_SCALE = 0.1  # the soft Llama stays soft enough for FP8 activations (the top-5 rule)


def _requantized(round_dir: Path, out: Path) -> Path:
    """The reference for an FP8 engine after an update: the round's float weights of every
    quantized linear quantized as the loaded layers hold them (FP8 E4M3 per output channel,
    Gaudi 3's range, the test's own quantizer) and dequantized; the rest as sent."""
    import shutil

    from safetensors.torch import load_file, save_file

    from tests.quant import fp8_checkpoints
    from tests.quant import fp8_packers as P

    shutil.copytree(round_dir, out, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = load_file(str(round_dir / "model.safetensors"))
    for name, tensor in tensors.items():
        if fp8_checkpoints._scheme(fp8_checkpoints.FORMATS[FP8_FORMAT], name[: -len(".weight")]):
            tensors[name] = P.dequantize(P.quantize(tensor, "channel")).to(tensor.dtype)
    save_file(tensors, str(out / "model.safetensors"))
    return out


# (backend, mode): the FP8 engine compiled on the emulation, with HPU graphs on the stand-in.
FP8_CASES = [("emulated", "compile"), ("gaudi", "graphs")]


@pytest.fixture(scope="module", params=FP8_CASES, ids=[f"{b}-{m}" for b, m in FP8_CASES])
def fp8_run(request, tmp_path_factory) -> dict:
    """An `fp8` checkpoint (block-scaled, dynamic activations) served compiled or with HPU
    graphs takes one round of float weights from a trainer that holds the float original."""
    from tests.quant import fp8_checkpoints

    backend, mode = request.param
    env: dict[str, str | None] = {
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
        "PT_HPU_LAZY_MODE": "1" if mode == "graphs" else "0",
    }
    if mode == "compile":
        env.update(fitted_plan_env())
    if backend == "gaudi":
        if REAL_GAUDI_SOFTWARE:
            pytest.skip("the stand-in does not load beside a real Gaudi stack")
        env.update(STANDIN_ENGINE_ENV)
    root = tmp_path_factory.mktemp(f"weights-fp8-{backend}")
    qdir, fdir = fp8_checkpoints.write(FP8_FORMAT, root, PROMPTS)
    job = {
        "model": str(qdir),
        "trainer_model": str(fdir),
        "prompts": PROMPTS,
        "max_tokens": MAX_TOKENS,
        "engine": COMPILE_ENGINE,
        "workdir": str(root),
        "timeout_s": TIMEOUT_S,
        "rounds": 1,
        "scale": FP8_SCALE,
        "dying_trainer": False,
        "report_quantized": True,
    }
    result = job_result(run_job(JOB, json.dumps(job), env), f"FP8 weight update job ({backend})")
    result["backend"], result["mode"] = backend, mode
    result["reference"] = hf_greedy(
        str(_requantized(root / "round0", root / "requantized")), PROMPTS, MAX_TOKENS
    )
    result["reference_float"] = hf_greedy(str(root / "round0"), PROMPTS, MAX_TOKENS)
    return result


def test_an_fp8_checkpoint_requantizes_an_update_in_place(fp8_run):
    label = f"fp8 {fp8_run['backend']}"
    assert fp8_run["stats_before"]["seam"] == (
        "gaudi" if fp8_run["backend"] == "gaudi" else "emulated on cpu"
    )
    assert fp8_run["trainer_rc"] == 0, fp8_run["trainer_log"]
    before, after = fp8_run["quantized_before"], fp8_run["quantized_after"]
    # Every linear of the decoder is FP8 with per-channel scales, before and after ...
    assert before["fp8_weights"] == after["fp8_weights"] > 0
    assert after["scale_shapes"] == before["scale_shapes"]
    assert all(len(shape) == 1 for shape in after["scale_shapes"])  # [N]: one per channel
    # ... the update wrote new FP8 weights and scales into the same storage ...
    assert fp8_run["same_storage"]
    assert after["weight_digest"] != before["weight_digest"]
    assert after["scale_digest"] != before["scale_digest"]
    # ... and greedy output is transformers' on the requantized round (the top-5 rule covers
    # the engine's FP8 activations), not the checkpoint's.
    assert_close(fp8_run["round0"], fp8_run["reference"], label)
    assert [o["tokens"] for o in fp8_run["round0"]] != [o["tokens"] for o in fp8_run["before"]]


def test_an_fp8_update_runs_on_the_warmed_graphs_with_no_recompile(fp8_run):
    before, after = fp8_run["stats_before"], fp8_run["stats_round0"]
    assert after["recompiles"] == 0, after["unwarmed_buckets"]
    if fp8_run["mode"] == "graphs":
        assert before["graphs_enabled"] and before["num_graphs"] > 0
        assert after["num_graphs"] == before["num_graphs"]
        assert after["graph_capture_seconds"] == before["graph_capture_seconds"]
        assert after["eager_steps"] == 0, after["eager_buckets"]
    else:
        # The compiled buckets read the re-quantized weights and scales: none compiled again.
        assert before["compiled"] and before["compiled_forward_on"]
        assert_compiled_only_in_warmup(after)
        assert after["compiled_graphs"]["warmup"] == before["compiled_graphs"]["warmup"]
        passes = after["compiled_serving_passes"].get("model", 0)
        assert passes > before["compiled_serving_passes"].get("model", 0)
