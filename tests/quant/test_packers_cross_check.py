"""The test packers against the compressed-tensors library's own decompression: the checkpoints
tests/quant/packers.py writes for compressed-tensors (pack-quantized 4-bit, symmetric or not,
group or channel; float-quantized FP8, per tensor or per channel) decompress, through the
library's compressors, to exactly the weights our packers' `dequantize` says (compared in the
library's output dtype: it multiplies in the scales' dtype, float16 for the 4-bit checkpoints).
A packer that wrote the wrong nibble order, offset or zero-point layout would agree with our own
kernels and still be a checkpoint no other tool reads the same way. No engine."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

from tests.quant import packers as P


def _scheme(config: dict) -> QuantizationScheme:
    group = config["config_groups"]["group_0"]
    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**group["weights"]))


def _weight() -> torch.Tensor:
    return torch.randn(64, 128, generator=torch.Generator().manual_seed(5)) * 0.1


@pytest.mark.parametrize(("sym", "group"), [(True, 32), (False, 64), (True, None), (False, None)])
def test_pack_quantized_4bit_decompresses_to_our_dequantized_weights(sym, group):
    w = _weight()
    qt = P.quantize(w, group or w.shape[1], sym=sym)
    packed = P.pack_ct_wna16(qt, sym=sym)
    out = PackedQuantizationCompressor.decompress(
        dict(packed), _scheme(P.ct_wna16_config(group, sym=sym))
    )["weight"]
    ours = P.dequantize(qt)
    assert out.shape == ours.shape
    assert torch.equal(out, ours.to(out.dtype)), (out.float() - ours).abs().max()


@pytest.mark.parametrize("per_channel", [True, False], ids=["channel", "tensor"])
def test_float_quantized_fp8_decompresses_to_our_dequantized_weights(per_channel):
    fw = P.quantize_fp8(_weight(), per_channel=per_channel)
    state = {"weight": fw.weight, "weight_scale": fw.scale}
    config = P.ct_fp8_config(per_channel=per_channel, dynamic=True)
    out = FloatQuantizationCompressor.decompress(state, _scheme(config))["weight"]
    ours = P.dequantize_fp8(fw)
    assert torch.equal(out.float(), ours.to(out.dtype).float()), (out.float() - ours).abs().max()
