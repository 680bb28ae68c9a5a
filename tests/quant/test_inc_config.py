"""INC FP8 settings: QUANT_CONFIG is read and checked before any engine starts, and each bad input
gets one error that names the file or key and the fix. Pure unit tests (no engine)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from vllm_gaudi_quant.methods import inc

MEASURE = {"mode": "MEASURE", "observer": "maxabs", "use_qdq": "True", "dump_stats_path": "s/m"}
QUANTIZE = {**MEASURE, "mode": "QUANTIZE", "scale_method": "maxabs_arbitrary"}


def _write(tmp_path, config, name="quant_config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(config) if isinstance(config, dict) else config)
    return str(path)


def _with_statistics(tmp_path):
    (tmp_path / "s").mkdir(exist_ok=True)
    (tmp_path / "s" / "m_hooks_maxabs_0_1.json").write_text("{}")


def test_unset_quant_config_names_the_variable_and_how_to_make_one():
    with pytest.raises(inc.IncConfigError, match=r"QUANT_CONFIG is not set.*vllm-gaudi calibrate"):
        inc.read_settings(None, emulated=True)


def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(inc.IncConfigError, match=rf"QUANT_CONFIG={missing}: no such file"):
        inc.read_settings(str(missing), emulated=True)


def test_unreadable_file_names_the_path(tmp_path):
    # A directory cannot be opened as a file (and file modes do not stop root).
    with pytest.raises(inc.IncConfigError, match=rf"QUANT_CONFIG={tmp_path} cannot be read"):
        inc.read_settings(str(tmp_path), emulated=True)


def test_malformed_json_names_the_file_and_line(tmp_path):
    path = _write(tmp_path, '{\n  "mode": "MEASURE",\n  oops\n}')
    with pytest.raises(inc.IncConfigError, match=r"is not valid JSON \(line 3"):
        inc.read_settings(path, emulated=True)


def test_unknown_mode_lists_the_modes_that_work(tmp_path):
    path = _write(tmp_path, {**MEASURE, "mode": "SHAPE"})
    with pytest.raises(inc.IncConfigError, match=r'"mode" is \'SHAPE\'.*"MEASURE".*"QUANTIZE"'):
        inc.read_settings(path, emulated=True)


def test_cpu_requires_quantize_dequantize_mode(tmp_path):
    path = _write(tmp_path, {**QUANTIZE, "use_qdq": "False"})
    with pytest.raises(
        inc.IncConfigError, match=r'CPU emulation.*"use_qdq".*set "use_qdq": "True"'
    ):
        inc.read_settings(path, emulated=True)


def test_cpu_refuses_hardware_aligned_scales_and_names_the_ones_that_work(tmp_path):
    _with_statistics(tmp_path)
    path = _write(tmp_path, {**QUANTIZE, "scale_method": "maxabs_hw"})
    with pytest.raises(
        inc.IncConfigError, match=r'"scale_method" is \'maxabs_hw\'.*maxabs_arbitrary, unit_scale'
    ):
        inc.read_settings(path, emulated=True)


def test_cpu_refuses_dynamic_quantization(tmp_path):
    path = _write(tmp_path, {**QUANTIZE, "dynamic_quantization": "True"})
    with pytest.raises(inc.IncConfigError, match=r'"dynamic_quantization" is not supported'):
        inc.read_settings(path, emulated=True)


def test_gaudi_accepts_hardware_aligned_scales_without_qdq(tmp_path):
    _with_statistics(tmp_path)
    path = _write(tmp_path, {**QUANTIZE, "use_qdq": "False", "scale_method": "maxabs_hw"})
    assert inc.read_settings(path, emulated=False).mode == "QUANTIZE"


def test_quantize_without_statistics_points_at_the_measure_step(tmp_path):
    path = _write(tmp_path, QUANTIZE)
    with pytest.raises(
        inc.IncConfigError, match=r"no calibration statistics at \"dump_stats_path\".*calibrate"
    ):
        inc.read_settings(path, emulated=True)


def test_unit_scale_quantize_needs_no_statistics(tmp_path):
    path = _write(tmp_path, {**QUANTIZE, "scale_method": "unit_scale"})
    assert inc.read_settings(path, emulated=True).mode == "QUANTIZE"


def test_relative_statistics_path_is_read_next_to_the_config_file(tmp_path):
    _with_statistics(tmp_path)
    settings = inc.read_settings(_write(tmp_path, QUANTIZE), emulated=True)
    assert settings.stats_prefix == str(tmp_path / "s" / "m")
    assert settings.inc_config["dump_stats_path"] == str(tmp_path / "s" / "m")


def test_measure_on_cpu_gets_a_cpu_scale_method_and_a_stats_directory(tmp_path):
    settings = inc.read_settings(_write(tmp_path, MEASURE), emulated=True)
    assert settings.measuring
    assert settings.inc_config["scale_method"] == "maxabs_arbitrary"
    assert (tmp_path / "s").is_dir()


def test_our_model_record_is_not_passed_to_neural_compressor(tmp_path):
    record = {"model": "m", "fingerprint": {"model_type": "llama"}}
    settings = inc.read_settings(_write(tmp_path, {**MEASURE, "vllm_gaudi": record}), emulated=True)
    assert settings.record == record
    assert "vllm_gaudi" not in settings.inc_config


def _hf_config(**overrides):
    base = dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    )
    return SimpleNamespace(**{**base, **overrides})


def test_statistics_made_for_another_model_are_refused_with_the_difference(tmp_path):
    record = inc.model_record("tiny-llama", _hf_config())
    settings = inc.read_settings(_write(tmp_path, {**MEASURE, "vllm_gaudi": record}), emulated=True)
    with pytest.raises(
        inc.IncConfigError,
        match=r"was made for model 'tiny-llama', not for 'other' \(hidden_size: 128 != 256",
    ):
        inc.check_model(settings, "other", _hf_config(hidden_size=256))


def test_statistics_of_the_same_model_under_another_path_are_accepted(tmp_path):
    record = inc.model_record("/old/place/tiny-llama", _hf_config())
    settings = inc.read_settings(_write(tmp_path, {**MEASURE, "vllm_gaudi": record}), emulated=True)
    inc.check_model(settings, "/new/place/tiny-llama", _hf_config())


def test_model_record_is_also_read_from_the_statistics_sidecar(tmp_path):
    _with_statistics(tmp_path)
    record = inc.model_record("tiny-llama", _hf_config())
    (tmp_path / "s" / "m_vllm_gaudi_0_1.json").write_text(json.dumps({**record, "kv_amax": {}}))
    settings = inc.read_settings(_write(tmp_path, QUANTIZE), emulated=True)
    assert settings.record["fingerprint"] == record["fingerprint"]


def test_measure_with_data_parallelism_is_refused(tmp_path, monkeypatch, emulated):
    monkeypatch.setenv("QUANT_CONFIG", _write(tmp_path, MEASURE))
    config = inc.HpuIncConfig()
    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=2))
    with pytest.raises(inc.IncConfigError, match=r"MEASURE config.*data_parallel_size=2"):
        config.hpu_check_vllm_config(vllm_config)


def test_quantize_with_data_parallelism_is_accepted(tmp_path, monkeypatch, emulated):
    _with_statistics(tmp_path)
    monkeypatch.setenv("QUANT_CONFIG", _write(tmp_path, QUANTIZE))
    config = inc.HpuIncConfig()
    config.hpu_check_vllm_config(
        SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=4))
    )


def test_missing_neural_compressor_names_the_install_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "neural_compressor" else real(name, *a),
    )
    with pytest.raises(inc.IncConfigError, match=r"pip install 'vllm-gaudi-quant\[inc\]'"):
        inc.require_neural_compressor()
