"""HPUWorker: one vLLM worker process driving one HPU (or its CPU emulation)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc

import torch
from vllm.config import set_current_vllm_config
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.utils.torch_utils import set_random_seed, set_torch_threads_for_runtime
from vllm.v1.worker.gpu_worker import Worker, init_worker_distributed_environment
from vllm.v1.worker.worker_base import CompilationTimes

from vllm_gaudi_platform import envs
from vllm_gaudi_platform.seam import backend as seam_backend
from vllm_gaudi_platform.worker import hybrid, profiling, sleep_mode
from vllm_gaudi_platform.worker.compiled import configure_dynamo
from vllm_gaudi_platform.worker.model_runner import HPUModelRunner

logger = init_logger(f"vllm.{__name__}")


def _check_recipe_cache(emulated: bool) -> None:
    """Validate PT_HPU_RECIPE_CACHE_CONFIG and say what it does here. Gaudi's runtime reads the
    variable itself (the worker inherits it); a bad value fails now, naming the variable."""
    cache = envs.recipe_cache()
    if cache is None:
        return
    if emulated:
        logger.info(
            "%s is set but has no effect in CPU emulation (there are no compiled recipes).",
            envs.PT_HPU_RECIPE_CACHE_CONFIG,
        )
        return
    logger.info(
        "Gaudi recipe cache: %s (%s at start, up to %d MB); warmup reuses the recipes found there",
        cache.directory,
        "cleared" if cache.delete else "kept",
        cache.max_size_mb,
    )


class HPUWorker(Worker):
    model_runner: HPUModelRunner

    # ------------------------------------------------------------------ start-up
    def init_device(self) -> None:
        configure_dynamo()  # lazy mode: no dynamo in this worker process either
        self.seam = seam_backend()
        self.device = self.seam.torch_device(self.local_rank)
        current_platform.set_device(self.device)
        current_platform.check_if_supports_dtype(self.model_config.dtype)
        init_worker_distributed_environment(
            self.vllm_config,
            self.rank,
            self.distributed_init_method,
            self.local_rank,
            current_platform.dist_backend,
        )
        set_random_seed(self.model_config.seed)
        _check_recipe_cache(self.seam.IS_EMULATED)
        self.model_runner = HPUModelRunner(self.vllm_config, self.device)
        logger.info("HPU worker rank %d on %s", self.rank, self.seam.device_name(0))

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        with set_current_vllm_config(self.vllm_config):
            self.model_runner.load_model(load_dummy_weights=load_dummy_weights)
        # In-place weight updates from a trainer (weight_transfer_config), set up after loading
        # as vLLM's GPU worker does; None without the setting.
        from vllm_gaudi_platform.distributed.weight_transfer import engine_for_worker

        self.weight_transfer_engine = engine_for_worker(
            self.vllm_config,
            self.device,
            self.model_runner.get_model(),
            asleep=lambda: self._sleep.asleep,
        )
        if self.seam.IS_EMULATED:
            # As vLLM's own workers do after loading: one intra-op thread while serving (unless
            # OMP_NUM_THREADS says otherwise), so OpenMP workers do not spin against the engine.
            set_torch_threads_for_runtime()

    # ------------------------------------------------------------------ memory
    def _maybe_get_memory_pool_context(self, tag: str) -> contextlib.AbstractContextManager:
        # vLLM's CUDA sleep-mode allocator pools do not exist on HPU; sleep() below moves
        # weights and drops the KV cache explicitly instead.
        return contextlib.nullcontext()

    @torch.inference_mode()
    def determine_available_memory(self) -> int:
        """Bytes of device memory for the KV cache.

        usable = total * gpu_memory_utilization - weights - peak activations of the profile run
        (profiling.py: the largest prompt bucket with its metadata, the attention and state
        layers' kernels included, then vLLM's profile run), read as the device's peak since a
        reset, not as what stays allocated; then a reserve for the HPU graphs warmup captures:
        what the profile run's sampled graphs bound the plan's at (graph_memory.py), at least the
        VLLM_GRAPH_RESERVED_MEM share (none without graphs: enforce_eager=True, torch.compile).
        The KV cache of a model with state layers holds their state slots in the same pages
        (vLLM's hybrid allocator sizes one page per group layer for both): the budget covers them.
        An explicit kv_cache_memory_bytes wins, as on every vLLM platform.
        """
        explicit = self.cache_config.kv_cache_memory_bytes
        if explicit is not None:
            logger.info("KV cache: %.2f GiB as set by kv_cache_memory_bytes", explicit / 2**30)
            return int(explicit)
        total = self.seam.mem_get_info()[1]
        gc.collect()
        self.seam.synchronize()
        used_before = self.seam.memory_allocated()
        self.seam.reset_peak_memory_stats()
        measured = self.model_runner.profile_run()
        self.seam.synchronize()
        used_peak = max(self.seam.max_memory_allocated(), used_before)
        gc.collect()
        activations = used_peak - used_before
        weights = sum(p.numel() * p.element_size() for p in self.model_runner.model.parameters())
        usable = total * self.cache_config.gpu_memory_utilization - weights - activations
        measured = measured if measured is not None else profiling.ProfileMemory()
        share = envs.get_number(envs.VLLM_GRAPH_RESERVED_MEM, lo=0.0, hi=1.0)
        graph_reserve = 0
        if self.model_runner.graphs.enabled:
            # The share, or what the profile run's sampled graphs bound the plan's at if more.
            graph_reserve = max(int(max(usable, 0) * share), measured.graphs_estimate)
        kv_bytes = int(usable) - graph_reserve
        self.profile_memory = dataclasses.replace(
            measured,
            before=used_before,
            peak=used_peak,
            after=self.seam.memory_allocated(),
            weights=weights,
            kv_budget=max(kv_bytes, 0),
            graph_reserve=graph_reserve,
        )
        if kv_bytes <= 0:
            raise ValueError(
                f"No HPU memory left for the KV cache: total {total / 2**30:.2f} GiB x "
                f"gpu_memory_utilization {self.cache_config.gpu_memory_utilization} - weights "
                f"{weights / 2**30:.2f} GiB - activations {activations / 2**30:.2f} GiB (the "
                f"profile run's peak) - HPU graphs {graph_reserve / 2**30:.2f} GiB (the larger "
                f"of {envs.VLLM_GRAPH_RESERVED_MEM}={share} and the {measured.graph_runs} "
                "graphs of the bucket plan as sampled). Raise gpu_memory_utilization, lower "
                "max_num_batched_tokens or max_num_seqs (fewer, smaller buckets), run without "
                "HPU graphs (enforce_eager=True, or PT_HPU_LAZY_MODE=0 for torch.compile), or "
                "set kv_cache_memory_bytes."
            )
        logger.info(
            "KV cache: %.2f GiB (total %.2f GiB, weights %.2f GiB, activations %.2f GiB at the "
            "profile run's peak, %.2f GiB of them still allocated after it, HPU graphs %.2f GiB: "
            "%s)",
            kv_bytes / 2**30,
            total / 2**30,
            weights / 2**30,
            activations / 2**30,
            max(self.profile_memory.after - used_before, 0) / 2**30,
            graph_reserve / 2**30,
            "none captured"
            if not self.model_runner.graphs.enabled
            else f"{measured.graph_runs} graphs bounded from {len(measured.graph_samples)} "
            f"sampled, at least {envs.VLLM_GRAPH_RESERVED_MEM}={share}",
        )
        return kv_bytes

    def get_memory_report(self) -> dict:
        """What determine_available_memory measured (profiling.ProfileMemory), and the bytes the
        KV cache holds now (attention blocks and state slots, each storage once): tests and
        collective_rpc callers compare them with the budget."""
        report = getattr(self, "profile_memory", profiling.ProfileMemory()).as_dict()
        storages = {}
        for kv in self._kv_cache_tensors():
            storage = kv.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        if self.model_runner.has_state_layers:
            for state in hybrid.state_tensors(self.model_runner):
                storage = state.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        report["kv_cache_allocated"] = sum(storages.values())
        return report

    # ------------------------------------------------------------------ warmup
    def compile_or_warm_up_model(self) -> CompilationTimes:
        # Warmup captures the HPU graphs: what they hold, and the peak above the KV cache while
        # capturing, are checked against what determine_available_memory kept back for them.
        gc.collect()
        self.seam.synchronize()
        before = self.seam.memory_allocated()
        self.seam.reset_peak_memory_stats()
        self.model_runner.warmup_model()
        self.seam.synchronize()
        peak = max(self.seam.max_memory_allocated(), before)
        gc.collect()
        self._check_warmup_memory(before, peak, self.seam.memory_allocated())
        set_random_seed(self.model_config.seed)
        return CompilationTimes(
            language_model=self.compilation_config.compilation_time,
            encoder=self.compilation_config.encoder_compilation_time,
        )

    def _check_warmup_memory(self, before: int, peak: int, after: int) -> None:
        memory = getattr(self, "profile_memory", None)
        if memory is None:
            memory = self.profile_memory = profiling.ProfileMemory()
        memory.warmup_peak = peak - before
        memory.graphs_held = max(after - before, 0)
        if not memory.kv_budget:  # kv_cache_memory_bytes: nothing was profiled to check against
            return
        margin = memory.graph_reserve + (memory.peak - memory.after)
        if memory.graphs_held > memory.graph_reserve or memory.warmup_peak > margin:
            logger.warning(
                "HPU warmup: the captured graphs hold %.3f GiB and warmup peaked %.3f GiB above "
                "the KV cache, more than was kept back (graph reserve %.3f GiB, profiled "
                "transient activations %.3f GiB): raise %s or lower gpu_memory_utilization "
                "before serving runs out of device memory.",
                memory.graphs_held / 2**30,
                memory.warmup_peak / 2**30,
                memory.graph_reserve / 2**30,
                (memory.peak - memory.after) / 2**30,
                envs.VLLM_GRAPH_RESERVED_MEM,
            )

    def execute_dummy_batch(self) -> None:
        """vLLM's step for a data-parallel rank with no requests while other ranks have some."""
        if self.parallel_config.data_parallel_size > 1:
            # Padding-only run of the buckets the DP ranks agree on (data_parallel.py).
            self.model_runner.execute_idle_dp_step()
            return
        self.model_runner._dummy_run(1, uniform_decode=True)

    # ------------------------------------------------------------------ sleep mode
    def sleep(self, level: int = 1) -> None:
        """Release device memory (see sleep_mode.py): level 1 offloads the weights to host memory,
        level 2 drops them (reloaded on wake-up); both drop the KV cache."""
        if level not in (1, 2):
            raise ValueError(f"HPU sleep mode has levels 1 and 2, got level={level}.")
        state = self._sleep
        if state.asleep:
            raise RuntimeError("HPU worker is already asleep; call wake_up first.")
        self.seam.synchronize()
        free_before = self.seam.mem_get_info()[0]
        state.level = level
        weights = state.release(
            sleep_mode.WEIGHTS, self.model_runner.model.parameters(), keep_on_host=level == 1
        )
        kv = state.release(sleep_mode.KV_CACHE, self._kv_cache_tensors(), keep_on_host=False)
        self.seam.synchronize()
        logger.info(
            "HPU worker asleep (level %d): %.3f GiB of weights %s, %.3f GiB of KV cache dropped; "
            "device free memory %.3f -> %.3f GiB",
            level,
            weights / 2**30,
            "offloaded to host" if level == 1 else "dropped",
            kv / 2**30,
            free_before / 2**30,
            self.seam.mem_get_info()[0] / 2**30,
        )

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take the memory back: "weights" (copied back, or reloaded after level 2) and/or
        "kv_cache" (zeroed: its old contents were dropped)."""
        for tag in sleep_mode.parse_tags(tags):
            restored = self._sleep.restore(tag, reload=self.model_runner.reload_weights)
            if restored:
                logger.info("HPU worker woke %s (%.3f GiB)", tag, restored / 2**30)
        self.seam.synchronize()
        if not self._sleep.asleep:
            # The restored weights and KV cache live at new addresses: graphs captured before
            # sleeping would replay on the old ones.
            self.model_runner.recapture_graphs()

    def get_sleep_report(self) -> dict:
        """Device bytes held now by the weights, the model's buffers and the KV cache, the
        device's own count of allocated bytes (the seam's memory_allocated: HBM on a Gaudi, the
        process's resident memory in emulation), and the sleep level (tests)."""
        import gc

        gc.collect()  # what sleeping dropped is gone before the device is asked
        return {
            "level": self._sleep.level,
            "asleep_tags": sorted(self._sleep.released),
            "weights_bytes": sleep_mode.device_bytes(self.model_runner.model.parameters()),
            "buffer_bytes": sleep_mode.device_bytes(self.model_runner.model.buffers()),
            "kv_cache_bytes": sleep_mode.device_bytes(self._kv_cache_tensors()),
            "device_allocated": self.seam.memory_allocated(),
        }

    @property
    def _sleep(self) -> sleep_mode.SleepState:
        state = getattr(self, "_sleep_state", None)
        if state is None:
            state = self._sleep_state = sleep_mode.SleepState()
        return state

    def _kv_cache_tensors(self) -> list[torch.Tensor]:
        return [kv for kv in self.model_runner.kv_caches if isinstance(kv, torch.Tensor)]

    # ------------------------------------------------------------------ introspection
    def get_recompile_stats(self) -> dict:
        """Warmup time and recompile count, for tests, logs and collective_rpc callers."""
        runner = self.model_runner
        return {
            "seam": runner.seam.NAME,  # "gaudi" (seam/gaudi) or "emulated on cpu"
            "kv_cache_devices": sorted({str(kv.device.type) for kv in self._kv_cache_tensors()}),
            "recompiles": runner.recompiles.count,
            "async_scheduling": runner.use_async_scheduling,
            "unwarmed_buckets": list(runner.recompiles.seen),
            "unwarmed_encoder_shapes": list(runner.recompiles.encoder_seen),
            "bucket_hits": dict(runner.recompiles.hits),
            "warmup_seconds": runner.warmup_seconds,
            "bucket_plan": runner.bucket_plan.describe(),
            "num_prompt_buckets": len(runner.bucket_plan.prompt),
            "num_decode_buckets": len(runner.bucket_plan.decode),
            "num_verify_buckets": sum(b.phase == "verify" for b in runner.bucket_plan.prompt),
            "lora_unwarmed_shapes": [list(shape) for shape in runner.lora_unwarmed_shapes()],
            "graphs_enabled": runner.graphs.enabled,
            "num_graphs": len(runner.graphs.graphs),
            "num_packed_graphs": sum(packed for _, packed in runner.graphs.graphs),
            "graph_capture_seconds": runner.graphs.stats.capture_seconds,
            "graph_replays": runner.graphs.stats.replays,
            "eager_steps": runner.graphs.stats.eager_steps,
            "variant_misses": runner.graphs.stats.variant_misses,
            "eager_buckets": {str(k): n for k, n in runner.graphs.stats.eager_buckets.items()},
            "split_steps": runner.split_steps,
            "packed_prefills": runner.recompiles.packed_prefills,
            "idle_dp_steps": runner.idle_dp_steps,
            "linears_on_seam": runner.linears_on_seam,
            "step_metrics": runner.step_metrics.snapshot(),
            "memory": self.get_memory_report(),  # the profile run's peak, the KV cache's bytes
            # torch.compile (eager mode): graphs per phase, graph breaks, compiles while serving.
            "compiled": runner.compiled_model is not None,
            "compiled_forward_on": runner.compiled_model is not None and runner.compiled_forward_on,
            **(runner.compiled_model.stats.as_dict() if runner.compiled_model is not None else {}),
        }

    def set_compiled_forward(self, on: bool) -> bool:
        """Diagnostics for an engine that compiles (PT_HPU_LAZY_MODE=0): run its forward passes
        through the compiled graphs (True, the default) or op by op (False), e.g. to compare
        its outputs with its own uncompiled passes without a second engine. Returns whether
        the passes are compiled now."""
        runner = self.model_runner
        runner.compiled_forward_on = bool(on)
        return runner.compiled_model is not None and runner.compiled_forward_on

    def check_health(self) -> None:
        return None

    # ------------------------------------------------------------------ calibration
    def finalize_calibration(self) -> None:
        """Write calibration statistics now (INC MEASURE mode); also done at shutdown."""
        self.model_runner.finalize_calibration()

    def shutdown(self) -> None:
        runner = getattr(self, "model_runner", None)
        if runner is not None:
            runner.finalize_calibration()
            if runner.trace_recorder is not None:
                runner.trace_recorder.close()  # the steps since the last periodic flush
        super().shutdown()
