"""Plain-torch implementations of the Triton kernels that vLLM's shared runner code launches.

Gaudi has no Triton. vLLM lets a platform swap a Triton kernel for a Python callable with the same
launch arguments (`vllm.triton_utils.dispatcher.register_kernels`); these run on Gaudi and in
emulation alike. Each kernel name string is a contract with vLLM, checked (with the kernel's
parameters) by the drift guard; the ledger (patches/triton_kernels.py) says when these can go.
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
    # Requests' tokens are contiguous from index 0: token i belongs to the request whose range
    # [start, end) holds it, the first whose end exceeds i (a request with no tokens has an
    # empty range and owns none). One search, no host sync for the output size.
    tokens = torch.arange(num_tokens, device=slot_mapping.device, dtype=query_start_loc.dtype)
    req_of_token = torch.searchsorted(query_start_loc[1:], tokens, right=True)
    pos = positions[:num_tokens].to(torch.int64)
    table = block_table.view(-1)[: num_reqs * block_table_stride].view(num_reqs, -1)
    blocks = table[req_of_token, pos // KV_CACHE_BLOCK_SIZE]
    torch.add(
        pos % KV_CACHE_BLOCK_SIZE,
        blocks,
        alpha=KV_CACHE_BLOCK_SIZE,
        out=slot_mapping[:num_tokens],
    )
    slot_mapping[num_tokens:max_num_tokens] = PAD_ID


# ------------------------------------------------------------------ speculative decoding
# vLLM's rejection sampler (vllm/v1/sample/rejection_sampler.py) launches one Triton program per
# request (or per request and draft position) that walks the request's draft tokens. These
# stand-ins compute the same result for the whole batch at once on [batch, max_spec_len] views of
# the flat per-token tensors: the tensor shapes depend only on the batch size, max_spec_len and
# the vocabulary, never on how many drafts each request got. Parameter names are the kernels'
# own, so vLLM's launcher passes every argument by name.

PLACEHOLDER_TOKEN_ID = -1  # vLLM's marker for an output position that holds no token


def _draft_grid(
    cu_num_draft_tokens: torch.Tensor, max_spec_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per request: flat index of each draft position, whether it is a real draft, draft count.

    Request r owns flat positions [cu[r-1], cu[r]). Positions past a request's count map to -1
    (the one padding slot `_gather_drafts` appends), so gathers stay in bounds for any batch,
    including one with no drafts at all.
    """
    cu = cu_num_draft_tokens.to(torch.int64)
    starts = torch.cat([cu.new_zeros(1), cu[:-1]])
    counts = cu - starts
    offsets = torch.arange(max_spec_len, device=cu.device)
    valid = offsets.unsqueeze(0) < counts.unsqueeze(1)
    index = torch.where(valid, starts.unsqueeze(1) + offsets, -1)
    return index, valid, counts


def _gather_drafts(values: torch.Tensor, index: torch.Tensor, fill: float | int) -> torch.Tensor:
    """values[index] for a flat per-token tensor, with `fill` where index is -1."""
    padded = torch.cat([values.reshape(-1), values.new_full((1,), fill)])
    return padded[index]


def _write_accepted(
    output_token_ids: torch.Tensor,
    rows: torch.Tensor,
    accepted: torch.Tensor,
    valid: torch.Tensor,
    counts: torch.Tensor,
    on_reject: torch.Tensor,
    drafts: torch.Tensor,
    bonus: torch.Tensor,
) -> None:
    """Write what the kernels write for the requests in `rows`.

    Position p gets the draft if it is accepted, else the replacement token (and the walk stops):
    so p is written when every earlier position was accepted. When all drafts are accepted the
    bonus token goes right after them. Other positions (and rows) keep their content.
    """
    batch, width = output_token_ids.shape
    max_spec_len = accepted.shape[1]
    accepted = accepted & valid
    # Number of leading accepted drafts per request.
    num_accepted = torch.cumprod(accepted.to(torch.int64), dim=1).sum(dim=1)
    positions = torch.arange(max_spec_len, device=accepted.device).unsqueeze(0)
    written = valid & (positions <= num_accepted.unsqueeze(1))
    tokens = torch.where(accepted, drafts, on_reject)
    all_accepted = num_accepted == counts
    columns = torch.arange(width, device=accepted.device).unsqueeze(0)
    bonus_here = (columns == counts.unsqueeze(1)) & all_accepted.unsqueeze(1)
    pad = width - max_spec_len
    written_full = torch.nn.functional.pad(written, (0, pad)) | bonus_here
    tokens_full = torch.nn.functional.pad(tokens, (0, pad))
    tokens_full = torch.where(
        bonus_here, bonus.reshape(batch, 1).to(tokens_full.dtype), tokens_full
    )
    mask = written_full & rows.reshape(batch, 1)
    output_token_ids.copy_(
        torch.where(mask, tokens_full.to(output_token_ids.dtype), output_token_ids)
    )


