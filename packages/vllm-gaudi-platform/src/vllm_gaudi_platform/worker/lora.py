"""Multi-LoRA on HPU: vLLM's punica wrapper interface over the seam's static-shape LoRA kernels.

vLLM's LoRA layers call a "punica wrapper" to add the adapters' contributions to a base layer's
output, one adapter slot per token. The CPU/GPU wrappers group tokens by adapter (segment kernels
whose shapes follow the batch's adapter mix); on Gaudi every new shape is a graph compile, so this
wrapper always runs the seam's `lora_shrink` / `lora_expand`, whose shapes depend only on the
bucket's token count and on max_loras / max_lora_rank (fixed at start-up). A step with one
adapter, several, or none runs the same shapes; warmup runs every bucket with LoRA on.

The per-token slot index lives in a buffer as long as the largest padded step: the tokens vLLM
scheduled come first, padding tokens carry slot -1 (no adapter) and row 0 of the embedding
adapters, so padding never picks up an adapter's weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from vllm.logger import init_logger
from vllm.lora.model_manager import DEFAULT_LANGUAGE_WRAPPER_KEY
from vllm.lora.punica_wrapper.punica_base import PunicaWrapperBase
from vllm.lora.request import LoRARequest

from vllm_gaudi_platform.seam import backend as seam_backend

if TYPE_CHECKING:
    from vllm.lora.layers import LoRAMapping

logger = init_logger(f"vllm.{__name__}")

NO_ADAPTER = -1  # slot index of tokens that use the base model only (vLLM's convention)
# The LoRA lm_head runs on the rows being sampled (one per request), like the base lm_head.
LOGITS_SHRINK, LOGITS_EXPAND = "logits-shrink", "logits-expand"
MOE_LORA_UNSUPPORTED = (
    "LoRA on mixture-of-experts layers is not supported on HPU by vllm-gaudi yet; serve this "
    "model without --enable-lora, or use a dense model."
)


class PunicaWrapperHPU(PunicaWrapperBase):
    """Punica wrapper for HPU: every LoRA product is one batched shrink and one batched expand over
    all adapter slots, masked per token (see the module docstring)."""

    def __init__(
        self,
        max_num_batched_tokens: int,
        max_batches: int,
        device: torch.device | str,
        **kwargs: Any,
    ) -> None:
        # The HPU runner pads a step to a prefill bucket (<= max_num_batched_tokens tokens) plus a
        # decode bucket (<= max_num_seqs tokens): the index buffers must cover both.
        capacity = max_num_batched_tokens + max_batches
        super().__init__(capacity, max_batches, device)
        self.capacity = capacity
        self.seam = seam_backend()
        self._token_lora_indices.fill_(NO_ADAPTER)
        self._sampler_indices.fill_(NO_ADAPTER)
        self._embeddings_indices.fill_(0)
        # (kernel, tokens, input width, slots, rank, output width) of every call, so the runner
        # can prove that serving met no LoRA shape warmup did not run.
        self.shapes: set[tuple[str, int, int, int, int, int]] = set()

    # ------------------------------------------------------------------ metadata
    def update_metadata(
        self,
        mapping: LoRAMapping,
        lora_index_to_id: list[int | None],
        max_loras: int,
        vocab_size: int,
        **kwargs: Any,
    ) -> None:
        """Per-token and per-request adapter slots of the next step; the padding after the
        scheduled tokens is reset to "no adapter"."""
        num_tokens = len(mapping.index_mapping)
        if num_tokens > self.capacity:
            raise ValueError(
                f"LoRA step of {num_tokens} tokens exceeds the HPU punica buffers "
                f"({self.capacity} tokens = max_num_batched_tokens + max_num_seqs)."
            )
        self._update_base_metadata(mapping, lora_index_to_id, max_loras, vocab_size)
        self._token_lora_indices[num_tokens:].fill_(NO_ADAPTER)
        self._embeddings_indices[num_tokens:].fill_(0)
        num_requests = len(mapping.prompt_mapping)
        self._sampler_indices[num_requests:].fill_(NO_ADAPTER)
        # Segment metadata (compute_meta) is never needed: the kernels take per-token slots.
        self.is_prefill = False

    def token_buffers(self) -> list[tuple[torch.Tensor, int]]:
        """The per-token buffers a forward pass reads by token index (tokens on the last
        dimension), each with the value a padding token carries: a step run in passes
        (mixed_steps.py) gives each pass its own tokens' entries at the front."""
        return [(self._token_lora_indices, NO_ADAPTER), (self._embeddings_indices, 0)]

    def _slots(self, num_tokens: int) -> torch.Tensor:
        if num_tokens > self.capacity:
            raise ValueError(
                f"LoRA kernel on {num_tokens} tokens exceeds the HPU punica buffers "
                f"({self.capacity} tokens)."
            )
        return self._token_lora_indices[:num_tokens]

    def _sampler_slots(self, num_rows: int) -> torch.Tensor:
        return self._sampler_indices[:num_rows]

    # ------------------------------------------------------------------ kernels
    def _shrink(
        self,
        x: torch.Tensor,
        lora_a: torch.Tensor,
        slots: torch.Tensor,
        scale: float,
        kind: str = "shrink",
    ) -> torch.Tensor:
        """x [T, in] through vLLM's stacked A [slots, 1, rank, in] -> float32 [T, rank]."""
        a = lora_a.flatten(0, 1) if lora_a.dim() == 4 else lora_a
        self._record((kind, x.size(0), x.size(1), a.size(0), a.size(1), a.size(1)))
        return self.seam.lora_shrink(x, a, slots, scale)

    def _expand(
        self, x: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor, kind: str = "expand"
    ) -> torch.Tensor:
        """x [T, rank] through vLLM's stacked B [slots, 1, out, rank] -> float32 [T, out]."""
        b = lora_b.flatten(0, 1) if lora_b.dim() == 4 else lora_b
        self._record((kind, x.size(0), x.size(1), b.size(0), b.size(2), b.size(1)))
        return self.seam.lora_expand(x, b, slots)

    def _record(self, shape: tuple[str, int, int, int, int, int]) -> None:
        """Note a kernel shape (for `unwarmed_shapes`). Not under torch.compile: a compiled
        pass would guard on the set's contents, and its own guards count new shapes there."""
        if not torch.compiler.is_compiling():
            self.shapes.add(shape)

    @staticmethod
    def _accumulate(y: torch.Tensor, value: torch.Tensor, add_inputs: bool) -> None:
        if add_inputs:
            y.add_(value.to(y.dtype))
        else:
            y.copy_(value.to(y.dtype))

    # ------------------------------------------------------------------ punica interface
    def add_shrink(
        self,
        y: tuple[torch.Tensor, ...] | torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: tuple[torch.Tensor, ...],
        scale: float,
        **kwargs: Any,
    ) -> None:
        """y[i] += scale * x @ A_i of each token's adapter, for each slice i."""
        x = x.view(-1, x.shape[-1])
        slots = self._slots(x.size(0))
        for i, lora_a in enumerate(lora_a_stacked):
            out = y[i]
            out.view(-1, out.shape[-1]).add_(self._shrink(x, lora_a, slots, scale).to(out.dtype))

    def add_expand(
        self,
        y: torch.Tensor,
        x: tuple[torch.Tensor, ...] | torch.Tensor,
        lora_b_stacked: tuple[torch.Tensor, ...],
        output_slices: tuple[int, ...],
        offset_start: int = 0,
        add_inputs: bool = True,
        **kwargs: Any,
    ) -> None:
        """y[:, slice i] += x[i] @ B_i of each token's adapter, slices laid side by side from
        `offset_start`."""
        y2 = y.view(-1, y.shape[-1])
        slots = self._slots(y2.size(0))
        offset = offset_start
        for i, lora_b in enumerate(lora_b_stacked):
            width = output_slices[i]
            xi = x[i].view(-1, x[i].shape[-1])
            self._accumulate(
                y2[:, offset : offset + width], self._expand(xi, lora_b, slots), add_inputs
            )
            offset += width

    def add_lora_embedding(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_b_stacked: torch.Tensor,
        add_inputs: bool = True,
        **kwargs: Any,
    ) -> None:
        """y += x @ B of each token's adapter, x being the adapter's embedding rows (A)."""
        y2 = y.view(-1, y.shape[-1])
        slots = self._slots(y2.size(0))
        self._accumulate(
            y2, self._expand(x.view(-1, x.shape[-1]), lora_b_stacked, slots), add_inputs
        )

    def add_lora_linear(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: tuple[torch.Tensor, ...],
        lora_b_stacked: tuple[torch.Tensor, ...],
        scale: float,
        output_slices: tuple[int, ...],
        *,
        buffer: tuple[torch.Tensor, ...] | None = None,
        **kwargs: Any,
    ) -> None:
        """y[:, slice i] += scale * x @ A_i @ B_i of each token's adapter."""
        if not len(lora_a_stacked) == len(lora_b_stacked) == len(output_slices):
            raise ValueError(
                f"LoRA linear: {len(lora_a_stacked)} A, {len(lora_b_stacked)} B stacks for "
                f"{len(output_slices)} output slices"
            )
        x = x.view(-1, x.shape[-1])
        y2 = y.view(-1, y.shape[-1])
        slots = self._slots(x.size(0))
        offset = 0
        for lora_a, lora_b, width in zip(lora_a_stacked, lora_b_stacked, output_slices):
            shrunk = self._shrink(x, lora_a, slots, scale)
            y2[:, offset : offset + width] += self._expand(shrunk, lora_b, slots).to(y.dtype)
            offset += width

    def add_lora_logits(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: torch.Tensor,
        lora_b_stacked: torch.Tensor,
        scale: Any,
        *,
        buffer: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> None:
        """logits += scale * hidden @ A @ B of each request's adapter (one row per sampled row)."""
        y2 = y.view(-1, y.shape[-1])
        x = x.view(-1, x.shape[-1])
        slots = self._sampler_slots(x.size(0))
        shrunk = self._shrink(x, lora_a_stacked, slots, scale, LOGITS_SHRINK)
        y2 += self._expand(shrunk, lora_b_stacked, slots, LOGITS_EXPAND).to(y.dtype)

    def apply_lora_full_linear(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        weight_stacked: torch.Tensor,
        bias_stacked: torch.Tensor,
        module_enabled: torch.Tensor,
    ) -> None:
        raise NotImplementedError(
            "Adapters that replace a full linear layer (classification heads) are not supported "
            "on HPU by vllm-gaudi; use adapters with low-rank A/B weights only."
        )

    # vLLM builds LoRA mixture-of-experts layers for MoE models; their kernels (expert-sorted
    # token blocks) have no static-shape HPU version yet. They run in the start-up profile pass,
    # so a MoE model with --enable-lora stops there with this message.
    def moe_lora_align_block_size(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(MOE_LORA_UNSUPPORTED)

    def add_lora_fused_moe(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(MOE_LORA_UNSUPPORTED)

    def add_lora_w13(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(MOE_LORA_UNSUPPORTED)

    def add_lora_w2(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(MOE_LORA_UNSUPPORTED)


# ---------------------------------------------------------------------------------------- warmup
def warmup_request(lora_id: int) -> LoRARequest:
    """The request naming dummy adapter `lora_id` as vLLM's runner mixin registers it during
    warmup (`maybe_setup_dummy_loras`): found in the dummy cache, never read from disk."""
    return LoRARequest(
        lora_name=f"warmup_{lora_id}", lora_int_id=lora_id, lora_path="dummy adapter, not on disk"
    )


def warmup_mapping(
    query_lens: Sequence[int], max_loras: int
) -> tuple[tuple[int, ...], tuple[int, ...], set[LoRARequest]]:
    """Adapter ids for a warmup bucket: requests cycle through "no adapter" and every dummy
    adapter, so warmup runs the batched kernels with a mix like serving's (the shapes do not
    depend on the mix). Returns (per-request ids, per-token ids, the active requests)."""
    per_request = tuple(i % (max_loras + 1) for i in range(len(query_lens)))
    per_token = tuple(lora_id for lora_id, n in zip(per_request, query_lens) for _ in range(n))
    requests = {warmup_request(lora_id) for lora_id in set(per_request) if lora_id > 0}
    return per_request, per_token, requests


def punica_wrapper_of(lora_manager: Any) -> PunicaWrapperHPU:
    """The language model's punica wrapper held by a runner's LoRA manager."""
    wrapper = lora_manager._adapter_manager.punica_wrapper_mapping.get(DEFAULT_LANGUAGE_WRAPPER_KEY)
    if not isinstance(wrapper, PunicaWrapperHPU):
        raise RuntimeError(f"LoRA on HPU runs on PunicaWrapperHPU; the model has {wrapper!r}.")
    return wrapper


def unwarmed_shapes(wrapper: PunicaWrapperHPU, warmed: set[tuple]) -> list[tuple]:
    """LoRA kernel widths run since warmup that warmup did not run: (kernel, input width, slots,
    rank, output width), the token count left out. The token count is the step's padded size,
    the same for the base layers and their LoRA (the runner's bucket tracker counts it); what
    LoRA itself could add is a new width, e.g. an adapter's own rank instead of max_lora_rank."""

    def widths(shapes: set[tuple]) -> set[tuple]:
        return {(shape[0], *shape[2:]) for shape in shapes}

    return sorted(widths(wrapper.shapes) - widths(warmed))
