"""Every environment variable the Gaudi plugins read, with its type, default and meaning.

Reading a variable goes through this module so that a bad value fails in one place, with a message
that names the variable and the fix. Importing it is cheap: no torch, no vllm. `VARIABLES` is the
one list: the README's settings table and `vllm-gaudi doctor` are checked against it, so a
variable read anywhere in the wheels is declared here (the bucketing variables too; bucketing/
validates them against the engine limits). vLLM's own variables (VLLM_PLUGINS, ...) are not ours
and stay out.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path


class EnvError(ValueError):
    """An environment variable holds a value the plugins cannot use."""


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str | None  # None: unset (or derived, as the doc says)
    doc: str
    kind: str = "str"  # how the value is read: one of KINDS


KINDS = ("str", "bool", "int", "float", "path", "choice")


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}

VARIABLES: dict[str, EnvVar] = {}


def _declare(name: str, default: str | None, doc: str, kind: str = "str") -> str:
    if kind not in KINDS:
        raise ValueError(f"{name}: kind {kind!r} is not one of {KINDS}")
    VARIABLES[name] = EnvVar(name, default, doc, kind)
    return name


VLLM_HPU_EMULATION = _declare(
    "VLLM_HPU_EMULATION",
    None,
    "Run the HPU platform without a Gaudi. 'cpu' emulates the Gaudi kernels in torch on the CPU. "
    "Unset or empty: use a real Gaudi if one is present, otherwise stay inactive.",
    kind="choice",
)
VLLM_HPU_SKIP_VERSION_CHECK = _declare(
    "VLLM_HPU_SKIP_VERSION_CHECK",
    "0",
    "true: register the platform and every general plugin even with a vLLM outside the supported "
    "range (each warns; untested). Default: outside the range none of them registers.",
    kind="bool",
)
HABANA_VISIBLE_MODULES = _declare(
    "HABANA_VISIBLE_MODULES", None, "Comma-separated Gaudi module ids this process may use."
)
PT_HPU_LAZY_MODE = _declare(
    "PT_HPU_LAZY_MODE",
    "0",
    "1: Gaudi lazy mode (graphs built op by op, flushed by mark_step; HPU graphs per bucket); "
    "0: eager / torch.compile, no HPU graphs.",
    kind="choice",
)
PT_HPU_WEIGHT_SHARING = _declare(
    "PT_HPU_WEIGHT_SHARING",
    "0",
    "Set to 0 by the platform: weight sharing breaks torch.compile.",
    kind="bool",
)
RUNTIME_SCALE_PATCHING = _declare(
    "RUNTIME_SCALE_PATCHING",
    "1",
    "FP8 scales patched at run time instead of baked into graphs (default 1 in eager/compile).",
    kind="bool",
)
VLLM_SKIP_WARMUP = _declare(
    "VLLM_SKIP_WARMUP", "false", "true: skip the bucket warmup.", kind="bool"
)
VLLM_FULL_WARMUP = _declare(
    "VLLM_FULL_WARMUP",
    "false",
    "true: a forward pass with a shape that was not warmed up (a recompile) is an error.",
    kind="bool",
)
VLLM_GRAPH_RESERVED_MEM = _declare(
    "VLLM_GRAPH_RESERVED_MEM",
    "0.1",
    "Least share (0..1) of the usable device memory kept back for captured graphs, not KV "
    "cache; more when the profile run's sampled graphs bound the plan's graphs above it.",
    kind="float",
)
VLLM_PREFILL_QUERY_SLICE = _declare(
    "VLLM_PREFILL_QUERY_SLICE",
    "1024",
    "Prefill attention with cached context, a sliding window or soft-capping runs in slices of "
    "this many query tokens, so its mask and scores grow linearly with the prompt (integer >= 1).",
    kind="int",
)
PT_HPU_RECIPE_CACHE_CONFIG = _declare(
    "PT_HPU_RECIPE_CACHE_CONFIG",
    None,
    "Intel's on-disk cache of compiled Gaudi recipes, kept between restarts so warmup reuses them: "
    "'<directory>,<delete existing: true|false>,<max size in MB>'. Checked at worker start on a "
    "Gaudi (read by Gaudi's runtime itself); no effect in CPU emulation.",
)
VLLM_MOE_GATHER_MAX_TOKENS = _declare(
    "VLLM_MOE_GATHER_MAX_TOKENS",
    None,
    "Mixture-of-experts steps of at most this many tokens (a low-batch decode) pass the MoE "
    "kernel only the experts their tokens were routed to, gathered on the device, instead of "
    "every expert of the layer; 0: never. Unset: per layer, the largest token count at which the "
    "gather moves fewer weight bytes than the dense pass (from the expert count, top-k and the "
    "weights' format).",
    kind="int",
)
VLLM_HPU_SELFTEST_REPORT = _declare(
    "VLLM_HPU_SELFTEST_REPORT",
    None,
    "A report written by `vllm-gaudi selftest --json FILE` on this machine: the platform takes "
    "the defaults its probes decided (today VLLM_MOE_GATHER_MAX_TOKENS, from whether the MoE "
    "kernel skips experts that receive no token). An explicit setting wins over the report; "
    "`vllm-gaudi doctor` says which default came from where. A missing or foreign file is an "
    "error naming this variable (selftest_defaults.py reads it).",
    kind="path",
)
VLLM_HPU_VISION_WARMUP = _declare(
    "VLLM_HPU_VISION_WARMUP",
    None,
    "Image sizes (pixels, 'HEIGHTxWIDTH', comma-separated) whose vision-encoder shapes warmup "
    "runs, one image per encoder pass, so serving images of these sizes compiles nothing. Unset: "
    "the largest image the model's processor makes. An image of another size still runs (a "
    "recompile, counted).",
)
VLLM_HPU_EMULATION_MEMORY_GB = _declare(
    "VLLM_HPU_EMULATION_MEMORY_GB",
    "8",
    "Device memory (GiB) the CPU emulation reports as the total memory of one emulated HPU.",
    kind="float",
)
VLLM_HPU_EMULATION_GAUDI = _declare(
    "VLLM_HPU_EMULATION_GAUDI",
    "3",
    "Gaudi generation the CPU emulation behaves as where generations differ: 3 or 2. Today that is "
    "the FP8 E4M3 range (largest value 448 on Gaudi 3, 240 on Gaudi 2).",
    kind="choice",
)
VLLM_HPU_OPS_STATS_FILE = _declare(
    "VLLM_HPU_OPS_STATS_FILE",
    None,
    "A JSON file each process adds its per-op-family forward_oot counts to at exit (tests).",
    kind="path",
)

QUANT_CONFIG = _declare(
    "QUANT_CONFIG",
    None,
    "JSON file of INC FP8 settings for --quantization inc (vllm-gaudi-quant[inc]): mode MEASURE "
    "(collect calibration statistics, written at shutdown) or QUANTIZE (run in FP8 from them). "
    "`vllm-gaudi calibrate` writes a ready one.",
    kind="path",
)

VLLM_NIXL_DEVICE_TO_DEVICE = _declare(
    "VLLM_NIXL_DEVICE_TO_DEVICE",
    "false",
    "true: the NIXL connector (vllm-gaudi-connectors) registers the KV cache itself with NIXL and "
    "moves KV blocks device to device (kv_buffer_device 'hpu'); false: through host staging "
    "buffers (kv_buffer_device 'cpu'). CPU emulation takes either path as a Gaudi does (its KV "
    "cache, host memory, is registered as DRAM).",
    kind="bool",
)
VLLM_HPU_NIXL_PROGRESS_WAIT_MS = _declare(
    "VLLM_HPU_NIXL_PROGRESS_WAIT_MS",
    "0",
    "How long NIXL's UCX progress thread (one per HpuNixlConnector worker) waits for network "
    "events before it polls again, in milliseconds. 0: NIXL's own setting, which polls without "
    "waiting and keeps one host core busy per worker even when idle; 1 or more: the thread sleeps "
    "until an event or the wait ends (idle: about 3 % of a core at 1).",
    kind="int",
)

VLLM_GAUDI_MODEL_CACHE = _declare(
    "VLLM_GAUDI_MODEL_CACHE",
    None,
    "Folder for the tiny models `vllm-gaudi demo` and the tests build (model_cache()). Unset: "
    "$XDG_CACHE_HOME/vllm-gaudi/models, or ~/.cache/vllm-gaudi/models.",
    kind="path",
)

# --- static-shape buckets (bucketing/ reads them; its __init__ docstring has the rules) -------
# Intel's vllm-gaudi names and meanings, so an operator's settings carry over.
VLLM_BUCKETING_STRATEGY = _declare(
    "VLLM_BUCKETING_STRATEGY",
    "exp",
    "How each bucket dimension's values are generated: exp (exponential, from the engine "
    "limits), lin (linear with ramp-up) or pad (padding-aware); or fitted: the buckets that "
    "minimise the padding of the step shapes in VLLM_BUCKETING_TRACE within "
    "VLLM_BUCKETING_GRAPH_BUDGET graphs.",
    kind="choice",
)
VLLM_BUCKETING_TRACE = _declare(
    "VLLM_BUCKETING_TRACE",
    None,
    "The step-shape trace VLLM_BUCKETING_STRATEGY=fitted fits its buckets to (a file written by "
    "VLLM_BUCKETING_RECORD_TRACE, or the operator's, same format).",
    kind="path",
)
VLLM_BUCKETING_GRAPH_BUDGET = _declare(
    "VLLM_BUCKETING_GRAPH_BUDGET",
    None,
    "Most warmup graphs (prompt + decode buckets) VLLM_BUCKETING_STRATEGY=fitted may pick. Unset: "
    "as many as exp warms up for the same engine limits.",
    kind="int",
)
VLLM_BUCKETING_RECORD_TRACE = _declare(
    "VLLM_BUCKETING_RECORD_TRACE",
    None,
    "A file the model runner appends the shape of every serving step to (prompt: batch, query "
    "length, context blocks; decode: batch, blocks), as counts flushed every 1000 steps or 10 s "
    "and at exit; the input of VLLM_BUCKETING_STRATEGY=fitted. Unset: nothing is recorded.",
    kind="path",
)
VLLM_BUCKETING_FROM_FILE = _declare(
    "VLLM_BUCKETING_FROM_FILE",
    None,
    "A file listing the buckets, one (batch_size, query_len, ctx_blocks) per line; replaces the "
    "generated buckets.",
    kind="path",
)
VLLM_EXPONENTIAL_BUCKETING = _declare(
    "VLLM_EXPONENTIAL_BUCKETING",
    None,
    "Deprecated (Intel's): true forces VLLM_BUCKETING_STRATEGY=exp, false forces lin.",
    kind="bool",
)
BUCKET_PARAMS = ("MIN", "STEP", "MAX", "PAD_MAX", "PAD_PERCENT")
BUCKET_DIMENSIONS = (
    ("PROMPT", "BS"),
    ("PROMPT", "QUERY"),
    ("PROMPT", "CTX"),
    ("DECODE", "BS"),
    ("DECODE", "BLOCK"),
)
_DIMENSION_MEANING = {
    ("PROMPT", "BS"): "prefill batch size",
    ("PROMPT", "QUERY"): "prefill query length (new tokens per sequence)",
    ("PROMPT", "CTX"): "prefill context blocks per sequence",
    ("DECODE", "BS"): "decode batch size",
    ("DECODE", "BLOCK"): "decode KV-cache blocks of the whole batch",
}
_PARAM_MEANING = {
    "MIN": "smallest value (lin, pad)",
    "STEP": "step between values (lin, pad)",
    "MAX": "largest value (lin, pad; PROMPT_BS_BUCKET_MAX under exp too)",
    "PAD_MAX": "most padding a value may cover, absolute (pad)",
    "PAD_PERCENT": "most padding a value may cover, percent, up to 50 (pad)",
}
# Every VLLM_{PHASE}_{DIM}_BUCKET_{PARAM} that means something; unset: derived from the engine
# limits (max_num_seqs, max_num_batched_tokens, max_model_len, block size, KV blocks).
BUCKET_VARIABLES = tuple(
    _declare(
        f"VLLM_{phase}_{dim}_BUCKET_{param}",
        None,
        f"Bucketing, {_DIMENSION_MEANING[phase, dim]}: {_PARAM_MEANING[param]}. Unset: derived "
        "from the engine limits.",
        kind="int",
    )
    for phase, dim in BUCKET_DIMENSIONS
    for param in BUCKET_PARAMS
)
# Intel's deprecated names for VLLM_PROMPT_QUERY_BUCKET_*, read when the new name is unset.
LEGACY_QUERY_VARIABLES = tuple(
    _declare(
        f"VLLM_PROMPT_SEQ_BUCKET_{param}",
        None,
        f"Deprecated (Intel's): stands in for VLLM_PROMPT_QUERY_BUCKET_{param} when that is unset.",
        kind="int",
    )
    for param in BUCKET_PARAMS
)


def get_raw(name: str) -> str | None:
    value = os.environ.get(name)
    if value is None:
        return VARIABLES[name].default if name in VARIABLES else None
    return value


def get_bool(name: str) -> bool:
    raw = (get_raw(name) or "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise EnvError(f"{name}={os.environ.get(name)!r} is not a boolean; set it to true or false.")


def get_number(name: str, cast: Callable[[str], float] = float, *, lo=None, hi=None) -> float:
    raw = (get_raw(name) or "").strip()
    try:
        value = cast(raw)
    except ValueError:
        raise EnvError(
            f"{name}={raw!r} is not a number; unset it to use the default "
            f"({VARIABLES[name].default})."
        ) from None
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise EnvError(f"{name}={raw!r} is out of range [{lo}, {hi}].")
    return value


def nixl_progress_wait_ms() -> int:
    """VLLM_HPU_NIXL_PROGRESS_WAIT_MS, validated: a whole number of milliseconds >= 0."""
    raw = (get_raw(VLLM_HPU_NIXL_PROGRESS_WAIT_MS) or "").strip()
    if not raw.isdigit():
        raise EnvError(
            f"{VLLM_HPU_NIXL_PROGRESS_WAIT_MS}={raw!r} is not a whole number of milliseconds; set "
            "it to e.g. 1, or to 0 (or unset it) for NIXL's own polling."
        )
    return int(raw)


def lazy_mode() -> bool:
    """Whether Gaudi's lazy mode is on (PT_HPU_LAZY_MODE=1), validated: HPU graphs exist only
    there; 0 is eager execution with torch.compile."""
    raw = (get_raw(PT_HPU_LAZY_MODE) or "").strip()
    if raw not in ("0", "1"):
        raise EnvError(
            f"{PT_HPU_LAZY_MODE}={raw!r} is not a mode; set it to 1 (lazy mode, HPU graphs) or "
            "0 (eager, torch.compile)."
        )
    return raw == "1"


def prefill_query_slice() -> int:
    """Query tokens per prefill attention slice (VLLM_PREFILL_QUERY_SLICE), validated."""
    raw = (get_raw(VLLM_PREFILL_QUERY_SLICE) or "").strip()
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise EnvError(
            f"{VLLM_PREFILL_QUERY_SLICE}={raw!r} is not a whole number of query tokens >= 1; set "
            f"it to e.g. 1024 or unset it for the default "
            f"({VARIABLES[VLLM_PREFILL_QUERY_SLICE].default})."
        )
    return value


def moe_gather_max_tokens() -> int | None:
    """VLLM_MOE_GATHER_MAX_TOKENS validated: None when unset (each layer derives its own),
    else a token count >= 0 (0: never gather)."""
    raw = (get_raw(VLLM_MOE_GATHER_MAX_TOKENS) or "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise EnvError(
            f"{VLLM_MOE_GATHER_MAX_TOKENS}={raw!r} is not a whole number of tokens >= 0; set it "
            "to e.g. 4 (gather the routed experts of steps of up to 4 tokens), to 0 (never), or "
            "unset it to let each MoE layer choose."
        )
    return value


def vision_warmup_sizes() -> list[tuple[int, int]] | None:
    """VLLM_HPU_VISION_WARMUP validated: (height, width) pairs in pixels, or None when unset."""
    raw = (get_raw(VLLM_HPU_VISION_WARMUP) or "").strip()
    if not raw:
        return None
    sizes = []
    for item in raw.split(","):
        height, sep, width = item.strip().lower().partition("x")
        if not (sep and height.isdigit() and width.isdigit() and int(height) and int(width)):
            raise EnvError(
                f"{VLLM_HPU_VISION_WARMUP}={raw!r}: {item.strip()!r} is not an image size; write "
                "'HEIGHTxWIDTH' in pixels, comma-separated (e.g. '448x448,720x1280'), or unset it "
                "to warm the largest image the processor makes."
            )
        sizes.append((int(height), int(width)))
    return sizes


def non_default(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The declared variables set to something other than their default, by name.

    Set-but-empty counts as unset for a variable without a default (as bucketing and vLLM read
    `VAR=`). Values are compared as written, after trimming spaces.
    """
    environ = os.environ if environ is None else environ
    found = {}
    for name, var in VARIABLES.items():
        value = environ.get(name)
        if value is None or (var.default is None and not value.strip()):
            continue
        if var.default is None or value.strip() != var.default:
            found[name] = value
    return found


