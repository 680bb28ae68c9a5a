"""KV offloading to host memory on the HPU platform (`hpu_offload`): what the transfer path moves,
and what a prefix served from host memory saves in time to first token.

Part 1 (no engine): for 1, 16 and 256 KV blocks, blocks/s that `HpuOffloadingWorker` stores from
the KV cache into host chunks and loads back, beside one plain gather copy of the same bytes
(`index_select` into a preallocated host tensor), the floor of any copy path.

Part 2 (two engines, one after the other in this process): time to first token of a prompt
whose first PREFIX tokens an earlier prompt already computed, with that prefix
  - in the device KV cache (a prefix-cache hit),
  - in host memory only (evicted from the device by other prompts, loaded back by the
    connector),
  - nowhere (the same eviction on an engine without offloading: recomputed),
each the median over trials with fresh prefixes. In CPU emulation the "device" KV cache is host
memory, so a load is a memory copy where a Gaudi crosses PCIe; the recompute side is the
emulated prefill. The ratios say what the path costs here, not on a Gaudi.

    python benchmarks/kv_offload.py [--repeats N] [--prefix TOKENS] [--skip-engines]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_HPU_EMULATION", "cpu")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# Warming every bucket up to a 4k context costs minutes; the first (untimed) trial of each engine
# runs the buckets the timed ones use.
os.environ.setdefault("VLLM_SKIP_WARMUP", "true")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Part 1: 2 canonical tensors (e.g. K and V of a layer group) of 256 KiB pages per block.
PAGE_BYTES = 256 << 10
CACHE_BLOCKS = 300
SIZES = (1, 16, 256)
BLOCKS_PER_CHUNK = 16
BLOCK = 128  # tokens per KV block (the platform's default)


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def worker_throughput(repeats: int) -> list[tuple[int, float, float, float]]:
    """(blocks, store blocks/s, load blocks/s, plain gather blocks/s) per size."""
    import torch
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
    )
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    from vllm_gaudi_connectors.offload import HpuOffloadingWorker

    tensors = [
        CanonicalKVCacheTensor(torch.zeros(CACHE_BLOCKS, PAGE_BYTES, dtype=torch.int8), PAGE_BYTES)
        for _ in range(2)
    ]
    refs = [[CanonicalKVCacheRef(0, PAGE_BYTES), CanonicalKVCacheRef(1, PAGE_BYTES)]]
    chunks = -(-max(SIZES) // BLOCKS_PER_CHUNK)
    worker = HpuOffloadingWorker(CanonicalKVCaches(tensors, refs), BLOCKS_PER_CHUNK, chunks)
    rows = []
    job = iter(range(1, 1 << 30))  # job ids, unique over the run
    for n in SIZES:
        blocks = list(range(7, 7 + n))  # away from block 0, in order as a prefix's blocks are
        device = GPULoadStoreSpec(blocks, [n], [0])
        host = CPULoadStoreSpec(list(range(-(-n // BLOCKS_PER_CHUNK))))

        def store(device=device, host=host) -> None:
            worker.submit_store(next(job), device, host)
            worker.get_finished()

        def load(device=device, host=host) -> None:
            worker.submit_load(next(job), host, device)
            worker.get_finished()

        index = torch.tensor(blocks)
        out = [torch.empty(n, PAGE_BYTES, dtype=torch.int8) for _ in tensors]

        def gather(index=index, out=out) -> None:
            for t, o in zip(tensors, out, strict=True):
                torch.index_select(t.tensor, 0, index, out=o)

        store()  # first touch of the host chunks
        rows.append(
            (
                n,
                n / _median_s(store, repeats),
                n / _median_s(load, repeats),
                n / _median_s(gather, repeats),
            )
        )
    return rows


def _offloading() -> dict:
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "HpuCPUOffloadingSpec",
            "cpu_bytes_to_use": 512 << 20,
        },
    }


def ttft(prefix: int, repeats: int) -> dict[str, float]:
    """Median time to first token (s) of a prompt whose prefix is in the device cache, in host
    memory only, or recomputed."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from gaudi_testkit import tinymodels

    model = str(tinymodels.build("llama"))
    max_len = prefix + 2 * BLOCK
    # Two sequences of max_len at once; three distinct long prompts evict everything earlier.
    block_bytes = 2 * BLOCK * 2 * 64 * 4  # the tiny Llama in float32
    engine = {
        "dtype": "float32",
        "max_model_len": max_len,
        "max_num_seqs": 2,
        "max_num_batched_tokens": max_len,
        "kv_cache_memory_bytes": 2 * (max_len // BLOCK) * block_bytes + block_bytes // 2,
        "hf_overrides": {"max_position_embeddings": max_len},
        "seed": 0,
    }
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 500) for _ in range(n)]

    first = SamplingParams(temperature=0.0, max_tokens=1)

    def timed(llm, prompt: list[int]) -> float:
        start = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=prompt)], first, use_tqdm=False)
        return time.perf_counter() - start

    def evict(llm) -> None:
        llm.generate(
            [TokensPrompt(prompt_token_ids=tokens(prefix)) for _ in range(3)], first, use_tqdm=False
        )

    results: dict[str, list[float]] = {"device": [], "host": [], "recomputed": []}
    for offload in (True, False):
        kv = {"kv_transfer_config": _offloading()} if offload else {}
        llm = LLM(model=model, **engine, **kv)
        try:
            for trial in range(repeats + 1):  # the first trial warms the buckets, untimed
                shared = tokens(prefix)
                timed(llm, shared + tokens(16))
                if offload:
                    device = timed(llm, shared + tokens(16))
                evict(llm)
                later = timed(llm, shared + tokens(16))
                if trial == 0:
                    continue
                if offload:
                    results["device"].append(device)
                    results["host"].append(later)
                else:
                    results["recomputed"].append(later)
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
    return {name: statistics.median(values) for name, values in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prefix", type=int, default=4096, help="shared prefix, tokens")
    parser.add_argument("--skip-engines", action="store_true", help="part 1 only")
    args = parser.parse_args()

    print(f"Offload worker, 2 x {PAGE_BYTES >> 10} KiB pages per block (blocks/s, median)")
    print(f"{'blocks':>7} {'store':>9} {'load':>9} {'gather':>9} {'store/gather':>13}")
    for n, store, load, gather in worker_throughput(args.repeats):
        print(f"{n:>7} {store:>9.0f} {load:>9.0f} {gather:>9.0f} {store / gather:>13.2f}")
    if args.skip_engines:
        return
    times = ttft(args.prefix, args.repeats)
    recomputed = times["recomputed"]
    print(f"\nTTFT with a {args.prefix}-token prefix seen before (median of {args.repeats}):")
    for name in ("device", "host", "recomputed"):
        t = times[name]
        print(f"  prefix {name:<11} {t * 1e3:8.1f} ms   ratio to recomputed {t / recomputed:.2f}")


if __name__ == "__main__":
    main()