def rejection_greedy_sample(
    output_token_ids_ptr: torch.Tensor,
    cu_num_draft_tokens_ptr: torch.Tensor,
    draft_token_ids_ptr: torch.Tensor,
    target_argmax_ptr: torch.Tensor,
    bonus_token_ids_ptr: torch.Tensor,
    is_greedy_ptr: torch.Tensor | None,
    max_spec_len: int,
    uniform_probs_ptr: torch.Tensor | None,
    synthetic_conditional_rates_ptr: torch.Tensor | None,
    SYNTHETIC_MODE: bool,
) -> None:
    """Greedy verification: keep drafts while they equal the target argmax.

    The first mismatching position gets the target argmax; if every draft matches, the bonus token
    follows. In synthetic mode a draft is accepted when its uniform sample is under the
    position's rate and it is not a -1 padding draft. Rows with is_greedy False are left alone.
    """
    out = output_token_ids_ptr
    batch = out.shape[0]
    index, valid, counts = _draft_grid(cu_num_draft_tokens_ptr, max_spec_len)
    drafts = _gather_drafts(draft_token_ids_ptr.to(torch.int64), index, PLACEHOLDER_TOKEN_ID)
    argmax = _gather_drafts(target_argmax_ptr.to(torch.int64), index, 0)
    if SYNTHETIC_MODE:
        assert uniform_probs_ptr is not None and synthetic_conditional_rates_ptr is not None
        uniform = _gather_drafts(uniform_probs_ptr, index, 1.0)
        positions = torch.arange(max_spec_len, device=out.device)
        rates = synthetic_conditional_rates_ptr[
            positions.clamp(max=synthetic_conditional_rates_ptr.numel() - 1)
        ]
        accepted = (uniform < rates.unsqueeze(0)) & (drafts >= 0)
    else:
        accepted = drafts == argmax
    if is_greedy_ptr is None:
        rows = torch.ones(batch, dtype=torch.bool, device=out.device)
    else:
        rows = is_greedy_ptr.to(torch.bool)
    _write_accepted(out, rows, accepted, valid, counts, argmax, drafts, bonus_token_ids_ptr)


