"""HPU serving metrics: what the worker counts per step and the channel that takes it to /metrics.

The numbers live in the worker (the model runner sees every step's bucket layout); vLLM's
Prometheus endpoint lives in the API-server process, where the ``vllm.stat_logger_plugins``
logger (``vllm_gaudi_platform.stat_logger``) runs. The channel between them is a small
memory-mapped file per engine, written in place by the worker and read by the logger:

- Why not ``collective_rpc``: a stat logger's ``record()`` is a synchronous call made by the
  output handler for every engine output, with no engine client to call, and an RPC per output
  would put a round trip to every worker into the serving loop.
- Why not the scheduler stats: they are built by the scheduler in the engine core from what the
  runner returns, and ``ModelRunnerOutput`` has no free-form field; ``kv_connector_stats`` exists
  only with a KV connector configured.
- The mapped file costs the worker a few float stores per step (no system call, no thread, no
  serialisation) and the logger one read of a few hundred bytes per output. Both sides name the
  file after what they share without talking: vLLM's ``VllmConfig.instance_id`` (set once in the
  API server and copied into every engine process) and the data-parallel rank (the logger's
  ``engine_idx``). The file sits in the temporary directory and is removed when the worker exits;
  a worker killed before it could remove its file leaves it behind, and the next worker that
  starts removes files whose writer process is gone (the file holds the writer's pid).

Counters are totals since warmup (serving steps only; warmup's own runs are not counted):

- ``recompiles``: shapes run after warmup that warmup did not run (first time each);
- ``{prompt,decode}_hits`` / ``_misses``: step parts that ran in a bucket of the plan / at their
  exact, unplanned shape;
- ``{prompt_tokens,decode_batch,decode_blocks}_{real,padded}``: the work a step needed and the
  work its buckets ran (prefill tokens, decode sequences, decode KV blocks);
- gauges ``warmup_seconds`` and ``graphs`` (captured HPU graphs; 0 until the runner has graphs);
- under torch.compile, ``compiled_graphs_{warmup,serving}`` (graphs dynamo compiled; one while
  serving is a recompile: a guard that failed) and ``graph_breaks_{warmup,serving}``;
- ``kv_staged_{to_host,to_device}_bytes``: KV cache bytes the NIXL connector's host staging
  copied out of the KV cache (prefill side) and into it (decode side), counted by the platform's
  ``swap_out_blocks_to_host`` / ``insert_blocks_to_device`` (0 without host staging).

Pure Python (no torch, no vllm): the arithmetic is tested without an engine.
"""

from __future__ import annotations

import atexit
import mmap
import os
import struct
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_gaudi_platform.attention.step_layout import StepLayout

FIELDS: tuple[str, ...] = (
    "recompiles",
    "prompt_hits",
    "prompt_misses",
    "decode_hits",
    "decode_misses",
    "prompt_tokens_real",
    "prompt_tokens_padded",
    "decode_batch_real",
    "decode_batch_padded",
    "decode_blocks_real",
    "decode_blocks_padded",
    "warmup_seconds",
    "graphs",
    "compiled_graphs_warmup",
    "compiled_graphs_serving",
    "graph_breaks_warmup",
    "graph_breaks_serving",
    "kv_staged_to_host_bytes",
    "kv_staged_to_device_bytes",
)
# torch.compile's counts per phase (see worker/compiled.py), each a "<what>_<phase>" of FIELDS.
COMPILE_PHASES: tuple[str, ...] = ("warmup", "serving")
# The padding dimensions, each a (real, padded) pair of FIELDS.
PADDING_DIMENSIONS: tuple[str, ...] = ("prompt_tokens", "decode_batch", "decode_blocks")
_INDEX = {name: i for i, name in enumerate(FIELDS)}
# Slot numbers, looked up once: record() runs every step.
_RECOMPILES, _P_HIT, _P_MISS, _D_HIT, _D_MISS = (
    _INDEX[n]
    for n in ("recompiles", "prompt_hits", "prompt_misses", "decode_hits", "decode_misses")
)
_PT_REAL, _PT_PAD, _DB_REAL, _DB_PAD, _DK_REAL, _DK_PAD = (
    _INDEX[f"{dim}_{kind}"] for dim in PADDING_DIMENSIONS for kind in ("real", "padded")
)
# A magic number and a layout version lead the file, so a reader never trusts a foreign file;
# then the writer's pid, so that files left by killed workers can be swept.
_MAGIC = 0x48505553  # "HPUS"
_VERSION = 4
_HEADER = struct.Struct("<IIQ")
_PREFIX = "vllm-gaudi-metrics-"
SIZE = _HEADER.size + 8 * len(FIELDS)


def channel_path(instance_id: str, engine_index: int) -> Path:
    """The file one engine's worker writes and the API server's logger reads."""
    safe = "".join(c for c in str(instance_id) if c.isalnum() or c in "-_") or "default"
    return Path(tempfile.gettempdir()) / f"{_PREFIX}{_uid()}-{safe}-dp{engine_index}.bin"


def _uid() -> int:
    return os.getuid() if hasattr(os, "getuid") else 0


def _alive(pid: int) -> bool:
    if pid <= 0:  # 0 and negatives name process groups, not a writer
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # gone, or no pid at all
        return False
    except OSError:  # exists, but not ours to signal
        return True
    return True


