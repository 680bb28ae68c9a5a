"""The plain-torch stand-in for vLLM's slot-mapping Triton kernel against a per-token loop:
slot = block_table[request, pos // block_size] * block_size + pos % block_size, padding after."""

from __future__ import annotations

import pytest
import torch

from vllm_gaudi_platform.worker.cuda_stand_ins import triton_kernels as to

BLOCK = 16
STRIDE = 8  # block table columns
MAX_TOKENS = 48


@pytest.mark.parametrize(
    "counts",
    [[1], [1] * 7, [5, 1, 1, 12], [3, 0, 4], [0, 2, 0]],
    ids=["one_decode", "decodes", "mixed", "empty_request", "empty_edges"],
)
def test_slots_match_a_per_token_loop(counts):
    gen = torch.Generator().manual_seed(len(counts))
    num_reqs = len(counts)
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    n = starts[-1]
    query_start_loc = torch.tensor(starts, dtype=torch.int32)
    table = torch.randint(0, 1000, (num_reqs + 2, STRIDE), dtype=torch.int32, generator=gen)
    # Each request's tokens continue from its own cached length.
    computed = torch.randint(0, BLOCK * (STRIDE - 2), (num_reqs,), generator=gen)
    positions = torch.cat(
        [computed[r] + torch.arange(c) for r, c in enumerate(counts)] + [torch.zeros(0)]
    ).to(torch.int64)
    slot_mapping = torch.full((MAX_TOKENS + 4,), 7777, dtype=torch.int64)

    to.compute_slot_mapping(
        n, MAX_TOKENS, query_start_loc, positions, table, STRIDE, slot_mapping, BLOCK
    )

    expected = []
    for r, c in enumerate(counts):
        for t in range(c):
            pos = int(computed[r]) + t
            expected.append(int(table[r, pos // BLOCK]) * BLOCK + pos % BLOCK)
    assert slot_mapping[:n].tolist() == expected
    assert (slot_mapping[n:MAX_TOKENS] == -1).all()  # padding slots
    assert (slot_mapping[MAX_TOKENS:] == 7777).all()  # nothing written past max_num_tokens


def test_context_parallelism_is_refused_by_name():
    with pytest.raises(NotImplementedError, match="Context parallelism"):
        to.compute_slot_mapping(
            1,
            4,
            torch.tensor([0, 1], dtype=torch.int32),
            torch.zeros(1, dtype=torch.int64),
            torch.zeros(1, STRIDE, dtype=torch.int32),
            STRIDE,
            torch.zeros(4, dtype=torch.int64),
            BLOCK,
            TOTAL_CP_WORLD_SIZE=2,
        )
