"""Each family's register(): what it replaces on HPU, idempotence, and nothing elsewhere.

vLLM resolves its platform once per process, so each platform is a fresh interpreter: one under
CPU emulation of the HPU platform, one on vLLM's CPU platform. Both start side by side on first
use; each prints one JSON report that the tests read.
"""

from __future__ import annotations

import importlib
import json
from concurrent.futures import Future, ThreadPoolExecutor
from importlib import metadata

import pytest

FAMILIES = {
    "hpu_ops_norm": ("norm", ["RMSNorm", "GemmaRMSNorm"]),
    "hpu_ops_rotary": (
        "rotary",
        [
            "RotaryEmbedding",
            "Llama3RotaryEmbedding",
            "LinearScalingRotaryEmbedding",
            "NTKScalingRotaryEmbedding",
            "DynamicNTKScalingRotaryEmbedding",
            "DynamicNTKAlphaRotaryEmbedding",
            "YaRNScalingRotaryEmbedding",
            "Gemma4RotaryEmbedding",
            "DeepseekScalingRotaryEmbedding",
            "DeepseekV4ScalingRotaryEmbedding",
            "MRotaryEmbedding",
            "MRotaryEmbeddingInterleaved",
            "Ernie4_5_VLRotaryEmbedding",
            "BailingMRotaryEmbedding",
            "FourierRotaryEmbedding",
            "Llama4VisionRotaryEmbedding",
            "ApplyRotaryEmb",
        ],
    ),
    "hpu_ops_activation": (
        "activation",
        [
            "SiluAndMul",
            "MulAndSilu",
            "GeluAndMul",
            "SwigluOAIAndMul",
            "SwigluStepAndMul",
            "SiluAndMulWithClamp",
            "FatreluAndMul",
            "SituAndMul",
            "GeluAndMulSparse",
        ],
    ),
    "hpu_ops_moe": ("moe", ["UnquantizedFusedMoEMethod", "GroupedTopk"]),
    "hpu_ops_encoder_attention": ("encoder_attention", ["MMEncoderAttention"]),
}

REGISTER_ALL = """
import json
import logging
from vllm.platforms import current_platform
from vllm.model_executor.custom_op import op_registry_oot
from vllm_gaudi_platform import plugins
from vllm_gaudi_ops import activation, encoder_attention, moe, norm, rotary

warnings = []
class Collect(logging.Handler):
    def emit(self, record):
        if record.levelno >= logging.WARNING:
            warnings.append(record.getMessage())
logging.getLogger("vllm.vllm_gaudi_platform").addHandler(Collect())

modules = [norm, rotary, activation, moe, encoder_attention]
for _ in range(2):
    for module in modules:
        module.register()
first = {k: f"{v.__module__}.{v.__qualname__}" for k, v in op_registry_oot.items()}
# Past the once-per-process guard: the replacement itself must be idempotent too.
plugins.OUTCOMES.clear()
for module in modules:
    module.register()
report = {
    "platform": type(current_platform).__name__,
    "outcomes": dict(plugins.OUTCOMES),
    "registry": {k: f"{v.__module__}.{v.__qualname__}" for k, v in op_registry_oot.items()},
    "registry_after_first_round": first,
    "op_names": {k: getattr(v, "name", None) for k, v in op_registry_oot.items()},
    "warnings": warnings,
}
"""

# Builds one in-tree layer per family, the way model code does, and runs it.
BUILD_AND_RUN = """
import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention.mm_encoder_attention import MMEncoderAttention
from vllm.model_executor.layers.fused_moe.router.grouped_topk_router import GroupedTopk
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm_gaudi_ops import stats

with set_current_vllm_config(VllmConfig()):
    layers = {
        "norm": (RMSNorm(16), (torch.randn(3, 16),)),
        "rotary": (
            get_rope(16, 64, True, {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 32}),
            (torch.arange(3), torch.randn(3, 32), torch.randn(3, 16)),
        ),
        "activation": (SiluAndMul(), (torch.randn(3, 16),)),
        "moe": (GroupedTopk(2, True, 2, 1), (torch.randn(3, 8), torch.randn(3, 8))),
        "encoder_attention": (
            MMEncoderAttention(2, 8), (torch.randn(1, 3, 16), torch.randn(1, 3, 16),
                                       torch.randn(1, 3, 16)),
        ),
    }
report["built"] = {}
for family, (layer, args) in layers.items():
    layer(*args)
    report["built"][family] = {
        "class": type(layer).__qualname__,
        "forward": layer._forward_method.__func__.__qualname__,
    }
report["counts"] = dict(stats.COUNTS)
"""

