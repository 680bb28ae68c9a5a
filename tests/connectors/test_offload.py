"""KV offloading to host memory on the HPU platform (the `hpu_offload` entry point):
vLLM's `OffloadingConnector` with `HpuCPUOffloadingSpec`, whose worker copies block pages between
the HPU KV cache and host chunks.

- The worker alone: pages stored from device blocks come back byte for byte into other device
  blocks, with KV-cache groups whose first block sits inside a host chunk;
- an engine whose KV cache is too small for its working set: a long prompt prefix, evicted from
  the device by other prompts, is served again from host memory (external prefix-cache hits,
  load bytes equal to its blocks), and every prompt generates what transformers does;
- a host tier too small for what the engine offers it: stores that do not fit are counted as
  allocation failures and the prompts are recomputed, with the same tokens.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

from tests.integration.generation import ENGINE, assert_close, hf_greedy, named_job_outputs, run_job
from vllm_gaudi_platform.testing import tinymodels

JOB = Path(__file__).with_name("offload_job.py")
REPO = Path(__file__).resolve().parents[2]
MAX_TOKENS = 6
# The tiny Llama: 2 layers x 128 tokens x 2 KV heads x (keys + values of 32) x 4 bytes.
BLOCK_BYTES = 2 * 128 * 2 * 64 * 4
PREFIX_BLOCKS = 2  # full blocks of the shared 300-token prefix


def _worker_caches(pages=(256, 384), num_blocks=16, seed=0):
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
    )

    gen = torch.Generator().manual_seed(seed)
    tensors = [
        CanonicalKVCacheTensor(
            torch.randint(-128, 127, (num_blocks, page), dtype=torch.int8, generator=gen), page
        )
        for page in pages
    ]
    # Group 0 reads both tensors (two layers); group 1 the second, with a smaller unpadded page.
    refs = [
        [CanonicalKVCacheRef(0, pages[0]), CanonicalKVCacheRef(1, pages[1])],
        [CanonicalKVCacheRef(1, pages[1] - 64)],
    ]
    return CanonicalKVCaches(tensors, refs)


def test_the_worker_stores_pages_and_loads_them_back_into_other_blocks(hpu_backend):
    # Copies go through the seam's copy_blocks: the emulation, and gaudi.py over the stand-in.
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    from vllm_gaudi_connectors.offload import HpuOffloadingWorker

    caches = _worker_caches()
    original = [t.tensor.clone() for t in caches.tensors]
    worker = HpuOffloadingWorker(caches, blocks_per_chunk=4, num_chunks=8)
    # Group 0: request blocks 2..4 (device 5, 6, 7): slots 2, 3 of one chunk and 0 of the next.
    # Group 1: request blocks 4..5 (device 2, 3): slots 0, 1 of a third chunk.
    stored = GPULoadStoreSpec([5, 6, 7, 2, 3], group_sizes=[3, 2], block_indices=[2, 4])
    chunks = CPULoadStoreSpec([6, 1, 3])
    assert worker.submit_store(7, stored, chunks)
    [done] = worker.get_finished()
    pages = caches.tensors[0].page_size_bytes, caches.tensors[1].page_size_bytes
    assert done.job_id == 7 and done.success
    assert done.transfer_size == 3 * (pages[0] + pages[1]) + 2 * (pages[1] - 64)
    assert worker.get_finished() == []  # reported once

    for t in caches.tensors:
        t.tensor.zero_()
    into = GPULoadStoreSpec([10, 11, 12, 8, 9], group_sizes=[3, 2], block_indices=[2, 4])
    assert worker.submit_load(8, chunks, into)
    worker.wait({8})
    assert [r.job_id for r in worker.get_finished()] == [8]
    for src, dst in ((5, 10), (6, 11), (7, 12)):
        for i in (0, 1):
            assert torch.equal(caches.tensors[i].tensor[dst], original[i][src])
    for src, dst in ((2, 8), (3, 9)):
        t = caches.tensors[1].tensor
        assert torch.equal(t[dst, : pages[1] - 64], original[1][src, : pages[1] - 64])
        assert not t[dst, pages[1] - 64 :].any()  # the padding is not part of the page
    # Nothing else was written.
    untouched = [b for b in range(16) if b not in (8, 9, 10, 11, 12)]
    assert not any(t.tensor[untouched].any() for t in caches.tensors)


# The same round trip with the KV cache on the Habana stand-in's torch device "hpu", which
# refuses an op mixing device and host tensors as a Gaudi does.
ON_HPU_DEVICE = r"""
import json, os
os.environ["HABANA_STANDIN_TORCH_DEVICE"] = "1"
import torch
import habana_frameworks.torch  # noqa: F401
from tests.connectors.test_offload import _worker_caches
from vllm.v1.kv_offload.base import GPULoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm_gaudi_connectors.offload import HpuOffloadingWorker

caches = _worker_caches()
for t in caches.tensors:
    t.tensor = t.tensor.to("hpu")
original = [t.tensor.cpu() for t in caches.tensors]
worker = HpuOffloadingWorker(caches, blocks_per_chunk=4, num_chunks=8)
worker.submit_store(1, GPULoadStoreSpec([5, 6, 7], [3], [2]), CPULoadStoreSpec([6, 1]))
for t in caches.tensors:
    t.tensor.zero_()
