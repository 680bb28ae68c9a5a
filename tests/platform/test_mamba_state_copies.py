"""The platform's stand-in for vLLM's Triton `batch_memcpy_kernel` (Mamba prefix caching's state
copies, `worker/cuda_stand_ins/mamba_state_copies.py`): copies by address within the registered
KV-cache memory, byte for byte, and refuses an address outside it."""

from __future__ import annotations

import pytest
import torch

from vllm_gaudi_platform.worker.cuda_stand_ins import mamba_state_copies

BLOCKS, PAGE = 6, 64  # bytes per page: a conv state of 24 bytes, then an SSM state of 40


def _states() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A raw page buffer and two strided state views over it, as vLLM binds a Mamba layer's."""
    raw = torch.arange(BLOCKS * PAGE, dtype=torch.int64).remainder(251).to(torch.uint8)
    pages = raw.view(BLOCKS, PAGE)
    conv = pages[:, :24]
    ssm = pages[:, 24:]
    return raw, conv, ssm


def test_state_blocks_copy_by_address_and_nothing_else_changes():
    raw, conv, ssm = _states()
    mamba_state_copies.register_regions([conv, ssm])
    before = raw.clone()
    src = torch.tensor([conv[1].data_ptr(), ssm[1].data_ptr()], dtype=torch.uint64)
    dst = torch.tensor([conv[4].data_ptr(), ssm[4].data_ptr()], dtype=torch.uint64)
    sizes = torch.tensor([24, 40], dtype=torch.int32)

    mamba_state_copies.batch_memcpy(src, dst, sizes)

    pages, old = raw.view(BLOCKS, PAGE), before.view(BLOCKS, PAGE)
    assert torch.equal(pages[4], old[1])
    untouched = [b for b in range(BLOCKS) if b != 4]
    assert torch.equal(pages[untouched], old[untouched])


def test_an_address_outside_the_registered_memory_is_refused():
    _, conv, ssm = _states()
    mamba_state_copies.register_regions([conv, ssm])
    elsewhere = torch.zeros(64, dtype=torch.uint8)
    src = torch.tensor([elsewhere.data_ptr()], dtype=torch.uint64)
    dst = torch.tensor([conv[0].data_ptr()], dtype=torch.uint64)
    with pytest.raises(RuntimeError, match="not inside the registered KV-cache memory"):
        mamba_state_copies.batch_memcpy(src, dst, torch.tensor([24], dtype=torch.int32))
    # A copy running past the end of the memory is refused too.
    end = torch.tensor([conv[BLOCKS - 1].data_ptr()], dtype=torch.uint64)
    with pytest.raises(RuntimeError, match="not inside"):
        mamba_state_copies.batch_memcpy(end, dst, torch.tensor([PAGE + 1], dtype=torch.int32))


def test_vllm_routes_its_memcpy_kernel_to_the_stand_in(emulated):
    from vllm.v1.worker import mamba_utils

    from vllm_gaudi_platform.worker.cuda_stand_ins import triton_kernels

    triton_kernels.register()
    _, conv, ssm = _states()
    mamba_state_copies.register_regions([conv, ssm])
    src = torch.tensor([ssm[2].data_ptr()], dtype=torch.uint64)
    dst = torch.tensor([ssm[3].data_ptr()], dtype=torch.uint64)
    mamba_utils.batch_memcpy(src, dst, torch.tensor([40], dtype=torch.int32))
    assert torch.equal(ssm[3], ssm[2])
