"""Serving observability: the worker-to-API-server metrics channel (`metrics.py`, published by
the `hpu_metrics` stat logger in `vllm_gaudi_platform.stat_logger`) and the step-shape trace
(`step_trace.py`, the input of fitted bucketing)."""
