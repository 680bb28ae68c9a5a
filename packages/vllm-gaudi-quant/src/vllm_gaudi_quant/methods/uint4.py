"""4-bit weights on the HPU platform: repacking checkpoints into Gaudi's layout, and the linear.

Gaudi dequantizes 4-bit weights with one kernel, `convert_from_uint4` (reached through the seam):
qweight int32 [K, N/8] packed along the output dim N in plain nibble order (nibble i of word j is
column 8j+i), zero points packed the same way and holding the zero point itself, scales [G, N].
Every 4-bit format (AWQ, GPTQ, compressed-tensors pack-quantized) is rewritten into that layout
once, after loading; the forward pass dequantizes to the activation dtype and runs one matmul,
as Gaudi's own plugin does.

Mixture of experts (`Uint4MoEMethod`): the experts' weights are repacked the same way, one
[K, N/8] matrix per expert and projection (w13: gate and up fused, gate columns first, K = hidden;
w2: down, K = intermediate). Each call dequantizes the local experts with `convert_from_uint4`
and runs the bf16 `mixture_of_experts` kernel: the 4-bit memory footprint, not 4-bit compute,
which is what Gaudi's plugin does for 4-bit MoE.

`Uint4Config` holds what the AWQ and GPTQ configs share: their name, the activation dtypes and
claiming checkpoints of their format on the HPU platform.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase, FusedMoeWeightScaleSupported
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.linear import LinearMethodBase
from vllm.model_executor.utils import set_weight_attrs

from vllm_gaudi_platform import seam
from vllm_gaudi_platform.worker.routed_experts import (
    ExpertSelection,
    dequantized_gather_cost,
    gather_max_tokens,
    select_experts,
)

PACK = 8  # 4-bit values per int32 word
# AWQ's GEMM checkpoints interleave columns inside a word: nibble i holds column 8j + AWQ_ORDER[i].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_SHIFTS = tuple(range(0, 32, 4))


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2**32) -> the int32 with the same bits (no reliance on wrap-on-cast)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_cols(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C/8] packed along columns in plain nibble order -> int32 [R, C] in 0..15."""
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).reshape(packed.shape[0], -1)


def pack_cols(values: torch.Tensor) -> torch.Tensor:
    """int [R, C] in 0..15 -> int32 [R, C/8], plain nibble order (column 8j+i in nibble i)."""
    rows, cols = values.shape
    if cols % PACK:
        raise ValueError(f"cannot pack {cols} columns of 4-bit values: not a multiple of {PACK}")
    shifts = torch.tensor(_SHIFTS, dtype=torch.int64, device=values.device)
    nibbles = values.to(torch.int64).reshape(rows, cols // PACK, PACK) & 0xF
    return _to_int32((nibbles << shifts).sum(-1))


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R/8, C] packed along rows (nibble i of word j in a column is row 8j+i) -> [R, C]."""
    return unpack_cols(packed.t().contiguous()).t().contiguous()


def awq_to_plain(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's interleaved column packing -> the plain nibble order Gaudi's kernel reads."""
    nibbles = unpack_cols(packed).reshape(packed.shape[0], -1, PACK)
    plain = torch.empty_like(nibbles)
    plain[..., list(AWQ_ORDER)] = nibbles
    return pack_cols(plain.reshape(packed.shape[0], -1))


def replace_parameter(layer: Any, name: str, value: torch.Tensor) -> None:
    """Swap `layer.<name>` for a plain frozen Parameter (vLLM's loader attributes are done)."""
    delattr(layer, name)
    layer.register_parameter(name, torch.nn.Parameter(value, requires_grad=False))


def dequantize(layer: Any, dtype: torch.dtype) -> torch.Tensor:
    """[K, N] weight of a layer repacked by one of the 4-bit methods, in `dtype`."""
    g_idx = getattr(layer, "hpu_g_idx", None)
    return seam.backend().convert_from_uint4(
        layer.qweight, layer.scales, layer.qzeros, dtype, g_idx
    )


class Uint4LinearMethod(LinearMethodBase):
    """Forward of every 4-bit linear on HPU: dequantize to the activation dtype, then matmul.

    Subclasses create the checkpoint's parameters and repack them in
    `process_weights_after_loading` into `qweight` [K, N/8], `qzeros` [G, N/8], `scales` [G, N]
    (and `hpu_g_idx` [K] when the checkpoint's rows are not in group order)."""

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        weight = dequantize(layer, x.dtype)
        out = torch.matmul(x.reshape(-1, x.shape[-1]), weight)
        if bias is not None:
            out.add_(bias)
        return out.reshape(*x.shape[:-1], weight.shape[1])


