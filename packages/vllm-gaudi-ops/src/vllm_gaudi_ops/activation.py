"""`hpu_ops_activation`: the gated-activation family (vllm.general_plugins entry point)."""

from __future__ import annotations

from vllm_gaudi_platform.plugins import general_plugin


@general_plugin("hpu_ops_activation")
def register() -> None:
    """Replace vLLM's gated activations (SiluAndMul, MulAndSilu, GeluAndMul, SwigluOAIAndMul,
    SwigluStepAndMul, SiluAndMulWithClamp, FatreluAndMul, SituAndMul, GeluAndMulSparse).

    Does nothing but log one line when vLLM's active platform is not HPU (real or emulated),
    and warns instead when the installed vLLM is outside the supported range. Idempotent.
    """
    from vllm_gaudi_ops.layers import activation
    from vllm_gaudi_ops.replacement import replace_ops

    replace_ops(activation.REPLACEMENTS)
