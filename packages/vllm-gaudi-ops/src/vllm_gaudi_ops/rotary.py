"""`hpu_ops_rotary`: the rotary-embedding family (vllm.general_plugins entry point)."""

from __future__ import annotations

from vllm_gaudi_platform.plugins import general_plugin


@general_plugin("hpu_ops_rotary")
def register() -> None:
    """Replace vLLM's RotaryEmbedding, each of its scaling variants (Llama3, linear, NTK,
    dynamic NTK, dynamic NTK alpha, YaRN, DeepSeek, DeepSeek V4, Gemma4, Fourier, Llama4
    vision, MRoPE and its interleaved, Ernie 4.5 VL and Bailing forms) and ApplyRotaryEmb with
    Gaudi's rotary kernel. See the README for the two variants left to vLLM and why.

    Does nothing but log one line when vLLM's active platform is not HPU (real or emulated),
    and warns instead when the installed vLLM is outside the supported range. Idempotent.
    """
    from vllm_gaudi_ops.layers import rotary
    from vllm_gaudi_ops.replacement import replace_ops

    replace_ops(rotary.REPLACEMENTS)
