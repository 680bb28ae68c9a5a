"""Greedy generation of one model single-process, with pipeline parallelism 2 and with data
parallelism 2, for test_parallel.py. Prints one `RESULT <case> <json>` line per case.

    python parallel_job.py '<json job>'

Job keys: model, prompts, max_tokens, engine (LLM kwargs shared by every case), cases (of
"single", "pp2", "dp2", "dp2ep"). The single and PP cases run one after the other in this
process. DP 2 runs as vLLM's offline data-parallel mode does: two processes (this script with
"dp_rank"), each one DP rank with its own share of the prompts, joined through VLLM_DP_*
variables; "dp2ep" also splits the experts between the two ranks (expert parallelism).

Each case reports its outputs, every worker's recompile statistics and what every worker's MoE
layers hold (`held_experts`, sent over collective_rpc: the job needs
VLLM_ALLOW_INSECURE_SERIALIZATION=1).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time


def generate(llm, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=5, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [
        {
            "tokens": list(o.outputs[0].token_ids),
            "logprobs": [
                {str(t): lp.logprob for t, lp in s.items()} for s in o.outputs[0].logprobs
            ],
        }
        for o in outs
    ]


def held_experts(worker) -> list[dict]:
    """What each MoE layer of a worker's model holds (sent to the workers over collective_rpc):
    vLLM's expert-parallel bookkeeping, the global ids of the experts this rank owns, the shape
    of its expert weights and how many experts the HPU method hands the kernel."""
    import torch
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    layers = []
    for name, module in worker.model_runner.get_model().named_modules():
        if not isinstance(module, RoutedExperts):
            continue
        parallel = module.moe_config.moe_parallel_config
        expert_map = module.expert_map
        if expert_map is None:  # no expert parallelism: every expert is local
            owned = list(range(module.global_num_experts))
        else:
            owned = torch.nonzero(expert_map >= 0).flatten().tolist()
            # The map sends each owned global id to its local slot, in order.
            assert expert_map[owned].tolist() == list(range(len(owned))), expert_map
        kernel_weights = getattr(module.quant_method, "_expert_weights", None)
        layers.append(
            {
                "layer": name,
                "method": type(module.quant_method).__name__,
                "use_ep": parallel.use_ep,
                "ep_rank": parallel.ep_rank,
                "ep_size": parallel.ep_size,
                "global_num_experts": module.global_num_experts,
                "local_num_experts": module.local_num_experts,
                "owned_experts": owned,
                "w13_shape": list(module.w13_weight.shape),
                "w2_shape": list(module.w2_weight.shape),
                "kernel_experts": None if kernel_weights is None else len(kernel_weights[0]),
            }
        )
    return layers


def run_engine(
    job: dict, prompts: list[list[int]], between=None, trace: str | None = None, **engine
) -> dict:
    """One engine: its outputs, every worker's recompile stats and the seconds it took.
    `between(stage)` is called after generating ("generated") and before shutting the engine
    down ("done"): the DP ranks meet there. With `trace`, the workers record their step shapes
    to that file (VLLM_BUCKETING_RECORD_TRACE) and the result holds its lines."""
    import gc

    from vllm import LLM

    if trace:
        os.environ["VLLM_BUCKETING_RECORD_TRACE"] = trace
    else:
        os.environ.pop("VLLM_BUCKETING_RECORD_TRACE", None)
    start = time.perf_counter()
    llm = LLM(model=job["model"], **job["engine"], **engine)
    started = time.perf_counter() - start
    outputs = generate(llm, prompts, job["max_tokens"])
    seconds = time.perf_counter() - start
    if between:
        between("generated")
    result = {
        "outputs": outputs,
        "stats": llm.collective_rpc("get_recompile_stats"),
        "experts": llm.collective_rpc(held_experts),
        "start_seconds": started,
        "seconds": seconds,
    }
    if between:
        between("done", result)
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    if trace:
        os.environ.pop("VLLM_BUCKETING_RECORD_TRACE", None)
        with open(trace, encoding="utf-8") as f:
            result["trace"] = sorted(line for line in f if not line.startswith("#"))
    return result


def dp_shares(num_prompts: int) -> list[list[int]]:
    """Prompt indices per DP rank: rank 1 gets two prompts only, so it runs out of requests
    while rank 0 still has some and must run idle (dummy) steps."""
    return [[i for i in range(num_prompts) if i not in (1, 3)], [1, 3]]


def run_dp(job: dict, **engine) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs, logs = [], []
    for rank in range(2):
        env = {
            **os.environ,
            "VLLM_DP_RANK": str(rank),
            "VLLM_DP_RANK_LOCAL": str(rank),
            "VLLM_DP_SIZE": "2",
            "VLLM_DP_MASTER_IP": "127.0.0.1",
            "VLLM_DP_MASTER_PORT": str(port),
            # vLLM's engine-core process: an offline DP rank's idle steps and its wave agreement
            # with the other rank come from the DP engine core's busy loop, which only that
            # process runs. (The single and PP engines keep the core in the job's process.)
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
            # vLLM logs to stdout, which carries this job's protocol: its log (an engine's
            # traceback included) goes to the rank's log file instead.
            "VLLM_LOGGING_STREAM": "ext://sys.stderr",
        }
        arg = json.dumps({**job, "engine": {**job["engine"], **engine}, "dp_rank": rank})
        logs.append(tempfile.TemporaryFile("w+"))  # noqa: SIM115 - lives as long as the job
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, arg],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=logs[-1],
                text=True,
            )
        )

    def read(rank: int, prefix: str) -> str:
        proc = procs[rank]
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix) :]
        proc.wait()
        failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
        report = []
        for r in failed or [rank]:
            logs[r].seek(0)
            report.append(f"DP rank {r} failed ({procs[r].returncode}):\n{logs[r].read()[-6000:]}")
        raise RuntimeError("\n".join(report))

    # A rank that dies leaves the other blocked in a DP collective: end it too, so that the job
    # fails at once with the dead rank's log instead of waiting for the test's timeout.
    done = threading.Event()

    def watch() -> None:
        while not done.wait(1.0):
            if any(p.poll() not in (None, 0) for p in procs):
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                return

    threading.Thread(target=watch, daemon=True).start()

    def tell_all(word: str) -> None:
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write(word + "\n")
            proc.stdin.flush()

    # A rank that finished its prompts keeps running idle steps for the other one: no rank asks
    # for its statistics or shuts its engine down before every rank has generated.
    try:
        for rank in range(2):
            read(rank, "GENERATED")
        tell_all("stats")
        results = [json.loads(read(rank, "RANK ")) for rank in range(2)]
        tell_all("exit")
        for proc in procs:
            proc.wait(timeout=120)
    finally:
        done.set()
        for proc in procs:  # a failed rank leaves the other waiting in a collective
            if proc.poll() is None:
                proc.kill()
    outputs: list[dict | None] = [None] * len(job["prompts"])
    for share, result in zip(dp_shares(len(job["prompts"])), results):
        for i, out in zip(share, result["outputs"]):
            outputs[i] = out
    return {
        "outputs": outputs,
        "stats": [s for r in results for s in r["stats"]],
        "experts": [e for r in results for e in r["experts"]],
        "start_seconds": max(r["start_seconds"] for r in results),
        "seconds": max(r["seconds"] for r in results),
    }


def main(job: dict) -> None:
    if "dp_rank" in job:
        share = dp_shares(len(job["prompts"]))[job["dp_rank"]]

        def between(stage: str, result: dict | None = None) -> None:
            if stage == "generated":
                print("GENERATED", flush=True)
                sys.stdin.readline()  # "stats": every rank has generated
            else:
                print("RANK " + json.dumps(result), flush=True)
                sys.stdin.readline()  # "exit": every rank has its statistics

        run_engine(job, [job["prompts"][i] for i in share], between=between)
        return
    for case in job["cases"]:
        trace = os.path.join(job["trace_dir"], f"{case}.trace") if "trace_dir" in job else None
        if case == "single":
            result = run_engine(job, job["prompts"], trace=trace)
        elif case == "pp2":
            result = run_engine(job, job["prompts"], trace=trace, pipeline_parallel_size=2)
        elif case == "dp2":
            result = run_dp(job)
        elif case == "dp2ep":  # experts split between the DP ranks
            result = run_dp(job, enable_expert_parallel=True)
        else:
            raise ValueError(f"unknown case {case!r}")
        print(f"RESULT {case} " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
