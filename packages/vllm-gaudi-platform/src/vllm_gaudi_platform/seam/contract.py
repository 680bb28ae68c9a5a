"""The seam's contract: what every backend (`gaudi/`, `emulated.py`) provides, typed.

`HpuBackend` is a Protocol that both backend MODULES satisfy: the type checker verifies it (see
the assignments under TYPE_CHECKING in `seam/__init__.py`), and
`tests/platform/test_seam_contract.py` compares the two modules' public signatures (seam/gaudi
parsed, never imported, so the check runs without a Gaudi) with each other and with this
Protocol. A kernel added to one backend and forgotten in the other, or left out of this Protocol,
fails CI.

Facts the platform used to infer from `DEVICE_TYPE == "hpu"` are stated here by each backend.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


class GraphInputError(RuntimeError):
    """A graph replay was handed an input that is not the buffer captured (storage, shape or
    dtype differ). On a Gaudi the replay would silently read the captured buffer's stale data."""


class HpuBackend(Protocol):
    """The device API and fused kernels of one Gaudi, real or emulated on the CPU."""

    # ------------------------------------------------------------------ facts
    NAME: str  # how logs and doctor name the backend ("gaudi", "emulated on cpu")
    DEVICE_TYPE: str  # torch device type of the tensors ("hpu", or "cpu" in emulation)
    IS_EMULATED: bool
    DISPATCH_KEY: str  # torch dispatch key of the device ("HPU" / "CPU")
    DIST_BACKEND: str  # torch.distributed backend between devices ("hccl" / "gloo")
    COMPILE_BACKEND: str  # torch.compile backend for vLLM's simple compile ("hpu_backend")
    PIN_MEMORY: bool  # whether pinned host buffers help host-to-device copies
    SHARED_HOST_MEMORY: bool  # host and device tensors are the same memory (no copy needed)
    # NIXL memory type under which device tensors (the KV cache) are registered for transfers
    # straight from device memory: "VRAM" (Gaudi HBM), or "DRAM" where the device is emulated.
    NIXL_DEVICE_MEMORY: str
    ROPE_BLOCKWISE: int  # apply_rotary_pos_emb mode: rotate halves (GPT-NeoX style)
    ROPE_PAIRWISE: int  # apply_rotary_pos_emb mode: rotate adjacent pairs (GPT-J style)
    MOE_ACTIVATIONS: tuple[str, ...]  # activations mixture_of_experts accepts

    # Classes standing in for torch.Event / torch.cuda.Stream while vLLM's runner constructor
    # builds its streams and events: Stream() with synchronize() and wait_stream(other);
    # Event() with record(stream=None) and synchronize().
    @property
    def Stream(self) -> type: ...

    @property
    def Event(self) -> type: ...

    # Class of one captured forward pass (see `emulated.Graph`): Graph(name); capture(fn, inputs)
    # runs fn once while recording it and returns its output; replay(inputs) runs the recording
    # again and returns the output. `inputs` names every tensor the recording reads (mappings,
    # sequences and dataclasses are walked); the caller must update them IN PLACE between replays.
    @property
    def Graph(self) -> type: ...

    # Whether this process can capture graphs: HPU graphs exist in Gaudi's lazy mode only
    # (PT_HPU_LAZY_MODE=1); in eager mode torch.compile builds the device graphs instead.
    def graphs_supported(self) -> bool: ...

    # The stream work is issued on now, and a context that issues its body's work on another
    # (vLLM's runner copies sampled tokens to the host on a side stream under async scheduling).
    def current_stream(self) -> Any: ...

    def stream(self, stream: Any) -> AbstractContextManager[Any]: ...

    # ------------------------------------------------------------------ device runtime
    def torch_device(self, index: int = 0) -> torch.device: ...

    def set_device(self, device: torch.device) -> None: ...

    def device_count(self) -> int: ...

    def device_name(self, index: int = 0) -> str: ...

    def mem_get_info(self) -> tuple[int, int]: ...

    def memory_allocated(self) -> int: ...

    # The most bytes allocated since the last reset_peak_memory_stats(): a profile run's peak,
    # transient tensors freed before it returns included (memory_allocated sees only what stays).
    def max_memory_allocated(self) -> int: ...

    def reset_peak_memory_stats(self) -> None: ...

    def synchronize(self) -> None: ...

    def mark_step(self) -> None: ...

    # ------------------------------------------------------------------ fused kernels
    def fused_sdpa(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        softmax_mode: str = "None",
        recompute_mode: bool | None = None,
        valid_sequence_lengths: torch.Tensor | None = None,
        padding_side: str = "left",
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor: ...

    # x @ weight.T + bias: the dense matmul of every unquantized linear layer (weight [out, in]).
    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor: ...

    def apply_rotary_pos_emb(
        self,
        p: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        offset: int = 0,
        mode: int = 0,
    ) -> torch.Tensor: ...

    def mixture_of_experts(
        self,
        hidden_states: torch.Tensor,
        expert_routing_table: torch.Tensor,
        router_weights: torch.Tensor,
        w12: list[torch.Tensor] | tuple[torch.Tensor, ...],
        w3: list[torch.Tensor] | tuple[torch.Tensor, ...],
        permuted_weights: bool,
        activation: str,
        experts_min: int,
        experts_max: int,
    ) -> torch.Tensor: ...

    # W8A8: FP8 hidden states and expert weights, with their dequantization scales (see
    # emulated_moe.mixture_of_experts_fp8); the result has router_weights' dtype.
    def mixture_of_experts_fp8(
        self,
        hidden_states: torch.Tensor,
        expert_routing_table: torch.Tensor,
        router_weights: torch.Tensor,
        w12: list[torch.Tensor] | tuple[torch.Tensor, ...],
        w3: list[torch.Tensor] | tuple[torch.Tensor, ...],
        d_scale_hidden_states: torch.Tensor,
        d_scale_intermediate_hidden_states: list[torch.Tensor] | None,
        d_scale_w12: list[torch.Tensor] | tuple[torch.Tensor, ...],
        d_scale_w3: list[torch.Tensor] | tuple[torch.Tensor, ...],
        permuted_weights: bool,
        activation: str,
        experts_min: int,
        experts_max: int,
    ) -> torch.Tensor: ...

    # MXFP4 experts (uint8 E2M1 pairs with E8M0 scales per 32 values) with biases and gpt-oss's
    # clamped SwiGLU over interleaved gate/up rows (see emulated_moe.mixture_of_experts_mxfp4).
    def mixture_of_experts_mxfp4(
        self,
        hidden_states: torch.Tensor,
        expert_routing_table: torch.Tensor,
        router_weights: torch.Tensor,
        w12: list[torch.Tensor] | tuple[torch.Tensor, ...],
        w3: list[torch.Tensor] | tuple[torch.Tensor, ...],
        w12_bias: list[torch.Tensor] | tuple[torch.Tensor, ...],
        w3_bias: list[torch.Tensor] | tuple[torch.Tensor, ...],
        d_scale_w12: list[torch.Tensor] | tuple[torch.Tensor, ...],
        d_scale_w3: list[torch.Tensor] | tuple[torch.Tensor, ...],
        experts_min: int,
        experts_max: int,
        alpha: float,
        limit: float,
    ) -> torch.Tensor: ...

    # ------------------------------------------------------------------ KV block copies
    def copy_blocks(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        src_block_indices: torch.Tensor,
        dst_block_indices: torch.Tensor,
    ) -> None: ...

    # ------------------------------------------------------------------ 4-bit kernels
    def convert_from_uint4(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        qzeros: torch.Tensor,
        out_dtype: torch.dtype,
        g_idx: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    # ------------------------------------------------------------------ quantization kernels
    def fp8_max(self, dtype: torch.dtype = ...) -> float: ...

    def cast_to_fp8_v2(
        self,
        x: torch.Tensor,
        scale: torch.Tensor | float | None = None,
        stochastic_rounding: bool = False,
        is_amax: bool = False,
        dtype: torch.dtype = ...,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def cast_from_fp8(
        self, x: torch.Tensor, scale: torch.Tensor | float | None, out_dtype: torch.dtype
    ) -> torch.Tensor: ...

    def fp8_gemm_v2(
        self,
        A: torch.Tensor,
        trans_A: bool,
        B: torch.Tensor,
        trans_B: bool,
        D: torch.Tensor | None,
        out_dtype: torch.dtype,
        A_scale_inv: torch.Tensor | float | None = None,
        B_scale_inv: torch.Tensor | float | None = None,
        bias: torch.Tensor | None = None,
        accumulate: bool = False,
    ) -> torch.Tensor: ...

    # ------------------------------------------------------------------ LoRA kernels
    def lora_shrink(
        self, x: torch.Tensor, lora_a: torch.Tensor, token_lora: torch.Tensor, scale: float
    ) -> torch.Tensor: ...

    def lora_expand(
        self, x: torch.Tensor, lora_b: torch.Tensor, token_lora: torch.Tensor
    ) -> torch.Tensor: ...

    # ------------------------------------------------------------------ paged decode
    # One query per sequence over Gaudi's flat block list (see seam/paged_attention.py).
    def paged_decode(
        self,
        query: torch.Tensor,
        cache: torch.Tensor,
        block_list: torch.Tensor,
        block_groups: torch.Tensor,
        block_bias: torch.Tensor,
        scale: float,
        *,
        soft_cap: float | None = None,
        alibi: tuple[torch.Tensor, torch.Tensor] | None = None,
        sinks: torch.Tensor | None = None,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor: ...

    # ------------------------------------------------------------------ MLA kernels
    # Weight-absorbed latent attention: one KV head whose rows are [kv_lora_rank + rope_dim], the
    # value being the first kv_lora_rank columns (see seam/latent_attention.py).
    def mla_prefill(
        self,
        query: torch.Tensor,
        latent: torch.Tensor,
        attn_mask: torch.Tensor,
        scale: float,
        kv_lora_rank: int,
    ) -> torch.Tensor: ...

    def mla_paged_decode(
        self,
        query: torch.Tensor,
        cache: torch.Tensor,
        block_list: torch.Tensor,
        block_groups: torch.Tensor,
        block_bias: torch.Tensor,
        scale: float,
        kv_lora_rank: int,
    ) -> torch.Tensor: ...
