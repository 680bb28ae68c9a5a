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

Mixture of experts: expert weights stay FP8 [E, out, in] with their checkpoint scales (one per
output row, or the block scales as loaded); each call dequantizes the local experts (per row with
`cast_from_fp8`, per block tile by tile) and runs the bf16 `mixture_of_experts` kernel (W8A16:
activation scales of MoE layers are not applied). Block-scaled experts are therefore not
requantized: they compute with exactly the checkpoint's weights. This keeps the FP8 memory
footprint but not the FP8 compute; Gaudi's `mixture_of_experts.fp8_fused_weights*` overloads are
the faster path left for later. compressed-tensors W8A8-FP8 experts (per-tensor or per-channel
`weight_scale`) run through the same `HpuFp8MoEMethod`.

On Gaudi 2 the E4M3 range ends at 240, not 448: checkpoint weights are scaled into that range as
they load and their scales scaled back (`seam.fp8_max()`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import Parameter
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase, RoutedExperts
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
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

from vllm_gaudi_platform.runner.routed_experts import capture_routed_experts
from vllm_gaudi_platform.seam import backend

logger = init_logger(f"vllm.{__name__}")

NAME = "fp8"
FP8_DTYPE = torch.float8_e4m3fn
# The E4M3 range checkpoints are written in (448, the OCP/NVIDIA range).
CHECKPOINT_FP8_MAX = 448.0
ACTIVATION_SCHEMES = ("static", "dynamic")
# Smallest per-token scale: an all-zero row would otherwise divide by zero.
_MIN_SCALE = 1e-12


# ----------------------------------------------------------------------------- the forward
def quantize_activations(
    x: torch.Tensor, input_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 x, its dequantization scale) for a 2-D x: with the static `input_scale` (0-d), or
    per token (one scale per row, [M]) when it is None."""
    kernels = backend()
    if input_scale is None:
        amax = x.abs().amax(dim=-1).float() if x.shape[0] else x.new_zeros(0, dtype=torch.float32)
        input_scale = (amax / kernels.fp8_max(FP8_DTYPE)).clamp(min=_MIN_SCALE)
    xq, _ = kernels.cast_to_fp8_v2(x, 1.0 / input_scale, False, False, FP8_DTYPE)
    return xq, input_scale


def apply_fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """y = x @ (weight * weight_scale) + bias with FP8 weights and FP8 activations.

    `weight` FP8 [K, N]; `weight_scale` float32, 0-d (per tensor) or [N] (per output channel);
    `input_scale` a 0-d static activation scale, or None to quantize each token with its own
    scale. `x` is [..., K]; the result is [..., N] in `out_dtype` (default: x's dtype)."""
    out_dtype = out_dtype or x.dtype
    x2 = x.reshape(-1, x.shape[-1])
    xq, x_scale = quantize_activations(x2, input_scale)
    out = backend().fp8_gemm_v2(
        xq, False, weight, False, None, out_dtype, x_scale, weight_scale, bias, False
    )
    return out.reshape(*x.shape[:-1], weight.shape[-1])


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float [..., rows, cols] -> (FP8 same shape, float32 [..., rows] scales), one scale per row
    (per output channel of an [out, in] weight), saturating at the device's FP8 max."""
    kernels = backend()
    amax = w.abs().amax(dim=-1).float()
    scale = (amax / kernels.fp8_max(FP8_DTYPE)).clamp(min=_MIN_SCALE)
    flat = w.reshape(-1, w.shape[-1])
    wq, _ = kernels.cast_to_fp8_v2(flat, 1.0 / scale.reshape(-1), False, False, FP8_DTYPE)
    return wq.reshape(w.shape), scale


def dequantize_blocks(
    w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """FP8 [..., N, K] with block scales [..., ceil(N/bn), ceil(K/bk)] -> float32 [..., N, K]."""
    bn, bk = block
    n, k = w.shape[-2:]
    s = scale_inv.float().repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)
    return w.float() * s[..., :n, :k]


# ----------------------------------------------------------------------------- loading
def _device_range_factor() -> float:
    """Checkpoint FP8 max over the device's (1 on Gaudi 3, 448/240 on Gaudi 2)."""
    return CHECKPOINT_FP8_MAX / backend().fp8_max(FP8_DTYPE)


def _into_device_range(loaded: torch.Tensor) -> torch.Tensor:
    factor = _device_range_factor()
    if factor == 1.0 or loaded.dtype != FP8_DTYPE:
        return loaded
    return (loaded.float() / factor).to(FP8_DTYPE)


def _shard_index(shard_id: Any, shard_count: int) -> int | None:
    """vLLM's shard id of a fused layer (0/1 for gate/up, "q"/"k"/"v") as an index."""
    if shard_id is None:
        return None
    index = {"q": 0, "k": 1, "v": 2}.get(shard_id, shard_id)
    if not isinstance(index, int) or not 0 <= index < shard_count:
        raise ValueError(f"fp8 checkpoint: unexpected shard id {shard_id!r}")
    return index


class _ShardedRows:
    """Where each shard of a (possibly fused, tensor-parallel) linear's output rows lives."""

    def __init__(self, output_partition_sizes: list[int], output_split: bool) -> None:
        self.sizes = list(output_partition_sizes)
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self.output_split = output_split

    def span(self, shard_id: Any) -> tuple[int, int]:
        index = _shard_index(shard_id, len(self.sizes))
        if index is None:
            return 0, sum(self.sizes)
        return self.offsets[index], self.sizes[index]

    def local(self, values: torch.Tensor, size: int, block: int = 1) -> torch.Tensor:
        """This rank's part of a checkpoint vector/matrix along dim 0 (`size` local rows)."""
        if values.shape[0] == size or not self.output_split:
            return values[:size]
        start = get_tensor_model_parallel_rank() * size
        return values.narrow(0, start, size)


def _channel_scale_loader(rows: _ShardedRows):
    """Loads `weight_scale` per tensor (a scalar per shard, spread over its rows) or per channel
    (a vector of the shard's rows) into one float32 scale per output row."""

    def load(param: Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        offset, size = rows.span(shard_id)
        values = loaded_weight.float().reshape(-1) * _device_range_factor()
        target = param.data.narrow(0, offset, size)
        if values.numel() == 1:
            target.fill_(values.item())
        else:
            target.copy_(rows.local(values, size))

    return load


def _input_scale_loader(rows: _ShardedRows):
    """Loads static `input_scale` scalars, one slot per shard (all slots for an unfused one)."""

    def load(param: Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        index = _shard_index(shard_id, len(rows.sizes))
        # In a narrower device range the same activations need a proportionally larger scale.
        value = loaded_weight.float().reshape(-1).max() * _device_range_factor()
        if index is None:
            param.data.fill_(value)
        else:
            param.data[index] = value

    return load


def _block_scale_loader(rows: _ShardedRows, block: tuple[int, int], input_split: bool):
    def load(param: Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        offset, size = rows.span(shard_id)
        bn = block[0]
        if offset % bn or (shard_id is not None and size % bn):
            raise ValueError(
                f"fp8 checkpoint: a fused shard of {size} rows at row {offset} does not align "
                f"with weight_block_size {list(block)}"
            )
        local_rows = -(-size // bn)
        values = rows.local(loaded_weight.float(), local_rows)
        cols = param.shape[1]
        if input_split and values.shape[1] != cols:
            values = values.narrow(1, get_tensor_model_parallel_rank() * cols, cols)
        param.data[offset // bn : offset // bn + local_rows].copy_(values * _device_range_factor())

    return load


def _wrap_weight_loader(loader):
    # vLLM passes the tensor by keyword `loaded_weight` (FusedMoE.load_weights calls
    # `param.weight_loader(param=..., loaded_weight=..., ...)`), so the name must match.
    def load(param: Parameter, loaded_weight: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return loader(param, _into_device_range(loaded_weight), *args, **kwargs)

    return load


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


# ----------------------------------------------------------------------------- MoE
_KERNEL_ACTIVATIONS = {MoEActivation.SILU: "silu", MoEActivation.GELU_TANH: "gelu"}


def route_topk(
    layer: Any, x: torch.Tensor, router_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(router weights float32 [T, k], expert ids int64 [T, k]) as vLLM's plain top-k router
    picks them: softmax scores, top k, renormalized when the layer asks; or the layer's custom
    routing function. Grouped routing and score-correction biases are refused by the method."""
    if layer.custom_routing_function is not None:
        weights, ids = layer.custom_routing_function(
            hidden_states=x,
            gating_output=router_logits,
            topk=layer.top_k,
            renormalize=layer.renormalize,
        )
        return weights.float(), ids.long()
    scores = router_logits.float()
    scores = scores.softmax(dim=-1) if layer.scoring_func == "softmax" else scores.sigmoid()
    weights, ids = scores.topk(layer.top_k, dim=-1)
    if layer.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class HpuFp8MoEMethod(FusedMoEMethodBase):
    """FP8 experts: FP8 storage with per-row or block scales, dequantized per call for the bf16
    kernel.

    The checkpoint's weight scales are `block` scales (`w*_weight_scale_inv`), or `w*_weight_scale`
    per tensor (one per expert and gate/up shard, vLLM's `fp8` format and compressed-tensors'
    `tensor` strategy) or, with `per_channel`, one per output row ([E, rows, 1], compressed-tensors'
    `channel` strategy). `static_input` registers the `w*_input_scale` the checkpoint carries.
    `label` names the checkpoint format in errors."""

    def __init__(
        self,
        layer: Any,
        *,
        block: tuple[int, int] | None = None,
        per_channel: bool = False,
        static_input: bool = False,
        label: str = NAME,
    ) -> None:
        super().__init__(layer.moe_config)
        if block is not None and per_channel:
            raise ValueError(f"{label} MoE: block and per-channel weight scales exclude each other")
        self.block = block
        self.per_channel = per_channel
        self.static_input = static_input
        self.label = label
        moe = layer.moe_config
        problem = None
        if moe.activation not in _KERNEL_ACTIVATIONS:
            problem = f"activation {moe.activation.value!r}"
        elif moe.has_bias:
            problem = "expert biases"
        elif layer.use_grouped_topk or layer.e_score_correction_bias is not None:
            problem = "grouped or bias-corrected routing"
        elif layer.custom_routing_function is None and layer.scoring_func not in (
            "softmax",
            "sigmoid",
        ):
            problem = f"scoring function {layer.scoring_func!r}"
        if problem is not None:
            raise ValueError(
                f"{label} MoE on HPU does not support {problem} yet; this model's FP8 "
                "checkpoint cannot be served by vllm-gaudi-quant."
            )
        self.kernel_activation = _KERNEL_ACTIVATIONS[moe.activation]

    @property
    def is_monolithic(self) -> bool:
        return True

    def get_fused_moe_quant_config(self, layer: Any) -> None:
        # Only vLLM's modular kernels read this; the HPU method runs its own kernel.
        return None

    def create_weights(
        self,
        layer: Any,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        from vllm.model_executor.layers.fused_moe import FusedMoeWeightScaleSupported

        inter = intermediate_size_per_partition
        shards = self.moe.w13_num_shards
        weight_loader = extra_weight_attrs.pop("weight_loader")
        attrs = {**extra_weight_attrs, "weight_loader": _wrap_weight_loader(weight_loader)}
        for name, shape in (
            ("w13_weight", (num_experts, shards * inter, hidden_size)),
            ("w2_weight", (num_experts, hidden_size, inter)),
        ):
            param = Parameter(torch.empty(shape, dtype=FP8_DTYPE), requires_grad=False)
            layer.register_parameter(name, param)
            set_weight_attrs(param, attrs)

        scale_loader = _moe_scale_loader(weight_loader)
        if self.per_channel:
            # One scale per output row of each expert, as compressed-tensors stores them.
            kind = FusedMoeWeightScaleSupported.CHANNEL.value
            w13_scale = torch.ones(num_experts, shards * inter, 1)
            w2_scale = torch.ones(num_experts, hidden_size, 1)
            suffix = "weight_scale"
        elif self.block is None:
            kind = FusedMoeWeightScaleSupported.TENSOR.value
            w13_scale = torch.ones(num_experts, shards)
            w2_scale = torch.ones(num_experts)
            suffix = "weight_scale"
        else:
            bn, bk = self.block
            if inter % bn or hidden_size % bn:
                raise ValueError(
                    f"{self.label} MoE checkpoint: weight_block_size {list(self.block)} does not "
                    f"divide the expert sizes (intermediate {inter}, hidden {hidden_size})."
                )
            kind = FusedMoeWeightScaleSupported.BLOCK.value
            w13_scale = torch.ones(num_experts, shards * inter // bn, -(-hidden_size // bk))
            w2_scale = torch.ones(num_experts, hidden_size // bn, -(-inter // bk))
            suffix = "weight_scale_inv"
        for name, data in ((f"w13_{suffix}", w13_scale), (f"w2_{suffix}", w2_scale)):
            param = Parameter(data, requires_grad=False)
            layer.register_parameter(name, param)
            set_weight_attrs(
                param, {**extra_weight_attrs, "quant_method": kind, "weight_loader": scale_loader}
            )
        # Static activation scales load (checkpoints carry them) but the bf16 kernel does not
        # use them: see the module docstring.
        if self.static_input:
            for name in ("w13_input_scale", "w2_input_scale"):
                param = Parameter(torch.ones(num_experts), requires_grad=False)
                layer.register_parameter(name, param)
                set_weight_attrs(param, {**extra_weight_attrs, "weight_loader": weight_loader})

    def process_weights_after_loading(self, layer: Any) -> None:
        if self.block is not None:
            # Block scales stay as loaded ([E, rows / bn, cols / bk], already in the device's
            # range): each call dequantizes tile by tile, exactly the checkpoint's weights.
            return
        w13, w2 = layer.w13_weight.data, layer.w2_weight.data
        if self.per_channel:
            # [E, rows, 1] -> [E, rows]: already one scale per row.
            w13_scale = layer.w13_weight_scale.data.reshape(w13.shape[0], -1)
            w2_scale = layer.w2_weight_scale.data.reshape(w2.shape[0], -1)
        else:
            # Per-tensor scales per expert (and per gate/up shard) spread over the rows.
            inter = w13.shape[1] // layer.w13_weight_scale.shape[1]
            w13_scale = layer.w13_weight_scale.data.repeat_interleave(inter, dim=1)
            w2_scale = layer.w2_weight_scale.data[:, None].expand(-1, w2.shape[1]).contiguous()
        del layer.w13_weight_scale, layer.w2_weight_scale
        layer.w13_weight_scale = Parameter(w13_scale.float(), requires_grad=False)
        layer.w2_weight_scale = Parameter(w2_scale.float(), requires_grad=False)

    def _dequantized(self, layer: Any, name: str, dtype: torch.dtype) -> list[torch.Tensor]:
        """The local experts' `name` weights ("w13" or "w2") as float `dtype`, one per expert."""
        weight = getattr(layer, f"{name}_weight")
        if self.block is not None:
            scale = getattr(layer, f"{name}_weight_scale_inv")
            return list(dequantize_blocks(weight, scale, self.block).to(dtype).unbind(0))
        kernels = backend()
        scale = getattr(layer, f"{name}_weight_scale")
        return [
            kernels.cast_from_fp8(w, s, dtype) for w, s in zip(weight.unbind(0), scale.unbind(0))
        ]

    def apply_monolithic(
        self,
        layer: Any,
        x: torch.Tensor,
        router_logits: torch.Tensor,
        input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        weights, ids = route_topk(layer, x, router_logits)
        capture_routed_experts(layer, ids)
        dtype = x.dtype
        w13 = self._dequantized(layer, "w13", dtype)
        w2 = self._dequantized(layer, "w2", dtype)
        first = layer.moe_config.ep_rank * layer.local_num_experts
        return backend().mixture_of_experts(
            x,
            ids,
            weights.to(dtype),
            w13,
            w2,
            True,
            self.kernel_activation,
            first,
            first + layer.local_num_experts - 1,
        )

    def apply(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError("HpuFp8MoEMethod is monolithic: vLLM calls apply_monolithic")


def _moe_scale_loader(weight_loader):
    """vLLM's expert weight loader for scales, with checkpoint scales brought into the device's
    FP8 range (the weights were divided by the same factor)."""

    def load(param: Parameter, loaded_weight: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        scaled = loaded_weight.float() * _device_range_factor()
        return weight_loader(param, scaled, *args, **kwargs)

    return load


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
