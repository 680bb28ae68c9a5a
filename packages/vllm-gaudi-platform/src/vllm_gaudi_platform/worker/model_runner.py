"""HPUModelRunner: vLLM's model runner with every forward pass padded to a warmed bucket.

It reuses vLLM's device-neutral runner (input batch, scheduler bookkeeping, sampler) and owns what
Gaudi needs: the step layout in bucketed static shapes (`step_layout.py`), the warmup of every
bucket, and the count of shapes run after warmup that were not warmed ("recompiles").

This module holds the runner class: construction, host/device buffers, the KV cache and the
bucketed step. Beside it in `worker/`:

- `model_loading.py`: what loading adds to vLLM's loader (LoRA, the quantization method's hook,
  the drafter, the unquantized linears routed to the seam, the compiled model);
- `warmup.py`: the warmup driver (`warmup_model`, one bucket's run and forward pass, progress log);
- `recompiles.py`: the recompile tracker (`RecompileTracker`, `RecompileError`);
- `cuda_stand_ins/cuda_streams.py`: the CUDA stream/event API routed to the seam
  (`cuda_streams_on_seam`);
- `mixed_steps.py`: a step run as several forward passes (mixed prefill + decode, or prompt rows
  in groups);
- `vision.py`: the vision encoder one image per pass, its shapes warmed per image size;
- `hpu_graphs.py`: the graphs' capture and replay (the forward pass a graph records, the buffers
  it reads, recapture after sleep); `data_parallel.py`: one agreed bucket per step for all DP
  ranks, idle ranks' padding steps; `spec_decode.py`, `lora.py`: the per-step helpers.
- `hybrid.py`: what changes for a model with Mamba state layers; `rng.py`: seeded sampling's
  rewindable generators.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from vllm.config import CUDAGraphMode, VllmConfig
from vllm.distributed.parallel_state import get_pp_group, get_tp_group
from vllm.forward_context import BatchDescriptor, get_forward_context
from vllm.logger import init_logger
from vllm.v1.utils import CpuGpuBuffer
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_gaudi_platform import envs, quant_hooks
from vllm_gaudi_platform.attention import host_tables, step_layout
from vllm_gaudi_platform.attention.metadata import HPUAttentionMetadata
from vllm_gaudi_platform.bucketing import BucketPlan, plan_from_env, prefill_batch_max
from vllm_gaudi_platform.observability import metrics as hpu_metrics
from vllm_gaudi_platform.observability.step_trace import TraceRecorder
from vllm_gaudi_platform.seam import backend as seam_backend
from vllm_gaudi_platform.worker import (
    compiled,
    data_parallel,
    hpu_graphs,
    hybrid,
    mixed_steps,
    model_loading,
    profiling,
    spec_decode,
    vision,
    warmup,
)
from vllm_gaudi_platform.worker import lora as hpu_lora
from vllm_gaudi_platform.worker.cuda_stand_ins import mamba_state_copies
from vllm_gaudi_platform.worker.cuda_stand_ins.cuda_streams import cuda_streams_on_seam
from vllm_gaudi_platform.worker.recompiles import RecompileTracker
from vllm_gaudi_platform.worker.rng import RewindableGenerator

logger = init_logger(f"vllm.{__name__}")


class HPUModelRunner(GPUModelRunner):
    def __init__(self, vllm_config: VllmConfig, device: torch.device) -> None:
        self.seam = seam_backend()
        self.linears_on_seam = 0  # set by load_model (model_loading.py), as is:
        self.compiled_model: compiled.CompiledModel | None = None
        sched = vllm_config.scheduler_config
        # A step holds a prefill part padded to <= max_num_batched_tokens plus a decode part
        # padded to <= max_num_seqs, so the token buffers need room for both.
        budget = sched.max_num_batched_tokens
        sched.max_num_batched_tokens = budget + sched.max_num_seqs
        try:
            with cuda_streams_on_seam():
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
        self.has_state_layers = False  # Mamba layers (set with the KV cache: hybrid.py)
        self._planning = False
        # EAGLE-style drafters: their forward passes on the plan's buckets (spec_decode.py).
        self.draft_bucketing: spec_decode.DraftBucketing | None = None
        # HPU graphs: one per warmed bucket, replayed by every serving step of that bucket
        # (hpu_graphs.py); enforce_eager=True runs every step op by op instead.
        # LoRA steps stay eager: the adapter mapping is not kept in static per-bucket buffers.
        # So do pipeline stages: a graph records input ids and positions only, while a stage
        # after the first reads the previous stage's hidden states and residual.
        # HPU graphs exist in lazy mode only (PT_HPU_LAZY_MODE=1); in eager mode the steps run
        # op by op, or through torch.compile where it is on.
        graphs_wanted = (
            not self.model_config.enforce_eager
            and self.lora_config is None
            and self.parallel_config.pipeline_parallel_size == 1
        )
        self.graphs = hpu_graphs.BucketGraphs(
            enabled=graphs_wanted and self.seam.graphs_supported()
        )
        if graphs_wanted and not self.graphs.enabled:
            logger.info(
                "HPU graphs are off: they need Gaudi's lazy mode (PT_HPU_LAZY_MODE=1); with "
                "PT_HPU_LAZY_MODE=0 steps run through torch.compile, once per bucket "
                "(enforce_eager=True: op by op)."
            )
        # A mixed prefill + decode step, or prompts that no bucket holds row by row when they
        # must not share a row, run as several forward passes, each on a warmed bucket
        # (step_layout.split_passes); with LoRA each pass gets its own tokens' adapter slots
        # (token_side_buffers). Not with pipeline stages (the next stage receives one tensor per
        # step) or data parallelism (every DP rank must meet the same MoE collectives, step by
        # step).
        self.steps_in_passes = (
            self.parallel_config.pipeline_parallel_size == 1
            and self.parallel_config.data_parallel_size == 1
        )
        self.split_steps = 0  # steps run in passes
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
        self.block_size = hybrid.attention_block_size(self.kv_cache_config.kv_cache_groups)
        if self.trace_recorder is not None:
            self.trace_recorder.block_size = self.block_size
        self.has_state_layers = hybrid.has_state_layers(self)
        if self.has_state_layers and self.cache_config.mamba_cache_mode == "align":
            mamba_state_copies.register_regions(hybrid.state_tensors(self))
        self.bucket_plan = self.serving_plan(kv_cache_config.num_blocks)

    def serving_plan(self, num_kv_blocks: int | None) -> BucketPlan:
        """The plan warmup runs for a KV cache of `num_kv_blocks` (None: not sized yet, the
        decode block range uncapped): the environment's buckets, without packed rows for a model
        with state layers (else with the packed-context buckets), plus the verification buckets
        of speculative decoding."""
        sched = self.scheduler_config
        plan = plan_from_env(
            max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            num_kv_blocks=num_kv_blocks,
            environ=hybrid.plan_environ(self.has_state_layers, sched.max_num_seqs),
        )
        plan = (
            hybrid.plan_without_packing(plan)
            if self.has_state_layers
            else step_layout.with_packed_context(
                plan, packed_rows=(self.max_num_batched_tokens, self.max_model_len)
            )
        )
        # Speculative decoding: verification steps (1 + k tokens per sequence) get their buckets.
        return spec_decode.with_verify_buckets(
            plan,
            spec_decode.verify_buckets(
                plan,
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
        model_loading.load(self, model)

    def _execute_mm_encoder(self, *args: Any, **kwargs: Any) -> Any:
        with vision.one_item_per_pass():  # an image's encoder shapes depend on its size only
            return super()._execute_mm_encoder(*args, **kwargs)

    def _gather_mm_embeddings(self, *args: Any, **kwargs: Any) -> Any:
        # vLLM builds the step's placeholder mask on the host and lets the embedding merge index a
        # device tensor with it (torch takes host indices for CUDA tensors). Whether the bridge's
        # index_put takes them is not established (the stand-in refuses it); Intel's plugin copies
        # the mask to the device, and so do we (a host-to-device copy, no sync).
        embeds, is_mm_embed = super()._gather_mm_embeddings(*args, **kwargs)
        return embeds, is_mm_embed.to(self.device, non_blocking=True)

    def get_model(self) -> torch.nn.Module:
        return self.model

    def finalize_calibration(self) -> None:
        """Let the quantization method write what it measured (INC MEASURE mode); idempotent."""
        quant_config = self.vllm_config.quant_config
        if isinstance(quant_config, quant_hooks.FinalizesCalibration) and (
            getattr(self, "model", None) is not None
        ):
            quant_config.hpu_finalize_calibration(self.model)

    # ------------------------------------------------------------------ bucketed execution
    def execute_model(self, scheduler_output, intermediate_tensors=None):
        self._planning = True
        host_tables.share(self.input_batch.block_table.block_tables)
        try:
            with cuda_streams_on_seam():
                return super().execute_model(scheduler_output, intermediate_tensors)
        finally:
            self._planning = False
            step_layout.set_current(None)

    def sample_tokens(self, grammar_output):
        """vLLM's sampling step; under async scheduling it returns before the sampled tokens
        reach the host (an `AsyncGPUModelRunnerOutput` copying them on a side stream) and keeps
        them on the device for the next step's input ids."""
        self._rewindable_generators()
        with cuda_streams_on_seam():
            return super().sample_tokens(grammar_output)

    def _rewindable_generators(self) -> None:
        """Seeded requests' CPU generators (emulation) as `RewindableGenerator`s, each holding
        its state from before this step's sampling. vLLM rewinds the generator of a request whose
        token it discards (a chunked prompt's partial step) with CUDA's get_offset/set_offset,
        which a CPU generator refuses: the engine died on any seeded request with a chunked
        prompt."""
        batch = self.input_batch
        for index, gen in list(batch.generators.items()):
            if gen.device.type != "cpu":
                continue
            if not isinstance(gen, RewindableGenerator):
                own = RewindableGenerator(gen)
                batch.generators[index] = own
                req_id = batch.req_ids[index]
                state = self.requests.get(req_id) if req_id is not None else None
                if state is not None and state.generator is gen:
                    state.generator = own
                gen = own
            gen.snapshot = gen.get_state()

    def propose_draft_token_ids(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's drafting; a draft head's forward passes run on the plan's buckets.

        vLLM's n-gram proposer sets numba's thread count per batch and restores numba's own
        count after, which through the shared OpenMP runtime can leave torch's intra-op thread
        count changed: torch.compile guards on it, so every bucket would compile again. The
        host's torch thread count is put back as it was."""
        threads = torch.get_num_threads()
        try:
            if self.draft_bucketing is None:
                return super().propose_draft_token_ids(*args, **kwargs)
            with self.draft_bucketing.propose():
                return super().propose_draft_token_ids(*args, **kwargs)
        finally:
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)

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
        elif self.steps_in_passes:
            layout = step_layout.split_passes(layout, seq_lens, self.block_size, self.bucket_plan)
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
        return data_parallel.agree(self, layout, ctx_blocks)

    def _num_tokens_across_dp(self, num_tokens: int) -> torch.Tensor | None:
        return data_parallel.tokens_across_dp(self, num_tokens)

    def execute_idle_dp_step(self) -> None:
        data_parallel.run_idle_step(self)

    # ------------------------------------------------------------------ HPU graphs
    def _model_forward(
        self,
        input_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **model_kwargs: Any,
    ) -> Any:
        """A serving step: replay its bucket's graph when it has one, else run eagerly; a step
        laid out in passes (step_layout.split_passes) runs one forward pass per pass."""
        entry = None
        if self._planning and intermediate_tensors is None and not model_kwargs:
            layout = step_layout.current()
            if layout is not None and layout.parts is not None:
                assert positions is not None
                inputs = dict(input_ids=input_ids, positions=positions, inputs_embeds=inputs_embeds)
                split = mixed_steps.forward_in_parts(self, layout, inputs, self._run_model)
                if split is not None:
                    return split
            entry = self.graphs.lookup(layout, get_forward_context().attn_metadata)
        if entry is None:
            return self._run_model(
                input_ids=input_ids,
                positions=positions,
                intermediate_tensors=intermediate_tensors,
                inputs_embeds=inputs_embeds,
                **model_kwargs,
            )
        step_metadata = get_forward_context().attn_metadata
        assert isinstance(step_metadata, dict)
        assert positions is not None
        ids, pos, embeds = input_ids, positions, inputs_embeds
        hidden = self.graphs.replay(
            entry,
            step_metadata,
            lambda static: self._graph_inputs(ids, pos, static, embeds),
        )
        if self.is_pooling_model:
            # A graph writes every replay into the output tensors of its capture, while a pooler
            # keeps a chunked prompt's hidden states across steps until the prompt is done:
            # hand it this step's own copy (found by the emulated graph, which replays as a
            # Gaudi does).
            return hidden.clone()
        return hidden

    def _run_model(self, **kwargs: Any) -> Any:
        """One forward pass without an HPU graph: through torch.compile when it is on (with
        bucket-shaped attention metadata, see compiled.py), else eagerly."""
        if self.compiled_model is None or not self.compiled_forward_on:
            return self.model(**kwargs)
        return self.compiled_model.run(get_forward_context(), **kwargs)

    def _graph_forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        metadata: dict[str, HPUAttentionMetadata],
        inputs_embeds: torch.Tensor | None = None,
    ) -> Callable[[], Any]:
        return hpu_graphs.graph_forward(self, input_ids, positions, metadata, inputs_embeds)

    def _graph_inputs(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        metadata: dict[str, HPUAttentionMetadata],
        inputs_embeds: torch.Tensor | None = None,
    ) -> dict[str, Any]:
        return hpu_graphs.graph_inputs(self, input_ids, positions, metadata, inputs_embeds)

    def _live_weights(self) -> dict[str, torch.Tensor]:
        return hpu_graphs.live_weights(self.model)

    def _static_metadata(self, metadata: HPUAttentionMetadata) -> dict[str, HPUAttentionMetadata]:
        return hpu_graphs.static_metadata_by_layer(self, metadata)

    def recapture_graphs(self) -> None:
        hpu_graphs.recapture(self)

    # ------------------------------------------------------------------ profiling
    def profile_run(self, *args: Any, **kwargs: Any) -> profiling.ProfileMemory:
        """The largest prompt bucket with its metadata over a minimal KV cache (the attention
        and state layers' kernels run), then vLLM's profile run (profiling.py)."""
        return profiling.profile_run(
            self, lambda: super(HPUModelRunner, self).profile_run(*args, **kwargs)
        )

    # ------------------------------------------------------------------ warmup (warmup.py)
    def warmup_model(self) -> None:
        """Run every bucket of the plan once (warmup.py, `warmup_model`)."""
        warmup.warmup_model(self)

    def _forward_with_metadata(
        self, metadata: HPUAttentionMetadata, total: int, n: int, *, capture: bool | None = None
    ) -> None:
        """Warmup's forward pass of one bucket, and an idle DP rank's padding-only step
        (warmup.py, `forward_with_metadata`)."""
        warmup.forward_with_metadata(self, metadata, total, n, capture=capture)

    def token_side_buffers(self) -> list[tuple[torch.Tensor, int]]:
        """Per-token buffers besides input ids and positions that a forward pass reads by token
        index, each with its padding value (tokens on the last dimension): LoRA's adapter slots.
        A split mixed step (mixed_steps.py) rearranges them per pass like the input ids."""
        if not self.lora_config:
            return []
        return hpu_lora.punica_wrapper_of(self.lora_manager).token_buffers()

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
