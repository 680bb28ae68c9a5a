"""KV transfer throughput of the HPU NIXL path, and time to first token of 1P1D vs one instance.

Part 1 (no engine): for 1, 16 and 256 KV blocks, bytes/s of
  - the connector path as it runs on a Gaudi with host staging: the prefill side copies the
    blocks out of its KV cache into its NIXL-registered host buffer
    (`HpuPlatform.swap_out_blocks_to_host`), the decode side READs them with NIXL (UCX) into its
    host buffer and copies them into its KV cache (`HpuPlatform.insert_blocks_to_device`);
  - a raw NIXL DRAM->DRAM READ of the same bytes between the same two agents,
with one descriptor per block per layer, as vLLM's connector builds them. In CPU emulation the
"device" KV cache is host memory, so the staging copies are memory copies, as on the CPU side of
a Gaudi host.

Part 2 (engines, run under the engine lock): time to first token for one long prompt, through
`vllm-gaudi proxy` in front of a prefill and a decode instance vs a single instance.

    python benchmarks/kv_transfer.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_HPU_EMULATION", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.connectors.cluster

# 2 layers x 128 slots x 4 KV heads x (key + value) x 128 dims, bf16: 256 KiB per layer per
# block, 512 KiB per block (4 caches of 260 blocks: about 0.5 GiB in all).
LAYERS, BLOCK, HEADS, HEAD_DIM = 2, 128, 4, 128
CACHE_BLOCKS = 260
SIZES = (1, 16, 256)


def _wait(agent, handle) -> None:
    while True:
        state = agent.check_xfer_state(handle)
        if state == "DONE":
            return
        if state == "ERR":
            raise RuntimeError("NIXL transfer failed")


def _descs(agent, tensors, block_ids):
    rows = []
    for t in tensors:
        base, stride = t.data_ptr(), t.stride(0) * t.element_size()
        rows += [(base + b * stride, stride, 0) for b in block_ids]
    return agent.get_xfer_descs(rows, "DRAM")


def transfer_throughput(repeats: int) -> list[tuple[int, float, float]]:
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    from vllm_gaudi_platform.platform import HpuPlatform

    # One torch thread, as the emulated worker serves: NIXL's UCX progress thread takes a core,
    # and multi-threaded copies then wait on each other's barriers (tens of times slower).
    torch.set_num_threads(1)
    shape = (CACHE_BLOCKS, BLOCK, HEADS, 2 * HEAD_DIM)

    def layers():
        return [torch.randn(shape).to(torch.bfloat16) for _ in range(LAYERS)]

    p_cache, p_host, d_host = layers(), layers(), layers()
    d_cache = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(LAYERS)]
    config = nixl_agent_config(backends=["UCX"])
    prefill, decode = nixl_agent("bench-prefill", config), nixl_agent("bench-decode", config)
    regs = [prefill.register_memory(p_host), decode.register_memory(d_host)]
    decode.add_remote_agent(prefill.get_agent_metadata())
    block_bytes = LAYERS * p_cache[0][0].numel() * 2
    results = []
    for n in SIZES:
        ids = list(range(0, 2 * n, 2))[:n] if 2 * n <= CACHE_BLOCKS else list(range(n))
        idx = torch.tensor(ids)
        remote, local = _descs(prefill, p_host, ids), _descs(decode, d_host, ids)

        def read(local=local, remote=remote) -> None:
            handle = decode.initialize_xfer("READ", local, remote, "bench-prefill")
            decode.transfer(handle)
            _wait(decode, handle)
            decode.release_xfer_handle(handle)

        def connector(idx=idx, read=read) -> None:
            for layer in range(LAYERS):
                HpuPlatform.swap_out_blocks_to_host(p_cache[layer], p_host[layer], idx, idx)
            read()
            for layer in range(LAYERS):
                HpuPlatform.insert_blocks_to_device(d_host[layer], d_cache[layer], idx, idx)

        times = {"connector": [], "raw": []}
        for _ in range(repeats):  # alternate, so machine noise hits both alike
            for name, fn in (("connector", connector), ("raw", read)):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        for layer in range(LAYERS):
            assert torch.equal(d_cache[layer][idx], p_cache[layer][idx])
        nbytes = n * block_bytes
        results.append(
            (
                n,
                nbytes / statistics.median(times["connector"]),
                nbytes / statistics.median(times["raw"]),
            )
        )
    for agent, reg in zip((prefill, decode), regs):
        agent.deregister_memory(reg)
    return results


def _ttft(url: str, prompt: list[int]) -> float:
    import httpx

    body = {"model": "m", "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True}
    start = time.perf_counter()
    with httpx.stream(
        "POST", url + "/v1/completions", json=body, timeout=300, trust_env=False
    ) as answer:
        answer.raise_for_status()
        for line in answer.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - start
    raise RuntimeError("no token streamed")


def ttft(prompt_len: int, repeats: int) -> tuple[float, float]:
    import random

    from gaudi_testkit import tinymodels
    from tests.connectors import cluster

    model = str(tinymodels.build("llama"))
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 250) for _ in range(prompt_len)] for _ in range(repeats + 1)]
    logs = Path(tempfile.mkdtemp(prefix="kv-bench-"))
    # Prefix caching off: every prompt is computed (and, in 1P1D, transferred) in full.
    single = cluster.start_vllm("single", model, logs, prefix_caching=False)
    try:
        cluster.wait_ready(single)
        _ttft(single.url, prompts[-1])  # warm
        single_s = statistics.median(_ttft(single.url, p) for p in prompts[:-1])
    finally:
        single.stop()
    servers = [
        cluster.start_vllm(
            role,
            model,
            logs,
            kv_config=cluster.kv_transfer_config(kind),
            env=cluster.base_env({"VLLM_NIXL_SIDE_CHANNEL_PORT": str(cluster.free_port())}),
            prefix_caching=False,
        )
        for role, kind in (("prefill", "kv_producer"), ("decode", "kv_consumer"))
    ]
    try:
        cluster.wait_ready(*servers)
        proxy = cluster.start_proxy([servers[0].url], [servers[1].url], logs, 120)
        servers.append(proxy)
        cluster.wait_ready(proxy)
        _ttft(proxy.url, prompts[-1])  # warm (and the NIXL handshake)
        pd_s = statistics.median(_ttft(proxy.url, p) for p in prompts[:-1])
    finally:
        for server in servers:
            server.stop()
    return single_s, pd_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--prompt-len", type=int, default=900)
    parser.add_argument("--skip-ttft", action="store_true", help="part 1 only (no engines)")
    args = parser.parse_args()

    print(f"KV blocks of {LAYERS * BLOCK * HEADS * 2 * HEAD_DIM * 2 >> 10} KiB ({LAYERS} layers)")
    print(f"{'blocks':>7} {'connector GB/s':>15} {'raw NIXL GB/s':>14} {'ratio':>6}")
    for n, conn, raw in transfer_throughput(args.repeats):
        print(f"{n:>7} {conn / 1e9:>15.2f} {raw / 1e9:>14.2f} {conn / raw:>6.2f}")
    if not args.skip_ttft:
        single_s, pd_s = ttft(args.prompt_len, args.repeats)
        print(f"\nTTFT, {args.prompt_len}-token prompt (median of {args.repeats}):")
        print(f"  single instance {single_s * 1e3:8.1f} ms")
        print(f"  1P1D via proxy  {pd_s * 1e3:8.1f} ms   ratio {pd_s / single_s:.2f}")


if __name__ == "__main__":
    main()
