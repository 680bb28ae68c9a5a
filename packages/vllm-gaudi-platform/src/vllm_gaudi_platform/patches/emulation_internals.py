"""torch internals the CPU emulation's kernels call."""

from __future__ import annotations

from vllm_gaudi_platform.patches import Patch, Upstream

UPSTREAM: tuple[Upstream, ...] = (
    Upstream("torch:ops.mkldnn._linear_pointwise", "seam/emulated.py linear (float32)"),
)

PATCH = Patch(
    what="",
    why=(
        "the emulated dense linear runs float32 through oneDNN's inner product, as torch's CPU "
        "linear does."
    ),
    can_go="never on a Gaudi (emulation only); when torch's CPU linear is as fast.",
    upstream=UPSTREAM,
)