worker.submit_load(2, CPULoadStoreSpec([6, 1]), GPULoadStoreSpec([10, 11, 12], [3], [2]))
out = {
    "devices": [t.tensor.device.type for t in caches.tensors],
    "jobs": [r.job_id for r in worker.get_finished()],
    "restored": all(
        torch.equal(caches.tensors[i].tensor[dst].cpu(), original[i][src])
        for i in (0, 1) for src, dst in ((5, 10), (6, 11), (7, 12))
    ),
}
print("RESULT " + json.dumps(out))
"""


def test_the_worker_round_trip_on_the_standin_hpu_device(run_python):
    from tests.conftest import REAL_GAUDI_SOFTWARE, standin_process_env
    from tests.integration.generation import job_result

    if REAL_GAUDI_SOFTWARE:
        pytest.skip("checks the Habana stand-in, which does not load beside a real Gaudi stack")
    env = standin_process_env(2)
    env["PYTHONPATH"] = os.pathsep.join([str(env["PYTHONPATH"]), str(REPO)])
    result = job_result(run_python(ON_HPU_DEVICE, env=env, timeout=900), "stand-in worker job")
    assert result == {"devices": ["hpu", "hpu"], "jobs": [1, 2], "restored": True}


REGISTER_TWICE = """
import vllm_gaudi_connectors
from vllm_gaudi_platform import plugins
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
vllm_gaudi_connectors.register_offload()
plugins.OUTCOMES.clear()  # as if a second general-plugin pass ran in this process
vllm_gaudi_connectors.register_offload()
cls = OffloadingSpecFactory.get_spec_cls({"spec_name": "HpuCPUOffloadingSpec"})
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
print(cls.__name__, issubclass(cls, CPUOffloadingSpec), plugins.OUTCOMES["hpu_offload"])
"""


def test_entry_point_registers_the_spec_once_even_when_run_twice(run_python):
    result = run_python(REGISTER_TWICE, {"VLLM_HPU_EMULATION": "cpu"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "HpuCPUOffloadingSpec True registered"


# ---- engines --------------------------------------------------------------------------------


def _prompts():
    rng = random.Random(0)
    tok = lambda n: [rng.randrange(3, 500) for _ in range(n)]  # noqa: E731
    prefix = tok(300)
    first = [prefix + tok(20)]
    fillers = [tok(300) for _ in range(6)]  # 18 blocks: more than the device cache holds
    again = [prefix + tok(10)]
    return [first, fillers, again]


def _offloading(cpu_bytes: int) -> dict:
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "HpuCPUOffloadingSpec",
            "cpu_bytes_to_use": cpu_bytes,
        },
    }


# 12 blocks of 128 tokens on the device (three 512-token sequences at once).
SMALL_CACHE = {**ENGINE, "max_num_seqs": 4, "max_num_batched_tokens": 512}
SMALL_CACHE.update(kv_cache_memory_bytes=12 * BLOCK_BYTES + BLOCK_BYTES // 2)
SMALL_CACHE["disable_log_stats"] = False


@pytest.fixture(scope="module")
def engines() -> dict[str, dict]:
    model = str(tinymodels.build("llama"))
    rounds = _prompts()
    jobs = {
        name: {
            "model": model,
            "engine": {**SMALL_CACHE, "kv_transfer_config": _offloading(cpu_bytes)},
            "rounds": rounds,
            "max_tokens": MAX_TOKENS,
        }
        for name, cpu_bytes in (("host-memory", 64 << 20), ("host-full", 2 * BLOCK_BYTES))
    }
    proc = run_job(JOB, json.dumps(jobs), {"PYTHONPATH": str(REPO)})
    results = named_job_outputs(proc)
    if set(results) != set(jobs):
        pytest.fail(f"the offload jobs printed {sorted(results)}:\n{proc.stderr[-5000:]}")
    results["reference"] = {"rounds": [hf_greedy(model, r, MAX_TOKENS) for r in rounds]}
    return results


def _delta(result: dict, name: str) -> float:
    """How much a counter moved during the last round."""
    before, after = result["counters"][-2], result["counters"][-1]
    return after[name] - before[name]


@pytest.mark.engine
def test_an_evicted_prefix_comes_back_from_host_memory(engines):
    result = engines["host-memory"]
    assert _delta(result, "vllm:prefix_cache_hits") == 0  # gone from the device cache
    assert _delta(result, "vllm:external_prefix_cache_hits") == PREFIX_BLOCKS * 128
    assert _delta(result, "vllm:kv_offload_load_bytes") == PREFIX_BLOCKS * BLOCK_BYTES
    assert result["counters"][0]["vllm:kv_offload_store_bytes"] >= PREFIX_BLOCKS * BLOCK_BYTES


@pytest.mark.engine
@pytest.mark.parametrize("name", ["host-memory", "host-full"])
def test_offloaded_serving_generates_what_transformers_does(engines, name):
    ours, ref = engines[name]["rounds"], engines["reference"]["rounds"]
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert assert_close(a, b, f"{name} round {i}") == 0


@pytest.mark.engine
def test_a_full_host_tier_falls_back_to_recomputing(engines):
    result = engines["host-full"]
    assert result["counters"][-1]["vllm:kv_offload_allocation_failure"] > 0
    assert _delta(result, "vllm:external_prefix_cache_hits") == 0
