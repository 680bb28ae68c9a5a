"""Each family's entry point: what it replaces on HPU, idempotence, and nothing elsewhere.

The families are the installed `hpu_ops_*` entry points; what each must replace is the ops
README's families table, and each family module's REPLACEMENTS must say the same. vLLM resolves
its platform once per process, so each platform is a fresh interpreter: one under CPU emulation
of the HPU platform, one on vLLM's CPU platform. Both start side by side on first use; each
prints one JSON report that the tests read.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
from concurrent.futures import Future, ThreadPoolExecutor
from importlib import metadata
from pathlib import Path
from types import ModuleType

import pytest

OPS_README = Path(__file__).resolve().parents[2] / "packages" / "vllm-gaudi-ops" / "README.md"
FAMILY_PREFIX = "hpu_ops_"


def _family_entry_points() -> dict[str, metadata.EntryPoint]:
    """The installed op-family entry points (`hpu_ops_*`), by name: the families under test."""
    return {
        ep.name: ep
        for ep in metadata.entry_points(group="vllm.general_plugins")
        if ep.name.startswith(FAMILY_PREFIX)
    }


ENTRY_POINTS = _family_entry_points()
# entry point name -> family (the module in vllm_gaudi_ops/families/)
FAMILIES = {name: name.removeprefix(FAMILY_PREFIX) for name in ENTRY_POINTS}
# Families replacing a whole vLLM layer (a PluggableLayer) rather than a CustomOp's forward.
PLUGGABLE_FAMILIES = {"mamba", "gdn"}


def _family_module(family: str) -> ModuleType:
    return importlib.import_module(f"vllm_gaudi_ops.families.{family}")


def _readme_families() -> dict[str, tuple[str, list[str]]]:
    """The ops README's families table: entry point -> (register function, classes replaced)."""
    rows = {}
    for line in OPS_README.read_text().splitlines():
        if not line.startswith(f"| `{FAMILY_PREFIX}"):
            continue
        name, value, classes = (cell.strip() for cell in line.strip("|").split("|")[:3])
        rows[name.strip("`")] = (value.strip("`"), re.findall(r"`([^`]+)`", classes))
    return rows


