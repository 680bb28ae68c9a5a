"""HPUModelRunner: vLLM's model runner with every forward pass padded to a warmed bucket.

It reuses vLLM's device-neutral runner (input batch, scheduler bookkeeping, sampler) and owns what
Gaudi needs: the step layout in bucketed static shapes (`step_layout.py`), the warmup of every
bucket, and the count of shapes run after warmup that were not warmed ("recompiles").
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from vllm.config import CUDAGraphMode, VllmConfig
from vllm.distributed.parallel_state import get_dp_group, get_pp_group, get_tp_group
from vllm.forward_context import BatchDescriptor, get_forward_context, set_forward_context
from vllm.logger import init_logger
from vllm.model_executor.model_loader import get_model
from vllm.v1.utils import CpuGpuBuffer
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_gaudi_platform import envs
from vllm_gaudi_platform.attention import step_layout
from vllm_gaudi_platform.attention.backend import HPUAttentionMetadata, build_metadata
from vllm_gaudi_platform.bucketing import Bucket, BucketPlan, plan_from_env, prefill_batch_max
from vllm_gaudi_platform.observability import metrics as hpu_metrics
from vllm_gaudi_platform.observability.step_trace import TraceRecorder
from vllm_gaudi_platform.runner import data_parallel, hpu_graphs, spec_decode
from vllm_gaudi_platform.runner import lora as hpu_lora
from vllm_gaudi_platform.seam import backend as seam_backend

logger = init_logger(f"vllm.{__name__}")

# Warmup progress goes to the log (not only a tqdm bar) at least this often, and at every tenth
# of the plan, so a supervisor reading the log sees it advance.
WARMUP_LOG_INTERVAL_S = 10.0
# Buckets warmed before the first estimate of the total warmup time.
WARMUP_ESTIMATE_AFTER = 3


class RecompileError(RuntimeError):
    """A forward pass ran a shape that warmup did not cover while VLLM_FULL_WARMUP=true."""


class RecompileTracker:
    """Counts forward-pass shapes run after warmup that warmup did not run, and the buckets run
    after warmup per phase (prompt, decode, verify)."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.warmed: set[Bucket] = set()
        self.warmup_done = False
        self.count = 0
        self.seen: list[Bucket] = []
        self.hits: dict[str, int] = {}

    def record(self, layout: step_layout.StepLayout) -> None:
        if not self.warmup_done:
            return
        for bucket in layout.buckets:
            self.hits[bucket.phase] = self.hits.get(bucket.phase, 0) + 1
            if bucket in self.warmed:
                continue
            self.count += 1
            self.seen.append(bucket)
            logger.warning(
                "Recompile #%d: %s bucket bs=%d query=%d ctx_blocks=%d was not warmed up",
                self.count,
                bucket.phase,
                bucket.batch_size,
                bucket.query_len,
                bucket.ctx_blocks,
            )
            if self.strict:
                raise RecompileError(
                    f"{bucket} was not warmed up and {envs.VLLM_FULL_WARMUP}=true forbids "
                    "recompiles after warmup; widen the bucket ranges (VLLM_*_BUCKET_MAX) or "
                    "unset VLLM_FULL_WARMUP."
                )
            self.warmed.add(bucket)  # compiled once now; later runs reuse it


@contextlib.contextmanager
def _cuda_streams_on_seam() -> Iterator[None]:
    """Route the CUDA stream/event API that vLLM's runner calls to the seam's streams and events.

    The constructor makes events and streams; under async scheduling each step also records an
    event on the input preparation and copies the sampled tokens to the host on a side stream
    (`AsyncGPUModelRunnerOutput`). On a Gaudi these become HPU streams and events; in emulation
    the seam's are exact for a CPU that finishes every op before returning.
    """
    seam = seam_backend()

    def event(*args: Any, blocking: bool | None = None, **kwargs: Any) -> Any:
        # CUDA's `blocking` (sleep rather than spin while waiting) has no HPU counterpart.
        return seam.Event(*args, **kwargs)

    patched = {
        (torch, "Event"): seam.Event,
        (torch.cuda, "Event"): event,
        (torch.cuda, "Stream"): seam.Stream,
        (torch.cuda, "current_stream"): seam.current_stream,
        (torch.cuda, "stream"): seam.stream,
    }
    # Process-wide, for the duration of the call only (see the ledger in the drift guard).
    saved = {key: getattr(*key) for key in patched}
    for (module, name), value in patched.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)


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


