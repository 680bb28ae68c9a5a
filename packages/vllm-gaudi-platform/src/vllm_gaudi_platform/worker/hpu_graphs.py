"""HPU graphs: one captured forward pass per warmed bucket, replayed with static inputs.

A graph replays on the buffers it saw at capture, so everything the forward pass reads must live
in per-bucket static buffers that each step updates IN PLACE:

- token ids and positions: vLLM's persistent `input_ids` / `positions` buffers, sliced to the
  bucket's padded token count (the same storage every step);
- attention metadata: one `HPUAttentionMetadata` per bucket and KV-cache group, built at capture
  (`static_metadata`) and overwritten tensor by tensor from each step's metadata
  (`copy_metadata`). Python values the attention code branches on are fixed per graph: the
  bucket's layout, the general (permuting) cell order, and every padded token written to the
  cache (padding tokens go to slots of block 0, the null block no request owns);
- KV caches and weights: allocated once; wake-up after sleep mode moves them, so the runner
  captures again then.

A single-row prompt bucket may have a second graph, its packed variant (several prefills in the
row), where packing changes the attention branch: always without cached context (the causal
fast path is for one sequence), and with context for a model with windowed or encoder-only
layers (`packing_matters`). Graphs are keyed by (buckets, packed).

A step run in passes (a mixed prefill + decode step, or prompts in groups of rows: see
`step_layout.split_passes`) replays one graph per pass. The seam's `Graph` does the capture and
replay; its emulation checks at every replay that each input is still the captured buffer, with
the captured shape and dtype.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.v1.attention.backend import AttentionType

from vllm_gaudi_platform.attention.metadata import HPUAttentionMetadata
from vllm_gaudi_platform.attention.step_layout import StepLayout
from vllm_gaudi_platform.bucketing import Bucket, can_pack

# Metadata fields that are not copied from the step: fixed per graph (see the module docstring)
# or a per-step cache that the forward pass rebuilds.
_FIXED_FIELDS = {
    "layout",
    "num_actual_tokens",
    "identity_layout",
    "slot_mapping",
    "_derived",
    "parts",  # a graph covers one pass; a step run in passes replays one graph per pass
}


class GraphStepError(RuntimeError):
    """A step cannot be written into its bucket's static buffers (a shape or field differs)."""


def static_metadata(md: HPUAttentionMetadata) -> HPUAttentionMetadata:
    """Turn freshly built metadata (warmup's, for one bucket) into the bucket's static buffers.

    The slot mapping covers every padded token (padding writes go to block 0), and the cells are
    always permuted through `cell_to_token`: both would otherwise change with the real token
    count, which a graph cannot follow.
    """
    total = md.layout.num_tokens_padded
    slots = torch.zeros(total, dtype=md.slot_mapping.dtype, device=md.slot_mapping.device)
    slots[: md.num_actual_tokens].copy_(md.slot_mapping[: md.num_actual_tokens])
    # Own copies: every bucket (and KV-cache group) has its own buffers.
    own: dict[str, Any] = {
        f.name: value.clone()
        for f in dataclasses.fields(md)
        if f.name not in _FIXED_FIELDS and isinstance(value := getattr(md, f.name), torch.Tensor)
    }
    return dataclasses.replace(
        md, **own, slot_mapping=slots, num_actual_tokens=total, identity_layout=False, _derived={}
    )


def packing_matters(layers: Iterable[Any]) -> bool:
    """Whether packing several sequences into a prefill row changes the attention branch even
    in a bucket with cached context: it does for a windowed or chunked local layer (the window
    or chunk narrows each row's context only with one sequence per row) and for an
    encoder-only layer, which has no context and takes its packed path (a same-sequence mask)
    at every bucket it is padded to, whatever the bucket's context blocks. Every other layer
    branches on packing only without context (the causal fast path)."""
    for layer in layers:
        impl = getattr(layer, "impl", None)
        if getattr(impl, "sliding_window", None) is not None:
            return True
        if getattr(layer, "attention_chunk_size", None):  # vLLM's ChunkedLocalAttention
            return True
        if getattr(impl, "attn_type", None) == AttentionType.ENCODER_ONLY:
            return True
    return False


def _branch_free_fields(static: HPUAttentionMetadata, packing_matters: bool) -> set[str]:
    """Non-tensor fields no branch of this graph depends on. Packing several sequences into a
    prefill row changes the code path only without cached context (the causal fast path), for
    windowed layers and for encoder-only layers (`packing_matters`); a runner whose layers are
    neither says so with `packing_matters=False`, and then a bucket with context has one graph
    for both."""
    p = static.layout.prefill
    if not packing_matters and p is not None and p.ctx_bucket > 0:
        return {"prefill_packed"}
    return set()


