"""torch.accelerator's cache and sync calls, routed to the seam in CPU emulation."""

from __future__ import annotations

from vllm_gaudi_platform.patches import Patch, Upstream

UPSTREAM: tuple[Upstream, ...] = (
    Upstream("torch:accelerator.empty_cache", "platform.py routes it to the seam (emulation)"),
    Upstream("torch:accelerator.empty_host_cache", "platform.py routes it to the seam"),
    Upstream("torch:accelerator.synchronize", "platform.py routes it to the seam (emulation)"),
)

PATCH = Patch(
    what=(
        "`torch.accelerator.{empty_cache, empty_host_cache, synchronize}` replaced process-wide "
        "when vLLM instantiates the platform, in CPU emulation only."
    ),
    why=(
        "vLLM's shared worker and runner code call torch.accelerator directly; with no torch "
        "accelerator (emulation on the CPU) those calls fail. On a Gaudi, torch's own HPU "
        "accelerator answers them and nothing is patched."
    ),
    can_go=(
        "when vLLM asks the platform (`current_platform.synchronize()` / `empty_cache()`) "
        "instead of torch.accelerator, or when torch.accelerator accepts the CPU."
    ),
    sites=("vllm_gaudi_platform.platform:_route_torch_accelerator_to_seam",),
    scope="process",
    upstream=UPSTREAM,
)
