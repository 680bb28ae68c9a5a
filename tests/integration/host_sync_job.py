"""Counts the host syncs of an engine's steps on the Habana stand-in's "hpu" device.

    python host_sync_job.py '<json job>'

Job keys: model (path), engines ({name: LLM kwargs}, one engine after another in this process),
runs ({name: {"prompts": [...], "max_tokens": N}}, each one generate call on every engine).
While a run goes, every engine step's syncs are counted per phase of the HPU runner: prepare
(execute_model outside the forward pass), forward (the forward pass: graph replay or eager),
sample (sample_tokens) and bookkeeping (everything else the engine does, the async output's
wait included). What is counted, each named by the innermost frame of vLLM or of the project
that asked for it:
- "value": a device value read on the host (`.item()`, `bool()`, `int()`, `.tolist()`,
  `.numpy()`);
- "copy": a blocking copy of device data to the host (`.cpu()`, `.to("cpu")`, `copy_` into a
  host tensor);
- "async copy": the same with `non_blocking=True` (no wait by itself);
- "wait": the host waits for the device (`synchronize` of the device, a stream or an event).
A blocking sync is a value, a copy or a wait. Prints `RESULT <engine>/<run> <json>` with, per
step kind (prefill, decode, mixed; a step that schedules nothing is "idle"): the steps, the
syncs per phase and kind, and the callers; and the stand-in device's own count of device-to-host
reads over the same run (its C++ backend's), which must equal values + copies + async copies.
"""

from __future__ import annotations

import collections
import gc
import json
import os
import sys
import traceback

_PHASE = ["bookkeeping"]
_OWN = (os.sep + "vllm" + os.sep, "vllm_gaudi_")
_VALUES = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__")


def _caller() -> str:
    """The innermost frame of vLLM or of the project below the sync."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if any(part in frame.filename for part in _OWN) and "host_sync_job" not in frame.filename:
            path = frame.filename
            for marker in ("site-packages" + os.sep, "src" + os.sep):
                if marker in path:
                    path = path.split(marker, 1)[1]
            return f"{path}:{frame.lineno} ({frame.name})"
    return "?"


def _spy_on_syncs(record) -> None:
    """Wrap the tensor methods that read device data and the device's waits, so each one on the
    stand-in's "hpu" device is recorded with its kind and caller."""
    import torch
    from habana_frameworks.torch import hpu

    def to_host(args, kwargs) -> bool:
        target = kwargs.get("device", args[0] if args else None)
        if isinstance(target, torch.Tensor):
            target = target.device
        if target is None or isinstance(target, torch.dtype):
            return False
        return torch.device(target).type == "cpu"

    def on_hpu(value) -> bool:
        return getattr(getattr(value, "device", None), "type", None) == "hpu"

    def wrap_tensor(name: str) -> None:
        method = getattr(torch.Tensor, name)

        def spied(self, *args, **kwargs):
            if self.device.type == "hpu":
                if name in ("to", "cpu") and (name == "cpu" or to_host(args, kwargs)):
                    record("async copy" if kwargs.get("non_blocking") else "copy")
                elif name in _VALUES:
                    record("value")
            elif name == "copy_" and self.device.type == "cpu" and args and on_hpu(args[0]):
                non_blocking = kwargs.get("non_blocking") or args[1:2] == (True,)
                record("async copy" if non_blocking else "copy")
            return method(self, *args, **kwargs)

        setattr(torch.Tensor, name, spied)

    for name in (*_VALUES, "cpu", "to", "copy_"):
        wrap_tensor(name)

    def wrap_wait(owner, name: str) -> None:
        method = getattr(owner, name)

        def waited(*args, **kwargs):
            record("wait")
            return method(*args, **kwargs)

        setattr(owner, name, waited)

    wrap_wait(hpu, "synchronize")
    wrap_wait(hpu.Stream, "synchronize")
    wrap_wait(hpu.Event, "synchronize")
    wrap_wait(torch.accelerator, "synchronize")


def _step_kind(scheduler_output) -> str:
    tokens = list(scheduler_output.num_scheduled_tokens.values())
    if not tokens:
        return "idle"
    if max(tokens) == 1:
        return "decode"
    return "mixed" if min(tokens) == 1 else "prefill"


def _in_phase(name: str, fn):
    def wrapped(*args, **kwargs):
        outer, _PHASE[0] = _PHASE[0], name
        try:
            return fn(*args, **kwargs)
        finally:
            _PHASE[0] = outer

    return wrapped


def run_engine(model: str, engine: dict, runs: dict, steps: list[dict]) -> dict[str, dict]:
    from habana_frameworks.torch import _torch_device
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, **engine)
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    execute = _in_phase("prepare", runner.execute_model)

    def execute_model(scheduler_output, *args, **kwargs):
        steps.append(
            {
                "kind": _step_kind(scheduler_output),
                "phases": collections.Counter(),
                "callers": collections.Counter(),
            }
        )
        return execute(scheduler_output, *args, **kwargs)

    runner.execute_model = execute_model
    runner._model_forward = _in_phase("forward", runner._model_forward)
    runner.sample_tokens = _in_phase("sample", runner.sample_tokens)
    results = {}
    for name, spec in runs.items():
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=spec["max_tokens"])
        prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
        steps.clear()
        before = _torch_device.host_reads()
        llm.generate(prompts, params, use_tqdm=False)
        standin_reads = _torch_device.host_reads() - before
        kinds: dict = {}
        for step in steps:
            kind = kinds.setdefault(
                step["kind"],
                {"steps": 0, "phases": collections.Counter(), "callers": collections.Counter()},
            )
            kind["steps"] += 1
            kind["phases"].update(step["phases"])
            kind["callers"].update(step["callers"])
        reads = sum(
            n for step in steps for key, n in step["phases"].items() if not key.endswith(" wait")
        )
        results[name] = {"kinds": kinds, "reads": reads, "standin_reads": standin_reads}
    del llm
    gc.collect()
    return results


def run(job: dict) -> None:
    steps: list[dict] = []

    def record(kind: str) -> None:
        if steps:  # syncs before the first step (engine start, warmup) are not a step's
            steps[-1]["phases"][f"{_PHASE[0]} {kind}"] += 1
            steps[-1]["callers"][f"{_PHASE[0]} {kind} at {_caller()}"] += 1

    _spy_on_syncs(record)
    for engine_name, engine in job["engines"].items():
        results = run_engine(job["model"], engine, job["runs"], steps)
        for run_name, result in results.items():
            print(f"RESULT {engine_name}/{run_name} " + json.dumps(result), flush=True)


if __name__ == "__main__":
    run(json.loads(sys.argv[1]))
