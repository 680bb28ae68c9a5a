"""INC FP8's settings: `QUANT_CONFIG` read and checked (`read_settings`, `IncSettings`), the
statistics' sidecar record of the model they were measured on (`model_record`, `check_model`),
and the error every bad setting raises (`IncConfigError`, naming the file or key and the fix).
No neural-compressor import: `vllm-gaudi calibrate` and the config's checks read these before
neural-compressor is needed (see `inc.py` for the flow).
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from typing import Any

from vllm_gaudi_platform import envs

INSTALL_HINT = "pip install 'vllm-gaudi-quant[inc]'"
MODES = ("MEASURE", "QUANTIZE")
# Scale methods neural-compressor's CPU path computes (no hardware-aligned rounding on the CPU).
CPU_SCALE_METHODS = ("maxabs_arbitrary", "unit_scale")
# Scale methods that need no statistics: QUANTIZE with them reads no measurement files.
STATLESS_SCALE_METHODS = ("unit_scale",)
# Our own record inside QUANT_CONFIG (model identity); removed before neural-compressor reads it.
RECORD_KEY = "vllm_gaudi"
# Per-rank file written beside neural-compressor's statistics: model identity + K/V maxima.
SIDECAR_SUFFIX = "_vllm_gaudi"
_TRUE = ("true", "1", "yes")


class IncConfigError(RuntimeError):
    """QUANT_CONFIG (or a setting that goes with it) cannot be used; the message says why.

    Not a ValueError on purpose: raised while vLLM builds its (pydantic) config, a ValueError would
    come out wrapped in a pydantic ValidationError; this one reaches the operator as is.
    """


def named(path: str) -> str:
    """The setting as the operator wrote it, for messages: QUANT_CONFIG=<path>."""
    return f"{envs.QUANT_CONFIG}={path}"


@dataclass(frozen=True)
class IncSettings:
    """QUANT_CONFIG, read and checked."""

    path: str
    mode: str  # MEASURE or QUANTIZE
    inc_config: dict[str, Any]  # what neural-compressor reads: our record removed, paths resolved
    stats_prefix: str  # dump_stats_path, absolute
    record: dict[str, Any] | None = field(default=None)  # model the config/statistics were made for

    @property
    def measuring(self) -> bool:
        return self.mode == "MEASURE"


def _is_true(value: Any) -> bool:
    return str(value).strip().lower() in _TRUE


def read_settings(path: str | None, *, emulated: bool) -> IncSettings:
    """Read and check the QUANT_CONFIG file `path`; raise IncConfigError naming what is wrong."""
    if not path:
        raise IncConfigError(
            f"{envs.QUANT_CONFIG} is not set: --quantization inc on HPU reads its FP8 settings "
            f"from the JSON file {envs.QUANT_CONFIG} names. Make one with `vllm-gaudi calibrate "
            f"MODEL --dataset FILE --out DIR`, then set {envs.QUANT_CONFIG}=DIR/quant_config.json."
        )
    path = os.path.abspath(path)
    if not os.path.exists(path):
        raise IncConfigError(
            f"{named(path)}: no such file. Point {envs.QUANT_CONFIG} at an INC JSON config (for "
            "example DIR/quant_config.json written by `vllm-gaudi calibrate`)."
        )
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise IncConfigError(f"{named(path)} cannot be read: {exc}") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise IncConfigError(
            f"{named(path)} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})."
        ) from None
    if not isinstance(raw, dict):
        raise IncConfigError(f"{named(path)} must hold a JSON object, not {type(raw).__name__}.")

    config = dict(raw)
    record = config.pop(RECORD_KEY, None)
    mode = str(config.get("mode", "")).upper()
    if mode not in MODES:
        raise IncConfigError(
            f'{named(path)}: "mode" is {config.get("mode")!r}; use "MEASURE" (collect '
            'calibration statistics) or "QUANTIZE" (run in FP8 from them).'
        )
    config["mode"] = mode
    scale_method = config.get("scale_method", "maxabs_hw")
    if emulated:
        _check_cpu_modes(path, config, mode, scale_method)
        if mode == "MEASURE" and "scale_method" not in config:
            # Measuring computes no scales, but neural-compressor validates the method anyway and
            # its default (maxabs_hw) is Gaudi-only.
            config["scale_method"] = "maxabs_arbitrary"

    stats = config.get("dump_stats_path", "stats")
    if not isinstance(stats, str) or not stats:
        raise IncConfigError(f'{named(path)}: "dump_stats_path" must be a path prefix string.')
    if not os.path.isabs(stats):
        stats = os.path.join(os.path.dirname(path), stats)
    stats = os.path.normpath(stats)
    config["dump_stats_path"] = stats
    observer = config.get("observer", "maxabs")

    if mode == "MEASURE":
        try:
            os.makedirs(os.path.dirname(stats), exist_ok=True)
        except OSError as exc:
            raise IncConfigError(
                f'{named(path)}: cannot create the statistics directory of "dump_stats_path" '
                f"({os.path.dirname(stats)}): {exc}"
            ) from None
        if not os.access(os.path.dirname(stats), os.W_OK):
            raise IncConfigError(
                f'{named(path)}: the statistics directory of "dump_stats_path" '
                f"({os.path.dirname(stats)}) is not writable."
            )
    elif str(scale_method).lower() not in STATLESS_SCALE_METHODS and not glob.glob(
        f"{stats}_hooks_{observer}*.json"
    ):
        raise IncConfigError(
            f"{named(path)} is a QUANTIZE config but there are no calibration statistics at "
            f'"dump_stats_path" ({stats}_hooks_{observer}*.json). Run the MEASURE step first: '
            "`vllm-gaudi calibrate MODEL --dataset FILE --out DIR`."
        )

    if record is None:
        record = read_sidecar(stats)
    if record is not None and not isinstance(record, dict):
        raise IncConfigError(f'{named(path)}: "{RECORD_KEY}" must be a JSON object.')
    return IncSettings(path=path, mode=mode, inc_config=config, stats_prefix=stats, record=record)


def _check_cpu_modes(path: str, config: dict[str, Any], mode: str, scale_method: Any) -> None:
    """Neural-compressor's CPU path runs a subset of INC's modes: say which key to change."""
    where = f"{named(path)} (CPU emulation)"
    if not _is_true(config.get("use_qdq", False)):
        raise IncConfigError(
            f'{where}: "use_qdq" is {config.get("use_qdq", False)!r}; neural-compressor\'s CPU '
            'path only runs quantize-dequantize mode: set "use_qdq": "True".'
        )
    if _is_true(config.get("dynamic_quantization", False)):
        raise IncConfigError(
            f'{where}: "dynamic_quantization" is not supported on the CPU; set it to "False" '
            "(static scales from a MEASURE run)."
        )
    if _is_true(config.get("fake_quant", False)):
        raise IncConfigError(
            f'{where}: "fake_quant" is not supported here; set it to "False" and "use_qdq" to '
            '"True".'
        )
    if not isinstance(scale_method, str):
        raise IncConfigError(
            f'{where}: "scale_method" must be one of {", ".join(CPU_SCALE_METHODS)} on the CPU '
            "(per-layer scale-method dictionaries are Gaudi-only here)."
        )
    if scale_method.lower() not in CPU_SCALE_METHODS and (
        mode == "QUANTIZE" or "scale_method" in config
    ):
        raise IncConfigError(
            f'{where}: "scale_method" is {scale_method!r}, which needs Gaudi\'s hardware-aligned '
            f"scales; on the CPU use one of: {', '.join(CPU_SCALE_METHODS)}."
        )


def sidecar_path(stats_prefix: str, rank: int, world_size: int) -> str:
    return f"{stats_prefix}{SIDECAR_SUFFIX}_{rank}_{world_size}.json"


def read_sidecar(stats_prefix: str, rank: int | None = None) -> dict[str, Any] | None:
    pattern = f"{stats_prefix}{SIDECAR_SUFFIX}_{'*' if rank is None else rank}_*.json"
    for candidate in sorted(glob.glob(pattern)):
        try:
            with open(candidate, encoding="utf-8") as f:
                return json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise IncConfigError(
                f"Calibration record {candidate} (beside {envs.QUANT_CONFIG}'s statistics) cannot "
                f"be read: {exc}. Re-run the MEASURE step."
            ) from None
    return None


_FINGERPRINT_KEYS = (
    "model_type",
    "architectures",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
)


def model_fingerprint(hf_config: Any) -> dict[str, Any]:
    """The shape of a model: what calibration statistics are only valid for."""
    text = getattr(hf_config, "text_config", None) or hf_config
    out: dict[str, Any] = {}
    for key in _FINGERPRINT_KEYS:
        value = getattr(text, key, None)
        if value is None:
            value = getattr(hf_config, key, None)
        if isinstance(value, tuple):
            value = list(value)
        out[key] = value
    return out


def model_record(model_name: str, hf_config: Any) -> dict[str, Any]:
    return {"model": model_name, "fingerprint": model_fingerprint(hf_config)}


def check_model(settings: IncSettings, model_name: str, hf_config: Any) -> None:
    """Raise IncConfigError when QUANT_CONFIG's statistics were made for a different model."""
    record = settings.record
    if not record or hf_config is None or "fingerprint" not in record:
        return
    ours = model_fingerprint(hf_config)
    theirs = record["fingerprint"]
    diff = [f"{k}: {theirs.get(k)!r} != {ours.get(k)!r}" for k in ours if theirs.get(k) != ours[k]]
    if diff:
        raise IncConfigError(
            f"{named(settings.path)} was made for model {record.get('model')!r}, not for "
            f"{model_name!r} ({'; '.join(diff)}). Calibrate this model: `vllm-gaudi calibrate "
            f"{model_name} --dataset FILE --out DIR`."
        )
