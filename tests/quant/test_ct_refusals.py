"""compressed-tensors schemes the quant wheel does not run on HPU are refused when the layer is
built, by a ValueError naming the layer, the scheme and what HPU runs (no engine): int8 W8A8 and
weight-only int8, FP4 (NVFP4-style, group 16), MXFP4 weights with FP8 activations, 4-bit weights
with 8-bit activations, FP8 with block or group weight scales, 4-bit with activation reordering by
group, output quantization, and dynamic weight scales. The schemes HPU runs resolve to its own
classes (MXFP4 with MXFP4 activations runs weight-only)."""

from __future__ import annotations

import pytest
from compressed_tensors.quantization import QuantizationArgs

from tests.quant import packers as P

LAYER = "model.layers.0.mlp.down_proj"


def args(**kwargs) -> QuantizationArgs:
    return QuantizationArgs(**kwargs)


INT8_CHANNEL = {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True}
INT8_TOKEN = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}
FP8_TOKEN = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
MXFP4 = {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32}

REFUSED = {
    "int8 W8A8": (args(**INT8_CHANNEL), args(**INT8_TOKEN), None, "int-quantized"),
    "int8 weight-only": (args(**INT8_CHANNEL), None, None, "pack-quantized"),
    "fp4 W4A4 (group 16)": (
        args(num_bits=4, type="float", strategy="tensor_group", group_size=16),
        args(num_bits=4, type="float", strategy="tensor_group", group_size=16, dynamic="local"),
        None,
        "nvfp4-pack-quantized",
    ),
    "mxfp4 W4A8-FP8": (
        args(num_bits=4, type="float", strategy="group", group_size=32),
        args(**FP8_TOKEN),
        None,
        "mxfp4-pack-quantized",
    ),
    "int4 W4A8": (
        args(num_bits=4, type="int", strategy="group", group_size=128, symmetric=True),
        args(**INT8_TOKEN),
        None,
        "pack-quantized",
    ),
    "fp8 block weights": (
        args(num_bits=8, type="float", strategy="block", block_structure=[128, 128]),
        args(num_bits=8, type="float", strategy="group", group_size=128, dynamic=True),
        None,
        "float-quantized",
    ),
    "int4 group act-order": (
        args(num_bits=4, type="int", strategy="group", group_size=128, actorder="group"),
        None,
        None,
        "pack-quantized",
    ),
    "fp8 with output quantization": (
        args(num_bits=8, type="float", strategy="channel"),
        args(**FP8_TOKEN),
        args(num_bits=8, type="float", strategy="tensor"),
        "float-quantized",
    ),
}


@pytest.fixture
def config(emulated):
    from vllm_gaudi_quant.methods.compressed_tensors import HpuCompressedTensorsConfig

    return HpuCompressedTensorsConfig.from_config(P.ct_fp8_config(per_channel=True, dynamic=True))


@pytest.mark.parametrize("scheme", sorted(REFUSED))
def test_a_scheme_hpu_does_not_run_is_refused_naming_the_layer(config, scheme):
    weights, inputs, outputs, fmt = REFUSED[scheme]
    with pytest.raises(ValueError) as raised:
        config._get_scheme_from_parts(weights, inputs, outputs, fmt, LAYER)
    message = str(raised.value)
    assert LAYER in message and "supported on HPU" in message, message
    assert f"{weights.num_bits}-bit" in message, message


@pytest.mark.parametrize(
    ("weights", "inputs", "fmt", "scheme"),
    [
        (args(num_bits=8, type="float", strategy="channel"), args(**FP8_TOKEN), "float-quantized",
         "HpuW8A8Fp8"),
        (args(num_bits=4, type="int", strategy="group", group_size=64, symmetric=False), None,
         "pack-quantized", "HpuWNA16Uint4"),
        (args(**MXFP4), None, "mxfp4-pack-quantized", "HpuMxfp4Linear"),
        (args(**MXFP4), args(**MXFP4, dynamic=True), "mxfp4-pack-quantized", "HpuMxfp4Linear"),
    ],
)  # fmt: skip
def test_the_schemes_hpu_runs_resolve_to_its_classes(config, weights, inputs, fmt, scheme):
    assert type(config._get_scheme_from_parts(weights, inputs, None, fmt, LAYER)).__name__ == scheme
