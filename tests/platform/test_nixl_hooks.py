"""The HpuPlatform hooks vLLM's NIXL connector calls: supported transfer buffers, registered
memory type, block copies between the KV cache and host staging buffers, NUMA reservation."""

from __future__ import annotations

import pytest
import torch

# Per layer, block-first (LBNHC): [num_blocks, block_size, kv_heads, 2 * head_size].
SHAPE = (6, 4, 2, 8)


@pytest.fixture
def platform(emulated):
    from vllm_gaudi_platform.platform import HpuPlatform

    return HpuPlatform


def _cache(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_nixl_supports_host_staging_for_the_device_type_of_the_kv_cache(platform):
    # vLLM looks the entry up by the platform's device type: "cpu" in emulation.
    assert platform.get_nixl_supported_devices() == {"cpu": ("cpu",)}
    assert platform.get_nixl_memory_type() == "DRAM"  # the host staging buffers


def test_device_to_device_registers_the_emulated_cache_as_host_dram(platform, monkeypatch):
    """As on a Gaudi, VLLM_NIXL_DEVICE_TO_DEVICE=true offers kv_buffer_device "hpu"; the
    registered memory is the device's: HBM ("VRAM") on a Gaudi, host DRAM when emulated."""
    monkeypatch.setenv("VLLM_NIXL_DEVICE_TO_DEVICE", "true")

    assert platform.get_nixl_supported_devices() == {"cpu": ("cpu", "hpu")}
    assert platform.get_nixl_memory_type() == "DRAM"


def test_staging_hooks_count_the_bytes_they_copy(platform):
    from vllm_gaudi_platform.observability import metrics

    counters = metrics.StepMetrics()
    device, host = _cache(5), torch.zeros(SHAPE, dtype=torch.bfloat16)
    block = SHAPE[1] * SHAPE[2] * SHAPE[3] * 2  # bfloat16

    platform.swap_out_blocks_to_host(device, host, torch.tensor([1, 4, 2]), torch.tensor([0, 1, 2]))
    platform.insert_blocks_to_device(host, device, torch.tensor([0, 2]), torch.tensor([3, 5]))

    assert counters["kv_staged_to_host_bytes"] == 3 * block
    assert counters["kv_staged_to_device_bytes"] == 2 * block
    counters.close()


def test_swap_out_copies_non_contiguous_blocks_to_the_given_host_slots(platform):
    device, host = _cache(0), torch.zeros(SHAPE, dtype=torch.bfloat16)
    src, dst = torch.tensor([4, 1, 3]), torch.tensor([0, 5, 2])

    platform.swap_out_blocks_to_host(device, host, src, dst)

    for s, d in zip(src.tolist(), dst.tolist()):
        assert torch.equal(host[d], device[s])
    untouched = [i for i in range(SHAPE[0]) if i not in dst.tolist()]
    assert torch.count_nonzero(host[untouched]) == 0


def test_insert_copies_non_contiguous_host_blocks_into_the_given_device_blocks(platform):
    host, device = _cache(1), _cache(2)
    before = device.clone()
    src, dst = torch.tensor([0, 2, 5]), torch.tensor([3, 0, 4])

    platform.insert_blocks_to_device(host, device, src, dst)

    for s, d in zip(src.tolist(), dst.tolist()):
        assert torch.equal(device[d], host[s])
    for i in (1, 2, 5):
        assert torch.equal(device[i], before[i])


def test_blocks_survive_a_round_trip_through_host_staging(platform):
    device, host, back = _cache(3), torch.zeros(SHAPE, dtype=torch.bfloat16), _cache(4)
    ids = torch.tensor([5, 0, 2])

    platform.swap_out_blocks_to_host(device, host, ids, ids)
    platform.insert_blocks_to_device(host, back, ids, ids)

    assert torch.equal(back[ids], device[ids])


def test_no_cores_are_reserved_for_the_transfer_thread(platform):
    assert platform.discover_numa_topology() == []
