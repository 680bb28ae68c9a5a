"""compressed-tensors MXFP4 linears below the engine: `dequantize_mxfp4` (the quant wheel's,
elementwise, run on every backend) against the test packer's numpy reference for every E2M1 code
and E8M0 scale, and the packer's checkpoint tensors against compressed-tensors' own MXFP4
decompression (so the engine tests' checkpoints are what llm-compressor writes)."""

from __future__ import annotations

import torch

from tests.quant import mxfp4_packer as M

ROWS = 6


def every_code_and_scale() -> tuple[torch.Tensor, torch.Tensor]:
    """Packed bytes holding every pair of codes (256 bytes per row: 512 values, 16 blocks) and a
    row of scales from the smallest E8M0 to the largest finite one."""
    packed = torch.arange(256, dtype=torch.uint8).repeat(ROWS, 1)
    scales = torch.tensor([0, 1, 100, 126, 127, 128, 200, 254], dtype=torch.uint8)
    scales = torch.stack([scales.roll(r).repeat(2) for r in range(ROWS)])
    return packed, scales


def test_every_code_and_scale_dequantizes_as_the_packer_reads_them():
    from vllm_gaudi_quant.methods.ct_mxfp4 import dequantize_mxfp4

    packed, scales = every_code_and_scale()
    ours = dequantize_mxfp4(packed, scales, torch.float32)
    assert torch.equal(ours, M.dequantize(packed, scales))
    # bf16 keeps an E2M1 value times a power of two exactly, while the power is in its range.
    in_range = scales >= 1  # 2 ** -127 is below bf16's smallest normal
    bf16 = dequantize_mxfp4(packed, scales, torch.bfloat16).float().reshape(ROWS, -1, M.BLOCK)
    exact = ours.reshape(ROWS, -1, M.BLOCK)
    assert torch.equal(bf16[in_range], exact[in_range])


def test_an_e8m0_scale_of_255_is_nan():
    from vllm_gaudi_quant.methods.ct_mxfp4 import dequantize_mxfp4

    packed = torch.full((1, 32), 0x22, dtype=torch.uint8)  # 64 values of 1.0
    out = dequantize_mxfp4(packed, torch.tensor([[127, 255]], dtype=torch.uint8), torch.float32)
    assert torch.equal(out[0, :32], torch.ones(32))
    assert out[0, 32:].isnan().all()


def test_the_packer_writes_what_compressed_tensors_decompresses():
    from compressed_tensors.compressors.mx_utils import decompress_mx_scale
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 128, generator=gen) * torch.logspace(-3, 1, 48)[:, None]
    packed, scales = M.quantize(weight)
    values = unpack_fp4_from_uint8(packed, 48, 128, dtype=torch.float32)
    theirs = values.reshape(48, -1, M.BLOCK) * decompress_mx_scale(scales).float()[..., None]
    ours = M.dequantize(packed, scales)
    assert torch.equal(theirs.reshape(48, 128), ours)
    # The scale choice keeps every value within a quarter of its block's largest magnitude.
    blocks = weight.reshape(48, -1, M.BLOCK)
    error = (ours.reshape(48, -1, M.BLOCK) - blocks).abs().amax(-1)
    assert (error <= blocks.abs().amax(-1) / 4 + 1e-12).all()
