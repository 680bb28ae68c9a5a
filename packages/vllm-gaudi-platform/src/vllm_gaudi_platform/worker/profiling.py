"""The profile run that sizes the KV cache, and what it measured.

vLLM's own profile run (`GPUModelRunner.profile_run`: a dummy pass of max_num_batched_tokens, the
sampler, a multimodal model's encoder) runs without attention metadata, so neither the attention
kernels nor the state layers' kernels (Mamba2, gated delta net) run in it: their intermediates
(attention scores, a state layer's chunked scan over a prefill) would be missing from the peak.
`profile_run` sets up a minimal KV cache (vLLM's own: one block per group, state slots
included). With HPU graphs on, it first captures a few of the plan's graphs over it and measures
what each holds, dropping each at once (graph_memory.py: the whole plan's graphs are bounded from
them, and the worker keeps that back from the KV cache). Then it runs the plan's largest prompt
bucket as warmup runs it, with its metadata, eagerly (no HPU graph is captured and torch.compile
is not entered, so nothing of the profile stays), then vLLM's profile run.

The worker reads the device's peak across the last two (`seam.max_memory_allocated` after
`reset_peak_memory_stats`: the most allocated at any moment, transient tensors freed before
the run returned included), not what stays allocated after it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from vllm.config import get_current_vllm_config, set_current_vllm_config
from vllm.logger import init_logger

from vllm_gaudi_platform.bucketing import Bucket, plan_from_env
from vllm_gaudi_platform.worker import graph_memory, hybrid, warmup
from vllm_gaudi_platform.worker.cuda_stand_ins import mamba_state_copies

logger = init_logger(f"vllm.{__name__}")


@dataclasses.dataclass
class ProfileMemory:
    """What determine_available_memory measured (bytes of device memory; in emulation, of the
    process's resident set)."""

    before: int = 0  # allocated before the profile run (weights, buffers)
    peak: int = 0  # the most allocated at any moment during it
    after: int = 0  # allocated after it: what stays
    weights: int = 0
    kv_budget: int = 0  # what the worker returned for the KV cache
    graph_reserve: int = 0  # of the usable memory, kept back for HPU graphs
    bucket: str = ""  # the prompt bucket profiled with metadata
    # State layers (Mamba2, gated delta net) that ran their kernels in the profile pass (they
    # were handed their prefill state metadata), of all the model's state layers.
    state_layers_profiled: int = 0
    state_layers: int = 0
    # Measured around warmup: its peak above what was allocated before it (the KV cache
    # included), and what stays allocated after it (the captured HPU graphs).
    warmup_peak: int = 0
    graphs_held: int = 0
    # HPU graphs sampled in the profile run (graph_memory.py): each one's bucket and bytes held,
    # the plan's graph count and the bound on what they hold together.
    graph_samples: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    graph_runs: int = 0
    graphs_estimate: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def largest_prompt_bucket(runner: Any) -> Bucket | None:
    """The prompt bucket whose pass holds the most tokens (then the largest attention extent):
    from the plan as initialize_kv_cache will build it before the block count is known (the
    profile reads the null block only, so the count does not bound it)."""
    sched = runner.scheduler_config
    plan = plan_from_env(
        max_num_seqs=sched.max_num_seqs,
        max_num_batched_tokens=runner.max_num_batched_tokens,
        max_model_len=runner.max_model_len,
        block_size=runner.block_size,
        environ=hybrid.plan_environ(runner.has_state_layers, sched.max_num_seqs),
    )
    prompts = [b for b in plan.prompt if b.phase == "prompt"]
    if not prompts:
        return None

    def size(b: Bucket) -> tuple[int, int]:
        tokens = b.batch_size * b.query_len
        return tokens, tokens * (b.query_len + b.ctx_blocks * runner.block_size)

    return max(prompts, key=size)


def profile_run(runner: Any, vllm_profile_run: Any) -> ProfileMemory:
    """The runner's profile run: the largest prompt bucket with metadata over a minimal KV cache,
    then vLLM's own (`vllm_profile_run`). Returns what it can tell before the worker's readings
    (the bucket, the state layers that ran)."""
    result = ProfileMemory()
    _minimal_kv_cache(runner)
    try:
        state_layers = _state_layers(runner)
        result.state_layers = len(state_layers)
        if runner.graphs.enabled:
            _sample_graphs(runner, result)
            # What the samples held is freed: the peak the worker reads is the passes' below.
            runner.seam.reset_peak_memory_stats()
        bucket = largest_prompt_bucket(runner)
        if bucket is not None:
            result.bucket = str(bucket)
            with _eager_uncaptured(runner), _watch_state_metadata(state_layers) as ran:
                warmup.run_bucket(runner, bucket, 0)
            runner.seam.synchronize()
            result.state_layers_profiled = len(ran)
    finally:
        runner._cleanup_profiling_kv_cache()
        mamba_state_copies.register_regions([])  # the minimal cache's storages: let them go
        runner.has_state_layers = False  # known again with the real KV cache
    vllm_profile_run()
    logger.info(
        "HPU profile run: prompt bucket %s with its metadata (%d of %d state layers ran their "
        "kernels), then vLLM's profile run",
        result.bucket or "(none)",
        result.state_layers_profiled,
        result.state_layers,
    )
    return result


def _sample_graphs(runner: Any, result: ProfileMemory) -> None:
    """The HPU graphs' memory: a few of the plan's graphs captured and measured, the whole
    plan's bounded from them (graph_memory.py). The plan is the one warmup will run, its decode
    block range not yet capped by the KV cache's size (an upper bound)."""
    runs = warmup.warmup_runs(runner, runner.serving_plan(None))
    if not runs:
        return
    with _eager_uncaptured(runner, graphs=True):
        taken = graph_memory.sample(runner, graph_memory.samples_to_take(runs, runner.block_size))
    result.graph_samples = [s.as_dict() for s in taken]
    result.graph_runs = len(runs)
    result.graphs_estimate = graph_memory.estimate(runs, taken, runner.block_size)
    logger.info(
        "HPU graphs: %d sampled in the profile run (%s); the plan's %d graphs hold at most "
        "%.3f GiB",
        len(taken),
        ", ".join(f"{s.run[0]}: {s.held / 2**20:.1f} MiB" for s in taken),
        len(runs),
        result.graphs_estimate / 2**30,
    )


def _minimal_kv_cache(runner: Any) -> None:
    """vLLM's minimal KV cache for profiling, through HPUModelRunner.initialize_kv_cache: one
    block per group (the profile pass reads and writes the null block only). vLLM sizes it by
    the CUDA graph capture sizes, which the HPU leaves unset: one block, for the call."""
    with set_current_vllm_config(runner.vllm_config):
        config = get_current_vllm_config().compilation_config
        saved = config.max_cudagraph_capture_size
        if saved is None:
            config.max_cudagraph_capture_size = 1
        try:
            runner._init_minimal_kv_cache_for_profiling()
        finally:
            config.max_cudagraph_capture_size = saved


def _state_layers(runner: Any) -> dict[str, torch.nn.Module]:
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    context = runner.compilation_config.static_forward_context
    return {name: layer for name, layer in context.items() if isinstance(layer, MambaBase)}


@contextlib.contextmanager
def _eager_uncaptured(runner: Any, *, graphs: bool = False) -> Iterator[None]:
    """No compiled pass and no draft head for the profile pass, and no HPU graph captured
    unless `graphs` (the samples, dropped at once): what it allocates is freed when it
    returns."""
    saved = (runner.graphs.enabled, runner.compiled_forward_on, runner.draft_bucketing)
    runner.graphs.enabled = graphs
    runner.compiled_forward_on = False
    runner.draft_bucketing = None
    try:
        yield
    finally:
        runner.graphs.enabled, runner.compiled_forward_on, runner.draft_bucketing = saved


@contextlib.contextmanager
def _watch_state_metadata(layers: dict[str, torch.nn.Module]) -> Iterator[set[str]]:
    """The names of the state layers whose forward pass found prefill state metadata for them
    (the state families run their kernels exactly then; without it they skip them)."""
    from vllm.forward_context import get_forward_context

    ran: set[str] = set()
    handles = []
    for name, layer in layers.items():

        def seen(module: Any, args: Any, name: str = name) -> None:
            step = get_forward_context().attn_metadata
            md = step.get(name) if isinstance(step, dict) else None
            if getattr(md, "state_slots_prefill", None) is not None:
                ran.add(name)

        handles.append(layer.register_forward_pre_hook(seen))
    try:
        yield ran
    finally:
        for handle in handles:
            handle.remove()
