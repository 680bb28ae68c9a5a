"""The warmup driver: every bucket of the plan run once before serving, so serving never meets a
new shape; with HPU graphs on, that run captures the bucket's graph.

`HPUModelRunner.warmup_model` (called by the worker) runs `warmup_model`, `recapture_graphs` (after
sleep mode) runs `run_bucket` again, and `HPUModelRunner._forward_with_metadata` (also the forward
pass of an idle data-parallel rank's padding-only step) is `forward_with_metadata`. `runner` is
the HPUModelRunner throughout.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import torch
from vllm.config import CUDAGraphMode
from vllm.distributed.parallel_state import get_pp_group
from vllm.forward_context import set_forward_context
from vllm.logger import init_logger

from vllm_gaudi_platform import envs
from vllm_gaudi_platform.attention import chunked_local, step_layout
from vllm_gaudi_platform.attention.metadata import HPUAttentionMetadata
from vllm_gaudi_platform.attention.metadata_builder import build_metadata
from vllm_gaudi_platform.bucketing import Bucket, BucketPlan
from vllm_gaudi_platform.worker import hybrid, vision
from vllm_gaudi_platform.worker import lora as hpu_lora

logger = init_logger(f"vllm.{__name__}")

# Warmup progress goes to the log (not only a tqdm bar) at least this often, and at every tenth
# of the plan, so a supervisor reading the log sees it advance.
WARMUP_LOG_INTERVAL_S = 10.0
# Buckets warmed before the first estimate of the total warmup time.
WARMUP_ESTIMATE_AFTER = 3


class _WarmupProgress:
    """Plain warmup progress lines for a supervisor reading the log (a tqdm bar is not one)."""

    def __init__(self, total: int, start: float) -> None:
        self.total = total
        self.start = self.last_log = start
        self.done = 0
        self.next_tenth = 1

    def step(self) -> None:
        self.done += 1
        done, total = self.done, self.total
        now = time.perf_counter()
        elapsed = now - self.start
        left = elapsed / done * (total - done)
        if done == WARMUP_ESTIMATE_AFTER and done < total:
            logger.info(
                "HPU warmup: estimated %.1f s in total from the first %d buckets (%.2f s each; "
                "later buckets are larger, so this is a lower bound)",
                elapsed + left,
                done,
                elapsed / done,
            )
        tenth = done * 10 >= self.next_tenth * total
        if done == total or tenth or now - self.last_log >= WARMUP_LOG_INTERVAL_S:
            logger.info(
                "HPU warmup progress: %d/%d buckets, %.1f s elapsed, ~%.1f s left",
                done,
                total,
                elapsed,
                left,
            )
            self.last_log = now
            self.next_tenth = done * 10 // total + 1


def warmup_model(runner: Any) -> None:
    """Run every bucket of the plan once, so serving never meets a new shape; with HPU
    graphs on, that run captures the bucket's graph.

    The plan (bucket and graph count) is logged before the first bucket, an estimate of the
    total time after the first few, and progress lines (done/total, elapsed, time left) at
    least every WARMUP_LOG_INTERVAL_S seconds and at every tenth of the plan.
    """
    logger.info("HPU bucket plan:\n%s", runner.bucket_plan.describe())
    if envs.get_bool(envs.VLLM_SKIP_WARMUP):
        logger.warning("%s=true: warmup skipped; first steps will compile", envs.VLLM_SKIP_WARMUP)
        runner.recompiles.warmup_done = True
        if runner.compiled_model is not None:
            runner.compiled_model.warmup_done()
        return
    runs = warmup_runs(runner, runner.bucket_plan)
    num_blocks = runner.cache_config.num_gpu_blocks or 0
    total = len(runs)
    logger.info(
        "HPU warmup plan: %d runs (%d prompt, %d decode buckets, %d packed-prefill variants), %s",
        total,
        len(runner.bucket_plan.prompt),
        len(runner.bucket_plan.decode),
        total - len(runner.bucket_plan.prompt) - len(runner.bucket_plan.decode),
        f"capturing {total} HPU graphs" if runner.graphs.enabled else "no HPU graphs",
    )
    start = time.perf_counter()
    progress_log = _WarmupProgress(total, start)
    try:
        from tqdm import tqdm

        progress = tqdm(runs, desc="HPU warmup", unit="bucket", leave=False)
    except ImportError:  # tqdm comes with vLLM; keep working without it
        progress = runs
    vision.warm(runner)  # a multimodal model's encoder, per image size to warm
    # With LoRA on, every bucket runs with max_loras dummy adapters loaded (removed after).
    with runner.maybe_setup_dummy_loras(runner.lora_config):
        for bucket, packed in progress:
            run_bucket(runner, bucket, num_blocks, packed=packed)
            runner.recompiles.warmed.add(runner.recompiles.shape(bucket, packed))
            progress_log.step()
    if runner.lora_config:
        runner.lora_warmed_shapes = set(hpu_lora.punica_wrapper_of(runner.lora_manager).shapes)
    runner.seam.synchronize()
    runner.warmup_seconds = time.perf_counter() - start
    runner.recompiles.warmup_done = True
    if runner.compiled_model is not None:
        runner.compiled_model.warmup_done()
    graphs = getattr(getattr(runner, "graphs", None), "graphs", None)  # HPU graphs, if any
    runner.step_metrics.set_warmup(runner.warmup_seconds, len(graphs) if graphs else 0)
    logger.info(
        "HPU warmup: %d prompt + %d decode buckets in %.2f s; %d HPU graphs captured in %.2f s",
        len(runner.bucket_plan.prompt),
        len(runner.bucket_plan.decode),
        runner.warmup_seconds,
        runner.graphs.stats.captured,
        runner.graphs.stats.capture_seconds,
    )


def warmup_runs(runner: Any, plan: BucketPlan) -> list[tuple[Bucket, bool]]:
    """What warmup runs of `plan`, as (bucket, packed): each bucket once, then the
    packed-prefill variant of the single-row prompt buckets where packing changes the attention
    branch (a shape of its own on a Gaudi); buckets only packed rows reach (more new tokens than
    max_model_len) in their packed variant alone. With HPU graphs on, one graph each."""
    longest = runner.max_model_len
    runs = [
        (b, False) for b in (*plan.prompt, *plan.decode) if not step_layout.packed_only(b, longest)
    ]
    runs += [
        (b, True)
        for b in plan.prompt
        if plan.pack_prefills
        and (runner.graphs.needs_packed_variant(b) or step_layout.packed_only(b, longest))
    ]
    return runs


@torch.inference_mode()  # as serving steps run (vLLM's execute_model): tensors, and the
# guards of a compiled pass on them, are the same kind in warmup and serving
def run_bucket(runner: Any, bucket: Bucket, num_blocks: int, *, packed: bool = False) -> None:
    """One warmup run of `bucket` (its packed-prefill variant if `packed`), and of the draft
    head on it when there is one."""
    block_size = runner.block_size
    layout, seq_lens = step_layout.layout_for_bucket(
        bucket, block_size, packed=packed, max_model_len=runner.max_model_len
    )
    n = len(seq_lens)
    if runner.lora_config:
        runner._set_active_loras(
            *hpu_lora.warmup_mapping(layout.query_lens, runner.lora_config.max_loras)
        )
    # Every warmup sequence reads and writes block 0, the null block that vLLM never hands
    # to a request, so warmup cannot disturb cached data.
    max_blocks = max(-(-s // block_size) for s in seq_lens)
    block_table = torch.zeros(n, max_blocks, dtype=torch.int32)
    total = layout.num_tokens_padded
    num_real = sum(layout.query_lens)
    slot_mapping = torch.zeros(num_real, dtype=torch.int64, device=runner.device)
    metadata = build_metadata(
        layout=layout,
        seq_lens=seq_lens,
        block_table=block_table,
        slot_mapping=slot_mapping,
        block_size=block_size,
        device=runner.device,
        # An mm prefix LM's graphs take the image-span branch on every prefill step.
        image_spans={} if runner.is_mm_prefix_lm else None,
        # State-space layers: every warmup sequence reads and writes state slot 0 (the null
        # block) likewise.
        state_slots=[0] * n if runner.has_state_layers else None,
    )
    runner._forward_with_metadata(metadata, total, n)
    if runner.draft_bucketing is not None:
        # The draft head runs on every bucket too (its passes use the target's buckets).
        layers = runner._attention_layer_names()
        runner.draft_bucketing.warm(dict.fromkeys(layers, metadata), total)


def attention_groups(runner: Any) -> list[tuple[Any, list[str], int | None]]:
    """The sets of layers that read one metadata object in a serving step (vLLM builds one per
    attention group: the layers of a KV-cache group that share a backend), each with its
    KV-cache group and its chunk of chunked local attention (None for other layers)."""
    sets = []
    attn_groups = getattr(runner, "attn_groups", None) or []
    for gid, group in enumerate(runner.kv_cache_config.kv_cache_groups):
        if gid < len(attn_groups) and attn_groups[gid]:
            for ag in attn_groups[gid]:
                sets.append((group, list(ag.layer_names), chunked_local.chunk_of(ag.backend)))
        else:  # no attention groups formed (a runner under test): the whole KV-cache group
            sets.append((group, list(group.layer_names), None))
    return sets


def metadata_by_layer(
    runner: Any,
    metadata: HPUAttentionMetadata,
    own: Callable[[HPUAttentionMetadata], HPUAttentionMetadata],
) -> dict[str, HPUAttentionMetadata]:
    """Warmup's metadata of one bucket for every layer, as a serving step hands it out: per
    attention group, state fields for a state group only (`hybrid.for_group`), the chunk for
    chunked local layers; `own(md)` makes each group's object its own (a deep copy, the
    graphs' static buffers)."""
    by_layer: dict[str, HPUAttentionMetadata] = {}
    for group, names, chunk in attention_groups(runner):
        group_md = own(hybrid.for_group(metadata, group))
        if chunk is not None:
            group_md = chunked_local.with_chunk(group_md, chunk)
        by_layer.update(dict.fromkeys(names, group_md))
    return by_layer


