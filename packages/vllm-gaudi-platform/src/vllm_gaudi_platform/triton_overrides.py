"""Plain-torch implementations of the Triton kernels that vLLM's shared runner code launches.

Gaudi has no Triton. vLLM lets a platform swap a Triton kernel for a Python callable with the same
launch arguments (`vllm.triton_utils.dispatcher.register_kernels`); these run on Gaudi and in
emulation alike. Each kernel name string is a contract with vLLM, checked (with the kernel's
parameters) by tests/platform/test_upstream_contract.py, whose ledger says when these can go.
"""

from __future__ import annotations

import torch


def compute_slot_mapping(
    num_tokens: int,
    max_num_tokens: int,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_table: torch.Tensor,
    block_table_stride: int,
    slot_mapping: torch.Tensor,
    KV_CACHE_BLOCK_SIZE: int,
    TOTAL_CP_WORLD_SIZE: int = 1,
    TOTAL_CP_RANK: int = 0,
    CP_KV_CACHE_INTERLEAVE_SIZE: int = 1,
    PAD_ID: int = -1,
    BLOCK_SIZE: int = 1024,
) -> None:
    """slot = block_table[request, pos // block_size] * block_size + pos % block_size."""
    if TOTAL_CP_WORLD_SIZE != 1:
        raise NotImplementedError("Context parallelism is not supported on HPU.")
    num_reqs = query_start_loc.numel() - 1
    device = slot_mapping.device
    counts = (query_start_loc[1:] - query_start_loc[:-1]).to(torch.int64)
    # Requests' tokens are contiguous from index 0, so token i belongs to request req_of_token[i].
    req_of_token = torch.repeat_interleave(torch.arange(num_reqs, device=device), counts)
    n = req_of_token.numel()
    pos = positions[:n].to(torch.int64)
    table = block_table.view(-1)[: num_reqs * block_table_stride].view(num_reqs, -1)
    blocks = table[req_of_token, pos // KV_CACHE_BLOCK_SIZE].to(torch.int64)
    slot_mapping[:n] = blocks * KV_CACHE_BLOCK_SIZE + pos % KV_CACHE_BLOCK_SIZE
    slot_mapping[num_tokens:max_num_tokens] = PAD_ID


_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels(
        {"vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel": compute_slot_mapping}
    )
    _registered = True
