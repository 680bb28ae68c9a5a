"""The plain-torch stand-ins for the Triton kernels of vLLM's EAGLE proposer
(vllm/v1/spec_decode/utils.py) compute what the kernels compute: each is checked against a direct
per-request transcription of the kernel's program, on batches with padding rows, requests without
drafts, rejected (-1) tokens, discarded requests and positions past max_model_len."""

from __future__ import annotations

import torch

from vllm_gaudi_platform.worker.cuda_stand_ins import triton_kernels as to

PAD_ID = -1


def test_step_slot_mapping_advances_positions_slots_and_lengths_and_pads_the_rest():
    block_size, max_model_len, n_blocks = 4, 16, 4
    positions = torch.tensor([0, 5, 14, 15, 3], dtype=torch.int64)
    table = torch.tensor(
        [[7, 1, 2, 3], [4, 9, 6, 0], [8, 2, 5, 11], [3, 3, 3, 12], [10, 1, 1, 1]],
        dtype=torch.int32,
    )
    seq_lens = torch.tensor([1, 6, 15, 16, 4], dtype=torch.int32)
    batch_size, input_batch_size = 4, 6  # the fifth request and one more row are padding
    out_pos = torch.full((batch_size,), 99, dtype=torch.int64)
    out_slots = torch.full((input_batch_size,), 99, dtype=torch.int64)
    expected_lens = seq_lens.clone()
    expected_pos, expected_slots = out_pos.clone(), out_slots.clone()
    for r in range(input_batch_size):  # the kernel's programs, one per row
        if r >= batch_size:
            expected_slots[r] = PAD_ID
            continue
        new = int(positions[r]) + 1
        exceeds = new >= max_model_len
        clamped = 0 if exceeds else new
        block = min(clamped // block_size, n_blocks - 1)
        slot = int(table[r, block]) * block_size + clamped % block_size
        expected_pos[r] = clamped
        expected_slots[r] = PAD_ID if exceeds else slot
        expected_lens[r] = min(1 if exceeds else int(seq_lens[r]) + 1, max_model_len)

    to.eagle_step_slot_mapping_metadata(
        positions, table, table.stride(0), seq_lens, out_pos, out_slots,
        block_size, max_model_len, n_blocks, PAD_ID, batch_size,
    )  # fmt: skip

    assert out_pos.tolist() == expected_pos.tolist()
    assert out_slots.tolist() == expected_slots.tolist()
    assert seq_lens.tolist() == expected_lens.tolist()


def test_prepare_inputs_padded_points_each_request_at_its_last_accepted_token():
    num_drafts = [3, 0, 2, 3]
    valid = torch.tensor([2, 1, 3, 1], dtype=torch.int32)  # 1 + accepted drafts
    query_lens = [4, 5, 3, 4]  # drafts + 1, and a prefill without drafts
    cu = torch.tensor(num_drafts, dtype=torch.int32).cumsum(0).to(torch.int32)
    qsl = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0).to(torch.int32)
    n = len(num_drafts)
    indices = torch.full((n,), -7, dtype=torch.int32)
    rejected = torch.full((n,), -7, dtype=torch.int32)
    expected_idx, expected_rej = [], []
    for r in range(n):
        rej = num_drafts[r] + 1 - int(valid[r]) if num_drafts[r] > 0 else 0
        expected_rej.append(rej)
        expected_idx.append(int(qsl[r + 1]) - 1 - rej)

    to.eagle_prepare_inputs_padded(cu, valid, qsl, indices, rejected, n)

    assert indices.tolist() == expected_idx
    assert rejected.tolist() == expected_rej


def test_prepare_next_token_takes_the_last_valid_sampled_token_or_the_backup():
    vocab = 50
    sampled = torch.tensor(
        [
            [4, 9, -1, -1],  # two valid: next is 9
            [-1, -1, -1, -1],  # none valid: backup
            [3, 60, -1, -1],  # 60 is outside the vocabulary: only 3 counts
            [1, 2, 3, 4],  # discarded: backup, count 0
            [8, 8, 8, 8],  # a row past num_reqs: untouched
        ],
        dtype=torch.int32,
    )
    discard = torch.tensor([False, False, False, True, False])
    backup = torch.tensor([11, 12, 13, 14, 15], dtype=torch.int32)
    next_ids = torch.full((5,), -5, dtype=torch.int32)
    counts = torch.full((5,), -5, dtype=torch.int32)
    num_reqs, width = 4, 4

    to.eagle_prepare_next_token_padded(
        sampled, discard, backup, next_ids, counts, vocab, width, num_reqs, sampled.stride(0), 4
    )

    assert next_ids.tolist() == [9, 12, 3, 14, -5]
    assert counts.tolist() == [2, 0, 1, 0, -5]