def forward_with_metadata(
    runner: Any,
    metadata: HPUAttentionMetadata,
    total: int,
    n: int,
    *,
    capture: bool | None = None,
) -> None:
    """Warmup's forward pass of one bucket; with HPU graphs on (unless `capture` is False),
    the capture of its graph. `n` sequences get logits (none for a padding-only step)."""
    input_ids, positions, inputs_embeds, model_kwargs = step_inputs(runner, total)
    pp = get_pp_group()
    # A pipeline stage after the first takes the previous stage's hidden states: warm it with
    # intermediate tensors of the bucket's padded token count, as serving steps pass them.
    intermediate = None if pp.is_first_rank else _intermediate_tensors_for(runner, total)
    capture = runner.graphs.enabled if capture is None else capture and runner.graphs.enabled
    if capture:
        attn_metadata = runner._static_metadata(metadata)
    else:
        # Metadata of its own (layout and tensors) per attention group, as serving steps have:
        # a compiled graph guards an object through the first layer that read it, and which
        # layers share it by identity, so layers sharing one object here and not in serving
        # (state and attention groups; Gemma 4's sliding and full layers, Llama 4's chunked
        # and global ones) would compile every bucket again in serving.
        attn_metadata = metadata_by_layer(runner, metadata, copy.deepcopy)
    with set_forward_context(
        attn_metadata,
        runner.vllm_config,
        num_tokens=total,
        num_tokens_across_dp=runner._num_tokens_across_dp(total),
        cudagraph_runtime_mode=CUDAGraphMode.NONE,
    ):
        if capture:
            buckets = metadata.layout.buckets
            name = " + ".join(str(b) for b in buckets)
            start = time.perf_counter()
            hidden = runner.graphs.capture(
                (buckets, metadata.prefill_packed),
                runner.seam.Graph(f"{name} packed" if metadata.prefill_packed else name),
                runner._graph_forward(input_ids, positions, attn_metadata, inputs_embeds),
                runner._graph_inputs(input_ids, positions, attn_metadata, inputs_embeds),
                attn_metadata,
            )
            runner.seam.synchronize()
            runner.graphs.stats.capture_seconds += time.perf_counter() - start
        else:
            hidden = runner._run_model(
                input_ids=input_ids,
                positions=positions,
                intermediate_tensors=intermediate,
                inputs_embeds=inputs_embeds,
                **model_kwargs,
            )
    if not pp.is_last_rank:
        # A stage before the last returns intermediate tensors; the LM head is not on it.
        runner.seam.mark_step()
        return
    if isinstance(hidden, tuple):
        hidden = hidden[0]
    if not runner.is_pooling_model and n:
        # A pooling model has no LM head: its pooler reads the hidden states per request
        # after the padded forward pass, so warmup has nothing more to run for it.
        logits = runner.model.compute_logits(hidden[:n])
        del logits
    runner.seam.mark_step()


