"""The unquantized linear method's GEMM, routed through the seam per layer."""

from __future__ import annotations

from vllm_gaudi_platform.patches import Patch, Upstream

UPSTREAM: tuple[Upstream, ...] = (
    Upstream(
        "vllm.model_executor.layers.linear:UnquantizedLinearMethod.apply",
        "model_loading.route_linears_through_seam replaces each method's _gemm_impl",
        params=("layer", "x", "bias"),
        mentions=("_gemm_impl",),
    ),
    Upstream(
        "vllm.model_executor.layers.utils:default_unquantized_gemm",
        "the _gemm_impl HPUModelRunner installs takes the same arguments",
        params=("layer", "x", "weight", "bias"),
    ),
)

PATCH = Patch(
    what=(
        "`UnquantizedLinearMethod._gemm_impl` replaced on each loaded layer's method object, "
        "after loading."
    ),
    why=(
        "every dense linear layer then runs the seam's `linear` (Gaudi's MME on a Gaudi, its "
        "torch twin in emulation), where vLLM would call its CUDA/CPU dispatch."
    ),
    can_go="when vLLM dispatches unquantized GEMMs through the platform (a platform linear hook).",
    sites=("vllm_gaudi_platform.worker.model_loading:route_linears_through_seam",),
    scope="object",
    upstream=UPSTREAM,
)