def rejection_random_sample(
    output_token_ids_ptr: torch.Tensor,
    cu_num_draft_tokens_ptr: torch.Tensor,
    draft_token_ids_ptr: torch.Tensor,
    draft_probs_ptr: torch.Tensor | None,
    target_probs_ptr: torch.Tensor,
    bonus_token_ids_ptr: torch.Tensor,
    recovered_token_ids_ptr: torch.Tensor,
    uniform_probs_ptr: torch.Tensor,
    is_greedy_ptr: torch.Tensor,
    max_spec_len: int,
    vocab_size: int,
    synthetic_conditional_rates_ptr: torch.Tensor | None,
    NO_DRAFT_PROBS: bool,
    SYNTHETIC_MODE: bool,
) -> None:
    """Random-sampling verification (Leviathan et al.): accept draft d at position p when
    target_prob(d) / draft_prob(d) >= u_p (draft_prob is 1 without draft probabilities, a zero
    draft_prob rejects); a rejected position gets its recovered token. -1 drafts are rejected.
    Rows with is_greedy True are left alone."""
    out = output_token_ids_ptr
    index, valid, counts = _draft_grid(cu_num_draft_tokens_ptr, max_spec_len)
    drafts = _gather_drafts(draft_token_ids_ptr.to(torch.int64), index, PLACEHOLDER_TOKEN_ID)
    uniform = _gather_drafts(uniform_probs_ptr, index, 1.0)
    recovered = _gather_drafts(recovered_token_ids_ptr.to(torch.int64), index, 0)
    real = drafts >= 0
    if SYNTHETIC_MODE:
        assert synthetic_conditional_rates_ptr is not None
        positions = torch.arange(max_spec_len, device=out.device)
        rates = synthetic_conditional_rates_ptr[
            positions.clamp(max=synthetic_conditional_rates_ptr.numel() - 1)
        ]
        accepted = real & (uniform < rates.unsqueeze(0))
    else:
        # Row of each (request, position) in the flat [num_tokens, vocab] probability tensors;
        # padding positions and -1 drafts read row 0 / token 0 and are masked out below.
        flat_rows = index.clamp(min=0)
        token = drafts.clamp(min=0)
        target_probs = target_probs_ptr.reshape(-1, vocab_size)
        if target_probs.shape[0] == 0:
            target_prob = torch.zeros(drafts.shape, dtype=target_probs.dtype, device=out.device)
        else:
            target_prob = target_probs[flat_rows, token]
        if NO_DRAFT_PROBS or draft_probs_ptr is None:
            accepted = real & (target_prob >= uniform)
        else:
            draft_probs = draft_probs_ptr.reshape(-1, vocab_size)
            if draft_probs.shape[0] == 0:
                draft_prob = torch.zeros_like(target_prob)
            else:
                draft_prob = draft_probs[flat_rows, token]
            # A zero draft probability rejects (and would divide by zero).
            safe = torch.where(draft_prob > 0, draft_prob, torch.ones_like(draft_prob))
            accepted = real & (draft_prob > 0) & (target_prob / safe >= uniform)
    rows = ~is_greedy_ptr.to(torch.bool)
    _write_accepted(out, rows, accepted, valid, counts, recovered, drafts, bonus_token_ids_ptr)


def expand(
    output_ptr: torch.Tensor,
    input_ptr: torch.Tensor,
    cu_num_tokens_ptr: torch.Tensor,
    replace_from: float | int,
    replace_to: float | int,
    MAX_NUM_TOKENS: int,
) -> None:
    """output[t] = input[request of t] (replace_from swapped for replace_to), for the first
    MAX_NUM_TOKENS tokens of each request; positions past the last request keep their content."""
    n = output_ptr.shape[0]
    if n == 0:
        return
    cu = cu_num_tokens_ptr.to(torch.int64)
    token = torch.arange(n, device=output_ptr.device)
    # Request r owns tokens [cu[r-1], cu[r]): the first r with cu[r] > t.
    request = torch.searchsorted(cu, token, right=True)
    inside = request < cu.numel()
    request = request.clamp(max=cu.numel() - 1)
    starts = torch.cat([cu.new_zeros(1), cu[:-1]])
    inside &= (token - starts[request]) < MAX_NUM_TOKENS
    values = torch.where(
        input_ptr == replace_from, torch.full_like(input_ptr, replace_to), input_ptr
    )
    output_ptr.copy_(torch.where(inside, values[request], output_ptr))


