"""The HPU serving metrics without an engine: what the worker counts per step, the channel file,
and the stat logger that turns the file into Prometheus metrics."""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import pytest

from vllm_gaudi_platform.attention import step_layout
from vllm_gaudi_platform.bucketing import Bucket, BucketPlan
from vllm_gaudi_platform.observability import metrics

BLOCK = 128


def plan() -> BucketPlan:
    return BucketPlan(
        strategy="file",
        prompt=(Bucket("prompt", 1, 128, 0), Bucket("prompt", 1, 256, 2)),
        decode=(Bucket("decode", 4, 1, 8),),
    )


def layout(query_lens, seq_lens):
    return step_layout.plan_step(
        query_lens=query_lens, seq_lens=seq_lens, block_size=BLOCK, plan=plan()
    )


def test_a_prefill_in_a_bucket_counts_a_hit_and_its_padded_tokens():
    m = metrics.StepMetrics()
    m.record(layout([100], [100]), [100], BLOCK, recompiles=0)

    assert m["prompt_hits"] == 1 and m["prompt_misses"] == 0
    assert (m["prompt_tokens_real"], m["prompt_tokens_padded"]) == (100, 128)


def test_a_decode_step_counts_sequences_and_blocks_real_and_padded():
    m = metrics.StepMetrics()
    seq_lens = [130, 5, 300]  # 2 + 1 + 3 = 6 blocks
    m.record(layout([1, 1, 1], seq_lens), seq_lens, BLOCK, recompiles=0)

    assert m["decode_hits"] == 1
    assert (m["decode_batch_real"], m["decode_batch_padded"]) == (3, 4)
    assert (m["decode_blocks_real"], m["decode_blocks_padded"]) == (6, 8)


def test_a_shape_outside_the_plan_counts_a_miss_and_no_padding():
    m = metrics.StepMetrics()
    seq_lens = [200] * 5  # five decodes: no bucket holds more than four
    m.record(layout([1] * 5, seq_lens), seq_lens, BLOCK, recompiles=1)

    assert m["decode_misses"] == 1 and m["decode_hits"] == 0
    assert m["decode_batch_real"] == m["decode_batch_padded"] == 5
    assert m["recompiles"] == 1


def test_a_mixed_step_counts_both_parts():
    m = metrics.StepMetrics()
    seq_lens = [50, 129]
    m.record(layout([50, 1], seq_lens), seq_lens, BLOCK, recompiles=0)

    assert (m["prompt_hits"], m["decode_hits"]) == (1, 1)
    assert (m["prompt_tokens_real"], m["decode_blocks_real"]) == (50, 2)


def test_a_step_run_in_passes_counts_each_pass():
    plan = BucketPlan(
        strategy="file",
        prompt=(Bucket("prompt", 2, 128, 0),),
        decode=(Bucket("decode", 4, 1, 8),),
        pack_prefills=False,
    )
    query_lens, seq_lens = [100, 60, 1, 30], [100, 60, 129, 30]
    one = step_layout.plan_step(
        query_lens=query_lens, seq_lens=seq_lens, block_size=BLOCK, plan=plan
    )
    split = step_layout.split_passes(one, seq_lens, BLOCK, plan)
    m = metrics.StepMetrics()
    m.record(split, seq_lens, BLOCK, recompiles=0)

    assert (m["prompt_hits"], m["prompt_misses"], m["decode_hits"]) == (2, 0, 1)
    assert (m["prompt_tokens_real"], m["prompt_tokens_padded"]) == (190, 2 * 256)
    assert (m["decode_blocks_real"], m["decode_blocks_padded"]) == (2, 8)


def test_padding_ratio_is_padding_over_real_work():
    assert metrics.padding_ratio(100, 125) == pytest.approx(0.25)
    assert metrics.padding_ratio(0, 0) == 0.0


def test_the_channel_file_carries_the_counters_to_a_reader(tmp_path):
    path = tmp_path / "engine.bin"
    writer = metrics.StepMetrics(path)
    writer.set_warmup(12.5, 3)
    writer.record(layout([100], [100]), [100], BLOCK, recompiles=2)

    snap = metrics.read_snapshot(path)

    assert snap is not None
    assert snap["warmup_seconds"] == 12.5 and snap["graphs"] == 3
    assert snap["recompiles"] == 2 and snap["prompt_tokens_padded"] == 128


def test_the_worker_removes_its_channel_file_when_it_closes(tmp_path):
    path = tmp_path / "engine.bin"
    metrics.StepMetrics(path).close()

    assert not path.exists()


def test_a_missing_or_foreign_file_reads_as_nothing(tmp_path):
    foreign = tmp_path / "foreign.bin"
    foreign.write_bytes(b"x" * metrics.SIZE)

    assert metrics.read_snapshot(tmp_path / "absent.bin") is None
    assert metrics.read_snapshot(foreign) is None


def test_engines_of_one_server_and_of_two_servers_use_different_files():
    a0, a1 = metrics.channel_path("111", 0), metrics.channel_path("111", 1)
    b0 = metrics.channel_path("222", 0)

    assert len({a0, a1, b0}) == 3


