"""GPTQ (4-bit) checkpoints on the HPU platform, as quantization method `gptq_hpu`.

A checkpoint whose `quantization_config` says `"quant_method": "gptq"` is claimed on HPU. GPTQ
packs eight 4-bit values along the input dim K (qweight int32 [K/8, N]) and, in its original
format (`checkpoint_format` "gptq", the default), stores each zero point minus one; "gptq_v2"
stores the zero point itself. After loading, the weights are repacked once along N and the zeros
made real, the layout Gaudi's `convert_from_uint4` reads.

Activation order (`desc_act: true`) is kept: the checkpoint's `g_idx` (the group of each input
row) is loaded, which vLLM's default checkpoint mapper would drop, and passed to the kernel.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.logger import init_logger
from vllm.model_executor.layers.linear import (
    LinearBase,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.layers.quantization.base_config import (
    QuantizationConfig,
    QuantizeMethodBase,
)
from vllm.model_executor.models.utils import WeightsMapper
from vllm.model_executor.parameter import (
    ChannelQuantScaleParameter,
    GroupQuantScaleParameter,
    PackedColumnParameter,
    PackedvLLMParameter,
    RowvLLMParameter,
)

from vllm_gaudi_quant.methods.awq import _claims
from vllm_gaudi_quant.methods.uint4 import (
    PACK,
    Uint4LinearMethod,
    pack_cols,
    replace_parameter,
    unpack_cols,
    unpack_rows,
)

logger = init_logger(f"vllm.{__name__}")

NAME = "gptq_hpu"
FORMATS = ("gptq", "gptq_v2")


class HpuGptqConfig(QuantizationConfig):
    """GPTQ 4-bit on HPU (symmetric or not, any group size, with or without act-order)."""

    def __init__(
        self,
        group_size: int,
        desc_act: bool,
        checkpoint_format: str = "gptq",
        lm_head_quantized: bool = False,
    ) -> None:
        super().__init__()
        self.group_size = group_size
        self.desc_act = desc_act
        self.checkpoint_format = checkpoint_format
        self.lm_head_quantized = lm_head_quantized

    def __repr__(self) -> str:
        return (
            f"HpuGptqConfig(group_size={self.group_size}, desc_act={self.desc_act}, "
            f"checkpoint_format={self.checkpoint_format!r})"
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
    def get_config_filenames(cls) -> list[str]:
        return ["quantize_config.json"]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> HpuGptqConfig:
        bits = cls.get_from_keys(config, ["bits"])
        if bits != 4:
            raise ValueError(
                f"GPTQ checkpoint with bits={bits}: only 4-bit GPTQ runs on HPU "
                "(quantization_config 'bits' must be 4)."
            )
        fmt = cls.get_from_keys_or(config, ["checkpoint_format"], "gptq") or "gptq"
        if fmt not in FORMATS:
            raise ValueError(
                f"GPTQ checkpoint_format={fmt!r} is not supported on HPU; use one of {FORMATS}."
            )
        if cls.get_from_keys_or(config, ["dynamic"], None):
            raise ValueError(
                "GPTQ checkpoint with per-module 'dynamic' rules: not supported on HPU; "
                "quantize every module with the same settings."
            )
        if cls.get_from_keys_or(config, ["lm_head"], False):
            raise ValueError(
                "GPTQ checkpoint with a quantized lm_head ('lm_head': true): not supported on "
                "HPU; keep lm_head in float."
            )
        return cls(
            group_size=cls.get_from_keys(config, ["group_size"]),
            desc_act=bool(cls.get_from_keys_or(config, ["desc_act"], False)),
            checkpoint_format=fmt,
        )

    @classmethod
    def override_quantization_method(  # type: ignore[override]
        cls, hf_quant_cfg: dict[str, Any], user_quant: str | None, hf_config: Any = None
    ) -> str | None:
        return NAME if _claims(hf_quant_cfg, user_quant, "gptq") else None

    def get_checkpoint_weight_mapper(self) -> WeightsMapper:  # type: ignore[override]
        # vLLM's default drops every `.g_idx`; act-order checkpoints need it.
        return WeightsMapper()

    def get_quant_method(self, layer: Any, prefix: str) -> QuantizeMethodBase | None:
        if not isinstance(layer, LinearBase):
            return None
        return HpuGptqLinearMethod(self)


# Its parameters are vLLM parameter classes, which shard themselves (weight_loader_v2).
@register_weight_loader_v2_supported_method
class HpuGptqLinearMethod(Uint4LinearMethod):
    """GPTQ linear: the checkpoint's parameters, repacked once for `convert_from_uint4`."""

    def __init__(self, quant_config: HpuGptqConfig) -> None:
        self.quant_config = quant_config

    def create_weights(
        self,
        layer: Any,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        cfg = self.quant_config
        n = sum(output_partition_sizes)
        group_size = cfg.group_size if cfg.group_size != -1 else input_size
        if input_size_per_partition % group_size or input_size_per_partition % PACK:
            raise ValueError(
                f"GPTQ layer input size {input_size_per_partition} is not a multiple of the "
                f"group size {group_size} and of {PACK}: lower the tensor parallel size."
            )
        if n % PACK:
            raise ValueError(
                f"GPTQ layer output size {n} is not a multiple of {PACK}: lower the tensor "
                "parallel size."
            )
        loader = extra_weight_attrs.get("weight_loader")
        row_parallel = input_size != input_size_per_partition
        # With act-order a rank's rows may belong to any group, and with one group a row-parallel
        # shard still needs the whole group: those ranks keep every group's scales and zeros.
        replicate = row_parallel and (cfg.desc_act or cfg.group_size == -1)
        groups = (input_size if replicate else input_size_per_partition) // group_size

        layer.register_parameter(
            "qweight",
            PackedvLLMParameter(
                data=torch.empty(input_size_per_partition // PACK, n, dtype=torch.int32),
                input_dim=0,
                output_dim=1,
                packed_dim=0,
                packed_factor=PACK,
                weight_loader=loader,
            ),
        )
        layer.register_parameter(
            "g_idx",
            RowvLLMParameter(
                data=torch.empty(input_size_per_partition, dtype=torch.int32),
                input_dim=0,
                weight_loader=loader,
            ),
        )
        zeros = torch.empty(groups, n // PACK, dtype=torch.int32)
        scales = torch.empty(groups, n, dtype=params_dtype)
        if replicate:
            layer.register_parameter(
                "qzeros",
                PackedColumnParameter(
                    data=zeros, output_dim=1, packed_dim=1, packed_factor=PACK, weight_loader=loader
                ),
            )
            layer.register_parameter(
                "scales",
                ChannelQuantScaleParameter(data=scales, output_dim=1, weight_loader=loader),
            )
        else:
            layer.register_parameter(
                "qzeros",
                PackedvLLMParameter(
                    data=zeros,
                    input_dim=0,
                    output_dim=1,
                    packed_dim=1,
                    packed_factor=PACK,
                    weight_loader=loader,
                ),
            )
            layer.register_parameter(
                "scales",
                GroupQuantScaleParameter(
                    data=scales, input_dim=0, output_dim=1, weight_loader=loader
                ),
            )

    def process_weights_after_loading(self, layer: Any) -> None:
        replace_parameter(layer, "qweight", pack_cols(unpack_rows(layer.qweight.data)))
        zeros = unpack_cols(layer.qzeros.data)
        if self.quant_config.checkpoint_format == "gptq":
            # The original format stores zero - 1 in four bits; a stored 15 would be a zero of
            # 16, which four bits cannot hold.
            if bool((zeros == 15).any()):
                raise ValueError(
                    "GPTQ checkpoint stores a zero point of 16 (qzeros nibble 15 in the 'gptq' "
                    "format), which 4-bit zero points cannot hold on HPU; re-quantize with "
                    "zero points in 1..15 or use checkpoint_format 'gptq_v2'."
                )
            zeros = zeros + 1
        replace_parameter(layer, "qzeros", pack_cols(zeros))
        replace_parameter(layer, "scales", layer.scales.data)
        g_idx = layer.g_idx.data
        del layer.g_idx
        if self.quant_config.desc_act:
            # Rows out of group order: the kernel looks each row's group up.
            layer.register_buffer("hpu_g_idx", g_idx.to(torch.int32), persistent=False)