def _scatter_tokens(out: Any, tokens: torch.Tensor, total: int, into: Any = None) -> Any:
    """Write one pass's forward output (hidden states, or EAGLE-3's (hidden, [aux...])) rows
    0..len(tokens) to rows `tokens` of `into`, a zero tensor of the step's padded token count
    made on first use."""
    if isinstance(out, torch.Tensor):
        if into is None:
            into = out.new_zeros((total, *out.shape[1:]))
        into[tokens] = out[: tokens.shape[0]]
        return into
    if isinstance(out, (tuple, list)):
        targets = into if into is not None else [None] * len(out)
        return type(out)(_scatter_tokens(o, tokens, total, t) for o, t in zip(out, targets))
    raise TypeError(f"unexpected forward output {type(out).__name__} in a split mixed step")


class HPUModelRunner(GPUModelRunner):
    def __init__(self, vllm_config: VllmConfig, device: torch.device) -> None:
        self.seam = seam_backend()
        self.linears_on_seam = 0  # set by load_model
        sched = vllm_config.scheduler_config
        # A step holds a prefill part padded to <= max_num_batched_tokens plus a decode part
        # padded to <= max_num_seqs, so the token buffers need room for both.
        budget = sched.max_num_batched_tokens
        sched.max_num_batched_tokens = budget + sched.max_num_seqs
        try:
            with _cuda_streams_on_seam():
                super().__init__(vllm_config, device)
        finally:
            sched.max_num_batched_tokens = budget
        self.use_cuda_graph = False
        if self.seam.SHARED_HOST_MEMORY:
            self._share_host_buffers()
        self.max_num_batched_tokens = budget
        self.block_size = self.cache_config.block_size
        # Provisional until the KV cache exists (initialize_kv_cache rebuilds it).
        self.bucket_plan: BucketPlan = plan_from_env(
            max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=self.max_model_len,
            block_size=self.cache_config.block_size,
        )
        self.recompiles = RecompileTracker(strict=envs.get_bool(envs.VLLM_FULL_WARMUP))
        # Serving counters for the API server's /metrics (see observability/metrics.py).
        self.step_metrics = hpu_metrics.StepMetrics(hpu_metrics.worker_channel(vllm_config))
        self.trace_recorder: TraceRecorder | None = None
        trace_path = (envs.get_raw(envs.VLLM_BUCKETING_RECORD_TRACE) or "").strip()
        # Every tensor- and pipeline-parallel rank runs the same steps: the first of them records
        # (each data-parallel rank runs its own steps, and records them).
        if trace_path and get_tp_group().rank_in_group == 0 and get_pp_group().rank_in_group == 0:
            self.trace_recorder = TraceRecorder(
                trace_path,
                block_size=self.block_size,
                max_num_batched_tokens=budget,
                max_prefill_batch=prefill_batch_max(),
            )
        self.warmup_seconds: float | None = None
        self._planning = False
        # EAGLE-style drafters: their forward passes on the plan's buckets (spec_decode.py).
        self.draft_bucketing: spec_decode.DraftBucketing | None = None
        # HPU graphs: one per warmed bucket, replayed by every serving step of that bucket
        # (hpu_graphs.py); enforce_eager=True runs every step op by op instead.
        # LoRA steps stay eager: the adapter mapping is not kept in static per-bucket buffers.
        # So do pipeline stages: a graph records input ids and positions only, while a stage
        # after the first reads the previous stage's hidden states and residual.
        self.graphs = hpu_graphs.BucketGraphs(
            enabled=not self.model_config.enforce_eager
            and self.lora_config is None
            and self.parallel_config.pipeline_parallel_size == 1
        )
        self._graph_weights: dict[str, torch.nn.Parameter] = {}
        # A mixed prefill + decode step runs as two forward passes, each on a warmed bucket
        # (step_layout.split_mixed). Not with LoRA (its token mapping covers the whole step),
        # pipeline stages (the next stage receives one tensor per step) or data parallelism
        # (every DP rank must meet the same MoE collectives, step by step).
        self.split_mixed_steps = (
            self.lora_config is None
            and self.parallel_config.pipeline_parallel_size == 1
            and self.parallel_config.data_parallel_size == 1
        )
        self.split_steps = 0  # mixed steps run as two passes
        self.idle_dp_steps = 0  # padding-only steps of this DP rank while others had requests

    # ------------------------------------------------------------------ device plumbing
    def _share_host_buffers(self) -> None:
        """In emulation host and device are the same memory: let the 'device' side of every
        host/device buffer pair alias the host side instead of copying."""
        for value in vars(self).values():
            if isinstance(value, CpuGpuBuffer):
                value.gpu = value.cpu
        for name, value in list(vars(self.input_batch).items()):
            if name.endswith("_cpu_tensor") and isinstance(value, torch.Tensor):
                device_name = name[: -len("_cpu_tensor")]
                if isinstance(getattr(self.input_batch, device_name, None), torch.Tensor):
                    setattr(self.input_batch, device_name, value)
        for table in self.input_batch.block_table.block_tables:
            for value in vars(table).values():
                if isinstance(value, CpuGpuBuffer):
                    value.gpu = value.cpu

    def _sync_device(self) -> None:
        self.seam.synchronize()

    def _to_list(self, sampled_token_ids: torch.Tensor) -> list[list[int]]:
        return sampled_token_ids.tolist()

    def _zero_block_ids(self, block_ids: list[int]) -> None:
        if not block_ids:
            return
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        seen: set[int] = set()
        for kv in self.kv_caches:
            if isinstance(kv, torch.Tensor) and kv.data_ptr() not in seen:
                seen.add(kv.data_ptr())
                if kv.element_size() == 1:  # FP8 cache: torch has no FP8 index_fill on the CPU
                    kv = kv.view(torch.uint8)  # all-zero bits are 0.0 in FP8 too
                kv.index_fill_(0, index, 0)

    def initialize_kv_cache(self, kv_cache_config, *args: Any, **kwargs: Any) -> None:
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
        # The plan's block arithmetic must use the block size and count the KV cache really has.
        # self.kv_cache_config: vLLM's runner adds a group for encoder-only layers there (a
        # BERT-style model has no other group).
        spec = self.kv_cache_config.kv_cache_groups[0].kv_cache_spec
        self.block_size = spec.block_size
        if self.trace_recorder is not None:
            self.trace_recorder.block_size = self.block_size
        sched = self.scheduler_config
        self.bucket_plan = step_layout.with_packed_context(
            plan_from_env(
                max_num_seqs=sched.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                block_size=self.block_size,
                num_kv_blocks=kv_cache_config.num_blocks,
            )
        )
        # Speculative decoding: verification steps (1 + k tokens per sequence) get their buckets.
        self.bucket_plan = spec_decode.with_verify_buckets(
            self.bucket_plan,
            spec_decode.verify_buckets(
                self.bucket_plan,
                num_speculative_tokens=spec_decode.num_speculative_tokens(self.speculative_config),
                max_model_len=self.max_model_len,
                block_size=self.block_size,
                max_num_batched_tokens=self.max_num_batched_tokens,
            ),
        )

    def load_model(
        self, load_dummy_weights: bool = False, *, model: torch.nn.Module | None = None
    ) -> None:
        """Load the model (or take `model`, already loaded, as vLLM's runner does)."""
        if load_dummy_weights:
            raise ValueError("Dummy weights (elastic EP scale-up) are not supported on HPU.")
        logger.info("Loading model %s on %s", self.model_config.model, self.seam.NAME)
        # Any: vLLM's model classes add methods (compute_logits, ...) that nn.Module lacks.
        loaded: Any = model if model is not None else get_model(vllm_config=self.vllm_config)
        self.model = loaded
        if self.lora_config:
            # vLLM's LoRA manager swaps the supported layers for LoRA layers whose products run
            # through the platform's punica wrapper (runner/lora.py, PunicaWrapperHPU).
            self.model = self.load_lora_model(self.model, self.vllm_config, self.device)
        # A quantization method may transform the loaded model before warmup (INC FP8 patches its
        # layers for measurement or FP8). Duck-typed: the platform never imports a quant wheel.
        after_load = getattr(self.vllm_config.quant_config, "hpu_after_load_model", None)
        if after_load is not None:
            self.model = after_load(self.model)
        if hasattr(self, "drafter"):
            self.drafter.load_model(self.model)
            if self.use_aux_hidden_state_outputs:
                # EAGLE-3: the target also returns the hidden states of the layers the head reads
                # (vLLM's constructor set the flag; its load_model tells the model which layers).
                self._setup_eagle3_aux_hidden_state_outputs()
            self.draft_bucketing = spec_decode.draft_bucketing(self)
        self.linears_on_seam = self._route_linears_through_seam()
        # HPU graphs: without a windowed layer, a packed prefill row with cached context takes
        # the same attention branch as one sequence per row, so one graph serves both.
        layers = self.vllm_config.compilation_config.static_forward_context.values()
        self.graphs.packing_matters = any(
            getattr(getattr(layer, "impl", None), "sliding_window", None) is not None
            for layer in layers
        )

    def _route_linears_through_seam(self) -> int:
        """Send the unquantized linear layers' matmul (vLLM's UnquantizedLinearMethod, which
        calls F.linear off CUDA and CPU) to the seam's `linear`, in the model and the drafter.
        Quantized layers keep their method's kernels. Returns the number of layers routed."""
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod

        linear = self.seam.linear

        def gemm(
            layer: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
        ) -> torch.Tensor:
            return linear(x, weight, bias)

        models = [self.model, getattr(getattr(self, "drafter", None), "model", None)]
        routed = 0
        for model in (m for m in models if isinstance(m, torch.nn.Module)):
            for module in model.modules():
                method = getattr(module, "quant_method", None)
                if method is not None and type(method) is UnquantizedLinearMethod:
                    method._gemm_impl = gemm
                    routed += 1
        logger.debug("%d unquantized linear layers run through the seam's linear", routed)
        return routed

    def get_model(self) -> torch.nn.Module:
        return self.model

    def finalize_calibration(self) -> None:
        """Let the quantization method write what it measured (INC MEASURE mode); idempotent."""
        finalize = getattr(self.vllm_config.quant_config, "hpu_finalize_calibration", None)
        if finalize is not None and getattr(self, "model", None) is not None:
            finalize(self.model)

    # ------------------------------------------------------------------ bucketed execution
    def execute_model(self, scheduler_output, intermediate_tensors=None):
        self._planning = True
        try:
            with _cuda_streams_on_seam():
                return super().execute_model(scheduler_output, intermediate_tensors)
        finally:
            self._planning = False
            step_layout.set_current(None)

    def sample_tokens(self, grammar_output):
        """vLLM's sampling step; under async scheduling it returns before the sampled tokens
        reach the host (an `AsyncGPUModelRunnerOutput` copying them on a side stream) and keeps
        them on the device for the next step's input ids."""
        with _cuda_streams_on_seam():
            return super().sample_tokens(grammar_output)

    def propose_draft_token_ids(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's drafting; a draft head's forward passes run on the plan's buckets."""
        if self.draft_bucketing is None:
            return super().propose_draft_token_ids(*args, **kwargs)
        with self.draft_bucketing.propose():
            return super().propose_draft_token_ids(*args, **kwargs)

    def _determine_batch_execution_and_padding(
        self,
        num_tokens: int,
        num_reqs: int,
        num_scheduled_tokens_np: np.ndarray,
        max_num_scheduled_tokens: int,
        *args: Any,
        **kwargs: Any,
    ):
        if not self._planning:
            # vLLM's own dummy/profiling runs: exact shape, not a serving step.
            step_layout.set_current(None)
            return (CUDAGraphMode.NONE, BatchDescriptor(num_tokens=num_tokens), False, None, None)
        # One vectorized sum and two tolist() calls: a per-element int() loop costs ~0.1 ms per
        # 256 requests, every step.
        scheduled = num_scheduled_tokens_np[:num_reqs]
        computed = self.input_batch.num_computed_tokens_cpu[:num_reqs]
        query_lens = scheduled.tolist()
        seq_lens = (computed.astype(np.int64) + scheduled).tolist()
        layout = step_layout.plan_step(
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_size=self.block_size,
            plan=self.bucket_plan,
        )
        if self.parallel_config.data_parallel_size > 1:
            ctx_blocks = [-(-(s - q) // self.block_size) for s, q in zip(seq_lens, query_lens)]
            layout = self._agree_across_dp(layout, ctx_blocks)
        elif self.split_mixed_steps:
            layout = step_layout.split_mixed(layout)
        self.recompiles.record(layout)
        self.step_metrics.record(layout, seq_lens, self.block_size, self.recompiles.count)
        if self.trace_recorder is not None:
            self.trace_recorder.record(query_lens, seq_lens)
        step_layout.set_current(layout)
        padded = layout.num_tokens_padded
        across_dp = self._num_tokens_across_dp(padded)
        return (CUDAGraphMode.NONE, BatchDescriptor(num_tokens=padded), False, across_dp, None)

    # ------------------------------------------------------------------ data parallelism
    def _agree_across_dp(
        self, layout: step_layout.StepLayout | None, ctx_blocks: list[int] | None = None
    ) -> step_layout.StepLayout:
        """This step's layout in the buckets all DP ranks run (see data_parallel.py): one
        all-reduce (MAX) of the padded dimensions over the DP group, every step, on every rank."""
        vector = data_parallel.shape_vector(layout, ctx_blocks)
        shape = torch.tensor(vector, dtype=torch.int64)
        dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=get_dp_group().cpu_group)
        maxima = tuple(int(x) for x in shape.tolist())
        return data_parallel.pad_to_agreed(layout, maxima, self.bucket_plan)

    def _num_tokens_across_dp(self, num_tokens: int) -> torch.Tensor | None:
        """vLLM's per-DP-rank token counts for the forward context (MoE token exchange): every
        rank runs the same agreed bucket, so every count is this rank's padded count."""
        size = self.parallel_config.data_parallel_size
        if size == 1:
            return None
        return torch.full((size,), num_tokens, dtype=torch.int32)

    @torch.no_grad()
    def execute_idle_dp_step(self) -> None:
        """A step of a DP rank without requests while other DP ranks have some: agree on the
        step's buckets like a busy rank and run them on padding only, so that the MoE token
        exchange in every layer meets the same collectives, shapes and warmed buckets."""
        layout = self._agree_across_dp(None)
        total = layout.num_tokens_padded
        if total == 0:
            return
        self.recompiles.record(layout)
        metadata = build_metadata(
            layout=layout,
            seq_lens=[],
            block_table=torch.zeros(0, 1, dtype=torch.int32),
            slot_mapping=torch.zeros(0, dtype=torch.int64, device=self.device),
            block_size=self.block_size,
            device=self.device,
        )
        self._forward_with_metadata(metadata, total, 0, capture=False)
        self.idle_dp_steps += 1

    # ------------------------------------------------------------------ HPU graphs
    def _model_forward(
        self,
        input_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **model_kwargs: Any,
    ) -> Any:
        """A serving step: replay its bucket's graph when it has one, else run eagerly; a mixed
        step split in two parts runs one forward pass per part."""
        entry = None
        if (
            self._planning
            and input_ids is not None
            and inputs_embeds is None
            and intermediate_tensors is None
            and not model_kwargs
        ):
            layout = step_layout.current()
            if layout is not None and layout.parts is not None:
                assert positions is not None
                split = self._forward_in_parts(layout, input_ids, positions)
                if split is not None:
                    return split
            entry = self.graphs.lookup(layout, get_forward_context().attn_metadata)
        if entry is None:
            return super()._model_forward(
                input_ids=input_ids,
                positions=positions,
                intermediate_tensors=intermediate_tensors,
                inputs_embeds=inputs_embeds,
                **model_kwargs,
            )
        step_metadata = get_forward_context().attn_metadata
        assert isinstance(step_metadata, dict)
        assert input_ids is not None and positions is not None
        ids, pos = input_ids, positions
        return self.graphs.replay(
            entry,
            step_metadata,
            lambda static: self._graph_inputs(ids, pos, static),
        )

    def _forward_in_parts(
        self, layout: step_layout.StepLayout, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> Any:
        """A mixed step as two forward passes, the prefill part's bucket then the decode part's,
        each replaying its own graph (or eager without one); None when the step's metadata was
        not built in parts (then the step runs as one pass).

        Each pass reads its own tokens at the front of vLLM's persistent token buffers (where its
        graph was captured); the buffers get the step's tokens back afterwards, since vLLM reads
        them again (drafting). The hidden states come back in the step's token order, padding
        rows zero, so vLLM's logits and pooling indices are unchanged.
        """
        context = get_forward_context()
        step_md = context.attn_metadata
        split = layout.parts
        assert isinstance(step_md, dict) and split is not None
        if positions.dim() != 1 or any(
            not isinstance(md, HPUAttentionMetadata) or md.parts is None for md in step_md.values()
        ):
            return None
        saved_ids, saved_pos = input_ids.clone(), positions.clone()
        saved_padding = context.is_padding
        passes = (
            (split.prefill, split.prefill_tokens),
            (split.decode, split.decode_tokens),
        )
        merged: Any = None
        try:
            # The step's padding mask (vLLM's MoE may skip padded tokens) is for one pass.
            context.is_padding = None
            for index, (part, token_list) in enumerate(passes):
                tokens = torch.tensor(token_list, dtype=torch.int64, device=input_ids.device)
                n, total = len(token_list), part.num_tokens_padded
                ids, pos = input_ids[:total], positions[:total]
                ids[:n].copy_(saved_ids[tokens])
                ids[n:].zero_()
                pos[:n].copy_(saved_pos[tokens])
                pos[n:].zero_()
                part_md = {name: md.parts[index] for name, md in step_md.items()}
                context.attn_metadata = part_md  # type: ignore[assignment]
                step_layout.set_current(part)
                entry = self.graphs.lookup(part, part_md)
                if entry is not None:
                    out = self.graphs.replay(
                        entry, part_md, functools.partial(self._graph_inputs, ids, pos)
                    )
                else:
                    out = super()._model_forward(input_ids=ids, positions=pos)
                merged = _scatter_tokens(out, tokens, input_ids.shape[0], merged)
        finally:
            context.attn_metadata = step_md
            context.is_padding = saved_padding
            step_layout.set_current(layout)
            input_ids.copy_(saved_ids)
            positions.copy_(saved_pos)
        self.split_steps += 1
        return merged

    def _graph_forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: dict[str, HPUAttentionMetadata],
    ) -> Callable[[], Any]:
        """The forward pass a graph records: the model on the static token buffers, with the
        bucket's static attention metadata in the forward context (whoever set the context)."""

        def forward() -> Any:
            context = get_forward_context()
            saved = context.attn_metadata
            context.attn_metadata = metadata  # type: ignore[assignment]
            try:
                return self.model(input_ids=input_ids, positions=positions)
            finally:
                context.attn_metadata = saved

        return forward

    def _graph_inputs(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: dict[str, HPUAttentionMetadata],
    ) -> dict[str, Any]:
        """Every buffer a graph reads, by name (the emulated Graph checks them at each replay)."""
        distinct = list({id(md): md for md in metadata.values()}.values())
        return {
            "input_ids": input_ids,
            "positions": positions,
            "attn_metadata": distinct,
            "kv_caches": [kv for kv in self.kv_caches if isinstance(kv, torch.Tensor)],
            "weights": self._graph_weights,
        }

    def _static_metadata(self, metadata: HPUAttentionMetadata) -> dict[str, HPUAttentionMetadata]:
        """Per-layer static metadata of one bucket: one copy per KV-cache group, since each
        group's step metadata is written into its own buffers."""
        static: dict[str, HPUAttentionMetadata] = {}
        for group in self.kv_cache_config.kv_cache_groups:
            group_md = hpu_graphs.static_metadata(metadata)
            static.update(dict.fromkeys(group.layer_names, group_md))
        return static

    def recapture_graphs(self) -> None:
        """Capture every bucket's graph again: sleep mode re-allocates the weights and the KV
        cache, and a graph holds the addresses it was captured with."""
        if not self.graphs.graphs:
            return
        keys = list(self.graphs.graphs)
        self.graphs.clear()
        start = time.perf_counter()
        num_blocks = self.cache_config.num_gpu_blocks or 0
        for buckets, packed in keys:
            self._run_bucket(buckets[0], num_blocks, packed=packed)
        logger.info("HPU graphs: %d recaptured in %.2f s", len(keys), time.perf_counter() - start)

    # ------------------------------------------------------------------ warmup
    def warmup_model(self) -> None:
        """Run every bucket of the plan once, so serving never meets a new shape; with HPU
        graphs on, that run captures the bucket's graph.

        The plan (bucket and graph count) is logged before the first bucket, an estimate of the
        total time after the first few, and progress lines (done/total, elapsed, time left) at
        least every WARMUP_LOG_INTERVAL_S seconds and at every tenth of the plan.
        """
        logger.info("HPU bucket plan:\n%s", self.bucket_plan.describe())
        if envs.get_bool(envs.VLLM_SKIP_WARMUP):
            logger.warning(
                "%s=true: warmup skipped; first steps will compile", envs.VLLM_SKIP_WARMUP
            )
            self.recompiles.warmup_done = True
            return
        # Each bucket once, then the packed-prefill variant of the single-row prompt buckets
        # where packing changes the attention branch (a shape of its own on a Gaudi).
        runs = [(b, False) for b in (*self.bucket_plan.prompt, *self.bucket_plan.decode)]
        runs += [(b, True) for b in self.bucket_plan.prompt if self.graphs.needs_packed_variant(b)]
        num_blocks = self.cache_config.num_gpu_blocks or 0
        total = len(runs)
        logger.info(
            "HPU warmup plan: %d runs (%d prompt, %d decode buckets, %d packed-prefill "
            "variants), %s",
            total,
            len(self.bucket_plan.prompt),
            len(self.bucket_plan.decode),
            total - len(self.bucket_plan.prompt) - len(self.bucket_plan.decode),
            f"capturing {total} HPU graphs" if self.graphs.enabled else "no HPU graphs",
        )
        start = time.perf_counter()
        progress_log = _WarmupProgress(total, start)
        try:
            from tqdm import tqdm

            progress = tqdm(runs, desc="HPU warmup", unit="bucket", leave=False)
        except ImportError:  # tqdm comes with vLLM; keep working without it
            progress = runs
        # With LoRA on, every bucket runs with max_loras dummy adapters loaded (removed after).
        with self.maybe_setup_dummy_loras(self.lora_config):
            for bucket, packed in progress:
                self._run_bucket(bucket, num_blocks, packed=packed)
                self.recompiles.warmed.add(bucket)
                progress_log.step()
        if self.lora_config:
            self.lora_warmed_shapes = set(hpu_lora.punica_wrapper_of(self.lora_manager).shapes)
        self.seam.synchronize()
        self.warmup_seconds = time.perf_counter() - start
        self.recompiles.warmup_done = True
        graphs = getattr(getattr(self, "graphs", None), "graphs", None)  # HPU graphs, if any
        self.step_metrics.set_warmup(self.warmup_seconds, len(graphs) if graphs else 0)
        logger.info(
            "HPU warmup: %d prompt + %d decode buckets in %.2f s; %d HPU graphs captured in %.2f s",
            len(self.bucket_plan.prompt),
            len(self.bucket_plan.decode),
            self.warmup_seconds,
            self.graphs.stats.captured,
            self.graphs.stats.capture_seconds,
        )

    @torch.no_grad()
    def _run_bucket(self, bucket: Bucket, num_blocks: int, *, packed: bool = False) -> None:
        block_size = self.block_size
        layout, seq_lens = step_layout.layout_for_bucket(bucket, block_size, packed=packed)
        n = len(seq_lens)
        if self.lora_config:
            self._set_active_loras(
                *hpu_lora.warmup_mapping(layout.query_lens, self.lora_config.max_loras)
            )
        # Every warmup sequence reads and writes block 0, the null block that vLLM never hands
        # to a request, so warmup cannot disturb cached data.
        max_blocks = max(-(-s // block_size) for s in seq_lens)
        block_table = torch.zeros(n, max_blocks, dtype=torch.int32)
        total = layout.num_tokens_padded
        num_real = sum(layout.query_lens)
        slot_mapping = torch.zeros(num_real, dtype=torch.int64, device=self.device)
        metadata = build_metadata(
            layout=layout,
            seq_lens=seq_lens,
            block_table=block_table,
            slot_mapping=slot_mapping,
            block_size=block_size,
            device=self.device,
        )
        self._forward_with_metadata(metadata, total, n)
        if self.draft_bucketing is not None:
            # The draft head runs on every bucket too (its passes use the target's buckets).
            layers = self._attention_layer_names()
            self.draft_bucketing.warm(dict.fromkeys(layers, metadata), total)

    def _forward_with_metadata(
        self, metadata: HPUAttentionMetadata, total: int, n: int, *, capture: bool | None = None
    ) -> None:
        """Warmup's forward pass of one bucket; with HPU graphs on (unless `capture` is False),
        the capture of its graph. `n` sequences get logits (none for a padding-only step)."""
        input_ids = self.input_ids.gpu[:total]
        positions = self.positions[:total]
        pp = get_pp_group()
        # A pipeline stage after the first takes the previous stage's hidden states: warm it with
        # intermediate tensors of the bucket's padded token count, as serving steps pass them.
        intermediate = None if pp.is_first_rank else self._intermediate_tensors_for(total)
        capture = self.graphs.enabled if capture is None else capture and self.graphs.enabled
        if capture:
            attn_metadata = self._static_metadata(metadata)
        else:
            attn_metadata = {name: metadata for name in self._attention_layer_names()}
        with set_forward_context(
            attn_metadata,
            self.vllm_config,
            num_tokens=total,
            num_tokens_across_dp=self._num_tokens_across_dp(total),
            cudagraph_runtime_mode=CUDAGraphMode.NONE,
        ):
            if capture:
                if not self.graphs.graphs:
                    # Allocated once; sleep mode moves them, and then recapture_graphs runs.
                    self._graph_weights = dict(self.model.named_parameters())
                buckets = metadata.layout.buckets
                name = " + ".join(str(b) for b in buckets)
                start = time.perf_counter()
                hidden = self.graphs.capture(
                    (buckets, metadata.prefill_packed),
                    self.seam.Graph(f"{name} packed" if metadata.prefill_packed else name),
                    self._graph_forward(input_ids, positions, attn_metadata),
                    self._graph_inputs(input_ids, positions, attn_metadata),
                    attn_metadata,
                )
                self.seam.synchronize()
                self.graphs.stats.capture_seconds += time.perf_counter() - start
            else:
                hidden = self.model(
                    input_ids=input_ids,
                    positions=positions,
                    intermediate_tensors=intermediate,
                )
        if not pp.is_last_rank:
            # A stage before the last returns intermediate tensors; the LM head is not on it.
            self.seam.mark_step()
            return
        if isinstance(hidden, tuple):
            hidden = hidden[0]
        if not self.is_pooling_model and n:
            # A pooling model has no LM head: its pooler reads the hidden states per request
            # after the padded forward pass, so warmup has nothing more to run for it.
            logits = self.model.compute_logits(hidden[:n])
            del logits
        self.seam.mark_step()

    def _intermediate_tensors_for(self, num_tokens: int) -> Any:
        """The runner's receive buffers for the previous stage's tensors, `num_tokens` long
        (allocated once at the runner's largest token count, as vLLM's runner does)."""
        if getattr(self, "intermediate_tensors", None) is None:
            self.intermediate_tensors = self.model.make_empty_intermediate_tensors(
                batch_size=self.max_num_tokens,
                dtype=self.model_config.dtype,
                device=self.device,
            )
        return self.sync_and_gather_intermediate_tensors(num_tokens, None, False)

    def lora_unwarmed_shapes(self) -> list[tuple]:
        """LoRA kernel shapes run after warmup that warmup did not run (empty when LoRA is off)."""
        if not self.lora_config:
            return []
        wrapper = hpu_lora.punica_wrapper_of(self.lora_manager)
        return hpu_lora.unwarmed_shapes(wrapper, getattr(self, "lora_warmed_shapes", set()))

    def _attention_layer_names(self) -> list[str]:
        names: list[str] = []
        for group in self.kv_cache_config.kv_cache_groups:
            names.extend(group.layer_names)
        return names