def per_expert(fn: Callable[[torch.Tensor], torch.Tensor], stacked: torch.Tensor) -> torch.Tensor:
    """`fn` applied to each expert's matrix of an [E, ...] tensor, stacked again."""
    return torch.stack([fn(matrix) for matrix in stacked.unbind(0)])


# ----------------------------------------------------------------------------- config
def claims(hf_quant_cfg: dict[str, Any], user_quant: str | None, marker: str) -> bool:
    """True when the active platform is HPU and the checkpoint says `marker`, unless the user
    asked for a different method."""
    from vllm_gaudi_platform.plugins import hpu_platform_active

    if str(hf_quant_cfg.get("quant_method", "")).lower() != marker:
        return False
    return hpu_platform_active() and user_quant in (None, marker, f"{marker}_hpu")


class Uint4Config:
    """Mixed in before vLLM's QuantizationConfig by the 4-bit configs (`awq_hpu`, `gptq_hpu`):
    the method's name, and claiming checkpoints whose quant_method is `checkpoint_marker` when
    the platform is HPU (vLLM probes custom methods' override_quantization_method first)."""

    hpu_name: ClassVar[str]
    checkpoint_marker: ClassVar[str]

    @classmethod
    def get_name(cls) -> Any:  # QuantizationMethods, a Literal of vLLM's own names
        return cls.hpu_name

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # a CUDA notion; Gaudi has none

    @classmethod
    def override_quantization_method(
        cls, hf_quant_cfg: dict[str, Any], user_quant: str | None, hf_config: Any = None
    ) -> Any:
        return cls.hpu_name if claims(hf_quant_cfg, user_quant, cls.checkpoint_marker) else None


# ----------------------------------------------------------------------------- MoE
# vLLM's MoE activations and the kernel's names for them (Gaudi's "gelu" is the tanh form).
KERNEL_ACTIVATIONS = {MoEActivation.SILU: "silu", MoEActivation.GELU_TANH: "gelu"}
GROUP = FusedMoeWeightScaleSupported.GROUP.value
# Scales and zeros every rank keeps whole (vLLM's expert loader copies them without splitting).
REPLICATED = FusedMoeWeightScaleSupported.CHANNEL.value


@dataclass
class Uint4Experts:
    """One projection's experts in `convert_from_uint4`'s layout (E local experts)."""

    qweight: torch.Tensor  # int32 [E, K, N/8], packed along N
    qzeros: torch.Tensor  # int32 [E, G, N/8], the zero points themselves
    scales: torch.Tensor  # [E, G, N]
    g_idx: torch.Tensor | None = None  # int32 [E, K], each row's group, when not in order


def unsupported_moe(layer: Any) -> str | None:
    """What the 4-bit MoE path cannot run in this RoutedExperts layer, or None."""
    moe = layer.moe_config
    if moe.activation not in KERNEL_ACTIVATIONS:
        names = ", ".join(a.value for a in KERNEL_ACTIVATIONS)
        return f"activation {moe.activation.value!r} (the kernel supports {names})"
    if moe.has_bias:
        return "expert biases"
    if getattr(moe, "has_hash_routing", False):
        return "hash routing"
    if layer.use_grouped_topk or layer.e_score_correction_bias is not None:
        return "grouped or bias-corrected routing"
    if layer.custom_routing_function is None and layer.scoring_func not in ("softmax", "sigmoid"):
        return f"scoring function {layer.scoring_func!r}"
    return None