def sample_recovered_tokens(
    output_token_ids_ptr: torch.Tensor,
    cu_num_draft_tokens_ptr: torch.Tensor,
    draft_token_ids_ptr: torch.Tensor,
    draft_probs_ptr: torch.Tensor | None,
    target_probs_ptr: torch.Tensor,
    inv_q_ptr: torch.Tensor,
    vocab_size: int,
    BLOCK_SIZE: int,
    NO_DRAFT_PROBS: bool,
    USE_FP64_GUMBEL: bool,
) -> None:
    """Recovered token per draft position: argmax over the vocabulary of p(v) * inv_q[request, v],
    with p = target probabilities without the draft token (no draft probabilities) or
    max(target - draft, 0); ties go to the lowest token id, as in the kernel."""
    num_tokens = output_token_ids_ptr.shape[0]
    if num_tokens == 0:
        return
    cu = cu_num_draft_tokens_ptr.to(torch.int64)
    token = torch.arange(num_tokens, device=output_token_ids_ptr.device)
    request = torch.searchsorted(cu, token, right=True)
    inside = request < cu.numel()
    request = request.clamp(max=cu.numel() - 1)
    target = target_probs_ptr.reshape(-1, vocab_size)[:num_tokens]
    if NO_DRAFT_PROBS or draft_probs_ptr is None:
        vocab = torch.arange(vocab_size, device=target.device)
        is_draft = vocab.unsqueeze(0) == draft_token_ids_ptr[:num_tokens].to(torch.int64).unsqueeze(
            1
        )
        prob = target.masked_fill(is_draft, 0.0)
    else:
        draft = draft_probs_ptr.reshape(-1, vocab_size)[:num_tokens]
        prob = torch.clamp(target - draft, min=0.0)
    score = prob * inv_q_ptr.reshape(-1, vocab_size)[request]
    recovered = score.argmax(dim=-1).clamp(max=vocab_size - 1)
    output_token_ids_ptr.copy_(
        torch.where(inside, recovered.to(output_token_ids_ptr.dtype), output_token_ids_ptr)
    )


SPEC_DECODE_KERNELS = {
    "vllm.v1.sample.rejection_sampler.rejection_greedy_sample_kernel": rejection_greedy_sample,
    "vllm.v1.sample.rejection_sampler.rejection_random_sample_kernel": rejection_random_sample,
    "vllm.v1.sample.rejection_sampler.expand_kernel": expand,
    "vllm.v1.sample.rejection_sampler.sample_recovered_tokens_kernel": sample_recovered_tokens,
}


# ------------------------------------------------------------------ EAGLE drafting
# vLLM's EAGLE proposer (vllm/v1/spec_decode/llm_base_proposer.py) prepares its inputs with three
# one-program-per-request kernels of vllm/v1/spec_decode/utils.py. These compute the same for the
# whole batch at once.