@dataclass(frozen=True)
class RecipeCache:
    """PT_HPU_RECIPE_CACHE_CONFIG, parsed."""

    directory: str
    delete: bool  # clear the directory when the process starts
    max_size_mb: int


def recipe_cache(environ: Mapping[str, str] | None = None) -> RecipeCache | None:
    """PT_HPU_RECIPE_CACHE_CONFIG parsed, None when unset; raises EnvError on a bad value.

    Format (Intel's): '<directory>,<delete: true|false>,<max size in MB>'. A trailing fourth
    field, seen in some of Intel's scripts, is accepted if it is a boolean and not interpreted.
    """
    environ = os.environ if environ is None else environ
    raw = (environ.get(PT_HPU_RECIPE_CACHE_CONFIG) or "").strip()
    if not raw:
        return None
    parts = [p.strip() for p in raw.split(",")]
    fix = (
        f"set {PT_HPU_RECIPE_CACHE_CONFIG}='<directory>,<true|false>,<max size in MB>' "
        "(e.g. /data/recipes,false,8192) or unset it"
    )
    if len(parts) not in (3, 4) or not parts[0]:
        raise EnvError(f"{PT_HPU_RECIPE_CACHE_CONFIG}={raw!r} is not valid; {fix}.")
    flags = [p.lower() for p in parts[1:2] + parts[3:]]
    if any(flag not in ("true", "false") for flag in flags):
        raise EnvError(
            f"{PT_HPU_RECIPE_CACHE_CONFIG}={raw!r}: the delete flag must be true or false; {fix}."
        )
    try:
        size = int(parts[2])
    except ValueError:
        size = 0
    if size <= 0:
        raise EnvError(
            f"{PT_HPU_RECIPE_CACHE_CONFIG}={raw!r}: the max size must be a positive number of "
            f"MB; {fix}."
        )
    return RecipeCache(parts[0], parts[1].lower() == "true", size)


def model_cache() -> Path:
    """Where built tiny models are kept: VLLM_GAUDI_MODEL_CACHE, else the user's cache folder."""
    root = get_raw(VLLM_GAUDI_MODEL_CACHE)
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vllm-gaudi" / "models"


def emulation_mode() -> str | None:
    """'cpu' when CPU emulation is asked for, None when not; raises EnvError on a bad value."""
    raw = (os.environ.get(VLLM_HPU_EMULATION) or "").strip().lower()
    if raw in ("", "0", "false", "off", "none"):
        return None
    if raw == "cpu":
        return "cpu"
    raise EnvError(
        f"{VLLM_HPU_EMULATION}={os.environ.get(VLLM_HPU_EMULATION)!r} is not supported; "
        "set it to 'cpu' for CPU emulation or unset it to use a real Gaudi."
    )