class Uint4MoEMethod(FusedMoEMethodBase):
    """Forward of every 4-bit MoE layer on HPU: route in torch, dequantize the local experts
    with `convert_from_uint4`, run the bf16 `mixture_of_experts` kernel.

    Subclasses create the checkpoint's parameters with `add_parameter` in `create_weights`
    (vLLM's expert loader fills them) and implement `repack`, which returns both projections
    in the kernel's layout; the checkpoint's parameters are then dropped."""

    label: ClassVar[str]  # the format, as error messages name it

    def __init__(self, layer: Any) -> None:
        super().__init__(layer.moe_config)
        problem = unsupported_moe(layer)
        if problem is not None:
            raise ValueError(
                f"{self.label} checkpoint: MoE layer {layer.layer_name!r} uses {problem}, which "
                "the 4-bit MoE path on HPU does not run yet; vllm-gaudi-quant cannot serve it."
            )
        self.kernel_activation = KERNEL_ACTIVATIONS[layer.moe_config.activation]
        self._checkpoint_params: list[str] = []
        self._gather_max_tokens: int | None = None  # resolved at the first call

    @property
    def is_monolithic(self) -> bool:
        # vLLM's routers call top-k kernels built for CUDA/ROCm/CPU: this method routes itself.
        return True

    def get_fused_moe_quant_config(self, layer: Any) -> None:
        # Only vLLM's modular kernels read this; the HPU method runs its own kernel.
        return None

    def add_parameter(
        self, layer: Any, name: str, data: torch.Tensor, attrs: dict[str, Any]
    ) -> None:
        """Register a checkpoint parameter of the layer, loaded by `attrs["weight_loader"]`."""
        param = torch.nn.Parameter(data, requires_grad=False)
        layer.register_parameter(name, param)
        set_weight_attrs(param, attrs)
        self._checkpoint_params.append(name)

    def repack(self, layer: Any) -> dict[str, Uint4Experts]:
        """The loaded checkpoint parameters as {"w13": ..., "w2": ...}."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: Any) -> None:
        packed = self.repack(layer)
        for name in self._checkpoint_params:
            delattr(layer, name)
        self._checkpoint_params = []
        for proj, experts in packed.items():
            for field in ("qweight", "qzeros", "scales"):
                value = getattr(experts, field).contiguous()
                layer.register_parameter(
                    f"{proj}_{field}", torch.nn.Parameter(value, requires_grad=False)
                )
            if experts.g_idx is not None:
                layer.register_buffer(
                    f"{proj}_hpu_g_idx", experts.g_idx.to(torch.int32), persistent=False
                )
        self._resolve_gather(layer)

    def _resolve_gather(self, layer: Any) -> None:
        # Packed 4-bit weights (half a byte each), dequantized per call to the scales' dtype.
        cost = dequantized_gather_cost(0.5, layer.w13_scales.element_size())
        self._gather_max_tokens = gather_max_tokens(
            layer.local_num_experts, self.moe.experts_per_token, cost
        )

    def dequantized_experts(
        self, layer: Any, proj: str, dtype: torch.dtype, chosen: ExpertSelection | None = None
    ) -> list[torch.Tensor]:
        """Each local expert's [K, N] weight of projection `proj` ("w13" or "w2") in `dtype`,
        or only the `chosen` experts' (gathered before dequantizing)."""
        kernels = seam.backend()
        qweight, qzeros, scales = (
            getattr(layer, f"{proj}_{f}") for f in ("qweight", "qzeros", "scales")
        )
        g_idx = getattr(layer, f"{proj}_hpu_g_idx", None)
        if chosen is not None:
            qweight, qzeros, scales = (chosen.take(t) for t in (qweight, qzeros, scales))
            g_idx = None if g_idx is None else chosen.take(g_idx)
        return [
            kernels.convert_from_uint4(
                qweight[e], scales[e], qzeros[e], dtype, None if g_idx is None else g_idx[e]
            )
            for e in range(qweight.shape[0])
        ]

    def apply_monolithic(
        self,
        layer: Any,
        x: torch.Tensor,
        router_logits: torch.Tensor,
        input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        from vllm_gaudi_quant.methods.fp8_moe import route_to_local_experts

        weights, ids = route_to_local_experts(layer, x, router_logits)
        num_local = layer.local_num_experts
        weights = weights.to(x.dtype)
        if layer.apply_router_weight_on_input:
            # Llama 4 (top-1): the router weight scales the input, not the expert output.
            x = x * weights
            weights = torch.ones_like(weights)
        if self._gather_max_tokens is None:
            self._resolve_gather(layer)
        assert self._gather_max_tokens is not None
        chosen = select_experts(ids, num_local, self._gather_max_tokens)
        gathered = chosen if chosen.gathered else None
        w13 = self.dequantized_experts(layer, "w13", x.dtype, gathered)
        w2 = self.dequantized_experts(layer, "w2", x.dtype, gathered)
        # Dequantized weights are [K, N] = [in, out]: the kernel's unpermuted layout.
        return seam.backend().mixture_of_experts(
            x, chosen.ids, weights, w13, w2, False, self.kernel_activation, 0, chosen.count - 1
        )

    def apply(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError(
            f"{type(self).__name__} is monolithic: vLLM calls apply_monolithic"
        )


def check_expert_sizes(label: str, hidden: int, inter: int, group_size: int) -> None:
    """Refuse expert sizes the 4-bit layout cannot split: packing and groups along both K."""
    for what, size in (("hidden size", hidden), ("intermediate size per rank", inter)):
        if size % PACK or (group_size != -1 and size % group_size):
            raise ValueError(
                f"{label} checkpoint: MoE {what} {size} is not a multiple of {PACK} and of the "
                f"group size {group_size}; lower the tensor parallel size."
            )
