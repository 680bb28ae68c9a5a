"""The `hpu_metrics` stat logger: HPU bucket and recompile metrics on vLLM's Prometheus /metrics.

Registered under vLLM's ``vllm.stat_logger_plugins`` group, which vLLM loads in the API-server
process of ``vllm serve`` (``AsyncLLM``; offline ``LLM`` loads no stat loggers). It adds, per
engine and with vLLM's ``model_name``/``engine`` labels:

=====================================  =======  ==================================================
metric                                 type     meaning
=====================================  =======  ==================================================
``vllm:hpu_recompiles_total``          counter  shapes run after warmup that warmup did not run
``vllm:hpu_bucket_hits_total``         counter  step parts (``phase`` prompt/decode) run in a
                                                bucket of the plan
``vllm:hpu_bucket_misses_total``       counter  step parts run at an exact shape outside the plan
``vllm:hpu_padding_ratio``             gauge    since warmup, (padded - real) / real per
                                                ``dimension``: prompt_tokens, decode_batch,
                                                decode_blocks
``vllm:hpu_warmup_seconds``            gauge    how long the bucket warmup took
``vllm:hpu_graphs``                    gauge    HPU graphs captured during warmup
``vllm:hpu_compiled_graphs``           gauge    torch.compile graphs per ``phase``: warmup, and
                                                serving (each a recompile: a guard failed)
``vllm:hpu_graph_breaks``              gauge    torch.compile graph breaks per ``phase``
``vllm:hpu_kv_staged_bytes_total``     counter  KV cache bytes NIXL host staging copied, per
                                                ``direction``: to_host (out of the KV cache,
                                                prefill side), to_device (into it, decode side)
=====================================  =======  ==================================================

The values come from the worker through the memory-mapped channel of
``vllm_gaudi_platform.observability.metrics`` (its docstring says why that channel). The logger
does nothing when the platform is not the HPU platform, and in API-server processes other than
the first (``--api-server-count`` > 1), so that counters are not added up once per API server.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.v1.metrics.loggers import AggregateStatLoggerBase
from vllm.v1.metrics.stats import IterationStats, MultiModalCacheStats, SchedulerStats

from vllm_gaudi_platform.observability import metrics
from vllm_gaudi_platform.plugins import hpu_platform_active

logger = init_logger(f"vllm.{__name__}")

PHASES = ("prompt", "decode")


class HpuStatLogger(AggregateStatLoggerBase):
    """Publishes the HPU workers' counters as Prometheus metrics, refreshed on every record()."""

    def __init__(self, vllm_config: VllmConfig, engine_indexes: list[int]) -> None:
        parallel = vllm_config.parallel_config
        # vLLM loads every stat-logger plugin in every API server, whatever the platform: on
        # another platform this logger stays inert (no metric, no device probe, no import of the
        # HPU platform module), with one DEBUG line.
        on_hpu = hpu_platform_active()
        self.enabled = on_hpu and getattr(parallel, "_api_process_rank", 0) in (0, -1)
        if not on_hpu:
            logger.debug("hpu_metrics: active vLLM platform is not HPU; no HPU metrics")
        self.engine_indexes = list(engine_indexes)
        self.paths = {
            idx: metrics.channel_path(vllm_config.instance_id, idx) for idx in self.engine_indexes
        }
        self.model_name = vllm_config.model_config.served_model_name
        # Totals already added to the Prometheus counters, per engine and field.
        self._published: dict[int, dict[str, float]] = {}
        self._ready = False

    def log_engine_initialized(self) -> None:
        # Created here, not in __init__: vLLM builds its own Prometheus logger after the plugin
        # loggers, and that constructor unregisters every collector whose name starts "vllm:".
        if not self.enabled or self._ready:
            return
        labels = ["model_name", "engine"]
        self.recompiles = Counter(
            "vllm:hpu_recompiles",
            "Shapes run after warmup that the HPU warmup did not run (a graph compile each).",
            labels,
        )
        self.hits = Counter(
            "vllm:hpu_bucket_hits",
            "Step parts (prompt or decode) that ran in a warmed bucket of the HPU plan.",
            [*labels, "phase"],
        )
        self.misses = Counter(
            "vllm:hpu_bucket_misses",
            "Step parts (prompt or decode) that ran at an exact shape outside the HPU plan.",
            [*labels, "phase"],
        )
        self.padding = Gauge(
            "vllm:hpu_padding_ratio",
            "Padding since warmup as a share of the real work: (padded - real) / real.",
            [*labels, "dimension"],
            multiprocess_mode="mostrecent",
        )
        self.warmup_seconds = Gauge(
            "vllm:hpu_warmup_seconds",
            "Seconds the HPU bucket warmup took.",
            labels,
            multiprocess_mode="mostrecent",
        )
        self.graphs = Gauge(
            "vllm:hpu_graphs",
            "HPU graphs captured during warmup.",
            labels,
            multiprocess_mode="mostrecent",
        )
        self.compiled_graphs = Gauge(
            "vllm:hpu_compiled_graphs",
            "Graphs torch.compile compiled, per phase (serving: recompiles after warmup).",
            [*labels, "phase"],
            multiprocess_mode="mostrecent",
        )
        self.graph_breaks = Gauge(
            "vllm:hpu_graph_breaks",
            "torch.compile graph breaks (a forward pass split in several graphs), per phase.",
            [*labels, "phase"],
            multiprocess_mode="mostrecent",
        )
        self.kv_staged = Counter(
            "vllm:hpu_kv_staged_bytes",
            "KV cache bytes copied by NIXL host staging, per direction (to_host, to_device).",
            [*labels, "direction"],
        )
        self._ready = True
        for idx in self.engine_indexes:
            self.refresh(idx)

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        mm_cache_stats: MultiModalCacheStats | None = None,
        engine_idx: int = 0,
    ) -> None:
        # The worker updates its counters while planning a step, before the step's output is
        # sent, so reading them when that output arrives is up to date.
        if self._ready and engine_idx in self.paths:
            self.refresh(engine_idx)

    def refresh(self, engine_idx: int) -> None:
        """Bring the metrics of one engine up to its worker's counters."""
        snap = metrics.read_snapshot(self.paths[engine_idx])
        if snap is None:
            return
        engine = str(engine_idx)
        done = self._published.setdefault(engine_idx, dict.fromkeys(metrics.FIELDS, 0.0))

        def advance(counter, field: str) -> None:
            delta = snap[field] - done[field]
            if delta > 0:  # a restarted worker starts again from 0: never count backwards
                counter.inc(delta)
            done[field] = snap[field]

        advance(self.recompiles.labels(self.model_name, engine), "recompiles")
        for phase in PHASES:
            advance(self.hits.labels(self.model_name, engine, phase), f"{phase}_hits")
            advance(self.misses.labels(self.model_name, engine, phase), f"{phase}_misses")
        for dim in metrics.PADDING_DIMENSIONS:
            ratio = metrics.padding_ratio(snap[f"{dim}_real"], snap[f"{dim}_padded"])
            self.padding.labels(self.model_name, engine, dim).set(ratio)
        self.warmup_seconds.labels(self.model_name, engine).set(snap["warmup_seconds"])
        self.graphs.labels(self.model_name, engine).set(snap["graphs"])
        for phase in metrics.COMPILE_PHASES:
            self.compiled_graphs.labels(self.model_name, engine, phase).set(
                snap[f"compiled_graphs_{phase}"]
            )
            self.graph_breaks.labels(self.model_name, engine, phase).set(
                snap[f"graph_breaks_{phase}"]
            )
        for direction in metrics.STAGING_DIRECTIONS:
            advance(
                self.kv_staged.labels(self.model_name, engine, direction),
                f"kv_staged_{direction}_bytes",
            )
