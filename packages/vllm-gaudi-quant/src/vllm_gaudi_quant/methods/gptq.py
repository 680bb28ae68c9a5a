"""GPTQ (4-bit) checkpoints on the HPU platform, as quantization method `gptq_hpu`.

A checkpoint whose `quantization_config` says `"quant_method": "gptq"` is claimed on HPU. GPTQ
packs eight 4-bit values along the input dim K (qweight int32 [K/8, N]) and, in its original
format (`checkpoint_format` "gptq", the default), stores each zero point minus one; "gptq_v2"
stores the zero point itself. After loading, the weights are repacked once along N and the zeros
made real, the layout Gaudi's `convert_from_uint4` reads.

Activation order (`desc_act: true`) is kept: the checkpoint's `g_idx` (the group of each input
row) is loaded, which vLLM's default checkpoint mapper would drop, and passed to the kernel.

MoE layers (Mixtral...): each expert's tensors load stacked per projection (w13 = gate and up,
w2 = down) and are repacked the same way; vLLM's expert loader has no case for `g_idx`, so the
method loads it itself. Gate and up read the same input, so act-order checkpoints give them the
same g_idx; a checkpoint where they differ is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe import RoutedExperts
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

from vllm_gaudi_quant.methods.uint4 import (
    GROUP,
    PACK,
    REPLICATED,
    Uint4Config,
    Uint4Experts,
    Uint4LinearMethod,
    Uint4MoEMethod,
    check_expert_sizes,
    pack_cols,
    per_expert,
    replace_parameter,
    unpack_cols,
    unpack_rows,
)

logger = init_logger(f"vllm.{__name__}")

NAME = "gptq_hpu"
FORMATS = ("gptq", "gptq_v2")


class HpuGptqConfig(Uint4Config, QuantizationConfig):
    """GPTQ 4-bit on HPU (symmetric or not, any group size, with or without act-order)."""

    hpu_name = NAME
    checkpoint_marker = "gptq"

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

    def get_checkpoint_weight_mapper(self) -> WeightsMapper:  # type: ignore[override]
        # vLLM's default drops every `.g_idx`; act-order checkpoints need it.
        return WeightsMapper()

    def get_quant_method(self, layer: Any, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, LinearBase):
            return HpuGptqLinearMethod(self)
        if isinstance(layer, RoutedExperts):
            return HpuGptqMoEMethod(self, layer)
        return None

    def real_zeros(self, zeros: torch.Tensor) -> torch.Tensor:
        """Unpacked checkpoint zero points (0..15) -> the zero points themselves: the original
        format stores zero - 1 in four bits, gptq_v2 the zero point."""
        if self.checkpoint_format != "gptq":
            return zeros
        # A stored 15 would be a zero of 16, which four bits cannot hold.
        if bool((zeros == 15).any()):
            raise ValueError(
                "GPTQ checkpoint stores a zero point of 16 (qzeros nibble 15 in the 'gptq' "
                "format), which 4-bit zero points cannot hold on HPU; re-quantize with "
                "zero points in 1..15 or use checkpoint_format 'gptq_v2'."
            )
        return zeros + 1


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
        zeros = self.quant_config.real_zeros(unpack_cols(layer.qzeros.data))
        replace_parameter(layer, "qzeros", pack_cols(zeros))
        replace_parameter(layer, "scales", layer.scales.data)
        g_idx = layer.g_idx.data
        del layer.g_idx
        if self.quant_config.desc_act:
            # Rows out of group order: the kernel looks each row's group up.
            layer.register_buffer("hpu_g_idx", g_idx.to(torch.int32), persistent=False)


def _g_idx_loader(layer: Any) -> Callable[..., bool | None]:
    """Loads an expert's `g_idx` (vLLM's expert loader has no case for it): w1/w3 into their
    slot of w13_g_idx [E, 2, hidden], w2 into w2_g_idx [E, rows of this rank]."""

    def load(
        param: torch.nn.Parameter,
        loaded_weight: torch.Tensor,
        weight_name: str,
        shard_id: str,
        expert_id: int,
        return_success: bool = False,
    ) -> bool | None:
        local = layer._map_global_expert_id_to_local_expert_id(expert_id)
        if local < 0:  # another rank's expert
            return False if return_success else None
        values = loaded_weight.to(torch.int32)
        if shard_id == "w2":
            rows = param.shape[-1]
            if values.numel() != rows:  # down_proj is row-parallel: this rank's rows
                values = values.narrow(0, layer.moe_config.tp_rank * rows, rows)
            param.data[local].copy_(values)
        elif shard_id in ("w1", "w3"):
            param.data[local, 0 if shard_id == "w1" else 1].copy_(values)
        else:
            raise ValueError(f"GPTQ checkpoint: unexpected expert shard {shard_id!r} for g_idx")
        return True if return_success else None

    load.supports_moe_loading = True  # type: ignore[attr-defined]
    return load


class HpuGptqMoEMethod(Uint4MoEMethod):
    """GPTQ experts: each expert's tensors as GPTQ stores them (qweight [K/8, N] packed along
    K, qzeros [G, N/8], scales [G, N], g_idx [K]), stacked per projection, repacked once."""

    label = "GPTQ"

    def __init__(self, quant_config: HpuGptqConfig, layer: Any) -> None:
        super().__init__(layer)
        self.quant_config = quant_config

    def create_weights(
        self,
        layer: Any,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        cfg = self.quant_config
        group = cfg.group_size
        hidden, inter = hidden_size, intermediate_size_per_partition
        check_expert_sizes(self.label, hidden, inter, group)
        n13 = self.moe.w13_num_shards * inter
        g13 = hidden // group if group != -1 else 1
        # With act-order a rank's rows of w2 may belong to any group, and one group spans all
        # ranks' rows: then every rank keeps all of w2's groups.
        inter_total = self.moe.intermediate_size
        replicate = cfg.desc_act or group == -1
        g2 = (inter_total if replicate else inter) // (group if group != -1 else inter_total)
        # GPTQ stores [K, N]: vLLM's expert loader splits the other dim (is_transposed).
        attrs = {**extra_weight_attrs, "is_transposed": True, "quant_method": GROUP}
        w2_group_attrs = {**attrs, "quant_method": REPLICATED if replicate else GROUP}
        g_idx_attrs = {**extra_weight_attrs, "weight_loader": _g_idx_loader(layer)}
        e, i32 = num_experts, torch.int32
        self.add_parameter(
            layer, "w13_qweight", torch.empty(e, hidden // PACK, n13, dtype=i32), attrs
        )
        self.add_parameter(layer, "w13_qzeros", torch.empty(e, g13, n13 // PACK, dtype=i32), attrs)
        self.add_parameter(layer, "w13_scales", torch.empty(e, g13, n13, dtype=params_dtype), attrs)
        self.add_parameter(layer, "w13_g_idx", torch.zeros(e, 2, hidden, dtype=i32), g_idx_attrs)
        self.add_parameter(
            layer, "w2_qweight", torch.empty(e, inter // PACK, hidden, dtype=i32), attrs
        )
        self.add_parameter(
            layer, "w2_qzeros", torch.empty(e, g2, hidden // PACK, dtype=i32), w2_group_attrs
        )
        self.add_parameter(
            layer, "w2_scales", torch.empty(e, g2, hidden, dtype=params_dtype), w2_group_attrs
        )
        self.add_parameter(layer, "w2_g_idx", torch.zeros(e, inter, dtype=i32), g_idx_attrs)

    def repack(self, layer: Any) -> dict[str, Uint4Experts]:
        cfg = self.quant_config
        packed = {}
        for proj in ("w13", "w2"):
            zeros = per_expert(unpack_cols, getattr(layer, f"{proj}_qzeros").data)
            packed[proj] = Uint4Experts(
                qweight=per_expert(
                    lambda q: pack_cols(unpack_rows(q)), getattr(layer, f"{proj}_qweight").data
                ),
                qzeros=per_expert(pack_cols, cfg.real_zeros(zeros)),
                scales=getattr(layer, f"{proj}_scales").data,
            )
        if cfg.desc_act:
            gate, up = layer.w13_g_idx.data.unbind(1)
            if not torch.equal(gate, up):
                raise ValueError(
                    f"GPTQ checkpoint: MoE layer {layer.layer_name!r} has experts whose gate and "
                    "up projections (w1, w3) order their input rows differently (g_idx); they "
                    "read the same input, so re-quantize them with one activation order."
                )
            packed["w13"].g_idx = gate
            packed["w2"].g_idx = layer.w2_g_idx.data
        return packed
