"""RMSNorm and GemmaRMSNorm on Gaudi's fused RMSNorm kernel (residual add, then the kernel)."""

from __future__ import annotations

import torch
from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm

from vllm_gaudi_ops import stats
from vllm_gaudi_platform.seam import backend

FAMILY = "norm"


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    # The kernel takes 3-D input only; vLLM passes [tokens, hidden] and, for q/k norms, more dims.
    x3 = x if x.dim() == 3 else x.reshape(1, -1, x.shape[-1])
    return backend().rms_norm(x3, weight, epsilon).view(x.shape)


def _add_and_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, epsilon: float
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if residual is None:
        return _rms_norm(x, weight, epsilon)
    residual = x + residual
    return _rms_norm(residual, weight, epsilon), residual


class HpuRMSNorm(RMSNorm):
    """RMSNorm through the kernel; the fused-add variant returns (normed, x + residual)."""

    def forward_oot(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        stats.count(FAMILY)
        if self.variance_size_override is not None:
            # The kernel normalises over the whole hidden size; a partial variance is vLLM's.
            return self.forward_native(x, residual)
        # Without a learned weight, `weight` holds ones: cast them so the kernel's fast
        # same-dtype path applies (multiplying by one is exact in any dtype).
        weight = self.weight if self.has_weight else self.weight.to(x.dtype)
        return _add_and_norm(x, residual, weight, self.variance_epsilon)


class HpuGemmaRMSNorm(GemmaRMSNorm):
    """Gemma's RMSNorm: the kernel with a float32 (1 + weight), as vLLM computes it."""

    def forward_oot(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        stats.count(FAMILY)
        return _add_and_norm(x, residual, self.weight.float() + 1.0, self.variance_epsilon)


REPLACEMENTS: tuple[tuple[type, type], ...] = (
    (RMSNorm, HpuRMSNorm),
    (GemmaRMSNorm, HpuGemmaRMSNorm),
)
