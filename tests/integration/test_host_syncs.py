"""Host syncs per engine step on the Gaudi backend: seam/gaudi over the Habana stand-in, every
tensor on its torch device "hpu", where each device-to-host read and each wait for the device is
counted per step and per phase of the HPU runner (host_sync_job.py), with HPU graphs in lazy
mode, under vLLM's async scheduling (how it serves) and without it.

The goal (a Gaudi's device runs ahead of the host only as long as the host does not wait for
it): in decode steps one device-to-host read per step, the sampled ids, and nothing inside the
forward pass; with async scheduling that read is a non_blocking copy whose wait happens when the
engine takes the step's output (bookkeeping, after the next step is issued), never while a step
is prepared or sampled. The figures per step, at batch 1 and 64, are in
benchmarks/host_syncs.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import REAL_GAUDI_SOFTWARE, STANDIN_ENGINE_ENV
from tests.integration.generation import COMPILE_ENGINE, make_prompts, named_job_outputs, run_job

pytestmark = [pytest.mark.engine, pytest.mark.gaudi]

JOB = Path(__file__).with_name("host_sync_job.py")
REPO = Path(__file__).resolve().parents[2]
ENGINES = {"async": COMPILE_ENGINE, "sync": {**COMPILE_ENGINE, "async_scheduling": False}}
RUNS = {"batch1": 1, "batch6": 6}
MAX_TOKENS = 8
# vLLM's wait before a step reuses the host buffers of the previous step's input copies
# (GPUModelRunner.synchronize_input_prep): a host-to-device copy finishing, not a read.
INPUT_PREP_WAIT = "(synchronize_input_prep)"


@pytest.fixture(scope="module")
def counts() -> dict[str, dict]:
    if REAL_GAUDI_SOFTWARE:
        pytest.skip("the stand-in does not load beside a real Gaudi stack (its counts are its own)")
    from gaudi_testkit import tinymodels

    prompts = make_prompts()
    job = {
        "model": str(tinymodels.build("llama")),
        "engines": ENGINES,
        "runs": {
            name: {"prompts": prompts[:batch], "max_tokens": MAX_TOKENS}
            for name, batch in RUNS.items()
        },
    }
    env = {
        **STANDIN_ENGINE_ENV,
        "PT_HPU_LAZY_MODE": "1",
        "PYTHONPATH": os.pathsep.join([str(STANDIN_ENGINE_ENV["PYTHONPATH"]), str(REPO)]),
    }
    proc = run_job(JOB, json.dumps(job), env, timeout=900)
    outputs = named_job_outputs(proc)
    expected = {f"{engine}/{run}" for engine in ENGINES for run in RUNS}
    assert set(outputs) == expected, proc.stderr[-6000:]
    return outputs


def per_step(kind: dict, suffixes: tuple[str, ...]) -> float:
    return sum(n for key, n in kind["phases"].items() if key.endswith(suffixes)) / kind["steps"]


READS = (" value", " copy")  # " async copy" ends with " copy" too
BLOCKING = (" value", "prepare copy", "sample copy", "forward copy", "bookkeeping copy")


CASES = [f"{engine}/{run}" for engine in ENGINES for run in RUNS]


@pytest.mark.parametrize("case", CASES)
def test_the_count_agrees_with_the_stand_in_devices_own(counts, case):
    # Every read the runner's callers made is one the device saw, and the other way round.
    result = counts[case]
    assert result["reads"] == result["standin_reads"] > 0, result


@pytest.mark.parametrize("case", CASES)
def test_nothing_inside_the_forward_pass_reads_or_waits(counts, case):
    for name, kind in counts[case]["kinds"].items():
        forward = {k: n for k, n in kind["phases"].items() if k.startswith("forward ")}
        assert not forward, (name, forward, kind["callers"])


@pytest.mark.parametrize("case", CASES)
def test_a_decode_step_reads_the_device_once_its_sampled_ids(counts, case):
    decode = counts[case]["kinds"]["decode"]
    assert decode["steps"] >= MAX_TOKENS - 2, decode
    assert per_step(decode, READS) == 1, decode["callers"]
    for kind in counts[case]["kinds"].values():
        assert per_step(kind, READS) <= 1, kind["callers"]


@pytest.mark.parametrize("run", RUNS)
def test_async_scheduling_keeps_every_wait_off_the_step(counts, run):
    # The sampled ids leave as a non_blocking copy; the engine waits for it when it takes the
    # output, after the next step is issued. Nothing blocks while a step is prepared or sampled
    # but vLLM's own wait for its previous input copies.
    for name, kind in counts[f"async/{run}"]["kinds"].items():
        assert per_step(kind, BLOCKING) == 0, (name, kind["callers"])
        step_waits = {
            caller: n
            for caller, n in kind["callers"].items()
            if caller.startswith(("prepare wait", "sample wait"))
            and not caller.endswith(INPUT_PREP_WAIT)
        }
        assert not step_waits, (name, step_waits)
    decode = counts[f"async/{run}"]["kinds"]["decode"]
    assert per_step(decode, ("sample async copy",)) == 1, decode["callers"]
    assert per_step(decode, ("bookkeeping wait",)) <= 1, decode["callers"]


@pytest.mark.parametrize("run", RUNS)
def test_without_async_scheduling_the_sampled_ids_are_the_steps_one_blocking_read(counts, run):
    decode = counts[f"sync/{run}"]["kinds"]["decode"]
    assert per_step(decode, BLOCKING) == 1, decode["callers"]
    assert per_step(decode, (" wait",)) == 0, decode["callers"]