def same_variant(
    static: HPUAttentionMetadata, step: HPUAttentionMetadata, packing_matters: bool = True
) -> bool:
    """Whether a step can replay the graph captured with `static`: same buckets, and the same
    value of every non-tensor field the attention code branches on (e.g. `prefill_packed`,
    which picks the masked path over the causal fast path). A graph records one branch."""
    if step.layout.buckets != static.layout.buckets:
        return False
    free = _branch_free_fields(static, packing_matters)
    for f in dataclasses.fields(static):
        if f.name in _FIXED_FIELDS or f.name in free:
            continue
        mine, theirs = getattr(static, f.name), getattr(step, f.name)
        if isinstance(mine, torch.Tensor) or isinstance(theirs, torch.Tensor):
            if (mine is None) != (theirs is None):
                return False
        elif mine != theirs:
            return False
    return True


def copy_metadata(
    static: HPUAttentionMetadata, step: HPUAttentionMetadata, packing_matters: bool = True
) -> None:
    """Write one step's metadata into the bucket's static metadata, in place."""
    if step.layout.buckets != static.layout.buckets:
        raise GraphStepError(
            f"step buckets {step.layout.buckets} differ from the graph's {static.layout.buckets}"
        )
    n = step.num_actual_tokens
    static.slot_mapping[:n].copy_(step.slot_mapping[:n])
    static.slot_mapping[n:].zero_()
    static._derived.clear()  # derived masks: recomputed from the updated positions
    free = _branch_free_fields(static, packing_matters)
    for f in dataclasses.fields(static):
        if f.name in _FIXED_FIELDS or f.name in free:
            continue
        mine, theirs = getattr(static, f.name), getattr(step, f.name)
        if isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor):
            if mine.shape != theirs.shape or mine.dtype != theirs.dtype:
                raise GraphStepError(
                    f"attention metadata {f.name}: step has {theirs.dtype} {list(theirs.shape)}, "
                    f"the graph {mine.dtype} {list(mine.shape)}"
                )
            mine.copy_(theirs)
        elif isinstance(mine, torch.Tensor) or isinstance(theirs, torch.Tensor) or mine != theirs:
            raise GraphStepError(
                f"attention metadata {f.name} differs between the step and its graph and is "
                "not a tensor a graph could read in place"
            )


@dataclass
class BucketGraph:
    """One bucket's captured graph and the static buffers it reads."""

    graph: Any  # seam Graph
    metadata: dict[str, HPUAttentionMetadata]  # layer name -> its group's static metadata
    replays: int = 0


@dataclass
class GraphStats:
    captured: int = 0
    capture_seconds: float = 0.0
    replays: int = 0
    eager_steps: int = 0  # serving forward passes with no graph (unplanned shapes)
    variant_misses: int = 0  # of those: a graph of the buckets exists but for another branch
    eager_buckets: dict[tuple, int] = field(default_factory=dict)


GraphKey = tuple[tuple[Bucket, ...], bool]  # (a step layout's buckets, packed prefill row)


def is_packed(metadata: Mapping[str, Any]) -> bool:
    """Whether a step's (or a graph's) metadata has a packed prefill row."""
    if not isinstance(metadata, Mapping):
        return False
    return any(
        isinstance(md, HPUAttentionMetadata) and md.prefill_packed for md in metadata.values()
    )


