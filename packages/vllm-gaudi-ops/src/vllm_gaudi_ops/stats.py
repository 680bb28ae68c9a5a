"""How often each op family's Gaudi path (`forward_oot`) ran in this process.

`COUNTS` maps a family name ("norm", "rotary", ...) to the number of `forward_oot` calls; tests
read it in-process. vLLM runs the model in other processes (engine core, workers), so when
VLLM_HPU_OPS_STATS_FILE names a file, each process that ran an op adds its counts to that JSON
file (`{"norm": 96, "rotary": 48}`): at a family's first call, then at most once per
`FLUSH_INTERVAL_S` while counting, the calls since the last write `FLUSH_INTERVAL_S` after it (a
timer thread, so the last calls before the process goes idle are written too), and the rest when
the interpreter exits. A killed process runs no exit handler: vLLM force-kills an engine process
that does not stop within its shutdown grace period (5 s; a loaded machine misses it), and `vllm
serve` kills its engine-core process right after asking it to stop; the writes during the run keep
the counts it had. The file is merged under an exclusive lock, so concurrent writers are safe;
delete it before a run to start from zero.

The counter proves that a family's code ran; it is not a profiler. It counts eager calls only:
nothing is counted while torch.compile traces a model. vLLM's trace-once compilation (Gaudi's
torch.compile mode) drops dynamo's guards, so a traced update would become a constant written
back by every call (seen: counts reset to their trace-time values each step). An HPU graph replay
runs no Python either. Count with eager execution (`enforce_eager=True`, or lazy mode).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import threading
import time

from vllm_gaudi_platform.envs import VLLM_HPU_OPS_STATS_FILE as STATS_FILE_ENV

COUNTS: dict[str, int] = {}
FLUSH_INTERVAL_S = 1.0

_path = os.environ.get(STATS_FILE_ENV) or None
_written: dict[str, int] = {}  # the part of COUNTS already added to the file
_next_flush = 0.0
_lock = threading.Lock()  # one write at a time: the counting thread's and the timer's
_timer: threading.Timer | None = None  # the pending write of the calls since the last one


def count(family: str) -> None:
    """Record one forward_oot call of `family` (a dict update: cheap enough for every call)."""
    if _is_compiling():
        return
    n = COUNTS[family] = COUNTS.get(family, 0) + 1
    if _path is None:
        return
    if n == 1 or time.monotonic() >= _next_flush:
        _flush()
    elif _timer is None:
        _schedule_flush()


def _is_compiling() -> bool:
    import torch  # the ops that call count() have torch loaded already

    return torch.compiler.is_compiling()


def merge_into_file(path: str, counts: dict[str, int]) -> None:
    """Add `counts` to the JSON object in `path` (created if missing) under an exclusive lock."""
    import fcntl

    with open(path, "a+", encoding="utf-8") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        text = f.read()
        totals: dict[str, int] = {}
        if text.strip():
            with contextlib.suppress(ValueError):
                totals = {str(k): int(v) for k, v in json.loads(text).items()}
        for family, n in counts.items():
            totals[family] = totals.get(family, 0) + n
        f.seek(0)
        f.truncate()
        json.dump(totals, f, sort_keys=True)
        f.flush()


def _flush() -> None:
    """Add the counts not yet written to the stats file."""
    global _next_flush
    with _lock:
        _next_flush = time.monotonic() + FLUSH_INTERVAL_S
        counts = dict(COUNTS)  # a copy: the counting thread may add to COUNTS meanwhile
        delta = {f: n - _written.get(f, 0) for f, n in counts.items() if n != _written.get(f, 0)}
        if _path is None or not delta:
            return
        merge_into_file(_path, delta)
        _written.update({f: counts[f] for f in delta})


def _schedule_flush() -> None:
    """Write the calls not yet written once the interval since the last write has passed."""
    global _timer
    timer = threading.Timer(max(_next_flush - time.monotonic(), 0.0), _timed_flush)
    timer.daemon = True  # never holds the interpreter's exit (the exit handler writes then)
    _timer = timer
    timer.start()


def _timed_flush() -> None:
    global _timer
    _timer = None
    _flush()


def _after_fork_in_child() -> None:
    """A forked child (vLLM forks its engine-core process) writes its own calls only (the parent
    writes the ones it made) and has no timer thread of its parent."""
    global _timer, _lock
    _timer = None
    _lock = threading.Lock()
    _written.update(COUNTS)


if _path is not None:
    atexit.register(_flush)
    os.register_at_fork(after_in_child=_after_fork_in_child)
