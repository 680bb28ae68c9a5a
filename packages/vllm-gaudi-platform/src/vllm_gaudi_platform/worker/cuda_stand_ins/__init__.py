"""What vLLM's shared GPU runner code calls that only CUDA has, done for the HPU: its Triton
kernels in plain torch (`triton_kernels.py`: slot mapping, speculative decoding's and EAGLE's
input preparation; `mamba_state_copies.py`: Mamba prefix caching's batched state copies), and the
CUDA stream/event API routed to the seam's streams (`cuda_streams.py`). Each stands in for a named
upstream function: the ledger entry `vllm_gaudi_platform.patches.triton_kernels` and the
drift guard check that the names still exist."""
