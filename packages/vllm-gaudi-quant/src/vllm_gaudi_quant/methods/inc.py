"""INC FP8 on the HPU platform: Intel Neural Compressor's measure-then-quantize flow.

`--quantization inc` with `QUANT_CONFIG=<json>` (the variable Intel's Gaudi stack uses) runs
neural-compressor's FP8 toolkit (`neural_compressor.torch.algorithms.fp8_quant`) on the model the
HPU runner has just loaded, before warmup:

- MEASURE mode: every linear layer is wrapped by an observer that records the largest absolute
  input value seen; the attention layers' keys and values are measured too (for an FP8 KV
  cache). The statistics are written when the engine shuts down (`finalize_calibration`), next to
  `dump_stats_path`.
- QUANTIZE mode: the linear weights are stored in FP8 and inputs are quantized with scales derived
  from those statistics; with `kv_cache_dtype=fp8_inc` the attention layers' k/v scales come from
  the measured keys and values.

Where it runs:

- On Gaudi, neural-compressor's HPU path patches vLLM's layers itself (the LM head included),
  moves them to the device and uses Gaudi's FP8 kernels (`cast_to_fp8_v2`, `fp8_gemm_v2`). Use
  hardware-aligned scale methods there (`maxabs_hw`, the default, or `maxabs_pow2`,
  `act_maxabs_hw_weights_pcs_maxabs_pow2`): they round scales to values the FP8 matmul applies
  exactly (Gaudi 2's scale set 16, 1, 1/16, 1/256; powers of two on Gaudi 3). The tests run this
  path over the Habana stand-in (tests/quant/test_inc_gaudi_flow.py).
- In CPU emulation, neural-compressor's CPU path runs: it only accepts quantize-dequantize mode
  (`"use_qdq": "True"`) with arbitrary scales (`maxabs_arbitrary`, `unit_scale`), and it only
  patches modules whose class is named Linear/Conv2d/EmbeddingBag. vLLM's parallel linear classes
  are therefore registered in its patched-module table here (`register_vllm_linears`). It serves
  whoever has no Gaudi: trying calibration and FP8 serving in emulation.

Checks happen when vLLM builds its config (`HpuIncConfig()` reads and validates `QUANT_CONFIG`,
`maybe_update_config` compares the model the statistics were made for, `hpu_check_vllm_config`
refuses MEASURE with data parallelism), so a bad setting stops startup before any engine process
starts, with a message that names the file or key and the fix.

A relative `dump_stats_path` is read relative to the directory of the `QUANT_CONFIG` file (not the
current directory, as neural-compressor alone would), so a calibration directory can be moved.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import torch
from vllm.logger import init_logger
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import (
    QuantizationConfig,
    QuantizeMethodBase,
)

from vllm_gaudi_platform import envs
from vllm_gaudi_quant.methods.inc_settings import (
    INSTALL_HINT,
    IncConfigError,
    check_model,
    model_record,
    named,
    read_settings,
    read_sidecar,
    sidecar_path,
)

logger = init_logger(f"vllm.{__name__}")

# ---------------------------------------------------------------------------- neural-compressor


def require_neural_compressor() -> None:
    import importlib.util

    if importlib.util.find_spec("neural_compressor") is None:
        raise IncConfigError(
            "--quantization inc on HPU needs neural-compressor (neural-compressor-pt), which is "
            f"not installed: {INSTALL_HINT}"
        )


_REGISTERED_LINEARS = False


def register_vllm_linears() -> None:
    """Put vLLM's parallel linear classes in neural-compressor's CPU patched-module table.

    Its CPU path only knows modules named Linear/Conv2d/EmbeddingBag; vLLM's layers return
    `(output, bias)` and carry tensor-parallel state, so they get neural-compressor's own vLLM-aware
    wrappers (column-parallel, row-parallel, replicated), typed as plain linear layers so the CPU's
    linear scale methods apply. Its registration helper takes classes (names fail), and keys by
    class name. On Gaudi neural-compressor registers these classes itself: nothing to do.
    """
    global _REGISTERED_LINEARS
    if _REGISTERED_LINEARS:
        return
    from neural_compressor.torch.algorithms.fp8_quant import register_patched_module
    from neural_compressor.torch.algorithms.fp8_quant._quant_common import helper_modules
    from neural_compressor.torch.algorithms.fp8_quant.model_configs import ModuleType
    from vllm.model_executor.layers import linear

    linear_type = ModuleType(1, ["weight"], 1, False)

    def as_linear(base: type) -> type:
        # Wrappers outside neural-compressor's own table must describe their type themselves.
        return type(
            f"Hpu{base.__name__}",
            (base,),
            {
                "get_type": classmethod(lambda cls: "linear"),
                "get_module_type": classmethod(lambda cls: linear_type),
            },
        )

    column = as_linear(helper_modules.PatchedColumnParallelLinear)
    row = as_linear(helper_modules.PatchedRowParallelLinear)
    replicated = as_linear(helper_modules.PatchedReplicatedLinear)
    table = {
        linear.ColumnParallelLinear: column,
        linear.MergedColumnParallelLinear: column,
        linear.QKVParallelLinear: column,
        linear.RowParallelLinear: row,
        linear.ReplicatedLinear: replicated,
    }
    for vllm_cls, patched in table.items():
        register_patched_module(vllm_cls, device_types="cpu")(patched)
    _REGISTERED_LINEARS = True


_HP_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _attention_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    from vllm.model_executor.layers.attention.attention import Attention

    return {
        getattr(m, "layer_name", name): m
        for name, m in model.named_modules()
        if isinstance(m, Attention)
    }


def _unpatched_experts(model: torch.nn.Module) -> list[str]:
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    return [name for name, m in model.named_modules() if isinstance(m, RoutedExperts)]


def _vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def _rank() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class KVObserver:
    """Largest |key| and |value| each attention layer receives (MEASURE mode)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.amax: dict[str, list[float]] = {}
        self.handles = [
            layer.register_forward_pre_hook(self._hook(name))
            for name, layer in _attention_layers(model).items()
        ]

    def _hook(self, name: str):
        def observe(module, args):
            key, value = args[1], args[2]
            if key is None or value is None or key.numel() == 0:
                return
            seen = self.amax.setdefault(name, [0.0, 0.0])
            seen[0] = max(seen[0], float(key.detach().abs().max()))
            seen[1] = max(seen[1], float(value.detach().abs().max()))

        return observe


