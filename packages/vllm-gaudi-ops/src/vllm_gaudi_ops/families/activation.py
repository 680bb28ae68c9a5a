"""Gated activations (x -> act(gate) * up) for Gaudi.

Gaudi's public kernel API has no fused gated-activation kernel: these short elementwise chains
run as TPC ops that Gaudi's graph compiler fuses, so the family needs no seam kernel. Each
forward_oot states the op's math directly in torch: the ops stay on one known path on HPU (no
CUDA/XPU kernel handles, no IR-op dispatch), and the family counter shows they ran.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from vllm.model_executor.layers.activation import (
    FatreluAndMul,
    GeluAndMul,
    GeluAndMulSparse,
    MulAndSilu,
    SiluAndMul,
    SiluAndMulWithClamp,
    SituAndMul,
    SwigluOAIAndMul,
    SwigluStepAndMul,
)

from vllm_gaudi_ops import stats

FAMILY = "activation"


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d = x.shape[-1] // 2
    return x[..., :d], x[..., d:]


class HpuSiluAndMul(SiluAndMul):
    def forward_oot(self, x: torch.Tensor) -> torch.Tensor:
        stats.count(FAMILY)
        gate, up = _halves(x)
        return F.silu(gate) * up


class HpuMulAndSilu(MulAndSilu):
    def forward_oot(self, x: torch.Tensor) -> torch.Tensor:
        stats.count(FAMILY)
        up, gate = _halves(x)
        return up * F.silu(gate)


class HpuGeluAndMul(GeluAndMul):
    def forward_oot(self, x: torch.Tensor) -> torch.Tensor:
        stats.count(FAMILY)
        gate, up = _halves(x)
        return F.gelu(gate, approximate=self.approximate) * up


class HpuSwigluOAIAndMul(SwigluOAIAndMul):
    """gpt-oss: gate and up interleaved, both clamped, (up + 1) * gate * sigmoid(alpha * gate)."""

    def forward_oot(self, x: torch.Tensor) -> torch.Tensor:
        stats.count(FAMILY)
        gate = x[..., ::2].clamp(max=self.limit)
        up = x[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class HpuSwigluStepAndMul(SwigluStepAndMul):
    def forward_oot(self, x: torch.Tensor) -> torch.Tensor:
        stats.count(FAMILY)
        gate, up = _halves(x)
        return F.silu(gate).clamp(max=self.limit) * up.clamp(min=-self.limit, max=self.limit)


class HpuSiluAndMulWithClamp(SiluAndMulWithClamp):
    def forward_oot(self, x: torch.Tensor) -> torch.Tensor:
        stats.count(FAMILY)
        gate, up = _halves(x)
        limit = self.swiglu_limit
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return gate * torch.sigmoid(self.alpha * gate) * (up + self.beta)


class HpuFatreluAndMul(FatreluAndMul):
    def forward_oot(self, x: torch.Tensor) -> torch.Tensor:
        stats.count(FAMILY)
        gate, up = _halves(x)
        return F.threshold(gate, self.threshold, 0.0) * up


class HpuSituAndMul(SituAndMul):
    """Kimi's SituGLU, computed in float32 as vLLM does."""

    def forward_oot(self, x: torch.Tensor) -> torch.Tensor:
        stats.count(FAMILY)
        gate, up = (h.float() for h in _halves(x))
        gate = self.beta * torch.tanh(gate / self.beta) * torch.sigmoid(gate)
        if self.linear_beta is not None:
            up = self.linear_beta * torch.tanh(up / self.linear_beta)
        return (gate * up).to(x.dtype)


class HpuGeluAndMulSparse(GeluAndMulSparse):
    """Gemma 3n: gate values below mean + std * multiplier (per row) are zeroed before GELU."""

    def forward_oot(self, x: torch.Tensor) -> torch.Tensor:
        stats.count(FAMILY)
        gate, up = _halves(x)
        mean = gate.mean(dim=-1, keepdim=True)
        std = gate.std(dim=-1, keepdim=True, unbiased=False)
        gate = F.relu(gate - (mean + std * self.std_multiplier))
        return F.gelu(gate, approximate=self.approximate) * up


REPLACEMENTS: tuple[tuple[type, type], ...] = (
    (SiluAndMul, HpuSiluAndMul),
    (MulAndSilu, HpuMulAndSilu),
    (GeluAndMul, HpuGeluAndMul),
    (SwigluOAIAndMul, HpuSwigluOAIAndMul),
    (SwigluStepAndMul, HpuSwigluStepAndMul),
    (SiluAndMulWithClamp, HpuSiluAndMulWithClamp),
    (FatreluAndMul, HpuFatreluAndMul),
    (SituAndMul, HpuSituAndMul),
    (GeluAndMulSparse, HpuGeluAndMulSparse),
)
