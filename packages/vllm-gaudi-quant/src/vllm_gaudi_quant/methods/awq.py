"""AWQ (4-bit) checkpoints on the HPU platform, as quantization method `awq_hpu`.

A checkpoint whose `quantization_config` says `"quant_method": "awq"` is claimed on HPU (vLLM
probes registered custom methods before its own), parsed by vLLM's AutoAWQ config, and its linear
weights are repacked once after loading: AWQ interleaves the columns inside each int32 word
(`AWQ_ORDER`); Gaudi's `convert_from_uint4` reads them in plain order. Zero points are stored as
is (AWQ keeps the real zero point), scales [G, N] unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.logger import init_logger
from vllm.model_executor.layers.linear import (
    LinearBase,
    UnquantizedLinearMethod,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.layers.quantization.auto_awq import AutoAWQConfig, BaseAWQLinearMethod
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped

from vllm_gaudi_quant.methods.uint4 import Uint4LinearMethod, awq_to_plain, replace_parameter

logger = init_logger(f"vllm.{__name__}")

NAME = "awq_hpu"


def _claims(hf_quant_cfg: dict[str, Any], user_quant: str | None, marker: str) -> bool:
    """True when the active platform is HPU and the checkpoint says `marker`, unless the user
    asked for a different method."""
    from vllm_gaudi_platform.plugins import hpu_platform_active

    if str(hf_quant_cfg.get("quant_method", "")).lower() != marker:
        return False
    return hpu_platform_active() and user_quant in (None, marker, f"{marker}_hpu")


class HpuAwqConfig(AutoAWQConfig):
    """AWQ on HPU: vLLM's AutoAWQ parsing, Gaudi's 4-bit kernel."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not self.zero_point:
            raise ValueError(
                "AWQ checkpoint with zero_point=false: only AWQ with zero points (the AutoAWQ "
                "GEMM format) runs on HPU; set 'zero_point': true in quantization_config only if "
                "the checkpoint stores qzeros."
            )

    @classmethod
    def get_name(cls) -> str:  # type: ignore[override]
        return NAME

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # a CUDA notion; Gaudi has none

    @classmethod
    def override_quantization_method(  # type: ignore[override]
        cls, hf_quant_cfg: dict[str, Any], user_quant: str | None, hf_config: Any = None
    ) -> str | None:
        return NAME if _claims(hf_quant_cfg, user_quant, "awq") else None

    def get_quant_method(self, layer: Any, prefix: str) -> QuantizeMethodBase | None:
        if not isinstance(layer, LinearBase):
            return None
        if is_layer_skipped(
            prefix,
            self.modules_to_not_convert,
            self.packed_modules_mapping,
            match_mode="substring",
        ):
            return UnquantizedLinearMethod()
        return HpuAwqLinearMethod(self)


# Its parameters are vLLM parameter classes, which shard themselves (weight_loader_v2).
@register_weight_loader_v2_supported_method
class HpuAwqLinearMethod(BaseAWQLinearMethod, Uint4LinearMethod):
    """AWQ linear: vLLM's AWQ parameters, repacked once for `convert_from_uint4`."""

    def process_weights_after_loading(self, layer: Any) -> None:
        replace_parameter(layer, "qweight", awq_to_plain(layer.qweight.data))
        replace_parameter(layer, "qzeros", awq_to_plain(layer.qzeros.data))
        replace_parameter(layer, "scales", layer.scales.data)

    apply = Uint4LinearMethod.apply
