"""habana_frameworks.torch.hpex.normalization: FusedRMSNorm."""

from __future__ import annotations

import torch

from habana_frameworks.torch._kernels import _require


class FusedRMSNorm:
    """FusedRMSNorm.apply(x, weight, eps) = x * rsqrt(mean(x^2, last axis) + eps) * weight.

    Facts (bridge: FusedRMSNorm.py, rms_norm_gen.cpp and its tests): the weight is [hidden]; the
    result has x's dtype when the weight has it too, and is float32 when their dtypes differ.
    The bridge checks no rank (Intel's plugin passes 3-D activations)."""

    @staticmethod
    def apply(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        _require(weight.shape == (x.shape[-1],), "FusedRMSNorm: weight must be [hidden]")
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
        return out.to(x.dtype if weight.dtype == x.dtype else torch.float32)