PRINT = 'print("REPORT " + json.dumps(report))\n'

SCENARIOS = {
    "emulated": (REGISTER_ALL + BUILD_AND_RUN + PRINT, {"VLLM_HPU_EMULATION": "cpu"}),
    "cpu": (REGISTER_ALL + PRINT, {}),
}


class Reports:
    """Runs each scenario in its own interpreter, side by side, on first use."""

    def __init__(self, run_python) -> None:
        self._run_python = run_python
        self._pool = ThreadPoolExecutor(max_workers=len(SCENARIOS))
        self._futures: dict[str, Future] = {}

    def __getitem__(self, name: str) -> dict:
        if not self._futures:
            for key, (code, env) in SCENARIOS.items():
                self._futures[key] = self._pool.submit(self._run_python, code, env)
        result = self._futures[name].result()
        lines = [line for line in result.stdout.splitlines() if line.startswith("REPORT ")]
        assert lines, f"{name} crashed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
        return json.loads(lines[-1].removeprefix("REPORT "))


@pytest.fixture(scope="module")
def reports(run_python):
    return Reports(run_python)


@pytest.mark.parametrize("entry_point", sorted(FAMILIES))
def test_family_replaces_its_classes_on_hpu(reports, entry_point):
    family, class_names = FAMILIES[entry_point]
    report = reports["emulated"]

    assert report["platform"] == "HpuPlatform"
    assert report["outcomes"][entry_point] == "registered"
    for name in class_names:
        assert report["registry"].get(name, "").startswith(f"vllm_gaudi_ops.layers.{family}."), name


def test_families_register_nothing_else(reports):
    expected = {name for _, names in FAMILIES.values() for name in names}
    registry = reports["emulated"]["registry"]

    assert {k for k, v in registry.items() if v.startswith("vllm_gaudi_ops.")} == expected


def test_register_twice_and_after_a_reset_changes_nothing_and_warns_nothing(reports):
    report = reports["emulated"]

    assert report["registry"] == report["registry_after_first_round"]
    assert report["warnings"] == []


def test_replacements_keep_vllms_op_names_for_custom_ops_settings(reports):
    names = reports["emulated"]["op_names"]

    assert names["RMSNorm"] == "rms_norm"
    assert names["Llama3RotaryEmbedding"] == "rotary_embedding"
    assert names["UnquantizedFusedMoEMethod"] == "unquantized_fused_moe"


@pytest.mark.parametrize("family", sorted(f for f, _ in FAMILIES.values()))
def test_layers_built_by_model_code_run_the_gaudi_forward(reports, family):
    built = reports["emulated"]["built"][family]

    assert built["class"].startswith("Hpu")
    assert built["forward"].endswith(".forward_oot")


@pytest.mark.parametrize("family", sorted(f for f, _ in FAMILIES.values()))
def test_family_counter_shows_its_forward_oot_ran(reports, family):
    assert reports["emulated"]["counts"].get(family, 0) >= 1


def test_on_a_non_hpu_platform_register_does_nothing(reports):
    report = reports["cpu"]

    assert report["platform"] != "HpuPlatform"
    assert report["registry"] == {}
    for entry_point in FAMILIES:
        assert report["outcomes"][entry_point] == "skipped: active platform is not HPU"


def test_installed_metadata_declares_one_entry_point_per_family():
    eps = {
        ep.name: ep
        for ep in metadata.entry_points(group="vllm.general_plugins")
        if ep.name.startswith("hpu_ops_")
    }

    assert set(eps) == set(FAMILIES)
    for ep in eps.values():
        assert ep.load() is importlib.import_module(ep.module).register


def test_entry_point_modules_import_neither_torch_nor_vllm(run_python):
    # vLLM loads every general plugin in every process, whatever the platform: loading must be
    # cheap, and must not import vLLM's layers (that imports vLLM's compiled kernels).
    result = run_python(
        "import sys\n"
        "from vllm_gaudi_ops import activation, encoder_attention, moe, norm, rotary\n"
        "print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))"
    )

    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
