"""The quantization hooks the platform calls are declared (vllm_gaudi_platform/quant_hooks.py),
and every quantization config of the quant wheel that offers one matches its declaration: a
method named `hpu_*` that is no declared hook, or one whose parameters differ, would never be
called, or be called wrongly."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

import vllm_gaudi_quant
from vllm_gaudi_platform import quant_hooks


def _quant_configs() -> list[type]:
    found = []
    for info in pkgutil.walk_packages(vllm_gaudi_quant.__path__, "vllm_gaudi_quant."):
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, QuantizationConfig) and cls.__module__ == info.name:
                found.append(cls)
    return found


CONFIGS = _quant_configs()
DECLARED = {
    name: hook
    for hook in quant_hooks.HOOKS
    for name, _ in inspect.getmembers(hook, inspect.isfunction)
    if name.startswith("hpu_")
}


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_each_hook_is_one_method():
    assert sorted(DECLARED) == [
        "hpu_after_load_model",
        "hpu_check_vllm_config",
        "hpu_finalize_calibration",
    ]


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: f"{c.__module__}.{c.__name__}")
def test_every_hpu_method_of_a_quant_config_is_a_declared_hook(cls):
    for name, fn in inspect.getmembers(cls, inspect.isfunction):
        if not name.startswith("hpu_"):
            continue
        assert name in DECLARED, f"{cls.__name__}.{name} is no hook of quant_hooks.py"
        declared = getattr(DECLARED[name], name)
        assert _params(fn) == _params(declared), (cls.__name__, name)


def test_the_configs_that_offer_hooks_are_seen_as_offering_them():
    by_name = {cls.__name__: cls for cls in CONFIGS}
    assert len(by_name) >= 5, sorted(by_name)  # INC, FP8, AWQ, GPTQ, compressed-tensors, ...
    offering = {
        name: {hook.__name__ for hook in quant_hooks.HOOKS if issubclass(cls, hook)}
        for name, cls in by_name.items()
    }
    with_hooks = {name: hooks for name, hooks in offering.items() if hooks}
    # INC FP8 offers all three; compressed-tensors checks the engine's settings.
    assert any(len(hooks) == 3 for hooks in with_hooks.values()), with_hooks
    assert any(hooks == {"ChecksVllmConfig"} for hooks in with_hooks.values()), with_hooks
