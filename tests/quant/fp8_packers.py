"""Test-side FP8 quantizers for vLLM's `fp8` checkpoint format, written from the format's
definition and independent of the code under test.

A float weight [N, K] becomes E4M3 values and scales such that weight ~= fp8 * scale:
- "tensor": one float32 scale (0-d), amax / 448;
- "channel": one scale per output row, [N, 1];
- "block": one scale per [bn, bk] tile, `weight_scale_inv` [ceil(N/bn), ceil(K/bk)].
`dequantize` gives the float weight the quantized layer must behave like.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # checkpoints use the OCP E4M3 range whatever Gaudi reads them
SCHEMES = ("tensor", "channel", "block")


def _to_fp8(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def _tile(scale: torch.Tensor, block: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    bn, bk = block
    full = scale.repeat_interleave(bn, dim=0).repeat_interleave(bk, dim=1)
    return full[: shape[0], : shape[1]]


def quantize(
    weight: torch.Tensor, scheme: str, block: tuple[int, int] | None = None
) -> dict[str, torch.Tensor]:
    """Checkpoint tensors (`weight` plus `weight_scale` or `weight_scale_inv`) of one weight."""
    w = weight.detach().float()
    if scheme == "tensor":
        scale = (w.abs().max() / FP8_MAX).reshape(())
        return {"weight": _to_fp8(w, scale), "weight_scale": scale}
    if scheme == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
        return {"weight": _to_fp8(w, scale), "weight_scale": scale}
    if scheme == "block":
        assert block is not None
        bn, bk = block
        n, k = w.shape
        tiles = torch.nn.functional.pad(w, (0, -k % bk, 0, -n % bn)).abs()
        amax = tiles.reshape(-(-n // bn), bn, -(-k // bk), bk).amax(dim=(1, 3))
        scale = (amax / FP8_MAX).clamp(min=1e-12)
        return {"weight": _to_fp8(w, _tile(scale, block, w.shape)), "weight_scale_inv": scale}
    raise ValueError(f"unknown scheme {scheme!r}; one of {SCHEMES}")


def dequantize(tensors: dict[str, torch.Tensor], block: tuple[int, int] | None = None):
    """The float32 weight [N, K] the checkpoint tensors stand for."""
    q = tensors["weight"].float()
    if "weight_scale_inv" in tensors:
        assert block is not None
        return q * _tile(tensors["weight_scale_inv"], block, q.shape)
    scale = tensors["weight_scale"]
    return q * (scale if scale.dim() == 0 else scale.reshape(-1, 1))


def fp8_config(activation_scheme: str, block: tuple[int, int] | None = None) -> dict:
    """The checkpoint's `quantization_config`."""
    config = {"quant_method": "fp8", "activation_scheme": activation_scheme}
    if block is not None:
        config["weight_block_size"] = list(block)
    return config


def input_scale(amax: float) -> torch.Tensor:
    """A static activation scale covering activations up to `amax`."""
    return torch.tensor(amax / FP8_MAX, dtype=torch.float32)