class _Parallel:
    def __init__(self, rank, world_size, dp_rank):
        self.rank, self.world_size, self.data_parallel_rank = rank, world_size, dp_rank


class _Config:
    def __init__(self, rank, world_size, dp_rank=0):
        self.parallel_config = _Parallel(rank, world_size, dp_rank)
        self.instance_id = "42"


def test_only_the_first_rank_of_an_engine_writes_the_channel():
    assert metrics.worker_channel(_Config(0, 2, dp_rank=1)) == metrics.channel_path("42", 1)
    assert metrics.worker_channel(_Config(1, 2)) is None


# ---------------------------------------------------------------- the stat logger (vLLM side)


@pytest.fixture
def registry(monkeypatch):
    """A fresh Prometheus registry standing in for the process-wide one."""
    import prometheus_client  # a vLLM dependency: installed with the engine by the set-up

    fresh = prometheus_client.CollectorRegistry()
    from vllm_gaudi_platform import stat_logger

    for cls in ("Counter", "Gauge"):
        original = getattr(prometheus_client, cls)
        monkeypatch.setattr(
            stat_logger,
            cls,
            lambda *a, _o=original, **k: _o(*a, registry=fresh, **k),
        )
    monkeypatch.setattr(stat_logger, "hpu_platform_active", lambda: True)
    return fresh


class _ModelConfig:
    served_model_name = "tiny"


class _VllmConfig(_Config):
    def __init__(self, instance_id):
        super().__init__(0, 1)
        self.instance_id = instance_id
        self.model_config = _ModelConfig()


def _value(registry, name, **labels):
    return registry.get_sample_value(name, {"model_name": "tiny", "engine": "0", **labels})


def test_the_stat_logger_publishes_the_worker_counters_as_vllm_metrics(registry, tmp_path):
    from vllm_gaudi_platform.stat_logger import HpuStatLogger

    instance = f"unit-{tmp_path.name}"
    worker = metrics.StepMetrics(metrics.channel_path(instance, 0))
    try:
        worker.set_warmup(7.0, 0)
        worker.record(layout([100], [100]), [100], BLOCK, recompiles=0)
        logger = HpuStatLogger(_VllmConfig(instance), [0])  # type: ignore[arg-type]
        logger.log_engine_initialized()

        assert _value(registry, "vllm:hpu_recompiles_total") == 0
        assert _value(registry, "vllm:hpu_bucket_hits_total", phase="prompt") == 1
        assert _value(registry, "vllm:hpu_warmup_seconds") == 7.0
        assert _value(registry, "vllm:hpu_graphs") == 0
        ratio = _value(registry, "vllm:hpu_padding_ratio", dimension="prompt_tokens")
        assert ratio == pytest.approx(0.28)

        seq_lens = [200] * 5
        worker.record(layout([1] * 5, seq_lens), seq_lens, BLOCK, recompiles=1)
        logger.record(None, None, engine_idx=0)

        assert _value(registry, "vllm:hpu_recompiles_total") == 1
        assert _value(registry, "vllm:hpu_bucket_misses_total", phase="decode") == 1
        assert _value(registry, "vllm:hpu_bucket_hits_total", phase="prompt") == 1
        assert _value(registry, "vllm:hpu_compiled_graphs", phase="serving") == 0

        worker.set_compile({"warmup": 14, "serving": 2}, {"warmup": 0, "serving": 1})
        logger.record(None, None, engine_idx=0)

        assert _value(registry, "vllm:hpu_compiled_graphs", phase="warmup") == 14
        assert _value(registry, "vllm:hpu_compiled_graphs", phase="serving") == 2
        assert _value(registry, "vllm:hpu_graph_breaks", phase="warmup") == 0
        assert _value(registry, "vllm:hpu_graph_breaks", phase="serving") == 1
    finally:
        worker.close()


def test_the_stat_logger_publishes_nothing_off_the_hpu_platform(registry, monkeypatch):
    from vllm_gaudi_platform import stat_logger

    monkeypatch.setattr(stat_logger, "hpu_platform_active", lambda: False)
    logger = stat_logger.HpuStatLogger(_VllmConfig("off-hpu"), [0])  # type: ignore[arg-type]
    logger.log_engine_initialized()

    assert _value(registry, "vllm:hpu_recompiles_total") is None


@pytest.mark.process
def test_a_new_worker_removes_files_left_by_workers_that_are_gone(tmp_path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
    )
    uid = os.getuid()
    left = tmp_path / f"vllm-gaudi-metrics-{uid}-1-dp0.bin"
    alive = metrics.StepMetrics(tmp_path / f"vllm-gaudi-metrics-{uid}-2-dp0.bin")
    try:
        stale = metrics.StepMetrics(left)
        stale._values.release()
        stale._mm.close()  # as if killed: the file stays, its pid now names a finished process
        data = bytearray(left.read_bytes())
        struct.pack_into("<Q", data, 8, int(dead.stdout))
        left.write_bytes(bytes(data))

        metrics.StepMetrics(tmp_path / f"vllm-gaudi-metrics-{uid}-3-dp0.bin").close()

        assert not left.exists()
        assert alive.path.exists()
    finally:
        alive.close()
