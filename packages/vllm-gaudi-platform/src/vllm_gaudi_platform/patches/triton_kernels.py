"""Plain-torch stand-ins for the Triton kernels vLLM's shared runner code launches, through vLLM's
kernel override registry."""

from __future__ import annotations

from vllm_gaudi_platform.patches import Patch, Upstream

UPSTREAM: tuple[Upstream, ...] = (
    Upstream(
        "vllm.triton_utils.dispatcher:register_kernels",
        "triton_kernels.register",
        params=("overrides",),
    ),
    Upstream(
        "vllm.v1.worker.block_table:ComputeSlotMappingKernel.kernel",
        "triton_kernels.compute_slot_mapping stands in for it, positionally",
        params=(
            "num_tokens",
            "max_num_tokens",
            "query_start_loc_ptr",
            "positions_ptr",
            "block_table_ptr",
            "block_table_stride",
            "slot_mapping_ptr",
            "KV_CACHE_BLOCK_SIZE",
            "TOTAL_CP_WORLD_SIZE",
            "TOTAL_CP_RANK",
            "CP_KV_CACHE_INTERLEAVE_SIZE",
            "PAD_ID",
            "BLOCK_SIZE",
        ),
    ),
    *(
        Upstream(
            f"vllm.v1.sample.rejection_sampler:{kernel}",
            f"triton_kernels.{stand_in} stands in for it, by name",
            params=params,
        )
        for kernel, stand_in, params in (
            (
                "rejection_greedy_sample_kernel",
                "rejection_greedy_sample",
                (
                    "output_token_ids_ptr",
                    "cu_num_draft_tokens_ptr",
                    "draft_token_ids_ptr",
                    "target_argmax_ptr",
                    "bonus_token_ids_ptr",
                    "is_greedy_ptr",
                    "max_spec_len",
                    "uniform_probs_ptr",
                    "synthetic_conditional_rates_ptr",
                    "SYNTHETIC_MODE",
                ),
            ),
            (
                "rejection_random_sample_kernel",
                "rejection_random_sample",
                (
                    "output_token_ids_ptr",
                    "cu_num_draft_tokens_ptr",
                    "draft_token_ids_ptr",
                    "draft_probs_ptr",
                    "target_probs_ptr",
                    "bonus_token_ids_ptr",
                    "recovered_token_ids_ptr",
                    "uniform_probs_ptr",
                    "is_greedy_ptr",
                    "max_spec_len",
                    "vocab_size",
                    "synthetic_conditional_rates_ptr",
                    "NO_DRAFT_PROBS",
                    "SYNTHETIC_MODE",
                ),
            ),
            (
                "expand_kernel",
                "expand",
                (
                    "output_ptr",
                    "input_ptr",
                    "cu_num_tokens_ptr",
                    "replace_from",
                    "replace_to",
                    "MAX_NUM_TOKENS",
                ),
            ),
            (
                "sample_recovered_tokens_kernel",
                "sample_recovered_tokens",
                (
                    "output_token_ids_ptr",
                    "cu_num_draft_tokens_ptr",
                    "draft_token_ids_ptr",
                    "draft_probs_ptr",
                    "target_probs_ptr",
                    "inv_q_ptr",
                    "vocab_size",
                    "BLOCK_SIZE",
                    "NO_DRAFT_PROBS",
                    "USE_FP64_GUMBEL",
                ),
            ),
        )
    ),
    # Mamba prefix caching ("align"): vLLM's runner describes state copies by address and
    # launches this kernel (mamba_state_copies.py stands in for it; hybrid.py states the mode).
    Upstream(
        "vllm.v1.worker.mamba_utils:batch_memcpy_kernel",
        "mamba_state_copies.batch_memcpy stands in for it, by name",
        params=("src_ptrs", "dst_ptrs", "sizes", "BLOCK_SIZE"),
    ),
    Upstream(
        "vllm.v1.worker.mamba_utils:do_mamba_copy_block",
        "the align-mode copies reach mamba_state_copies.batch_memcpy through it",
        mentions=("batch_memcpy",),
    ),
    # EAGLE drafting (cuda_stand_ins/triton_kernels.py EAGLE_KERNELS; spec_decode.py
    # DraftBucketing).
    *(
        Upstream(
            f"vllm.v1.spec_decode.utils:{kernel}",
            f"triton_kernels.{kernel.removesuffix('_kernel')} stands in for it, by name",
        )
        for kernel in (
            "eagle_step_slot_mapping_metadata_kernel",
            "eagle_prepare_inputs_padded_kernel",
            "eagle_prepare_next_token_padded_kernel",
        )
    ),
)

PATCH = Patch(
    what=(
        "kernels registered in vLLM's Triton kernel override registry "
        "(`vllm.triton_utils.dispatcher.register_kernels`): the slot mapping, the rejection "
        "sampler's four kernels, EAGLE's three input kernels, Mamba prefix caching's batched "
        "state copy (worker/cuda_stand_ins/)."
    ),
    why=(
        "Gaudi has no Triton, and the runner's input preparation launches these on every "
        "platform. Not a monkeypatch: vLLM's own registry, keyed by kernel name (the contract "
        "checked here)."
    ),
    can_go=(
        "when vLLM computes these without Triton on non-CUDA platforms, or when a Gaudi Triton "
        "backend exists."
    ),
    sites=("vllm_gaudi_platform.worker.cuda_stand_ins.triton_kernels:register",),
    scope="process",
    upstream=UPSTREAM,
)
