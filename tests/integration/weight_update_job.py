"""In-place weight updates end to end in one engine process: serve, take two rounds of new
weights from a trainer process (weight_trainer.py; packed buckets, then one tensor per bucket),
serve each, then meet a trainer that dies mid-round, and report as one RESULT JSON line.

    python weight_update_job.py '<json job>'

Job keys: model, prompts, max_tokens, engine (LLM kwargs), workdir (where the trainer saves each
round's model for the reference), timeout_s (the transfer group's); optional: trainer_model (the
float model a trainer of a quantized checkpoint holds), rounds (how many, 1 or 2), scale (of the
perturbation), dying_trainer (false: no dying trainer after the rounds), sleep (true: at the end,
sleep at level 1, wake up and generate again). The result holds the greedy
outputs (engine_job.completion) before any update, after each round and after the failed round,
the worker's recompile statistics after each, whether every parameter kept its storage, the
engine's report, and the failed round's error with how long it took.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_trainer(job: dict, rounds: list[dict]) -> tuple[subprocess.Popen, dict]:
    info = {
        "master_address": "127.0.0.1",
        "master_port": free_port(),
        # The trainer and every worker of the engine (tensor-parallel ranks).
        "world_size": 1 + job["engine"].get("tensor_parallel_size", 1),
        "timeout_s": job["timeout_s"],
    }
    # The trainer's model: the served checkpoint, or (a quantized one) its float original.
    spec = {"model": job.get("trainer_model") or job["model"], "init_info": info, "rounds": rounds}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "PT_HPU", "HABANA"))}
    # The job's import path without the stand-in's start-up hook: the trainer needs no device.
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and "habana_standin" not in p)
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "weight_trainer.py"), json.dumps(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    return proc, info


def main(job: dict) -> dict:
    import torch
    from engine_job import completion
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_gaudi_platform.distributed import weight_sender

    llm = LLM(model=job["model"], weight_transfer_config={"backend": "hpu"}, **job["engine"])

    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    params = SamplingParams(
        temperature=0.0, max_tokens=job["max_tokens"], logprobs=5, ignore_eos=True
    )

    def generate() -> list[dict]:
        return [completion(o) for o in llm.generate(prompts, params, use_tqdm=False)]

    def stats() -> dict:
        return llm.collective_rpc("get_recompile_stats")[0]

    def storages() -> list[dict[str, int]]:  # per worker
        return llm.collective_rpc(
            lambda w: {n: p.data_ptr() for n, p in w.model_runner.get_model().named_parameters()}
        )

    def report() -> dict:  # the first worker's, with every worker's rank in the group
        reports = llm.collective_rpc(lambda w: w.weight_transfer_engine.report())
        return {
            **reports[0],
            "ranks": [r["rank"] for r in reports],
            "rounds_per_worker": [r["rounds_applied"] for r in reports],
            "connected_per_worker": [r["connected"] for r in reports],
        }

    def quantized() -> dict:  # the first worker's FP8 linears: how many, scale shapes, digests
        def look(w) -> dict:
            params = dict(w.model_runner.get_model().named_parameters())
            fp8 = {n: p for n, p in params.items() if p.dtype == torch.float8_e4m3fn}
            scales = [params[n.removesuffix("weight") + "weight_scale"] for n in sorted(fp8)]
            return {
                "fp8_weights": len(fp8),
                "scale_shapes": [list(s.shape) for s in scales],
                "weight_digest": sum(float(p.float().abs().sum()) for p in fp8.values()),
                "scale_digest": sum(float(s.double().sum()) for s in scales),
            }

        return llm.collective_rpc(look)[0]

    out: dict = {"before": generate(), "stats_before": stats()}
    if job.get("report_quantized"):
        out["quantized_before"] = quantized()
    ptrs = storages()
    workdir = Path(job["workdir"])
    rounds = [
        {"seed": 1, "scale": 0.5, "bucket_bytes": 4096, "save": str(workdir / "round0")},
        {"seed": 2, "scale": 0.5, "bucket_bytes": 0, "save": str(workdir / "round1")},
    ][: job.get("rounds", 2)]
    for spec in rounds:
        spec["scale"] = job.get("scale", spec["scale"])
    trainer, info = start_trainer(job, rounds)
    try:
        weight_sender.connect_engine(llm, info)
        for i in range(len(rounds)):
            weight_sender.apply_update(llm)
            out[f"round{i}"] = generate()
            out[f"stats_round{i}"] = stats()
        out["report_after_rounds"] = report()
        if job.get("report_quantized"):
            out["quantized_after"] = quantized()
        out["same_storage"] = storages() == ptrs
        out["trainer_rc"] = trainer.wait(timeout=120)
    finally:
        if trainer.poll() is None:
            trainer.kill()
        out["trainer_log"] = (trainer.stdout.read() if trainer.stdout else "")[-3000:]
    if not job.get("dying_trainer", True):
        return out

    # A trainer that dies after the first bucket of its round.
    dying, info = start_trainer(
        job, [{"seed": 3, "scale": 0.5, "bucket_bytes": 4096, "die_after_buckets": 1}]
    )
    try:
        weight_sender.connect_engine(llm, info)
        start = time.perf_counter()
        try:
            weight_sender.apply_update(llm)
            out["failed_round_error"] = None
        except Exception as exc:  # what the caller sees
            out["failed_round_error"] = f"{type(exc).__name__}: {exc}"
        out["failed_round_seconds"] = time.perf_counter() - start
    finally:
        out["dying_trainer_rc"] = dying.wait(timeout=120)
    out["after_failed_round"] = generate()
    out["stats_after_failed_round"] = stats()
    out["report_after_failure"] = report()
    out["same_storage_after_failure"] = storages() == ptrs
    if job.get("sleep"):  # level 1 keeps what was written in place (engine: enable_sleep_mode)
        llm.sleep(level=1)
        llm.wake_up()
        out["after_sleep"] = generate()
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(json.loads(sys.argv[1]))), flush=True)
