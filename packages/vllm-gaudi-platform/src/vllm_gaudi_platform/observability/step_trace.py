"""Step-shape traces: what the runner records when asked, and what the ``fitted`` strategy reads.

A trace is a text file, one shape per line, each with how many steps had it::

    # phase  batch  query_len  ctx_blocks  [count]
    prompt   1      1536       0           12
    prompt   2      700        3
    # phase  batch  blocks     [count]
    decode   32     410        5

A prompt line is the prefill part of a step as the runner first looks it up: the number of
prefill sequences, the longest number of new tokens of one of them and the largest number of
context blocks (cached prefix or earlier chunks) of one of them. A prefill that cannot run as a
batch (more sequences than ``VLLM_PROMPT_BS_BUCKET_MAX``, or ``batch * query_len`` over
``max_num_batched_tokens``) is recorded as the single packed row the runner runs instead: batch
1, the sum of the queries, the sum of the context blocks. A decode line is the decode part: the
number of sequences and the KV blocks of the whole batch. ``count`` defaults to 1; ``#`` starts a
comment. Lines may repeat (the recorder appends a summary of the latest steps each time it
flushes); the reader adds their counts up.

Recording (``VLLM_BUCKETING_RECORD_TRACE``) costs one dictionary update per step; the counts are
appended to the file every ``FLUSH_STEPS`` steps or ``FLUSH_SECONDS`` seconds and at exit, so a
crash loses at most the last interval. Pure Python: no torch, no vllm.
"""

from __future__ import annotations

import atexit
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_gaudi_platform.envs import VLLM_BUCKETING_RECORD_TRACE, VLLM_BUCKETING_TRACE, EnvError

FLUSH_STEPS = 1000
FLUSH_SECONDS = 10.0
HEADER = (
    "# vllm-gaudi step trace: 'prompt batch query_len ctx_blocks count' or "
    "'decode batch blocks count'\n"
)


@dataclass(frozen=True)
class TracedShape:
    """One traced step shape. ``query_len`` is 1 and ``ctx_blocks`` the batch's blocks (decode)."""

    phase: str  # "prompt" or "decode"
    batch_size: int
    query_len: int
    ctx_blocks: int


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def step_shapes(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_size: int,
    max_num_batched_tokens: int,
    max_prefill_batch: int,
) -> list[TracedShape]:
    """The prompt and decode shapes of one scheduler step (see the module docstring).

    ``seq_lens`` count each sequence's context plus this step's tokens.
    """
    shapes = []
    prefill = [(q, s - q) for q, s in zip(query_lens, seq_lens) if q > 1]
    if prefill:
        n = len(prefill)
        longest = max(q for q, _ in prefill)
        if n <= max_prefill_batch and n * longest <= max_num_batched_tokens:
            ctx = max(_blocks(c, block_size) for _, c in prefill)
            shapes.append(TracedShape("prompt", n, longest, ctx))
        else:
            total_q = sum(q for q, _ in prefill)
            total_ctx = sum(_blocks(c, block_size) for _, c in prefill)
            shapes.append(TracedShape("prompt", 1, total_q, total_ctx))
    decode = [s for q, s in zip(query_lens, seq_lens) if q == 1]
    if decode:
        blocks = sum(_blocks(s, block_size) for s in decode)
        shapes.append(TracedShape("decode", len(decode), 1, blocks))
    return shapes


def format_line(shape: TracedShape, count: int) -> str:
    if shape.phase == "prompt":
        return f"prompt {shape.batch_size} {shape.query_len} {shape.ctx_blocks} {count}\n"
    return f"decode {shape.batch_size} {shape.ctx_blocks} {count}\n"


