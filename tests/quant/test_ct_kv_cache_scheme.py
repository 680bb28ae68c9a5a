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
