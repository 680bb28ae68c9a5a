"""Async scheduling on HPU: the platform keeps vLLM's choice (on by default, so the host prepares
step N+1 while the device runs step N) and turns it off, with a log line saying why, only for the
configurations the HPU runner does not run with it (speculative decoding, pooling models).

Engine tests check the outputs: tests/integration/test_generation.py (offline, on against off)
and tests/integration/test_serve.py (a server with it on, concurrent requests).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

CONFIGS = (
    "from vllm.engine.arg_utils import EngineArgs\n"
    "from gaudi_testkit import tinymodels\n"
    "model = str(tinymodels.build('llama'))\n"
    "cases = {\n"
    "    'default': {},\n"
    "    'off': {'async_scheduling': False},\n"
    "    'ngram': {'speculative_config': {'method': 'ngram', 'num_speculative_tokens': 2,\n"
    "                                     'prompt_lookup_max': 3, 'prompt_lookup_min': 2}},\n"
    "    'pooling': {'runner': 'pooling', 'async_scheduling': True},\n"
    "}\n"
    "for name, kwargs in cases.items():\n"
    "    config = EngineArgs(model=model, max_model_len=256, **kwargs).create_engine_config()\n"
    "    print('ASYNC', name, config.scheduler_config.async_scheduling,\n"
    "          config.max_concurrent_batches, flush=True)\n"
)


@pytest.mark.process
def test_async_scheduling_is_on_by_default_and_off_where_the_hpu_runner_cannot_use_it(
    run_python,
):
    result = run_python(CONFIGS, {"VLLM_HPU_EMULATION": "cpu"})

    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("ASYNC ")]
    # Two batches in flight is what lets the engine schedule step N+1 before step N's output.
    assert lines == [
        "ASYNC default True 2",
        "ASYNC off False 1",
        "ASYNC ngram False 1",
        "ASYNC pooling False 1",
    ]
    assert "Async scheduling is off on HPU for pooling models" in result.stdout + result.stderr


@pytest.fixture
def check_async_scheduling(emulated):
    from vllm_gaudi_platform.config_checks import check_async_scheduling

    return check_async_scheduling


def _config(speculative: object = None, runner_type: str = "generate") -> SimpleNamespace:
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(async_scheduling=True),
        speculative_config=speculative,
        model_config=SimpleNamespace(runner_type=runner_type),
    )


def test_speculative_decoding_turns_async_scheduling_off_saying_why(check_async_scheduling, caplog):
    # vLLM already turns it off for the n-gram drafter; this guards a vLLM that stops doing so.
    caplog.set_level(logging.INFO, logger="vllm.vllm_gaudi_platform")
    config = _config(speculative=SimpleNamespace(method="ngram"))

    check_async_scheduling(config)

    assert config.scheduler_config.async_scheduling is False
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("vllm.vllm_gaudi")]
    assert any("Async scheduling is off on HPU for speculative decoding" in m for m in messages)


def test_a_generative_model_keeps_async_scheduling_without_a_log_line(
    check_async_scheduling, caplog
):
    caplog.set_level(logging.INFO, logger="vllm.vllm_gaudi_platform")
    config = _config()

    check_async_scheduling(config)

    assert config.scheduler_config.async_scheduling is True
    assert not [r for r in caplog.records if "Async scheduling" in r.getMessage()]
