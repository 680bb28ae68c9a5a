"""The profile pass: vLLM's CUDA-graph capture size set for the minimal KV cache, forward
pre-hooks on vLLM's state layers; each for the call's duration."""

from __future__ import annotations

from vllm_gaudi_platform.patches import Patch, Upstream

UPSTREAM: tuple[Upstream, ...] = (
    Upstream(
        "vllm.model_executor.layers.mamba.abstract:MambaBase",
        "worker/profiling.py finds the state layers (Mamba2, gated delta net) by this base",
    ),
    Upstream(
        "vllm.config.compilation:CompilationConfig",
        "worker/profiling.py sizes vLLM's minimal profiling KV cache by it (one block)",
        mentions=("max_cudagraph_capture_size",),
    ),
    Upstream(
        "vllm.forward_context:get_forward_context",
        "worker/profiling.py reads which layers the profile pass handed state metadata",
    ),
)

PATCH = Patch(
    what=(
        "`CompilationConfig.max_cudagraph_capture_size` set to 1 while vLLM builds its minimal "
        "profiling KV cache when the HPU left it unset (vLLM takes the minimum of it and the "
        "sequence count); a forward pre-hook on each state layer (a MambaBase module) during "
        "the profile pass, removed when the pass returns; it reads the forward context and "
        "changes nothing."
    ),
    why=(
        "the profile pass runs the largest prompt bucket with its metadata over a KV cache, so "
        "the attention and state kernels' intermediates count in the peak; vLLM's helper for "
        "that cache fails on an unset capture size. The worker reports how many state layers "
        "ran their kernels in the profile pass (they do exactly when handed their prefill state "
        "metadata), so a profile that misses their prefill intermediates shows."
    ),
    can_go=(
        "when vLLM's minimal profiling KV cache takes its block count as an argument, and the "
        "state families count their kernel runs themselves."
    ),
    # The hooks are registered through torch's module API (no attribute write for the scan).
    sites=("vllm_gaudi_platform.worker.profiling:_minimal_kv_cache",),
    scope="call",
    upstream=UPSTREAM,
)
