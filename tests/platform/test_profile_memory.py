"""The KV cache is sized from the profile run's peak, not from what stays allocated after it.

A profile run allocates its activations and frees them before it returns; reading the device's
allocated bytes after it would see none of them. The seam's `reset_peak_memory_stats` and
`max_memory_allocated` read the peak on every backend: the emulation from the process's peak
resident set (Linux keeps it at every page fault), seam/gaudi from Habana's allocator (the
stand-in's device counts every allocation of its "hpu" tensors). The worker's
`determine_available_memory` must leave the KV cache less memory, by the transient's size, when
the profile run allocated and freed one.

The engine-level check (the profile pass runs the state layers' kernels and its peak is above
what stays) is in the hybrid engine tests: test_hybrid.py (emulation) and
test_gaudi_standin_engine.py (seam/gaudi over the stand-in).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import REAL_GAUDI_SOFTWARE, standin_process_env
from tests.integration.generation import job_result

MIB = 1 << 20
TRANSIENT = 256 * MIB


def _touched(nbytes: int, device: str = "cpu") -> torch.Tensor:
    """A tensor whose every page is written (resident, not merely reserved)."""
    return torch.ones(nbytes // 4, dtype=torch.float32, device=device)


def fake_worker(seam, transient: int, device: str = "cpu"):
    """An HPUWorker with only what determine_available_memory reads: a runner whose profile run
    allocates `transient` bytes and frees them before it returns."""
    from vllm_gaudi_platform.worker.hpu_worker import HPUWorker

    def profile_run():
        if transient:
            x = _touched(transient, device)
            x.add_(1.0)
            del x
        return None

    worker = HPUWorker.__new__(HPUWorker)
    worker.seam = seam
    worker.cache_config = SimpleNamespace(kv_cache_memory_bytes=None, gpu_memory_utilization=0.9)
    worker.model_runner = SimpleNamespace(
        profile_run=profile_run,
        model=torch.nn.Linear(64, 64, device=device),
        graphs=SimpleNamespace(enabled=False),
    )
    return worker


def test_the_emulated_peak_counts_a_tensor_freed_before_it_is_read(emulated):
    emulated.reset_peak_memory_stats()
    before = emulated.memory_allocated()
    x = _touched(TRANSIENT)
    del x
    peak, after = emulated.max_memory_allocated(), emulated.memory_allocated()
    assert peak - before >= TRANSIENT * 0.9, (before, peak)
    assert after - before < TRANSIENT / 4, "the freed tensor should no longer be resident"
    # A reset starts the peak again from what is resident now.
    emulated.reset_peak_memory_stats()
    assert emulated.max_memory_allocated() - emulated.memory_allocated() < TRANSIENT / 4


def test_a_transient_allocation_of_the_profile_run_lowers_the_kv_cache_emulated(emulated):
    quiet = fake_worker(emulated, 0).determine_available_memory()
    busy_worker = fake_worker(emulated, TRANSIENT)
    busy = busy_worker.determine_available_memory()
    # The resident set moves by a few MiB between readings (the interpreter, glibc's arenas).
    assert quiet - busy >= TRANSIENT * 0.8, (quiet, busy)
    report = busy_worker.profile_memory
    assert report.peak - report.before >= TRANSIENT * 0.9
    assert report.peak - report.after >= TRANSIENT * 0.75


STANDIN_JOB = r"""
import json, os, sys
os.environ["HABANA_STANDIN_TORCH_DEVICE"] = "1"
sys.path.insert(0, {root!r})
import torch
from vllm_gaudi_platform.seam import gaudi
from tests.platform.test_profile_memory import fake_worker, TRANSIENT, _touched

out = {{}}
gaudi.reset_peak_memory_stats()
before = gaudi.memory_allocated()
x = _touched(TRANSIENT, "hpu")
del x
out["seam"] = [before, gaudi.max_memory_allocated(), gaudi.memory_allocated()]
import habana_frameworks.torch.hpu as hthpu
refused = []
for device in (1, "hpu:1", "cpu"):
    try:
        hthpu.max_memory_allocated(device)
    except Exception as exc:
        refused.append(type(exc).__name__)
out["refused"] = refused
quiet = fake_worker(gaudi, 0, "hpu").determine_available_memory()
worker = fake_worker(gaudi, TRANSIENT, "hpu")
busy = worker.determine_available_memory()
out["kv"] = [quiet, busy]
out["report"] = worker.profile_memory.as_dict()
print("RESULT " + json.dumps(out))
"""


@pytest.mark.process
def test_a_transient_allocation_of_the_profile_run_lowers_the_kv_cache_on_gaudi(run_python):
    if REAL_GAUDI_SOFTWARE:
        pytest.skip("checks the Habana stand-in, which does not load beside a real Gaudi stack")
    root = str(Path(__file__).resolve().parents[2])
    code = STANDIN_JOB.format(root=root)
    out = job_result(run_python(code, env=standin_process_env(3), timeout=600), "stand-in job")
    before, peak, after = out["seam"]
    # The stand-in's device counts its tensors' bytes exactly.
    assert peak - before == TRANSIENT and after == before
    assert out["refused"] == ["HabanaRuleError"] * 3
    quiet, busy = out["kv"]
    assert abs(quiet - busy - TRANSIENT) <= 1, (quiet, busy)  # int() of each budget
    report = out["report"]
    assert report["peak"] - report["before"] == TRANSIENT
    assert report["after"] == report["before"]
