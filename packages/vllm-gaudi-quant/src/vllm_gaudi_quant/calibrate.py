"""`vllm-gaudi calibrate`: the INC FP8 MEASURE step through vLLM, and a ready QUANTIZE config.

    vllm-gaudi calibrate MODEL --dataset FILE --out DIR [--num-samples N]

1. writes `DIR/measure_config.json` (mode MEASURE, statistics under `DIR/inc_output/`);
2. runs the model on the HPU platform (a Gaudi, or CPU emulation) with `--quantization inc` and
   that config over the dataset's samples (one prefill each, with a progress bar), then makes the
   workers write the statistics (`finalize_calibration`);
3. writes `DIR/quant_config.json` (mode QUANTIZE, same statistics), usable as is:
   `QUANT_CONFIG=DIR/quant_config.json vllm serve MODEL --quantization inc`.

Dataset: JSON Lines with a "text" or "prompt" string per line, or plain text with one sample per
non-empty line. Warmup is skipped while measuring so that only the dataset shapes the statistics.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from vllm_gaudi_platform import envs
from vllm_gaudi_quant.methods.inc import require_neural_compressor
from vllm_gaudi_quant.methods.inc_settings import RECORD_KEY, IncConfigError, model_record

STATS_PREFIX = "inc_output/measure"  # relative to DIR: the directory can be moved as a whole
MEASURE_FILE = "measure_config.json"
QUANTIZE_FILE = "quant_config.json"
# Scale methods per device: the CPU computes arbitrary scales; Gaudi's FP8 matmul wants
# hardware-aligned ones.
CPU_SCALE_METHOD = "maxabs_arbitrary"
GAUDI_SCALE_METHOD = "maxabs_hw"


class CalibrationError(ValueError):
    """Bad calibrate input (dataset, output directory); the message names it."""


# What `run` raises for bad input: the CLI prints these as one line, without a traceback.
ERRORS = (CalibrationError, IncConfigError)


def read_dataset(path: str | os.PathLike, num_samples: int | None = None) -> list[str]:
    """Samples from a JSONL file ({"text": ...} or {"prompt": ...} per line) or plain text."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise CalibrationError(f"--dataset {path}: no such file.") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CalibrationError(f"--dataset {path} cannot be read: {exc}") from None
    entries = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    is_jsonl = path.suffix in (".jsonl", ".json") or (
        bool(entries) and entries[0][1].lstrip().startswith("{")
    )
    samples: list[str] = []
    for lineno, line in entries:
        if not is_jsonl:
            samples.append(line.strip())
        else:
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CalibrationError(
                    f"--dataset {path} line {lineno} is not valid JSON ({exc.msg}); each line must "
                    'be an object with a "text" or "prompt" string.'
                ) from None
            text = record.get("text", record.get("prompt")) if isinstance(record, dict) else None
            if not isinstance(text, str) or not text:
                raise CalibrationError(
                    f'--dataset {path} line {lineno} has no "text" or "prompt" string.'
                )
            samples.append(text)
        if num_samples is not None and len(samples) >= num_samples:
            break
    if not samples:
        raise CalibrationError(f"--dataset {path} holds no samples.")
    return samples


def quant_config(mode: str, *, emulated: bool, record: dict[str, Any] | None) -> dict[str, Any]:
    """The INC JSON for `mode`, with statistics under STATS_PREFIX (relative to the file)."""
    config: dict[str, Any] = {
        "mode": mode,
        "observer": "maxabs",
        "scale_method": CPU_SCALE_METHOD if emulated else GAUDI_SCALE_METHOD,
        "dump_stats_path": STATS_PREFIX,
        "allowlist": {"types": [], "names": []},
        "blocklist": {"types": [], "names": []},
    }
    if emulated:
        config["use_qdq"] = "True"  # neural-compressor's CPU path runs quantize-dequantize only
    if record is not None:
        config[RECORD_KEY] = record
    return config


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def run(
    model: str,
    dataset: str,
    out: str,
    *,
    num_samples: int | None = None,
    max_model_len: int | None = None,
    dtype: str = "auto",
    tensor_parallel_size: int = 1,
    engine_kwargs: dict[str, Any] | None = None,
) -> Path:
    """Measure `model` over `dataset` and write DIR/quant_config.json; returns its path."""
    require_neural_compressor()
    samples = read_dataset(dataset, num_samples)
    out_dir = Path(out).resolve()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CalibrationError(f"--out {out}: cannot create the directory: {exc}") from None

    from vllm_gaudi_platform.seam import backend

    emulated = bool(backend().IS_EMULATED)
    measure_path = out_dir / MEASURE_FILE
    _write_json(measure_path, quant_config("MEASURE", emulated=emulated, record=None))
    os.environ[envs.QUANT_CONFIG] = str(measure_path)
    # Warmup runs dummy batches: keep them out of the statistics (and save the time).
    os.environ[envs.VLLM_SKIP_WARMUP] = "true"

    from vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = {
        "model": model,
        "quantization": "inc",
        "dtype": dtype,
        "tensor_parallel_size": tensor_parallel_size,
        **(engine_kwargs or {}),
    }
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    llm = LLM(**kwargs)
    try:
        limit = llm.llm_engine.model_config.max_model_len - 1
        tokenizer = llm.get_tokenizer()
        prompts = [{"prompt_token_ids": tokenizer.encode(s)[:limit]} for s in samples]
        # One generated token per sample: the prefill is what the statistics are made from.
        llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=True)
        llm.collective_rpc("finalize_calibration")
        record = model_record(model, llm.llm_engine.model_config.hf_config)
    finally:
        del llm

    quant_path = out_dir / QUANTIZE_FILE
    _write_json(quant_path, quant_config("QUANTIZE", emulated=emulated, record=record))
    _write_json(measure_path, quant_config("MEASURE", emulated=emulated, record=record))
    return quant_path
