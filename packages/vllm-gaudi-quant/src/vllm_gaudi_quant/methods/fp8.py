"""vLLM's `fp8` checkpoint format on HPU: FP8 weights through Gaudi's FP8 GEMM.

Checkpoint format (`quantization_config`): `{"quant_method": "fp8", "activation_scheme":
"static" | "dynamic", "weight_block_size": [bn, bk] (optional), "ignored_layers": [...]}`. Each
quantized linear has an FP8 E4M3 `weight` [N, K] and either

- `weight_scale`: one scale per tensor (per shard of a fused layer: q/k/v, gate/up) or one per
  output channel ([N] or [N, 1]); the loader accepts both and keeps one scale per output channel,
  which needs no requantization of fused shards (Gaudi's GEMM takes per-channel weight scales);
- `weight_scale_inv` [ceil(N/bn), ceil(K/bk)] with `weight_block_size`: block scales. Gaudi has
  no block-scaled GEMM, so the weight is dequantized block by block ONCE at load and requantized
  per output channel, staying FP8 (one extra rounding; what Gaudi's own plugin does under
  VLLM_HPU_FORCE_CHANNEL_FP8);

and with `activation_scheme: static` an `input_scale` (per shard; the largest is used).
Dynamic activations are quantized per token (one scale per row) at each call.

After loading, a linear holds `weight` FP8 [K, N], `weight_scale` float32 [N] and `input_scale`
(0-d float32, or None for dynamic); `apply_fp8_linear` is the forward, reusable by any method
with FP8 weights (compressed-tensors W8A8-FP8).

Layout: this module holds the config (`HpuFp8Config`) and the linear method (`HpuFp8LinearMethod`);
`fp8_linear.py` the FP8 forward and weight conversions, `fp8_checkpoint.py` the loading (and the
Gaudi 2 range), `fp8_moe.py` the experts (`HpuFp8MoEMethod`). The names other modules import from
here are re-exported.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import Parameter
from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.linear import (
    LinearBase,
    LinearMethodBase,
    UnquantizedLinearMethod,
)
from vllm.model_executor.layers.quantization.base_config import (
    QuantizationConfig,
    QuantizeMethodBase,
)
from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped
from vllm.model_executor.utils import set_weight_attrs

# `name as name` marks a re-export for this module's importers: CHECKPOINT_FP8_MAX
# (benchmarks/quant.py), route_topk (uint4.py), _device_range_factor (compressed_tensors.py).
from vllm_gaudi_quant.methods.fp8_checkpoint import CHECKPOINT_FP8_MAX as CHECKPOINT_FP8_MAX
from vllm_gaudi_quant.methods.fp8_checkpoint import (
    NAME,
    _block_scale_loader,
    _channel_scale_loader,
    _input_scale_loader,
    _ShardedRows,
    _wrap_weight_loader,
)
from vllm_gaudi_quant.methods.fp8_checkpoint import _device_range_factor as _device_range_factor
from vllm_gaudi_quant.methods.fp8_linear import (
    FP8_DTYPE,
    apply_fp8_linear,
    dequantize_blocks,
    quantize_activations,
    quantize_per_channel,
)
from vllm_gaudi_quant.methods.fp8_moe import HpuFp8MoEMethod
from vllm_gaudi_quant.methods.fp8_moe import route_topk as route_topk

logger = init_logger(f"vllm.{__name__}")

ACTIVATION_SCHEMES = ("static", "dynamic")


# ----------------------------------------------------------------------------- config
class HpuFp8Config(QuantizationConfig):
    """vLLM's `fp8` checkpoints (per-tensor, per-channel and block weight scales; static or
    dynamic activations) on the HPU platform."""

    def __init__(
        self,
        activation_scheme: str = "dynamic",
        ignored_layers: list[str] | None = None,
        weight_block_size: list[int] | None = None,
    ) -> None:
        super().__init__()
        if activation_scheme not in ACTIVATION_SCHEMES:
            raise ValueError(
                f"fp8 quantization_config: activation_scheme {activation_scheme!r} is not one "
                f"of {', '.join(ACTIVATION_SCHEMES)}; fix the checkpoint's config.json."
            )
        if weight_block_size is not None:
            if len(weight_block_size) != 2 or min(weight_block_size) <= 0:
                raise ValueError(
                    f"fp8 quantization_config: weight_block_size {weight_block_size!r} must be "
                    "two positive integers [block_n, block_k]; fix the checkpoint's config.json."
                )
            if activation_scheme != "dynamic":
                raise ValueError(
                    "fp8 quantization_config: block-scaled weights (weight_block_size) come with "
                    "activation_scheme 'dynamic'; this checkpoint says 'static'."
                )
        self.activation_scheme = activation_scheme
        self.ignored_layers = ignored_layers or []
        self.weight_block_size: tuple[int, int] | None = (
            (int(weight_block_size[0]), int(weight_block_size[1])) if weight_block_size else None
        )

    def __repr__(self) -> str:
        return (
            f"HpuFp8Config(activation_scheme={self.activation_scheme!r}, "
            f"weight_block_size={self.weight_block_size}, ignored_layers={self.ignored_layers})"
        )

    @classmethod
    def get_name(cls) -> str:
        return NAME

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        # A CUDA notion; vLLM only checks it on CUDA-alike platforms.
        return -1

    @classmethod
    def get_config_filenames(cls) -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> HpuFp8Config:
        quant_method = cls.get_from_keys(config, ["quant_method"])
        if "fp8" not in str(quant_method):
            # vLLM's Fp8Config used to quantize float checkpoints online under this name;
            # online quantization is `--quantization fp8_per_tensor` in vLLM 0.32.
            raise ValueError(
                f"--quantization fp8 needs an FP8 checkpoint; this one is {quant_method!r}."
            )
        ignored = cls.get_from_keys_or(config, ["ignored_layers"], None) or cls.get_from_keys_or(
            config, ["modules_to_not_convert"], None
        )
        return cls(
            activation_scheme=cls.get_from_keys_or(config, ["activation_scheme"], "dynamic"),
            ignored_layers=ignored,
            weight_block_size=cls.get_from_keys_or(config, ["weight_block_size"], None),
        )

    def apply_vllm_mapper(self, hf_to_vllm_mapper: Any) -> None:
        if self.ignored_layers:
            self.ignored_layers = hf_to_vllm_mapper.apply_list(self.ignored_layers)

    def get_quant_method(self, layer: Any, prefix: str) -> QuantizeMethodBase | None:
        skipped = is_layer_skipped(
            prefix=prefix,
            ignored_layers=self.ignored_layers,
            fused_mapping=self.packed_modules_mapping,
        )
        if isinstance(layer, LinearBase):
            return UnquantizedLinearMethod() if skipped else HpuFp8LinearMethod(self)
        if isinstance(layer, RoutedExperts):
            if skipped:
                from vllm.model_executor.layers.fused_moe import UnquantizedFusedMoEMethod

                return UnquantizedFusedMoEMethod(layer.moe_config)
            return HpuFp8MoEMethod(
                layer,
                block=self.weight_block_size,
                static_input=self.activation_scheme == "static",
            )
        return None


# ----------------------------------------------------------------------------- linear
class HpuFp8LinearMethod(LinearMethodBase):
    """FP8 linear: weights FP8 [K, N] with per-channel scales, activations quantized with
    `cast_to_fp8_v2` (static or per token), matmul through `fp8_gemm_v2`."""

    def __init__(self, quant_config: HpuFp8Config) -> None:
        self.quant_config = quant_config
        self.block = quant_config.weight_block_size
        self.static = quant_config.activation_scheme == "static"

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
        rows = sum(output_partition_sizes)
        layer.logical_widths = output_partition_sizes
        layer.orig_dtype = params_dtype
        shards = _ShardedRows(output_partition_sizes, output_split=rows != output_size)
        weight_loader = extra_weight_attrs.pop("weight_loader")
        # The layer's own loader of checkpoint-layout weights: an in-place update stages a
        # trainer's high-precision weights through it (hpu_stage_weight_update).
        layer.hpu_checkpoint_weight_loader = weight_loader

        weight = Parameter(
            torch.empty(rows, input_size_per_partition, dtype=FP8_DTYPE), requires_grad=False
        )
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0, **extra_weight_attrs})
        set_weight_attrs(weight, {"weight_loader": _wrap_weight_loader(weight_loader)})
        layer.register_parameter("weight", weight)

        if self.block is None:
            scale = Parameter(torch.ones(rows, dtype=torch.float32), requires_grad=False)
            set_weight_attrs(scale, {"weight_loader": _channel_scale_loader(shards)})
            layer.register_parameter("weight_scale", scale)
        else:
            bn, bk = self.block
            scale = Parameter(
                torch.ones(-(-rows // bn), -(-input_size_per_partition // bk)),
                requires_grad=False,
            )
            loader = _block_scale_loader(
                shards, self.block, input_split=input_size_per_partition != input_size
            )
            set_weight_attrs(scale, {"weight_loader": loader})
            layer.register_parameter("weight_scale_inv", scale)

        if self.static:
            input_scale = Parameter(
                torch.full((len(output_partition_sizes),), float("nan")), requires_grad=False
            )
            set_weight_attrs(input_scale, {"weight_loader": _input_scale_loader(shards)})
            layer.register_parameter("input_scale", input_scale)

    def process_weights_after_loading(self, layer: Any) -> None:
        if self.block is not None:
            weight = dequantize_blocks(layer.weight.data, layer.weight_scale_inv.data, self.block)
            wq, scale = quantize_per_channel(weight)
            del layer.weight_scale_inv
            layer.weight = Parameter(wq.t().contiguous(), requires_grad=False)
            layer.weight_scale = Parameter(scale, requires_grad=False)
        else:
            # [N, K] -> [K, N]: the layout fp8_gemm_v2 takes with trans_B=False.
            layer.weight = Parameter(layer.weight.data.t().contiguous(), requires_grad=False)
        if self.static:
            scales = layer.input_scale.data
            if torch.isnan(scales).any():
                raise ValueError(
                    "fp8 checkpoint with activation_scheme 'static' has no input_scale for a "
                    "layer; re-export it with activation scales or use 'dynamic'."
                )
            layer.input_scale = Parameter(scales.max(), requires_grad=False)
        else:
            layer.input_scale = None

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return apply_fp8_linear(x, layer.weight, layer.weight_scale, layer.input_scale, bias)

    # ------------------------------------------------------------ in-place weight updates
    def hpu_stage_weight_update(self, layer: Any) -> Parameter:
        """The layer's current weight, dequantized into the checkpoint's layout [N, K] and the
        model's dtype on the host, loadable with the layer's checkpoint loader: a round that
        writes only some shards of a fused layer keeps the others' values (re-quantizing a
        per-channel FP8 row gives the same row back)."""
        weight = layer.weight.data.t().float() * layer.weight_scale.data.reshape(-1, 1)
        staged = Parameter(weight.to(layer.orig_dtype).cpu(), requires_grad=False)
        set_weight_attrs(
            staged,
            {
                "input_dim": 1,
                "output_dim": 0,
                "weight_loader": layer.hpu_checkpoint_weight_loader,
            },
        )
        return staged

    def hpu_commit_weight_update(self, layer: Any, staged: Parameter) -> None:
        """Quantize the staged weight as loading left the layer (FP8 per output channel with
        the device's range, whatever the checkpoint's scale layout: per-tensor and block
        checkpoints are per-channel after loading too) and write the FP8 weight [K, N] and its
        scales [N] into the layer's storage. Static input scales stay as calibrated."""
        weight = staged.data.to(layer.weight.device).float()
        wq, scale = quantize_per_channel(weight)
        layer.weight.data.copy_(wq.t())
        layer.weight_scale.data.copy_(scale)


__all__ = [
    "NAME",
    "HpuFp8Config",
    "HpuFp8LinearMethod",
    "HpuFp8MoEMethod",
    "apply_fp8_linear",
    "quantize_activations",
    "quantize_per_channel",
    "dequantize_blocks",
]
