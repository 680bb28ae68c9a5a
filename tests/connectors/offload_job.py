"""Runs KV-offloading engine jobs in a fresh process and prints the results as JSON.

    python offload_job.py '<json {name: job}>'

Each job (keys: model, engine (LLM kwargs), rounds: lists of prompts, each a list of token ids,
submitted one list at a time) runs in its own engine, one after the other; prints one
`RESULT <name> <json>` line per job: the greedy tokens and top-5 logprobs of every prompt per
round, and vLLM's prefix-cache and KV-offload counters after each round.

A job with `"abort": true` runs its first two rounds so, then aborts the first prompt of its third
round while that prompt's prefix is being loaded from host memory, and serves the rest of the
round beside the abort (`run_abort`). Its engine offloads with `DeferredHpuCPUOffloadingSpec`,
whose worker completes every copy a few steps after its submission, as a device with its own copy
engine does: so "while it is being loaded" is a state the test can hold.
"""

from __future__ import annotations

import gc
import json
import sys

COUNTERS = (
    "vllm:prefix_cache_hits",
    "vllm:external_prefix_cache_hits",
    "vllm:kv_offload_store_bytes",
    "vllm:kv_offload_load_bytes",
    "vllm:kv_offload_allocation_failure",
    "vllm:kv_offload_tiering_read_bytes",
    "vllm:kv_offload_tiering_write_bytes",
)


GAUGES = ("vllm:kv_offload_cpu_cache_usage_perc", "vllm:kv_cache_usage_perc")


def _metrics(llm, names) -> dict[str, float]:
    values: dict[str, float] = {}
    for m in llm.get_metrics():  # labelled counters (per tier) add up
        values[m.name] = values.get(m.name, 0) + getattr(m, "value", 0)
    return {name: values.get(name, 0) for name in names}


def run(job: dict) -> dict:
    if job.get("abort"):
        return run_abort(job)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from tests.integration.engine_job import completion

    llm = LLM(model=job["model"], **job["engine"])
    params = SamplingParams(
        temperature=0.0, max_tokens=job["max_tokens"], logprobs=5, ignore_eos=True
    )
    rounds, counters = [], []
    for prompts in job["rounds"]:
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )
        rounds.append([completion(o) for o in outs])
        counters.append(_metrics(llm, COUNTERS))
    return {"rounds": rounds, "counters": counters}


def run_abort(job: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from tests.integration.engine_job import completion

    llm = LLM(model=job["model"], **job["engine"])
    params = SamplingParams(
        temperature=0.0, max_tokens=job["max_tokens"], logprobs=5, ignore_eos=True
    )
    first, fillers, (aborted, *others) = job["rounds"]
    for prompts in (first, fillers):
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    before = _metrics(llm, COUNTERS)
    # vLLM imports this file as a module (`spec_module_path`); run as a script it is __main__.
    from tests.connectors import offload_job

    [worker] = offload_job.WORKERS
    engine = llm.llm_engine
    engine.add_request("aborted", TokensPrompt(prompt_token_ids=aborted), params)
    steps = 0
    while not worker.queued(store=False) and steps < 10:
        engine.step()
        steps += 1
    in_flight = {
        "loads": len(worker.queued(store=False)),
        "steps": steps,
        **_metrics(llm, GAUGES),
    }
    engine.abort_request(["aborted"])
    for i, prompt in enumerate(others):
        engine.add_request(f"other-{i}", TokensPrompt(prompt_token_ids=prompt), params)
    finished: dict[str, dict] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = completion(out) if out.outputs[0].token_ids else {}
    engine.step()  # one idle step: its stats are the settled state
    after = _metrics(llm, COUNTERS)
    return {
        "in_flight": in_flight,
        "after": {
            "queued": len(worker.queued()),
            "submitted": worker.submitted,
            "completed": worker.completed,
            **_metrics(llm, GAUGES),
            **{name: after[name] - before[name] for name in COUNTERS},
        },
        "finished": sorted(finished),
        "rounds": [[finished[f"other-{i}"] for i in range(len(others))]],
    }


# ---- an offloading worker whose copies complete later, as on a device with a copy engine -----

WORKERS: list = []


def _deferred_worker_class():
    from vllm_gaudi_connectors.offload import HpuOffloadingWorker

    class DeferredHpuOffloadingWorker(HpuOffloadingWorker):
        """Runs each job's copies at the `LAG`-th `get_finished` after its submission, or when
        vLLM waits for it (the fence before a block with a pending job is written again)."""

        LAG = 3

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._queue: list[list] = []  # [lag left, job id, device spec, host spec, store]
            self.submitted = self.completed = 0

        def queued(self, store: bool | None = None) -> list[int]:
            return [e[1] for e in self._queue if store is None or e[4] == store]

        def _copy(self, job_id, device_spec, host_spec, store):
            self._queue.append([self.LAG, job_id, device_spec, host_spec, store])
            self.submitted += 1
            return True

        def _run(self, due) -> None:
            for entry in due:
                self._queue.remove(entry)
                super()._copy(*entry[1:])
                self.completed += 1

        def get_finished(self):
            for entry in self._queue:
                entry[0] -= 1
            self._run([e for e in self._queue if e[0] <= 0])
            return super().get_finished()

        def wait(self, job_ids):
            self._run([e for e in self._queue if e[1] in job_ids])

    return DeferredHpuOffloadingWorker


def __getattr__(name: str):
    # The spec class is built on first use: vLLM's factory imports this module by path
    # (`spec_module_path`) in the engine's process, where vLLM is loaded.
    if name != "DeferredHpuCPUOffloadingSpec":
        raise AttributeError(name)
    from vllm_gaudi_connectors.offload import HpuCPUOffloadingSpec

    worker_class = _deferred_worker_class()

    class DeferredHpuCPUOffloadingSpec(HpuCPUOffloadingSpec):
        def create_worker(self, kv_caches):
            worker = worker_class(kv_caches, self.blocks_per_chunk, self.num_chunks)
            WORKERS.append(worker)
            return worker

    globals()[name] = DeferredHpuCPUOffloadingSpec
    return DeferredHpuCPUOffloadingSpec


if __name__ == "__main__":
    for name, job in json.loads(sys.argv[1]).items():
        print(f"RESULT {name} " + json.dumps(run(job)), flush=True)
        gc.collect()  # the finished job's engine shuts down before the next one starts
