"""vLLM's Prometheus logger and config fields the HPU stat logger relies on."""

from __future__ import annotations

from vllm_gaudi_platform.patches import Patch, Upstream

UPSTREAM: tuple[Upstream, ...] = (
    Upstream(
        "vllm.v1.metrics.loggers:StatLoggerManager.__init__",
        "HpuStatLogger (an aggregate logger, built with engine_indexes) comes before vLLM's own "
        "PrometheusStatLogger, whose constructor unregisters every 'vllm:' collector, and "
        "log_engine_initialized follows both: HpuStatLogger creates its metrics there",
        mentions=("AggregateStatLoggerBase", "engine_indexes", "PrometheusStatLogger"),
    ),
    Upstream(
        "vllm.v1.metrics.loggers:PrometheusStatLogger.__init__",
        "HpuStatLogger creates its metrics after this constructor clears 'vllm:' collectors",
        mentions=("unregister_vllm_metrics",),
    ),
    Upstream(
        "vllm.config.parallel:ParallelConfig",
        "HpuStatLogger reports from the first API-server process only",
        mentions=("_api_process_rank",),
    ),
    Upstream(
        "vllm.config.vllm:VllmConfig",
        "metrics.channel_path: worker and API server name the channel after instance_id",
        mentions=("instance_id",),
    ),
)

PATCH = Patch(
    what="",
    why=(
        "HpuStatLogger publishes the HPU counters next to vLLM's own metrics, labelled like them."
    ),
    can_go="when vLLM's stat-logger plugin API hands loggers their labels.",
    upstream=UPSTREAM,
)
