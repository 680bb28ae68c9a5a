"""KV offloading to host memory on the HPU platform (the `hpu_offload` entry point):
vLLM's `OffloadingConnector` with `HpuCPUOffloadingSpec`, whose worker copies block pages between
the HPU KV cache and host chunks.

- The worker alone: pages stored from device blocks come back byte for byte into other device
  blocks, with KV-cache groups whose first block sits inside a host chunk;
- an engine whose KV cache is too small for its working set: a long prompt prefix, evicted from
  the device by other prompts, is served again from host memory (external prefix-cache hits,
  load bytes equal to its blocks), and every prompt generates what transformers does;
- a host tier too small for what the engine offers it: stores that do not fit are counted as
  allocation failures and the prompts are recomputed, with the same tokens;
- `HpuTieringOffloadingSpec` with vLLM's file tier behind a small host tier: the worker's host
  chunks are its cells of the shared region's rows, which the file tier writes to disk and reads
  back; a prefix evicted from the device and from host memory comes back from its block files,
  and a fresh engine on the same directory serves it from them too;
- a request aborted while its prefix is being loaded from host memory (a worker whose copies
  complete steps after submission, as on a device with a copy engine): its device blocks stay
  held until the load lands, then every device block and host chunk is free again, and the
  requests served beside it (one with the same prefix, two that need the freed blocks) generate
  what transformers does. A worker that reported its loads before copying fails this.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

from gaudi_testkit import tinymodels
from tests.integration.generation import ENGINE, assert_close, hf_greedy, named_job_outputs, run_job

JOB = Path(__file__).with_name("offload_job.py")
REPO = Path(__file__).resolve().parents[2]
MAX_TOKENS = 6
# The tiny Llama: 2 layers x 128 tokens x 2 KV heads x (keys + values of 32) x 4 bytes.
BLOCK_BYTES = 2 * 128 * 2 * 64 * 4
PREFIX_BLOCKS = 2  # full blocks of the shared 300-token prefix
FP8_BLOCK_BYTES = BLOCK_BYTES // 4
BIG_CACHE = {"kv_cache_memory_bytes": 64 << 20}


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
    # Copies go through the seam's copy_blocks: the emulation, and seam/gaudi over the stand-in.
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


@pytest.mark.process
def test_the_worker_round_trip_on_the_standin_hpu_device(run_python):
    from tests.conftest import REAL_GAUDI_SOFTWARE, standin_process_env
    from tests.integration.generation import job_result

    if REAL_GAUDI_SOFTWARE:
        pytest.skip("checks the Habana stand-in, which does not load beside a real Gaudi stack")
    env = standin_process_env(2)
    env["PYTHONPATH"] = os.pathsep.join([str(env["PYTHONPATH"]), str(REPO)])
    result = job_result(run_python(ON_HPU_DEVICE, env=env, timeout=900), "stand-in worker job")
    assert result == {"devices": ["hpu", "hpu"], "jobs": [1, 2], "restored": True}


def test_the_worker_copies_into_its_cell_of_each_shared_region_row(hpu_backend):
    # The tiered spec's host memory: one mmap region whose chunk rows hold every rank's cell;
    # the scheduler's secondary tiers copy whole rows. Rank 1's pages must land in its cell.
    import uuid

    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    from vllm_gaudi_connectors.offload import HpuOffloadingWorker

    caches = _worker_caches()
    original = [t.tensor.clone() for t in caches.tensors]
    bpc, chunks, cell = 2, 4, 2 * (256 + 384)
    row = 4096  # two ranks' cells, page-aligned
    engine = f"test-{uuid.uuid4().hex}"
    scheduler = SharedOffloadRegion(engine, chunks, None, row, cell)
    region = SharedOffloadRegion(engine, chunks, 1, row, cell)
    worker = HpuOffloadingWorker(caches, bpc, chunks, region)
    try:
        worker.submit_store(1, GPULoadStoreSpec([5, 6, 7], [3], [0]), CPULoadStoreSpec([2, 0]))
        rows = scheduler.base_tensor.view(chunks, row)
        # Chunk 2 holds blocks 5 and 6: tensor 0's two pages, then tensor 1's, in rank 1's cell.
        cell_2 = rows[2, cell : 2 * cell]
        assert torch.equal(cell_2[:256], original[0][5])
        assert torch.equal(cell_2[256:512], original[0][6])
        assert torch.equal(cell_2[512:896], original[1][5])
        assert not rows[:, :cell].any()  # rank 0's cells untouched
        # A secondary tier's promotion: the bytes come back into another row; load from there.
        rows[3].copy_(rows[2])
        rows[1].copy_(rows[0])
        for t in caches.tensors:
            t.tensor.zero_()
        worker.submit_load(2, CPULoadStoreSpec([3, 1]), GPULoadStoreSpec([9, 10, 11], [3], [0]))
        assert [r.job_id for r in worker.get_finished()] == [1, 2]
        for src, dst in ((5, 9), (6, 10), (7, 11)):
            for i in (0, 1):
                assert torch.equal(caches.tensors[i].tensor[dst], original[i][src])
    finally:
        worker.shutdown()
        scheduler.cleanup()


REGISTER_TWICE = """
from vllm_gaudi_connectors import register
from vllm_gaudi_platform import plugins
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
register.offload()
plugins.OUTCOMES.clear()  # as if a second general-plugin pass ran in this process
register.offload()
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
for name, base in (("HpuCPUOffloadingSpec", CPUOffloadingSpec),
                   ("HpuTieringOffloadingSpec", TieringOffloadingSpec)):
    cls = OffloadingSpecFactory.get_spec_cls({"spec_name": name})
    print(cls.__name__, issubclass(cls, base), plugins.OUTCOMES["hpu_offload"])