def step_inputs(
    runner: Any, total: int
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None, dict[str, Any]]:
    """What a serving step of `total` padded tokens hands the model, from the runner's own
    buffers, so that warmup compiles the pass serving runs (vLLM's `_preprocess`): token ids,
    or for a multimodal model (and with prompt embeddings) the input embeddings into which vLLM
    merged the encoder outputs, plus the model's extra inputs; the 3-row positions of M-RoPE.

    HPU graphs record these same buffers; under torch.compile each bucket compiles for them."""
    positions = runner.mrope_positions.gpu[:, :total] if runner.uses_mrope else None
    if positions is None:
        positions = runner.positions[:total]
    first_rank = get_pp_group().is_first_rank
    if first_rank and runner.supports_mm_inputs and not runner.model_config.is_encoder_decoder:
        input_ids, inputs_embeds = runner._prepare_mm_inputs(total)
        kwargs = {**runner._init_model_kwargs(num_reqs=0), **runner._dummy_mm_kwargs(1)}
        return input_ids, positions, inputs_embeds, kwargs
    if first_rank and runner.enable_prompt_embeds:
        return None, positions, runner.inputs_embeds.gpu[:total], {}
    return runner.input_ids.gpu[:total], positions, None, {}


def _intermediate_tensors_for(runner: Any, num_tokens: int) -> Any:
    """The runner's receive buffers for the previous stage's tensors, `num_tokens` long
    (allocated once at the runner's largest token count, as vLLM's runner does)."""
    if getattr(runner, "intermediate_tensors", None) is None:
        runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
            batch_size=runner.max_num_tokens,
            dtype=runner.model_config.dtype,
            device=runner.device,
        )
    return runner.sync_and_gather_intermediate_tensors(num_tokens, None, False)
