"""Bad INC input through vLLM's own entry points, in CPU emulation: each stops `LLM(...)` (or the
engine config `vllm serve` builds) with one error naming the file or setting, before any engine
process starts. Two fresh processes, no engine; plus `vllm-gaudi calibrate` input errors."""

from __future__ import annotations

import json

import pytest

from tests.integration.generation import job_result

CASES_JOB = r"""
import json, os, sys
from vllm import LLM
from vllm.engine.arg_utils import EngineArgs
from gaudi_testkit import tinymodels

model = str(tinymodels.build("llama"))
cases = json.loads(sys.argv[1])
results = {}
for name, case in cases.items():
    os.environ.pop("QUANT_CONFIG", None)
    if case["quant_config"] is not None:
        os.environ["QUANT_CONFIG"] = case["quant_config"]
    kwargs = dict(model=model, quantization="inc", max_model_len=256,
                  kv_cache_memory_bytes=1 << 24, **case.get("engine", {}))
    try:
        if case.get("serve"):  # what `vllm serve` builds before starting engines
            EngineArgs(**kwargs).create_engine_config()
        else:
            LLM(**kwargs)
        results[name] = {"error": None}
    except Exception as exc:
        results[name] = {"error": type(exc).__name__, "message": str(exc)}
print("RESULT " + json.dumps(results), flush=True)
"""

MEASURE = {"mode": "MEASURE", "observer": "maxabs", "use_qdq": "True", "dump_stats_path": "s/m"}


def _config(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


@pytest.fixture(scope="module")
def outcomes(run_python, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("inc-errors")
    other = {"model": "some-other-model", "fingerprint": {"model_type": "gemma", "hidden_size": 9}}
    cases = {
        "unset": {"quant_config": None},
        "missing": {"quant_config": str(tmp / "nope.json")},
        "malformed": {"quant_config": _config(tmp, "bad.json", '{"mode": "MEASURE",}')},
        "other_model": {"quant_config": _config(tmp, "o.json", {**MEASURE, "vllm_gaudi": other})},
        "cpu_mode": {"quant_config": _config(tmp, "c.json", {**MEASURE, "use_qdq": "False"})},
        "measure_dp": {
            "quant_config": _config(tmp, "m.json", MEASURE),
            "engine": {"data_parallel_size": 2},
            "serve": True,
        },
        "kv_dtype": {
            "quant_config": _config(tmp, "k.json", MEASURE),
            "engine": {"kv_cache_dtype": "fp8_e5m2"},
        },
    }
    proc = run_python(
        f"import sys; sys.argv[1:] = [{json.dumps(cases)!r}]\n" + CASES_JOB,
        env={"VLLM_HPU_EMULATION": "cpu"},
        timeout=600,
    )
    return job_result(proc, "error-case job"), proc.stderr


def _error(outcomes, case):
    result = outcomes[0][case]
    assert result["error"] is not None, f"{case}: no error raised"
    return result["message"]


@pytest.mark.process
def test_no_engine_process_starts_for_any_bad_input(outcomes):
    assert "EngineCore" not in outcomes[1]
    assert all(r["error"] for r in outcomes[0].values())


@pytest.mark.process
def test_unset_quant_config_is_named(outcomes):
    assert "QUANT_CONFIG is not set" in _error(outcomes, "unset")


@pytest.mark.process
def test_missing_quant_config_file_is_named(outcomes):
    assert "nope.json: no such file" in _error(outcomes, "missing")


@pytest.mark.process
def test_malformed_quant_config_is_named_with_the_line(outcomes):
    message = _error(outcomes, "malformed")
    assert "bad.json is not valid JSON (line 1" in message


@pytest.mark.process
def test_quant_config_for_another_model_is_refused(outcomes):
    message = _error(outcomes, "other_model")
    assert "was made for model 'some-other-model'" in message and "vllm-gaudi calibrate" in message


@pytest.mark.process
def test_mode_the_cpu_cannot_run_names_the_key_and_the_value_that_works(outcomes):
    assert 'set "use_qdq": "True"' in _error(outcomes, "cpu_mode")


@pytest.mark.process
def test_measure_with_data_parallelism_is_refused(outcomes):
    assert "data_parallel_size=2" in _error(outcomes, "measure_dp")


@pytest.mark.process
def test_kv_cache_dtype_the_backend_cannot_store_lists_the_ones_it_can(outcomes):
    message = _error(outcomes, "kv_dtype")
    assert "kv_cache_dtype='fp8_e5m2' is not supported on HPU" in message
    assert "fp8_inc" in message


MISSING_NC_JOB = r"""
import sys
sys.modules["neural_compressor"] = None  # as if neural-compressor were not installed
import os
os.environ["QUANT_CONFIG"] = sys.argv[1]
from vllm import LLM
from gaudi_testkit import tinymodels
try:
    LLM(model=str(tinymodels.build("llama")), quantization="inc", max_model_len=256)
except Exception as exc:
    print("ERROR", str(exc).splitlines()[1] if "validation error" in str(exc) else exc)
"""


@pytest.mark.process
def test_missing_neural_compressor_names_the_install_command(run_python, tmp_path):
    config = _config(tmp_path, "m.json", MEASURE)
    proc = run_python(
        f"import sys; sys.argv[1:] = [{config!r}]\n" + MISSING_NC_JOB,
        env={"VLLM_HPU_EMULATION": "cpu"},
        timeout=900,
    )
    assert "ERROR" in proc.stdout, proc.stderr[-3000:]
    assert "--quantization inc is not available on HPU" in proc.stdout
    assert "pip install vllm-gaudi-quant[inc]" in proc.stdout
    assert "EngineCore" not in proc.stderr


@pytest.mark.process
def test_calibrate_names_a_missing_dataset(console_script, clean_env, tmp_path):
    import subprocess

    proc = subprocess.run(
        [
            console_script("vllm-gaudi"),
            "calibrate",
            "m",
            "--dataset",
            str(tmp_path / "x.jsonl"),
            "--out",
            str(tmp_path / "out"),
        ],
        env=clean_env({"VLLM_HPU_EMULATION": "cpu"}),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 2
    assert f"--dataset {tmp_path / 'x.jsonl'}: no such file" in proc.stderr


@pytest.mark.process
def test_calibrate_names_a_bad_dataset_line(console_script, clean_env, tmp_path):
    import subprocess

    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "fine"}\n{"txt": "no text key"}\n')
    proc = subprocess.run(
        [
            console_script("vllm-gaudi"),
            "calibrate",
            "m",
            "--dataset",
            str(data),
            "--out",
            str(tmp_path / "out"),
        ],
        env=clean_env({"VLLM_HPU_EMULATION": "cpu"}),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 2
    assert 'line 2 has no "text" or "prompt" string' in proc.stderr


@pytest.mark.process
def test_calibrate_without_the_quant_wheel_names_the_install_command(run_python):
    proc = run_python(
        "import sys\n"
        "sys.modules['vllm_gaudi_quant'] = None  # as if the quant wheel were not installed\n"
        "from vllm_gaudi_platform.cli import main\n"
        "sys.exit(main(['calibrate', 'm', '--dataset', 'd', '--out', 'o']))\n",
        timeout=900,
    )
    assert proc.returncode == 2
    assert "pip install 'vllm-gaudi-quant[inc]'" in proc.stderr
