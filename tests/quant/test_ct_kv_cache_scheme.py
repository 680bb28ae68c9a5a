"""compressed-tensors `kv_cache_scheme` on HPU, checked while vLLM builds its config (the HPU
platform calls the config's `hpu_check_vllm_config` before any engine starts): a checkpoint with
an FP8 per-tensor scheme gets Gaudi's FP8 E4M3 KV cache (`fp8_inc`) unless the user chose a KV
cache dtype; a scheme the HPU cache cannot hold is refused, naming it. No engine (the end-to-end
run is in test_checkpoint_engines.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.quant import packers as P
from tests.quant.checkpoints import KV_CACHE_SCHEME


def _config(kv_cache_scheme: dict | None):
    from vllm_gaudi_quant.methods.compressed_tensors import HpuCompressedTensorsConfig

    hf_config = P.ct_wna16_config(64, sym=False)
    if kv_cache_scheme is not None:
        hf_config["kv_cache_scheme"] = kv_cache_scheme
    return HpuCompressedTensorsConfig.from_config(hf_config)


def _vllm_config(cache_dtype: str) -> SimpleNamespace:
    return SimpleNamespace(cache_config=SimpleNamespace(cache_dtype=cache_dtype))


def test_kv_cache_scheme_selects_the_fp8_kv_cache():
    vllm_config = _vllm_config("auto")
    _config(dict(KV_CACHE_SCHEME)).hpu_check_vllm_config(vllm_config)
    assert vllm_config.cache_config.cache_dtype == "fp8_inc"


def test_an_explicit_kv_cache_dtype_wins_over_the_scheme_as_in_vllm():
    vllm_config = _vllm_config("bfloat16")
    _config(dict(KV_CACHE_SCHEME)).hpu_check_vllm_config(vllm_config)
    assert vllm_config.cache_config.cache_dtype == "bfloat16"


def test_checkpoint_without_a_kv_cache_scheme_keeps_the_default_kv_cache():
    vllm_config = _vllm_config("auto")
    _config(None).hpu_check_vllm_config(vllm_config)
    assert vllm_config.cache_config.cache_dtype == "auto"


@pytest.mark.parametrize(
    "change",
    [{"strategy": "attn_head"}, {"num_bits": 4}, {"type": "int"}, {"symmetric": False}],
    ids=["per-head", "4-bit", "int", "asymmetric"],
)
def test_kv_cache_scheme_hpu_cannot_hold_is_refused_naming_it(change):
    scheme = {**KV_CACHE_SCHEME, **change}
    with pytest.raises(ValueError, match="kv_cache_scheme") as excinfo:
        _config(scheme).hpu_check_vllm_config(_vllm_config("auto"))
    assert "strategy 'tensor'" in str(excinfo.value)


@pytest.mark.parametrize(("generation", "factor"), [("3", 1.0), ("2", 448.0 / 240.0)])
def test_checkpoint_kv_scales_move_into_the_device_fp8_range(
    emulated, monkeypatch, generation, factor
):
    # F10: a checkpoint's k/v scales are written for E4M3 up to 448; Gaudi 2 saturates at 240,
    # so the cache is quantized with scales 448/240 larger (Intel's compressed-tensors KV method
    # recomputes them with that ratio).
    import torch
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsKVCacheMethod,
    )

    from vllm_gaudi_quant.methods.compressed_tensors import _kv_scales_in_device_range

    monkeypatch.setenv("VLLM_HPU_EMULATION_GAUDI", generation)
    method = CompressedTensorsKVCacheMethod(_config(dict(KV_CACHE_SCHEME)))
    _kv_scales_in_device_range(method)
    layer = torch.nn.Module()
    layer.kv_cache_dtype = "fp8_inc"
    for name in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale", "_k_scale_cpu", "_v_scale_cpu"):
        layer.register_buffer(name, torch.tensor(1.0))  # as vLLM's Attention holds them
    method.create_weights(layer)
    layer.k_scale.data.fill_(0.02)
    layer.v_scale.data.fill_(0.05)
    layer.q_scale.data.fill_(0.03)

    method.process_weights_after_loading(layer)

    want = (0.02 * factor, 0.05 * factor)
    got = (float(layer._k_scale), float(layer._v_scale))
    assert got == pytest.approx(want, rel=1e-6)
    assert (layer._k_scale_float, layer._v_scale_float) == pytest.approx(want, rel=1e-6)
