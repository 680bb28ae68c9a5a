"""The `vllm.general_plugins` entry points of the quantization methods, one attribute per method
(the same shape as `vllm_gaudi_ops.register` and `vllm_gaudi_connectors.register`).

The entry point `hpu_quant_<method> = "vllm_gaudi_quant.register:<method>"` loads
`vllm_gaudi_quant.register.<method>`: a register function built on first access from `METHODS`,
which registers the method's config class with vLLM's quantization registry under the method's
vLLM name. Loading an entry point imports neither torch nor vLLM (vLLM loads every general plugin
in every process, whatever the platform); the method's module (`vllm_gaudi_quant.methods.<...>`,
torch and vLLM freely) is imported only when the register function runs on HPU. Each registers
only its own name, so the order against the other methods does not matter.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import NamedTuple

from vllm_gaudi_platform.plugins import general_plugin, require

ENTRY_POINT_PREFIX = "hpu_quant_"


class Method(NamedTuple):
    name: str  # the name vLLM's registry and checkpoints know it by
    config: str  # "module:Class" of its QuantizationConfig
    summary: str
    # An optional package it needs: (distribution, import name, the extra that installs it)
    requires: tuple[str, str, str] | None = None


M = "vllm_gaudi_quant.methods"
METHODS: dict[str, Method] = {
    "inc": Method(
        "inc",
        f"{M}.inc:HpuIncConfig",
        "INC FP8 with neural-compressor",
        ("neural-compressor-pt", "neural_compressor", "vllm-gaudi-quant[inc]"),
    ),
    "fp8": Method("fp8", f"{M}.fp8:HpuFp8Config", "FP8 checkpoints, per tensor, channel or block"),
    "awq": Method("awq_hpu", f"{M}.awq:HpuAwqConfig", "AWQ 4-bit checkpoints"),
    "gptq": Method("gptq_hpu", f"{M}.gptq:HpuGptqConfig", "GPTQ 4-bit checkpoints"),
    "compressed_tensors": Method(
        "compressed-tensors",
        f"{M}.compressed_tensors:HpuCompressedTensorsConfig",
        "compressed-tensors: W8A8-FP8, 4-bit WNA16 and MXFP4 schemes",
    ),
    "mxfp4": Method("gpt_oss_mxfp4", f"{M}.mxfp4:HpuGptOssMxfp4Config", "gpt-oss MXFP4 experts"),
}

_built: dict[str, Callable[[], None]] = {}


def _plugin(method: str, spec: Method) -> Callable[[], None]:
    def register() -> None:
        if spec.requires is not None:
            require(*spec.requires)
        from vllm.model_executor.layers.quantization import register_quantization_config

        module, _, cls = spec.config.partition(":")
        register_quantization_config(spec.name)(getattr(importlib.import_module(module), cls))

    entry_point = ENTRY_POINT_PREFIX + method
    register.__name__ = register.__qualname__ = entry_point
    register.__module__ = __name__
    register.__doc__ = (
        f"{entry_point}: register `{spec.name}` ({spec.summary}) with vLLM's quantization "
        "registry. Does nothing off HPU; idempotent."
    )
    return general_plugin(entry_point)(register)


def __getattr__(method: str) -> Callable[[], None]:
    """The register function of `method` (PEP 562: `register.fp8`, `register.inc`, ...)."""
    if method in _built:
        return _built[method]
    if method not in METHODS:
        raise AttributeError(
            f"no quantization method {method!r}: the entry point {ENTRY_POINT_PREFIX}{method} "
            f"needs an entry in {__name__}.METHODS ({', '.join(METHODS)}); fix the entry "
            "point's value in the wheel's pyproject or add the method"
        )
    _built[method] = _plugin(method, METHODS[method])
    return _built[method]
