"""Every entry point of the four wheels is inert where the HPU platform is not the platform.

vLLM loads every `vllm.general_plugins` and `vllm.stat_logger_plugins` entry point in every
process that serves, whatever the platform: a GPU or CPU machine with our wheels installed (a
shared image, a CI runner) must serve with vLLM's own backend as if they were not there. Checked
in a fresh interpreter with no Gaudi and no `VLLM_HPU_EMULATION`: each group's plugins load
through vLLM's own loader and run, nothing raises, nothing probes the device (the HPU platform
module and the seam's backends stay unimported), no `vllm:hpu_*` metric is created, and our
loggers say nothing above DEBUG. The served check is in test_serve_off_hpu.py.
"""

from __future__ import annotations

import json

import pytest

from tests.vllm_build import VLLM_OWN_PLATFORM

INERT = r"""
import json, logging, sys, types

records = []
class Keep(logging.Handler):
    def emit(self, record):
        if record.name.startswith(("vllm.vllm_gaudi", "vllm_gaudi")):
            records.append([record.levelname, record.name, record.getMessage()])
keep = Keep(level=logging.DEBUG)
for name in ("vllm", "vllm_gaudi_platform", "vllm_gaudi_ops", "vllm_gaudi_quant",
             "vllm_gaudi_connectors"):
    logging.getLogger(name).addHandler(keep)
    logging.getLogger(name).setLevel(logging.DEBUG)
logging.getLogger("vllm.vllm_gaudi_platform").setLevel(logging.DEBUG)

from vllm.plugins import load_plugins_by_group, load_general_plugins
from vllm.platforms import current_platform

report = {"platform": type(current_platform).__name__}
platform_plugins = load_plugins_by_group("vllm.platform_plugins")
report["platform_plugins"] = {name: func() for name, func in platform_plugins.items()}

load_general_plugins()
from vllm_gaudi_platform import plugins
report["general_outcomes"] = dict(plugins.OUTCOMES)

import prometheus_client
stat_loggers = load_plugins_by_group("vllm.stat_logger_plugins")
config = types.SimpleNamespace(
    parallel_config=types.SimpleNamespace(_api_process_rank=0),
    instance_id="off-hpu-test",
    model_config=types.SimpleNamespace(served_model_name="m"),
)
report["stat_loggers"] = {}
for name, cls in stat_loggers.items():
    logger = cls(config, [0])
    logger.log_engine_initialized()
    logger.record(None, None, engine_idx=0)
    report["stat_loggers"][name] = bool(getattr(logger, "enabled", None))
report["hpu_collectors"] = sorted(
    n for n in prometheus_client.REGISTRY._names_to_collectors if n.startswith("vllm:hpu")
)
report["imported"] = sorted(
    m for m in sys.modules
    if m in ("vllm_gaudi_platform.platform", "vllm_gaudi_platform.seam.gaudi",
             "vllm_gaudi_platform.seam.emulated")
)
# Importing the platform module itself must not raise either; activating it must, with the reason.
import vllm_gaudi_platform.platform as hpu_platform
try:
    hpu_platform.HpuPlatform()
    report["activation_error"] = None
except RuntimeError as exc:
    report["activation_error"] = str(exc)
report["records"] = records
print("OFFHPU " + json.dumps(report))
"""


@pytest.fixture(scope="module")
def report(run_python) -> dict:
    result = run_python(INERT)
    lines = [line for line in result.stdout.splitlines() if line.startswith("OFFHPU ")]
    assert lines, f"crashed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return json.loads(lines[-1].removeprefix("OFFHPU "))


@pytest.mark.process
def test_vllm_keeps_its_own_platform_and_the_hpu_platform_plugin_declines(report):
    assert report["platform"] == VLLM_OWN_PLATFORM
    assert report["platform_plugins"] == {"hpu": None}


@pytest.mark.process
def test_every_general_plugin_loads_and_registers_nothing(report):
    outcomes = report["general_outcomes"]
    expected = {
        "hpu_ops_norm",
        "hpu_ops_rotary",
        "hpu_ops_activation",
        "hpu_ops_moe",
        "hpu_ops_encoder_attention",
        "hpu_ops_mamba",
        "hpu_quant_inc",
        "hpu_quant_fp8",
        "hpu_quant_awq",
        "hpu_quant_gptq",
        "hpu_quant_compressed_tensors",
        "hpu_quant_mxfp4",
        "hpu_nixl",
        "hpu_offload",
    }
    assert expected <= set(outcomes)
    assert set(outcomes.values()) == {"skipped: active platform is not HPU"}


@pytest.mark.process
def test_the_stat_logger_plugin_loads_and_creates_no_hpu_metric(report):
    assert report["stat_loggers"] == {"hpu_metrics": False}
    assert report["hpu_collectors"] == []


@pytest.mark.process
def test_no_plugin_imports_the_platform_module_or_a_device_backend(report):
    assert report["imported"] == []


@pytest.mark.process
def test_our_loggers_say_nothing_above_debug(report):
    loud = [r for r in report["records"] if r[0] != "DEBUG"]
    assert loud == []
    # One DEBUG line per inert plugin, naming it.
    debug = [r[2] for r in report["records"]]
    for name in report["general_outcomes"]:
        assert sum(name in line for line in debug) == 1, (name, debug)
    assert sum("hpu_metrics" in line for line in debug) == 1, debug


@pytest.mark.process
def test_the_platform_module_imports_and_fails_only_when_activated(report):
    error = report["activation_error"]
    assert error is not None
    assert error.startswith("No HPU backend: no Gaudi software (habana_frameworks) installed")
    assert "VLLM_HPU_EMULATION is not set" in error
