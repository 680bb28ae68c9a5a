"""`hpu_ops_moe`: the mixture-of-experts family (vllm.general_plugins entry point)."""

from __future__ import annotations

from vllm_gaudi_platform.plugins import general_plugin


@general_plugin("hpu_ops_moe")
def register() -> None:
    """Replace vLLM's UnquantizedFusedMoEMethod with one that routes in torch and runs the
    experts with Gaudi's mixture_of_experts kernel, and GroupedTopk (DeepSeek-style grouped
    routing) with an eager version.

    Does nothing but log one line when vLLM's active platform is not HPU (real or emulated),
    and warns instead when the installed vLLM is outside the supported range. Idempotent.
    """
    from vllm_gaudi_ops.layers import moe
    from vllm_gaudi_ops.replacement import replace_ops

    replace_ops(moe.REPLACEMENTS)