REGISTER_ALL = """
import json
import logging
from importlib import metadata
from vllm.platforms import current_platform
from vllm.model_executor.custom_op import op_registry_oot
from vllm_gaudi_platform import plugins

warnings = []
class Collect(logging.Handler):
    def emit(self, record):
        if record.levelno >= logging.WARNING:
            warnings.append(record.getMessage())
logging.getLogger("vllm.vllm_gaudi_platform").addHandler(Collect())

# Every installed op family, through its entry point, as vLLM loads it.
eps = metadata.entry_points(group="vllm.general_plugins")
eps = sorted((ep for ep in eps if ep.name.startswith("hpu_ops_")), key=lambda ep: ep.name)
registers = [ep.load() for ep in eps]
for _ in range(2):
    for register in registers:
        register()
first = {k: f"{v.__module__}.{v.__qualname__}" for k, v in op_registry_oot.items()}
# Past the once-per-process guard: the replacement itself must be idempotent too.
plugins.OUTCOMES.clear()
for register in registers:
    register()
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

# A pluggable layer (the whole layer replaced, not a CustomOp's forward): the Mamba2 mixer, in a
# one-process tensor-parallel group, run as a profiling pass runs it (no metadata, no state).
import socket
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
mamba_config = VllmConfig()
with set_current_vllm_config(mamba_config):
    init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
    initialize_model_parallel(1, 1)
    mixer = MambaMixer2(16, 4, 4, 16, True, False, n_groups=1, num_heads=2, head_dim=8,
                        prefix="mixer")
    with set_forward_context(None, mamba_config):
        mixer(torch.randn(3, 16))
report["built"]["mamba"] = {
    "class": type(mixer).__qualname__,
    "forward": type(mixer).conv_ssm_forward.__qualname__,
}
# A gated delta net layer as Qwen3.5's model code builds it, run as a profiling pass runs it.
from gaudi_testkit import tinymodels
from vllm.config import ModelConfig
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
gdn_config = VllmConfig(model_config=ModelConfig(str(tinymodels.build("qwen3.5")), dtype="float32"))
text_config = gdn_config.model_config.hf_text_config
with set_current_vllm_config(gdn_config):
    gdn = QwenGatedDeltaNetAttention(text_config, gdn_config, prefix="model.layers.0.linear_attn")
    with set_forward_context(None, gdn_config):
        gdn(torch.randn(3, text_config.hidden_size))
report["built"]["gdn"] = {
    "class": type(gdn).__qualname__, "forward": type(gdn).forward.__qualname__
}
report["counts"] = dict(stats.COUNTS)

# What custom_ops=["-rms_norm"] does to the replacement: vLLM matches the op's `name`.
from vllm.config import CompilationConfig
minus_rms_norm = VllmConfig(compilation_config=CompilationConfig(custom_ops=["-rms_norm"]))
with set_current_vllm_config(minus_rms_norm):
    norm = RMSNorm(16)
report["rms_norm_disabled"] = {
    "class": type(norm).__qualname__,
    "forward": norm._forward_method.__func__.__qualname__,
}
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


# --- the family modules and their entry points, in this process ----------------------------------


def test_families_are_installed():
    assert FAMILIES, "no hpu_ops_* entry point installed (run `make setup`)"


@pytest.mark.parametrize("entry_point", sorted(ENTRY_POINTS))
def test_entry_point_value_names_the_family_module_of_the_same_name(entry_point):
    family = FAMILIES[entry_point]

    assert ENTRY_POINTS[entry_point].value == f"vllm_gaudi_ops.register:{family}"
    assert importlib.util.find_spec(f"vllm_gaudi_ops.families.{family}") is not None


@pytest.mark.parametrize("entry_point", sorted(ENTRY_POINTS))
def test_entry_point_loads_one_register_function_named_after_it(entry_point):
    register = ENTRY_POINTS[entry_point].load()

    assert callable(register)
    assert register.__name__ == entry_point
    assert ENTRY_POINTS[entry_point].load() is register


def test_an_entry_point_naming_no_family_module_fails_to_load_and_says_which_module():
    from vllm_gaudi_ops import register

    with pytest.raises(AttributeError, match=r"vllm_gaudi_ops\.families\.nrom"):
        register.nrom  # noqa: B018


@pytest.mark.parametrize("entry_point", sorted(ENTRY_POINTS))
def test_family_module_counts_under_its_own_name(entry_point):
    family = FAMILIES[entry_point]

    assert family == _family_module(family).FAMILY


@pytest.mark.parametrize("entry_point", sorted(ENTRY_POINTS))
def test_each_replacement_is_a_subclass_with_its_own_forward_oot(entry_point):
    from vllm.model_executor.custom_op import PluggableLayer

    for in_tree, replacement in _family_module(FAMILIES[entry_point]).REPLACEMENTS:
        # Model code checks isinstance against the in-tree class; the Gaudi path is forward_oot.
        assert issubclass(replacement, in_tree), replacement
        if issubclass(in_tree, PluggableLayer):
            # vLLM builds the replacement instead of the whole layer: its Gaudi path is the
            # in-tree methods it overrides.
            own = [n for n, v in vars(replacement).items() if callable(v) and hasattr(in_tree, n)]
            assert own, replacement
        else:
            assert replacement.forward_oot is not in_tree.forward_oot, replacement


def test_ops_readme_families_table_lists_each_entry_point_and_the_classes_it_replaces():
    expected = {
        name: (ep.value, [c.__name__ for c, _ in _family_module(FAMILIES[name]).REPLACEMENTS])
        for name, ep in ENTRY_POINTS.items()
    }

    assert _readme_families() == expected


# --- registration through the entry points, in fresh processes ---------------------------------


@pytest.mark.process
@pytest.mark.parametrize("entry_point", sorted(ENTRY_POINTS))
def test_family_replaces_its_readme_classes_on_hpu(reports, entry_point):
    module = f"vllm_gaudi_ops.families.{FAMILIES[entry_point]}"
    _, class_names = _readme_families()[entry_point]
    report = reports["emulated"]

    assert report["platform"] == "HpuPlatform"
    assert report["outcomes"][entry_point] == "registered"
    for name in class_names:
        assert report["registry"].get(name, "").startswith(f"{module}.Hpu"), name


@pytest.mark.process
def test_families_register_nothing_else(reports):
    expected = {name for _, names in _readme_families().values() for name in names}
    registry = reports["emulated"]["registry"]

    assert {k for k, v in registry.items() if v.startswith("vllm_gaudi_ops.")} == expected


@pytest.mark.process
def test_register_twice_and_after_a_reset_changes_nothing_and_warns_nothing(reports):
    report = reports["emulated"]

    assert report["registry"] == report["registry_after_first_round"]
    assert report["warnings"] == []


@pytest.mark.process
@pytest.mark.parametrize("entry_point", sorted(ENTRY_POINTS))
def test_every_replacement_keeps_the_in_tree_op_name(reports, entry_point):
    # Registering with register_custom_op alone renames the op to its class name ("RMSNorm"),
    # and then compilation_config.custom_ops ("-rms_norm") no longer reaches it: replace_ops
    # restores the in-tree name.
    names = reports["emulated"]["op_names"]

    for in_tree, _ in _family_module(FAMILIES[entry_point]).REPLACEMENTS:
        assert names[in_tree.__name__] == in_tree.name, in_tree.__name__


@pytest.mark.process
def test_custom_ops_minus_rms_norm_runs_vllms_native_norm_on_hpu(reports):
    disabled = reports["emulated"]["rms_norm_disabled"]

    assert disabled["class"] == "HpuRMSNorm"
    assert disabled["forward"].endswith(".forward_native")


@pytest.mark.process
@pytest.mark.parametrize("family", sorted(FAMILIES.values()))
def test_layers_built_by_model_code_run_the_gaudi_forward(reports, family):
    built = reports["emulated"]["built"].get(family)

    assert built, f"add a layer of the {family} family to BUILD_AND_RUN"
    assert built["class"].startswith("Hpu")
    # A CustomOp's Gaudi path is its forward_oot; a pluggable layer's, the method it overrides.
    if family in PLUGGABLE_FAMILIES:
        assert built["forward"].startswith(built["class"] + ".")
    else:
        assert built["forward"].endswith(".forward_oot")


@pytest.mark.process
@pytest.mark.parametrize("family", sorted(FAMILIES.values()))
def test_family_counter_shows_its_forward_oot_ran(reports, family):
    assert reports["emulated"]["counts"].get(family, 0) >= 1


@pytest.mark.process
def test_on_a_non_hpu_platform_register_does_nothing(reports):
    report = reports["cpu"]

    assert report["platform"] != "HpuPlatform"
    assert report["registry"] == {}
    for entry_point in ENTRY_POINTS:
        assert report["outcomes"][entry_point] == "skipped: active platform is not HPU"


@pytest.mark.process
def test_loading_the_entry_points_imports_neither_torch_nor_vllm(run_python):
    # vLLM loads every general plugin in every process, whatever the platform: loading must be
    # cheap, and must not import vLLM's layers (that imports vLLM's compiled kernels).
    result = run_python(
        "import sys\n"
        "from importlib import metadata\n"
        "eps = metadata.entry_points(group='vllm.general_plugins')\n"
        "loaded = [ep.load() for ep in eps if ep.name.startswith('hpu_ops_')]\n"
        "assert loaded\n"
        "print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))",
        fresh=True,  # a preloaded interpreter has torch already
    )

    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