def eagle_step_slot_mapping_metadata(
    positions_ptr: torch.Tensor,
    block_table_ptr: torch.Tensor,
    block_table_stride: int,
    seq_lens_ptr: torch.Tensor,
    out_clamped_positions_ptr: torch.Tensor,
    out_slot_mapping_ptr: torch.Tensor,
    block_size: int,
    max_model_len: int,
    n_blocks_per_req: int,
    PAD_ID: int,
    batch_size: int,
) -> None:
    """One autoregressive drafting step: position + 1 (0 past max_model_len), its KV slot (PAD_ID
    past max_model_len, and for the padding rows of `out_slot_mapping_ptr` beyond batch_size), and
    seq_len + 1 (1 past max_model_len, at most max_model_len), for the first batch_size requests."""
    n = batch_size
    new_pos = positions_ptr[:n].to(torch.int64) + 1
    exceeds = new_pos >= max_model_len
    clamped = torch.where(exceeds, torch.zeros_like(new_pos), new_pos)
    block_number = torch.clamp(clamped // block_size, max=n_blocks_per_req - 1)
    table = block_table_ptr.reshape(-1)
    rows = torch.arange(n, device=new_pos.device) * block_table_stride
    block_id = table[rows + block_number].to(torch.int64)
    slot = block_id * block_size + clamped % block_size
    slot = torch.where(exceeds, torch.full_like(slot, PAD_ID), slot)
    seq = seq_lens_ptr[:n]
    new_seq = torch.where(exceeds, torch.ones_like(seq), seq + 1).clamp(max=max_model_len)
    out_clamped_positions_ptr[:n] = clamped.to(out_clamped_positions_ptr.dtype)
    out_slot_mapping_ptr[:n] = slot.to(out_slot_mapping_ptr.dtype)
    out_slot_mapping_ptr[n:] = PAD_ID
    seq_lens_ptr[:n] = new_seq.to(seq_lens_ptr.dtype)


def eagle_prepare_inputs_padded(
    cu_num_draft_tokens_ptr: torch.Tensor,
    valid_sampled_tokens_count_ptr: torch.Tensor,
    query_start_loc_gpu_ptr: torch.Tensor,
    token_indices_to_sample_ptr: torch.Tensor,
    num_rejected_tokens_gpu_ptr: torch.Tensor,
    num_reqs: int,
) -> None:
    """Per request: rejected = drafts + 1 - valid sampled tokens (0 without drafts), and the
    token to sample the next draft from = the request's last token minus the rejected ones."""
    n = num_reqs
    cu = cu_num_draft_tokens_ptr[:n].to(torch.int64)
    drafts = cu - torch.cat([cu.new_zeros(1), cu[:-1]])
    valid = valid_sampled_tokens_count_ptr[:n].to(torch.int64)
    rejected = torch.where(drafts > 0, drafts + 1 - valid, torch.zeros_like(drafts))
    last = query_start_loc_gpu_ptr[1 : n + 1].to(torch.int64) - 1
    token_indices_to_sample_ptr[:n] = (last - rejected).to(token_indices_to_sample_ptr.dtype)
    num_rejected_tokens_gpu_ptr[:n] = rejected.to(num_rejected_tokens_gpu_ptr.dtype)


def eagle_prepare_next_token_padded(
    sampled_token_ids_ptr: torch.Tensor,
    discard_request_mask_ptr: torch.Tensor,
    backup_next_token_ids_ptr: torch.Tensor,
    next_token_ids_ptr: torch.Tensor,
    valid_sampled_tokens_count_ptr: torch.Tensor,
    vocab_size: int,
    num_sampled_tokens_per_req: int,
    num_reqs: int,
    stride_sampled_token_ids: int,
    BLOCK_SIZE_TOKENS: int,
) -> None:
    """Per request: how many sampled tokens are valid (not -1, inside the vocabulary) and the
    last valid one as the next token; no valid token, or a discarded request (count 0), takes
    the backup token."""
    n = num_reqs
    width = num_sampled_tokens_per_req
    flat = sampled_token_ids_ptr.reshape(-1)
    row_starts = torch.arange(n, device=flat.device).unsqueeze(1) * stride_sampled_token_ids
    index = row_starts + torch.arange(width, device=flat.device).unsqueeze(0)
    tokens = flat[index].to(torch.int64)
    valid = (tokens != -1) & (tokens < vocab_size)
    count = valid.sum(dim=1)
    columns = torch.arange(width, device=flat.device).unsqueeze(0)
    last_index = torch.where(valid, columns, -1).max(dim=1).values.clamp(min=0)
    last = tokens.gather(1, last_index.unsqueeze(1)).squeeze(1)
    discarded = discard_request_mask_ptr[:n].to(torch.bool)
    backup = backup_next_token_ids_ptr[:n].to(torch.int64)
    use_backup = discarded | (count == 0)
    next_token_ids_ptr[:n] = torch.where(use_backup, backup, last).to(next_token_ids_ptr.dtype)
    count = torch.where(discarded, torch.zeros_like(count), count)
    valid_sampled_tokens_count_ptr[:n] = count.to(valid_sampled_tokens_count_ptr.dtype)


EAGLE_KERNELS = {
    "vllm.v1.spec_decode.utils.eagle_step_slot_mapping_metadata_kernel": (
        eagle_step_slot_mapping_metadata
    ),
    "vllm.v1.spec_decode.utils.eagle_prepare_inputs_padded_kernel": eagle_prepare_inputs_padded,
    "vllm.v1.spec_decode.utils.eagle_prepare_next_token_padded_kernel": (
        eagle_prepare_next_token_padded
    ),
}

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from vllm.triton_utils.dispatcher import register_kernels

    from vllm_gaudi_platform.worker.cuda_stand_ins import mamba_state_copies

    register_kernels(
        {
            "vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel": compute_slot_mapping,
            **SPEC_DECODE_KERNELS,
            **EAGLE_KERNELS,
            **mamba_state_copies.KERNELS,  # Mamba prefix caching's state copies
        }
    )
    _registered = True