class HpuIncConfig(QuantizationConfig):
    """`--quantization inc` on the HPU platform: INC FP8 driven by QUANT_CONFIG."""

    def __init__(self) -> None:
        super().__init__()
        require_neural_compressor()
        from vllm_gaudi_platform.seam import backend

        self.emulated = bool(backend().IS_EMULATED)
        self.settings = read_settings(envs.get_raw(envs.QUANT_CONFIG), emulated=self.emulated)
        self.model_name: str | None = None
        self.record: dict[str, Any] | None = None
        self._kv_observer: KVObserver | None = None
        self._finalized = False
        # MoE expert layers neural-compressor left unpatched (high precision), once prepared.
        self.unquantized_experts: list[str] = []

    def __repr__(self) -> str:
        return f"HpuIncConfig(mode={self.settings.mode}, config={self.settings.path})"

    @classmethod
    def get_name(cls) -> str:  # type: ignore[override]
        return "inc"

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        # Settings come from QUANT_CONFIG, not from a file in the checkpoint.
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> HpuIncConfig:
        return cls()

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        # Weights load in high precision; neural-compressor converts them after loading.
        if isinstance(layer, LinearBase):
            return UnquantizedLinearMethod()
        return None

    def maybe_update_config(self, model_name: str, hf_config=None, revision=None) -> None:
        check_model(self.settings, model_name, hf_config)
        self.model_name = model_name
        if hf_config is not None:
            self.record = model_record(model_name, hf_config)

    # ------------------------------------------------------------ hooks the HPU platform calls
    def hpu_check_vllm_config(self, vllm_config: Any) -> None:
        """Refuse combinations this flow cannot run, while vLLM is still building its config."""
        dp = vllm_config.parallel_config.data_parallel_size
        if self.settings.measuring and dp > 1:
            raise IncConfigError(
                f"{named(self.settings.path)} is a MEASURE config, and measuring with data "
                f"parallelism (data_parallel_size={dp}) would make every replica write the same "
                "statistics files. Calibrate with data_parallel_size=1 (tensor parallelism is "
                "fine), then serve the QUANTIZE config with any data parallelism."
            )

    def hpu_after_load_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Patch the loaded model for measurement or FP8 (neural-compressor's prep_model)."""
        from neural_compressor.torch.algorithms.fp8_quant import prep_model
        from neural_compressor.torch.algorithms.fp8_quant._core.quantized_func_wrappers import (
            clear_quantized_func_wrapper_factory,
            init_quantized_func_wrapper_factory,
        )

        if self.emulated:
            register_vllm_linears()
        config = dict(self.settings.inc_config)
        dtype = next(model.parameters()).dtype
        config.setdefault("hp_dtype", _HP_DTYPES.get(dtype, "bf16"))
        with tempfile.NamedTemporaryFile(
            "w", suffix=".json", prefix="inc_", delete=False, encoding="utf-8"
        ) as f:
            json.dump(config, f)
        try:
            init_quantized_func_wrapper_factory()
            prep_model(model, f.name)
        finally:
            clear_quantized_func_wrapper_factory()
            os.unlink(f.name)
        self.unquantized_experts = _unpatched_experts(model)
        if self.unquantized_experts:
            logger.warning(
                "INC FP8: %d MoE expert layers (%s...) are left out, neither measured nor "
                "quantized: they run in %s. neural-compressor patches vLLM's MoE by the class "
                "name FusedMoE, which vLLM %s's routed experts (RoutedExperts) do not carry; the "
                "linear layers are handled. For FP8 experts serve an FP8 checkpoint "
                "(--quantization fp8 or compressed-tensors) instead.",
                len(self.unquantized_experts),
                self.unquantized_experts[0],
                str(dtype).removeprefix("torch."),
                _vllm_version(),
            )
        if self.settings.measuring:
            self._kv_observer = KVObserver(model)
        else:
            self._load_kv_scales(model)
        if self.settings.measuring:
            what = "measuring linear inputs and attention keys/values"
        elif self.emulated:
            what = "FP8 weights, activations quantized-dequantized on the CPU"
        else:
            what = "FP8 weights and activations"
        logger.info("INC FP8 %s from %s: %s", self.settings.mode, self.settings.path, what)
        return model

    def hpu_finalize_calibration(self, model: torch.nn.Module) -> None:
        """MEASURE: write the statistics (once). QUANTIZE: nothing to do."""
        if not self.settings.measuring or self._finalized:
            return
        from neural_compressor.torch.algorithms.fp8_quant import finish_measurements

        finish_measurements(model)
        rank, world = _rank()
        sidecar = {
            **(self.record or {"model": self.model_name}),
            "kv_amax": self._kv_observer.amax if self._kv_observer else {},
        }
        with open(sidecar_path(self.settings.stats_prefix, rank, world), "w") as f:
            json.dump(sidecar, f, indent=1)
        self._finalized = True
        logger.info("INC calibration statistics written to %s*", self.settings.stats_prefix)

    def _load_kv_scales(self, model: torch.nn.Module) -> None:
        # vLLM's Attention layers: their k/v scale buffers and host copies are set below.
        layers: dict[str, Any] = {
            name: layer
            for name, layer in _attention_layers(model).items()
            if str(getattr(layer, "kv_cache_dtype", "auto")).startswith("fp8")
        }
        if not layers:
            return
        rank, _ = _rank()
        record = read_sidecar(self.settings.stats_prefix, rank) or {}
        amax = record.get("kv_amax", {})
        from vllm_gaudi_platform.seam import backend

        fp8_max = float(backend().fp8_max())
        missing = []
        for name, layer in layers.items():
            if name not in amax:
                missing.append(name)
                continue
            k_scale, v_scale = (max(float(a), 1e-12) / fp8_max for a in amax[name])
            layer._k_scale.fill_(k_scale)
            layer._v_scale.fill_(v_scale)
            layer._k_scale_float = k_scale
            layer._v_scale_float = v_scale
        if missing:
            logger.warning(
                "FP8 KV cache: no measured key/value range for %d attention layers (%s...) in %s; "
                "they keep scale 1.0. Re-run the MEASURE step to measure them.",
                len(missing),
                missing[0],
                self.settings.stats_prefix,
            )