"""


@pytest.mark.process
def test_entry_point_registers_the_spec_once_even_when_run_twice(run_python):
    result = run_python(REGISTER_TWICE, {"VLLM_HPU_EMULATION": "cpu"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-2:] == [
        "HpuCPUOffloadingSpec True registered",
        "HpuTieringOffloadingSpec True registered",
    ]


# ---- engines --------------------------------------------------------------------------------


def _prompts():
    rng = random.Random(0)
    tok = lambda n: [rng.randrange(3, 500) for _ in range(n)]  # noqa: E731
    prefix = tok(300)
    first = [prefix + tok(20)]
    fillers = [tok(300) for _ in range(6)]  # 18 blocks: more than the device cache holds
    again = [prefix + tok(10)]
    return [first, fillers, again]


def _abort_round(rounds):
    """The aborted prompt (the shared prefix, loaded from host memory), then the prompts served
    beside the abort: the prefix again, and two of 4 blocks each, which with the others need more
    than the 11 usable device blocks, so one waits for blocks the aborted prompt frees."""
    rng = random.Random(1)
    prefix = rounds[0][0][:300]
    fresh = [[rng.randrange(3, 500) for _ in range(400)] for _ in range(2)]
    return [[*prefix, 7, 8, 9, 10, 11], rounds[2][0], *fresh]


def _offloading(cpu_bytes: int, files: Path | None = None) -> dict:
    extra: dict = {"spec_name": "HpuCPUOffloadingSpec", "cpu_bytes_to_use": cpu_bytes}
    if files is not None:
        tier = {"type": "fs", "root_dir": str(files), "n_read_threads": 2, "n_write_threads": 2}
        extra.update(spec_name="HpuTieringOffloadingSpec", secondary_tiers=[tier])
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


# 12 blocks of 128 tokens on the device (three 512-token sequences at once).
SMALL_CACHE = {**ENGINE, "max_num_seqs": 4, "max_num_batched_tokens": 512}
SMALL_CACHE.update(kv_cache_memory_bytes=12 * BLOCK_BYTES + BLOCK_BYTES // 2)
SMALL_CACHE["disable_log_stats"] = False


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> dict[str, dict]:
    model = str(tinymodels.build("llama"))
    rounds = _prompts()
    files = tmp_path_factory.mktemp("kv-files")
    # The file tier sits behind 6 host blocks, which the fillers' 14 stored blocks overrun; the
    # restarted engine (same directory, empty host memory) serves only the last round.
    jobs = {
        name: {
            "model": model,
            "engine": {**SMALL_CACHE, "kv_transfer_config": _offloading(cpu_bytes, tier)},
            "rounds": job_rounds,
            "max_tokens": MAX_TOKENS,
        }
        for name, cpu_bytes, tier, job_rounds in (
            ("host-memory", 64 << 20, None, rounds),
            ("host-full", 2 * BLOCK_BYTES, None, rounds),
            ("file-tier", 6 * BLOCK_BYTES, files, rounds),
            ("file-tier-restart", 6 * BLOCK_BYTES, files, rounds[-1:]),
        )
    }
    abort_round = _abort_round(rounds)
    deferred = _offloading(64 << 20)
    deferred["kv_connector_extra_config"].update(
        spec_name="DeferredHpuCPUOffloadingSpec", spec_module_path="tests.connectors.offload_job"
    )
    jobs["abort"] = {
        **jobs["host-memory"],
        "engine": {**SMALL_CACHE, "kv_transfer_config": deferred},
        "rounds": [*rounds[:2], abort_round],
        "abort": True,
    }
    # An FP8 KV cache (one byte per element: 4x the blocks in the same memory), with the
    # same rounds on an FP8 engine whose cache holds everything as its reference.
    fp8 = {**SMALL_CACHE, "kv_cache_dtype": "fp8_inc"}
    fp8["kv_cache_memory_bytes"] = 12 * FP8_BLOCK_BYTES + FP8_BLOCK_BYTES // 2
    jobs["fp8"] = {
        **jobs["host-memory"],
        "engine": {**fp8, "kv_transfer_config": _offloading(64 << 20)},
    }
    jobs["fp8-reference"] = {**jobs["host-memory"], "engine": {**fp8, **BIG_CACHE}}
    # vLLM's own flag alone (--kv-offloading-size, GiB): the platform points it at the HPU spec.
    jobs["vllm-flag"] = {
        **jobs["host-memory"],
        "engine": {**SMALL_CACHE, "kv_offloading_size": (64 << 20) / (1 << 30)},
    }
    # One engine after another in one process: 300 s each, as the other multi-engine jobs allow
    # (at the start of a run the NIXL deployments' servers load both cores; 600 s for all of
    # them ran out on a 2-core machine, with every engine still making progress).
    proc = run_job(JOB, json.dumps(jobs), {"PYTHONPATH": str(REPO)}, timeout=300 * len(jobs))
    results = named_job_outputs(proc)
    if set(results) != set(jobs):
        pytest.fail(f"the offload jobs printed {sorted(results)}:\n{proc.stderr[-5000:]}")
    reference = [hf_greedy(model, r, MAX_TOKENS) for r in rounds]
    results["reference"] = {"rounds": reference}
    results["reference-restart"] = {"rounds": reference[-1:]}
    results["reference-abort"] = {"rounds": [hf_greedy(model, abort_round[1:], MAX_TOKENS)]}
    return results


def _delta(result: dict, name: str) -> float:
    """How much a counter moved during the last round."""
    before, after = result["counters"][-2], result["counters"][-1]
    return after[name] - before[name]


@pytest.mark.engine
@pytest.mark.parametrize("job", ["host-memory", "vllm-flag"])
def test_an_evicted_prefix_comes_back_from_host_memory(engines, job):
    # "vllm-flag": vLLM's --kv-offloading-size alone, no kv_transfer_config.
    result = engines[job]
    assert _delta(result, "vllm:prefix_cache_hits") == 0  # gone from the device cache
    assert _delta(result, "vllm:external_prefix_cache_hits") == PREFIX_BLOCKS * 128
    assert _delta(result, "vllm:kv_offload_load_bytes") == PREFIX_BLOCKS * BLOCK_BYTES
    assert result["counters"][0]["vllm:kv_offload_store_bytes"] >= PREFIX_BLOCKS * BLOCK_BYTES


@pytest.mark.engine
def test_an_fp8_kv_cache_is_offloaded_and_loaded_back_byte_for_byte(engines):
    result, reference = engines["fp8"], engines["fp8-reference"]
    assert _delta(result, "vllm:prefix_cache_hits") == 0
    assert _delta(result, "vllm:external_prefix_cache_hits") == PREFIX_BLOCKS * 128
    assert _delta(result, "vllm:kv_offload_load_bytes") == PREFIX_BLOCKS * FP8_BLOCK_BYTES
    # The reference kept the prefix on the device: the same FP8 bytes, the same tokens. (Not
    # the fillers: the small cache batches them otherwise, and where a prompt's chunks fall
    # changes which keys an FP8 cache has rounded.)
    assert _delta(reference, "vllm:prefix_cache_hits") == PREFIX_BLOCKS * 128
    for i in (0, 2):
        assert result["rounds"][i] == reference["rounds"][i]


@pytest.mark.engine
@pytest.mark.parametrize(
    "name", ["host-memory", "vllm-flag", "host-full", "file-tier", "file-tier-restart", "abort"]
)
def test_offloaded_serving_generates_what_transformers_does(engines, name):
    reference = {"file-tier-restart": "reference-restart", "abort": "reference-abort"}
    ours, ref = engines[name]["rounds"], engines[reference.get(name, "reference")]["rounds"]
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert assert_close(a, b, f"{name} round {i}") == 0


@pytest.mark.engine
def test_a_full_host_tier_falls_back_to_recomputing(engines):
    result = engines["host-full"]
    assert result["counters"][-1]["vllm:kv_offload_allocation_failure"] > 0
    assert _delta(result, "vllm:external_prefix_cache_hits") == 0


@pytest.mark.engine
def test_a_prefix_evicted_from_host_memory_comes_back_from_its_block_files(engines):
    result = engines["file-tier"]
    prefix_bytes = PREFIX_BLOCKS * BLOCK_BYTES
    # What host memory stores is written on to disk by the file tier's threads, counted when
    # the scheduler polls them (so a round's counters may not show its own writes yet); the
    # prefix's were done before it was read back.
    assert result["counters"][-1]["vllm:kv_offload_tiering_write_bytes"] >= prefix_bytes
    # The prefix's host chunks were reused by the fillers: it is read from the files, then
    # loaded into the device, and counted as external prefix-cache hits.
    assert _delta(result, "vllm:prefix_cache_hits") == 0
    assert _delta(result, "vllm:kv_offload_tiering_read_bytes") == prefix_bytes
    assert _delta(result, "vllm:kv_offload_load_bytes") == prefix_bytes
    assert _delta(result, "vllm:external_prefix_cache_hits") == PREFIX_BLOCKS * 128


@pytest.mark.engine
def test_a_fresh_engine_serves_a_prefix_from_the_files_of_an_earlier_one(engines):
    [counters] = engines["file-tier-restart"]["counters"]
    assert counters["vllm:kv_offload_tiering_read_bytes"] == PREFIX_BLOCKS * BLOCK_BYTES
    assert counters["vllm:external_prefix_cache_hits"] == PREFIX_BLOCKS * 128


@pytest.mark.engine
def test_a_request_aborted_mid_load_frees_everything_once_the_load_lands(engines):
    result = engines["abort"]
    in_flight, after = result["in_flight"], result["after"]
    # Caught mid-transfer: its load submitted, not complete; its prefix's host chunks pinned.
    assert in_flight["loads"] == 1
    assert in_flight["vllm:kv_offload_cpu_cache_usage_perc"] > 0
    assert in_flight["vllm:kv_cache_usage_perc"] > 0
    # Every copy ran; no host chunk is pinned and no device block held once all is served.
    assert after["queued"] == 0 and after["submitted"] == after["completed"] > 1
    assert after["vllm:kv_offload_cpu_cache_usage_perc"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0
    assert result["finished"] == ["other-0", "other-1", "other-2"]
    # The aborted load and the same prefix served again beside it, both from host memory.
    assert after["vllm:external_prefix_cache_hits"] == 2 * PREFIX_BLOCKS * 128
    assert after["vllm:kv_offload_load_bytes"] == 2 * PREFIX_BLOCKS * BLOCK_BYTES


# vLLM's own ways to ask for offloading, as the platform's config check rewrites them.
def _config(size=None, backend="native", transfer=None):
    from types import SimpleNamespace

    return SimpleNamespace(
        cache_config=SimpleNamespace(kv_offloading_size=size, kv_offloading_backend=backend),
        kv_transfer_config=transfer,
    )


@pytest.fixture
def offload_registered(monkeypatch):
    """The factory as the hpu_offload entry point leaves it in every vLLM process on the HPU
    (the entry point itself registers nothing off the HPU platform, which this process is)."""
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    from vllm_gaudi_connectors.register import OFFLOAD_SPECS

    monkeypatch.setattr(OffloadingSpecFactory, "_registry", dict(OffloadingSpecFactory._registry))
    for name, module, cls in OFFLOAD_SPECS:
        if name not in OffloadingSpecFactory._registry:
            OffloadingSpecFactory.register_spec(name, module, cls)


@pytest.mark.parametrize(
    ("named", "expected"),
    [
        (None, "HpuCPUOffloadingSpec"),
        ("CPUOffloadingSpec", "HpuCPUOffloadingSpec"),
        ("TieringOffloadingSpec", "HpuTieringOffloadingSpec"),
        ("HpuTieringOffloadingSpec", "HpuTieringOffloadingSpec"),
    ],
)
def test_vllms_offloading_specs_run_as_the_hpus(offload_registered, named, expected):
    from vllm.config import KVTransferConfig

    from vllm_gaudi_platform import config_checks

    extra = {"spec_name": named} if named else {}
    transfer = KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra
    )
    config = _config(transfer=transfer)
    config_checks.hpu_offloading_specs(config)
    assert config.kv_transfer_config.kv_connector_extra_config["spec_name"] == expected


def test_the_offloading_flag_alone_gets_the_hpu_spec(offload_registered):
    from vllm_gaudi_platform import config_checks

    config = _config(size=0.25)
    config_checks.hpu_offloading_specs(config)
    extra = config.kv_transfer_config.kv_connector_extra_config
    assert extra["spec_name"] == "HpuCPUOffloadingSpec"


def test_the_offloading_flag_without_the_hpu_spec_is_refused_naming_the_fix(monkeypatch):
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    from vllm_gaudi_platform import config_checks

    registry = {k: v for k, v in OffloadingSpecFactory._registry.items() if "Hpu" not in k}
    monkeypatch.setattr(OffloadingSpecFactory, "_registry", registry)
    with pytest.raises(ValueError, match="pip install vllm-gaudi-connectors") as refused:
        config_checks.hpu_offloading_specs(_config(size=0.25))
    assert "kv_offloading_size=0.25" in str(refused.value)
    assert "hpu_offload" in str(refused.value)


def test_other_connectors_and_backends_are_left_alone():
    from vllm.config import KVTransferConfig

    from vllm_gaudi_platform import config_checks

    nixl = KVTransferConfig(kv_connector="HpuNixlConnector", kv_role="kv_producer")
    for config in (_config(), _config(size=1.0, backend="lmcache"), _config(transfer=nixl)):
        before = config.kv_transfer_config
        config_checks.hpu_offloading_specs(config)
        assert config.kv_transfer_config is before
    assert "spec_name" not in nixl.kv_connector_extra_config