class TraceRecorder:
    """Counts the step shapes of a running engine and appends them to a trace file."""

    def __init__(
        self,
        path: str,
        *,
        block_size: int,
        max_num_batched_tokens: int,
        max_prefill_batch: int,
        flush_steps: int = FLUSH_STEPS,
        flush_seconds: float = FLUSH_SECONDS,
    ) -> None:
        self.path = path
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_batch = max_prefill_batch
        self.flush_steps = flush_steps
        self.flush_seconds = flush_seconds
        self._pending: Counter[TracedShape] = Counter()
        self._steps = 0
        self._last_flush = time.monotonic()
        self._lock = threading.Lock()
        # Open once now so that an unwritable path stops startup, not the first flush.
        try:
            with open(path, "a", encoding="utf-8") as f:
                if f.tell() == 0:
                    f.write(HEADER)
        except OSError as exc:
            raise EnvError(
                f"{VLLM_BUCKETING_RECORD_TRACE}={path!r} cannot be opened for appending ({exc}); "
                "point it at a writable file or unset it to stop recording."
            ) from None
        atexit.register(self.flush)

    def record(self, query_lens: Sequence[int], seq_lens: Sequence[int]) -> None:
        """Count one step (its query and sequence lengths, per request)."""
        for shape in step_shapes(
            query_lens,
            seq_lens,
            self.block_size,
            self.max_num_batched_tokens,
            self.max_prefill_batch,
        ):
            self._pending[shape] += 1
        self._steps += 1
        if (
            self._steps >= self.flush_steps
            or time.monotonic() - self._last_flush >= self.flush_seconds
        ):
            self.flush()

    def flush(self) -> None:
        """Append the counts since the last flush (nothing when there are none)."""
        with self._lock:
            pending, self._pending = self._pending, Counter()
            self._steps = 0
            self._last_flush = time.monotonic()
        if not pending:
            return
        text = "".join(format_line(s, n) for s, n in sorted(pending.items(), key=_line_order))
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(text)

    def close(self) -> None:
        self.flush()
        atexit.unregister(self.flush)


def _line_order(item: tuple[TracedShape, int]) -> tuple[str, int, int, int]:
    s = item[0]
    return (s.phase, s.batch_size, s.query_len, s.ctx_blocks)


def _trace_error(path: str, line_no: int, line: str, problem: str) -> EnvError:
    return EnvError(
        f"{VLLM_BUCKETING_TRACE}={path!r}, line {line_no} ({line.strip()!r}): {problem}. Each "
        "line must be 'prompt BATCH QUERY_LEN CTX_BLOCKS [COUNT]' or 'decode BATCH BLOCKS "
        "[COUNT]' with whole numbers (VLLM_BUCKETING_RECORD_TRACE writes such a file); fix the "
        "line or point the variable at another trace."
    )


def read_trace(path: str) -> Counter[TracedShape]:
    """Every shape of a trace file with its step count; EnvError naming the file when unusable."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise EnvError(
            f"{VLLM_BUCKETING_TRACE}={path!r} cannot be read ({exc}); record one with "
            f"{VLLM_BUCKETING_RECORD_TRACE}=<file> under another strategy, or point the variable "
            "at an existing trace."
        ) from None
    shapes: Counter[TracedShape] = Counter()
    for line_no, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        phase, numbers = fields[0].lower(), fields[1:]
        sizes = {"prompt": (3, 4), "decode": (2, 3)}.get(phase)
        if sizes is None:
            raise _trace_error(path, line_no, line, f"{fields[0]!r} is not prompt or decode")
        if len(numbers) not in sizes:
            raise _trace_error(path, line_no, line, f"{len(numbers)} numbers after {phase}")
        try:
            values = [int(x) for x in numbers]
        except ValueError:
            raise _trace_error(path, line_no, line, "not a whole number") from None
        if len(values) == sizes[0]:
            values.append(1)
        if phase == "prompt":
            batch, query, ctx, count = values
        else:
            batch, ctx, count = values
            query = 1
        if batch < 1 or query < 1 or ctx < 0 or count < 1:
            raise _trace_error(
                path, line_no, line, "batch, query_len and count must be >= 1, blocks >= 0"
            )
        if phase == "decode" and ctx < batch:
            raise _trace_error(path, line_no, line, "a decode batch holds at least one block each")
        shapes[TracedShape(phase, batch, query, ctx)] += count
    if not shapes:
        raise EnvError(
            f"{VLLM_BUCKETING_TRACE}={path!r} holds no step shapes; record a trace with "
            f"{VLLM_BUCKETING_RECORD_TRACE}=<file> while serving a representative load, or use "
            "another bucketing strategy."
        )
    return shapes