def sweep_stale(folder: Path) -> int:
    """Remove this user's channel files in `folder` whose writer process is gone."""
    removed = 0
    for path in folder.glob(f"{_PREFIX}{_uid()}-*.bin"):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if len(data) < _HEADER.size:
            continue
        magic, version, pid = _HEADER.unpack_from(data, 0)
        if (magic, version) == (_MAGIC, _VERSION) and not _alive(pid):
            path.unlink(missing_ok=True)
            removed += 1
    return removed


def worker_channel(vllm_config: Any) -> Path | None:
    """The channel the worker of `vllm_config` writes, or None on ranks other than an engine's
    first (tensor/pipeline-parallel ranks run the same steps: one of them reports)."""
    parallel = vllm_config.parallel_config
    if parallel.rank % max(parallel.world_size, 1) != 0:
        return None
    return channel_path(vllm_config.instance_id, parallel.data_parallel_rank)


def padding_ratio(real: float, padded: float) -> float:
    """Padding as a share of the real work: 0.25 means buckets ran 25% more than needed."""
    return (padded - real) / real if real > 0 else 0.0


# Directions of the KV host staging copies, each a "kv_staged_<direction>_bytes" of FIELDS.
STAGING_DIRECTIONS: tuple[str, ...] = ("to_host", "to_device")
# The process's counters: the last StepMetrics created (one model runner per worker process).
# The platform's staging hooks are called by vLLM's connector, which knows no runner.
_active: StepMetrics | None = None


def count_staged(direction: str, nbytes: int) -> None:
    """Add KV bytes copied by host staging (`direction`: "to_host" or "to_device")."""
    if _active is not None:
        _active._values[_INDEX[f"kv_staged_{direction}_bytes"]] += nbytes


class StepMetrics:
    """The worker's counters, stored straight into a float64 array (a mapped file or memory)."""

    def __init__(self, path: Path | None = None) -> None:
        global _active
        self.path = path
        self._mm: mmap.mmap | None = None
        if path is None:
            self._buf = bytearray(SIZE)
            buf: memoryview = memoryview(self._buf)
        else:
            sweep_stale(path.parent)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.ftruncate(fd, SIZE)
                self._mm = mmap.mmap(fd, SIZE)
            finally:
                os.close(fd)
            buf = memoryview(self._mm)
            atexit.register(self.close)
        _HEADER.pack_into(buf, 0, _MAGIC, _VERSION, os.getpid())
        self._values = buf[_HEADER.size :].cast("d")
        _active = self

    def __getitem__(self, name: str) -> float:
        return self._values[_INDEX[name]]

    def snapshot(self) -> dict[str, float]:
        return {name: self._values[i] for i, name in enumerate(FIELDS)}

    def set_warmup(self, seconds: float, graphs: int) -> None:
        self._values[_INDEX["warmup_seconds"]] = seconds
        self._values[_INDEX["graphs"]] = graphs

    def set_compile(self, graphs: dict[str, int], breaks: dict[str, int]) -> None:
        """torch.compile's totals per phase (worker/compiled.py's CompileStats)."""
        for phase in COMPILE_PHASES:
            self._values[_INDEX[f"compiled_graphs_{phase}"]] = graphs.get(phase, 0)
            self._values[_INDEX[f"graph_breaks_{phase}"]] = breaks.get(phase, 0)

    def record(
        self, layout: StepLayout, seq_lens: Sequence[int], block_size: int, recompiles: int
    ) -> None:
        """Count one serving step: which of its parts found a bucket and how much they padded
        (a step run in passes: each pass's)."""
        v = self._values
        v[_RECOMPILES] = recompiles  # the runner's RecompileTracker owns this count
        if layout.parts is not None:
            for one in layout.parts.passes:
                self.record(one.layout, [seq_lens[r] for r in one.requests], block_size, recompiles)
            return
        prefill = layout.prefill
        if prefill is not None:
            v[_P_HIT if prefill.warmed else _P_MISS] += 1
            v[_PT_REAL] += sum(layout.query_lens[i] for row in prefill.row_members for i in row)
            v[_PT_PAD] += prefill.rows * prefill.query_bucket
        decode = layout.decode
        if decode is not None:
            v[_D_HIT if decode.warmed else _D_MISS] += 1
            v[_DB_REAL] += len(decode.members)
            v[_DB_PAD] += decode.batch_bucket
            v[_DK_REAL] += sum(-(-seq_lens[i] // block_size) for i in decode.members)
            v[_DK_PAD] += decode.blocks_bucket

    def close(self) -> None:
        """Unmap and remove the file (the worker is going away)."""
        global _active
        if _active is self:
            _active = None
        if self._mm is None:
            return
        self._values.release()
        mm, self._mm = self._mm, None
        mm.close()
        if self.path is not None:
            self.path.unlink(missing_ok=True)


def read_snapshot(path: Path) -> dict[str, float] | None:
    """The counters in `path`, or None while no worker has written it (or it is not ours)."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if len(data) != SIZE or _HEADER.unpack_from(data, 0)[:2] != (_MAGIC, _VERSION):
        return None
    values = struct.unpack_from(f"<{len(FIELDS)}d", data, _HEADER.size)
    return dict(zip(FIELDS, values))
