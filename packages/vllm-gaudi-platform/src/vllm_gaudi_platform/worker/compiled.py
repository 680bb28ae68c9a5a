"""torch.compile of the model's forward pass: how a Gaudi runs steps in eager mode
(PT_HPU_LAZY_MODE=0), which is its default.

The runner compiles the model itself (vLLM's compile integration is off on this platform: its
modes drop dynamo's guards or compile for inductor and CUDA graphs) with the seam's backend
(Habana's `hpu_backend` on a Gaudi; dynamo's `aot_eager` in emulation, see seam/emulated.py),
`dynamic=False`: every bucket is a static shape, compiled once during warmup, and a step of a
warmed bucket meets guards that hold. What makes that true:

- token ids and positions are the bucket's padded length;
- the attention metadata a compiled pass reads is bucket-shaped (`bucket_shaped`): the slot
  mapping covers every padded token (padding writes go to block 0, the null block) and the cells
  are always permuted through `cell_to_token`, so no Python value of the trace changes with the
  number of real tokens;
- the attention backend is traced (the platform's `opaque_attention_op` is False in this mode),
  so its Python branches are guards of the bucket's trace.

Accounting (`CompileStats`): every graph dynamo hands the backend is counted, per phase (warmup
or serving); a graph compiled while serving is a recompile, counted with the bucket that caused
it. Graph breaks are counted with their reason and the place in the model's code (file, line,
and the module class whose forward it is); a break not in `GRAPH_BREAK_LEDGER` is an error in
warmup when VLLM_FULL_WARMUP=true, and a warning otherwise.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.logger import init_logger

from vllm_gaudi_platform.attention.metadata import HPUAttentionMetadata

logger = init_logger(f"vllm.{__name__}")

# Graph breaks that cannot be avoided, by (file name suffix, function name): why. Empty: every
# architecture, attention path, quant method and op family in the suite traces whole.
GRAPH_BREAK_LEDGER: dict[tuple[str, str], str] = {}

# dynamo keeps this many compiled versions per code object before it gives up and runs the
# frame eagerly. Every bucket (and attention variant) is a version of the model's forward.
_MIN_RECOMPILE_LIMIT = 4096


def compile_wanted(vllm_config: Any) -> bool:
    """Whether steps run through torch.compile: Gaudi's eager mode (PT_HPU_LAZY_MODE=0, the
    default) without enforce_eager. Lazy mode replays HPU graphs instead."""
    from vllm_gaudi_platform import envs

    model_config = getattr(vllm_config, "model_config", None)
    if model_config is None or model_config.enforce_eager:
        return False
    return not envs.lazy_mode()


def configure_dynamo() -> None:
    """Lazy mode: dynamo off in this process, as Habana's lazy mode cannot run torch.compile
    (and vLLM's small compiled helpers would try). Set in the process, not by exporting
    TORCHDYNAMO_DISABLE, which child processes started in eager mode would inherit; the platform
    calls this in the process that checks the config, and every worker at start."""
    import torch._dynamo

    from vllm_gaudi_platform import envs

    if envs.lazy_mode():
        torch._dynamo.config.disable = True


class GraphBreakError(RuntimeError):
    """A compiled forward pass broke into several graphs where the ledger allows none."""


@dataclass
class GraphBreak:
    reason: str
    file: str
    line: int
    function: str
    module: str  # the model's module (class and first path) whose code broke, or ""

    def describe(self) -> str:
        where = f"{self.module}: " if self.module else ""
        first = self.reason.strip().splitlines()[0] if self.reason.strip() else "?"
        return f"{where}{self.function} at {self.file}:{self.line}: {first}"

    def ledgered(self) -> bool:
        return any(
            self.file.endswith(suffix) and self.function == fn for suffix, fn in GRAPH_BREAK_LEDGER
        )


@dataclass
class CompileStats:
    graphs: dict[str, int] = field(default_factory=lambda: {"warmup": 0, "serving": 0})
    breaks: dict[str, list[GraphBreak]] = field(
        default_factory=lambda: {"warmup": [], "serving": []}
    )
    compile_seconds: float = 0.0
    recompiled_buckets: list[str] = field(default_factory=list)
    # Graphs compiled per bucket (and packed-prefill variant) over the engine's life; a draft
    # head's labels start with "draft ".
    by_bucket: dict[str, int] = field(default_factory=dict)
    # "warmup" until the runner's warmup ends, then "serving" (shared by every compiled model of
    # the runner: the target and a draft head).
    phase: str = "warmup"
    # Compiled passes run while serving, per model ("model", or "draft" for a draft head).
    serving_passes: dict[str, int] = field(default_factory=dict)

    @property
    def recompiles(self) -> int:
        """Graphs compiled after warmup: each one is a compile while serving on a Gaudi."""
        return self.graphs["serving"]

    def as_dict(self) -> dict[str, Any]:
        return {
            "compiled_graphs": dict(self.graphs),
            "graph_breaks": {
                phase: [dataclasses.asdict(b) for b in found]
                for phase, found in self.breaks.items()
            },
            "compile_recompiles": self.recompiles,
            "recompiled_buckets": list(self.recompiled_buckets),
            "compile_seconds": self.compile_seconds,
            "compiles_by_bucket": dict(self.by_bucket),
            "compiled_serving_passes": dict(self.serving_passes),
        }


def _module_locator(model: torch.nn.Module) -> Callable[[str, int], str]:
    """Maps a (file, line) of a break to 'Class (path)' of the first module whose class defines
    a method containing that line."""
    spans: list[tuple[str, int, int, str]] = []
    seen: set[type] = set()
    for path, module in model.named_modules():
        cls = type(module)
        if cls in seen:
            continue
        seen.add(cls)
        for name, fn in vars(cls).items():
            code = getattr(fn, "__code__", None)
            if code is None:
                continue
            try:
                lines, first = inspect.getsourcelines(fn)
            except (OSError, TypeError):
                continue
            spans.append(
                (
                    code.co_filename,
                    first,
                    first + len(lines),
                    f"{cls.__name__}.{name} ({path or 'model'})",
                )
            )

    def locate(file: str, line: int) -> str:
        for f, lo, hi, label in spans:
            if f == file and lo <= line < hi:
                return label
        return ""

    return locate


class CompiledModel:
    """A model's forward pass through torch.compile, with its compile accounting. The runner has
    one for the target model and one for an EAGLE-style draft head (`label_prefix` "draft "),
    sharing one `CompileStats`."""

    def __init__(
        self,
        model: torch.nn.Module,
        backend: str,
        *,
        strict: bool,
        publish: Callable[[dict[str, int], dict[str, int]], None] | None = None,
        stats: CompileStats | None = None,
        label_prefix: str = "",
    ) -> None:
        import torch._dynamo

        self.model = model
        self.backend_name = backend
        self.strict = strict
        self.stats = stats if stats is not None else CompileStats()
        self.label_prefix = label_prefix
        self.current_bucket = ""
        self._publish = publish  # the serving metrics' set_compile
        self._locate = _module_locator(model)
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, _MIN_RECOMPILE_LIMIT)
        config.accumulated_recompile_limit = max(
            config.accumulated_recompile_limit, _MIN_RECOMPILE_LIMIT
        )
        from torch._dynamo.backends.registry import lookup_backend

        inner = lookup_backend(backend)

        def counting_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
            stats = self.stats
            stats.graphs[stats.phase] += 1
            label = self.current_bucket
            stats.by_bucket[label] = stats.by_bucket.get(label, 0) + 1
            if stats.phase == "serving" and self.current_bucket:
                stats.recompiled_buckets.append(self.current_bucket)
            return inner(gm, example_inputs)

        self._compiled = torch.compile(model, backend=counting_backend, dynamic=False)

    @property
    def phase(self) -> str:
        return self.stats.phase

    def run(self, context: Any, **kwargs: Any) -> Any:
        """One forward pass in vLLM's forward context `context`, the pass reading bucket-shaped
        attention metadata (`bucket_shaped`) and no per-layer slot mappings: this platform's
        backend writes the cache from its own metadata, and a traced read of vLLM's slot
        mappings (real tokens only) would guard on their length."""
        step_md = context.attn_metadata
        if isinstance(step_md, dict):
            shaped: dict[int, Any] = {}
            for md in step_md.values():
                if isinstance(md, HPUAttentionMetadata) and id(md) not in shaped:
                    shaped[id(md)] = bucket_shaped(md)
            context.attn_metadata = {name: shaped.get(id(md), md) for name, md in step_md.items()}
        step_slots = context.slot_mapping
        context.slot_mapping = {}
        self.current_bucket = self.label_prefix + bucket_label(context.attn_metadata)
        stats = self.stats
        if stats.phase == "serving":
            which = self.label_prefix.strip() or "model"
            stats.serving_passes[which] = stats.serving_passes.get(which, 0) + 1
        try:
            return self(**kwargs)
        finally:
            context.attn_metadata = step_md
            context.slot_mapping = step_slots

    def __call__(self, **kwargs: Any) -> Any:
        import time

        from torch._dynamo.utils import graph_break_reasons

        before_graphs = sum(self.stats.graphs.values())
        before_breaks = len(graph_break_reasons)
        start = time.perf_counter()
        out = self._compiled(**kwargs)
        if sum(self.stats.graphs.values()) != before_graphs:
            self.stats.compile_seconds += time.perf_counter() - start
        if len(graph_break_reasons) != before_breaks:
            self._record_breaks(graph_break_reasons[before_breaks:])
        if self._publish is not None and sum(self.stats.graphs.values()) != before_graphs:
            self._publish(
                dict(self.stats.graphs),
                {phase: len(found) for phase, found in self.stats.breaks.items()},
            )
        return out

    def _record_breaks(self, reasons: list[Any]) -> None:
        for r in reasons:
            frame = r.user_stack[-1] if r.user_stack else None
            brk = GraphBreak(
                reason=str(r.reason),
                file=frame.filename if frame else "",
                line=frame.lineno or 0 if frame else 0,
                function=frame.name if frame else "",
                module=self._locate(frame.filename, frame.lineno or 0) if frame else "",
            )
            self.stats.breaks[self.phase].append(brk)
            if brk.ledgered():
                continue
            message = (
                f"torch.compile graph break in {brk.describe()} (bucket {self.current_bucket}): "
                "on a Gaudi the forward pass splits into several recipes"
            )
            if self.strict and self.phase == "warmup":
                raise GraphBreakError(
                    f"{message}; VLLM_FULL_WARMUP=true forbids it (unset it, or run with "
                    "enforce_eager=True)."
                )
            logger.warning(message)

    def warmup_done(self) -> None:
        stats = self.stats
        stats.phase = "serving"
        logger.info(
            "torch.compile (%s): %d graphs in warmup (%.2f s), %d graph breaks",
            self.backend_name,
            stats.graphs["warmup"],
            stats.compile_seconds,
            len(stats.breaks["warmup"]),
        )


def bucket_label(attn_metadata: Any) -> str:
    """'prompt bs=1 q=128 ctx=0 [packed] + decode bs=4 ctx=8' for a forward pass's metadata."""
    md = next(iter(attn_metadata.values()), None) if isinstance(attn_metadata, dict) else None
    layout = getattr(md, "layout", None)
    if layout is None:
        return "no attention metadata"
    parts = []
    for b in layout.buckets:
        if b.phase == "decode":
            parts.append(f"decode bs={b.batch_size} ctx={b.ctx_blocks}")
        else:
            packed = " packed" if getattr(md, "prefill_packed", False) else ""
            parts.append(f"{b.phase} bs={b.batch_size} q={b.query_len} ctx={b.ctx_blocks}{packed}")
    return " + ".join(parts)


def bucket_shaped(md: Any) -> Any:
    """Step metadata as a compiled pass reads it: every Python value the trace depends on is
    the bucket's, not the step's (see the module docstring). Shares the step's tensors except
    the slot mapping, which gets the padded tokens' block-0 slots."""
    total = md.layout.num_tokens_padded
    if md.num_actual_tokens == total and not md.identity_layout:
        return md
    slots = torch.zeros(total, dtype=md.slot_mapping.dtype, device=md.slot_mapping.device)
    slots[: md.num_actual_tokens].copy_(md.slot_mapping[: md.num_actual_tokens])
    parts = md.parts
    if parts is not None:
        parts = tuple(bucket_shaped(p) for p in parts)
    return dataclasses.replace(
        md,
        slot_mapping=slots,
        num_actual_tokens=total,
        identity_layout=False,
        _derived={},
        parts=parts,
    )
