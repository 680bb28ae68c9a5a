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


def test_nixl_supports_host_staging_for_the_hpu_device_type(platform):
    assert platform.get_nixl_supported_devices() == {"hpu": ("cpu",)}


def test_device_to_device_is_not_offered_in_emulation(platform, monkeypatch):
    monkeypatch.setenv("VLLM_NIXL_DEVICE_TO_DEVICE", "true")

    assert platform.get_nixl_supported_devices() == {"hpu": ("cpu",)}
    assert platform.get_nixl_memory_type() == "DRAM"


def test_registered_memory_is_host_dram_in_emulation(platform):
    assert platform.get_nixl_memory_type() == "DRAM"


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