class BucketGraphs:
    """The graphs of one runner, keyed by the buckets of a step layout and the packed flag."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.graphs: dict[GraphKey, BucketGraph] = {}
        self.stats = GraphStats()
        # Whether packed prefill rows take another branch with cached context (windowed or
        # encoder-only layers; see `packing_matters`). The runner sets it from the model.
        self.packing_matters = True

    def clear(self) -> None:
        self.graphs.clear()

    def needs_packed_variant(self, bucket: Bucket) -> bool:
        """Whether warmup captures `bucket`'s packed variant too (see the module docstring)."""
        return can_pack(bucket) and (bucket.ctx_blocks == 0 or self.packing_matters)

    def lookup(
        self, layout: StepLayout | None, step_metadata: Mapping[str, Any]
    ) -> BucketGraph | None:
        """The graph this step replays: its buckets' graph of its variant (packed or not), or
        the other variant's where packing does not change the branch; None (an eager step,
        counted) when the step has no graph."""
        if not self.enabled or layout is None:
            return None
        packed = is_packed(step_metadata)
        found = self.graphs.get((layout.buckets, packed))
        if found is None:
            found = self.graphs.get((layout.buckets, not packed))
        if found is None:
            self.stats.eager_steps += 1
            key = tuple((b.phase, b.batch_size, b.query_len, b.ctx_blocks) for b in layout.buckets)
            self.stats.eager_buckets[key] = self.stats.eager_buckets.get(key, 0) + 1
            return None
        return found if self.fits(found, step_metadata) else None

    def capture(
        self,
        key: GraphKey,
        graph: Any,
        fn: Callable[[], Any],
        inputs: Mapping[str, Any],
        metadata: dict[str, HPUAttentionMetadata],
    ) -> Any:
        out = graph.capture(fn, inputs)
        self.graphs[key] = BucketGraph(graph=graph, metadata=metadata)
        self.stats.captured = len(self.graphs)
        return out

    def fits(self, entry: BucketGraph, step_metadata: Mapping[str, Any]) -> bool:
        """Whether the step's metadata matches the graph's branch (see `same_variant`); a step
        that does not runs eagerly and is counted as an eager step."""
        ok = all(
            same_variant(static, step_metadata[name], self.packing_matters)
            for name, static in entry.metadata.items()
        )
        if not ok:
            self.stats.eager_steps += 1
            self.stats.variant_misses += 1
            static = next(iter(entry.metadata.values()))
            key = (
                *(
                    (b.phase, b.batch_size, b.query_len, b.ctx_blocks)
                    for b in static.layout.buckets
                ),
                "other variant",
            )
            self.stats.eager_buckets[key] = self.stats.eager_buckets.get(key, 0) + 1
        return ok

    def replay(
        self,
        entry: BucketGraph,
        step_metadata: Mapping[str, Any],
        inputs_for: Callable[[dict[str, HPUAttentionMetadata]], Mapping[str, Any]],
    ) -> Any:
        """Copy the step's attention metadata into the bucket's static buffers and replay."""
        done: set[int] = set()
        for name, static in entry.metadata.items():
            if id(static) in done:
                continue
            done.add(id(static))
            copy_metadata(static, step_metadata[name], self.packing_matters)
        entry.replays += 1
        self.stats.replays += 1
        return entry.graph.replay(inputs_for(entry.metadata))


# ---------------------------------------------------------------------- the runner's graphs


def graph_forward(
    runner: Any,
    input_ids: torch.Tensor | None,
    positions: torch.Tensor,
    metadata: dict[str, HPUAttentionMetadata],
    inputs_embeds: torch.Tensor | None = None,
) -> Callable[[], Any]:
    """The forward pass a graph records: the model on the static token buffers (token ids, or a
    multimodal model's input embeddings), with the bucket's static attention metadata in the
    forward context (whoever set the context)."""
    from vllm.forward_context import get_forward_context

    tokens: dict[str, Any] = {"input_ids": input_ids, "positions": positions}
    if inputs_embeds is not None:
        tokens["inputs_embeds"] = inputs_embeds

    def forward() -> Any:
        context = get_forward_context()
        saved = context.attn_metadata
        context.attn_metadata = metadata  # type: ignore[assignment]
        try:
            return runner.model(**tokens)
        finally:
            context.attn_metadata = saved

    return forward


def graph_inputs(
    runner: Any,
    input_ids: torch.Tensor | None,
    positions: torch.Tensor,
    metadata: dict[str, HPUAttentionMetadata],
    inputs_embeds: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Every buffer a graph reads, by name (the emulated Graph checks them at each replay)."""
    distinct = list({id(md): md for md in metadata.values()}.values())
    return {
        "input_ids": input_ids,
        "inputs_embeds": inputs_embeds,
        "positions": positions,
        "attn_metadata": distinct,
        "kv_caches": [kv for kv in runner.kv_caches if isinstance(kv, torch.Tensor)],
        # Gathered only when checked (the emulated Graph does, at capture and each replay): the
        # live parameters and buffers, which sleep mode moves (then recapture).
        "weights": runner._live_weights,
    }


def live_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = dict(model.named_parameters())
    weights.update((f"buffer:{n}", b) for n, b in model.named_buffers())
    return weights


def static_metadata_by_layer(
    runner: Any, metadata: HPUAttentionMetadata
) -> dict[str, HPUAttentionMetadata]:
    """Per-layer static metadata of one bucket: one copy per attention group (warmup.py,
    `metadata_by_layer`), since each group's step metadata is written into its own buffers."""
    from vllm_gaudi_platform.worker import warmup

    return warmup.metadata_by_layer(runner, metadata, static_metadata)


def recapture(runner: Any) -> None:
    """Capture every bucket's graph again: sleep mode re-allocates the weights and the KV cache,
    and a graph holds the addresses it was captured with."""
    import time

    from vllm.logger import init_logger

    from vllm_gaudi_platform.worker import warmup

    if not runner.graphs.graphs:
        return
    keys = list(runner.graphs.graphs)
    runner.graphs.clear()
    start = time.perf_counter()
    num_blocks = runner.cache_config.num_gpu_blocks or 0
    for buckets, packed in keys:
        warmup.run_bucket(runner, buckets[0], num_blocks, packed=packed)
    init_logger(f"vllm.{__name__}").info(
        "HPU graphs: %d recaptured in %.2f s", len(keys), time.perf_counter() - start
    )
