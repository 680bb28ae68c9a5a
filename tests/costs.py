"""What a test costs: its cost markers are checked, and the suite's time can be profiled.

The markers (pyproject.toml):
- `engine`: the test starts a vLLM engine (a job script, a served instance);
- `process`: it starts a fresh Python interpreter (`python -c`, a console script, a venv's
  pip) or a multiprocessing child, but no engine.
`make test-unit` deselects both. The checks: a test that asks for the `run_python` or
`console_script` fixture without one of them fails the collection; a test that starts an
interpreter without one, or an engine job or server without `engine`, fails where it starts it
(before the child runs), and one whose child printed vLLM's engine start line fails too.

The profile is off unless TEST_PROFILE_DIR names a folder (`make test-profile` sets it). Then
every pytest process (the controller and each xdist worker) records, per test: its wall time
(setup + call + teardown); each interpreter it started, of which kind (an engine job, a served
engine, the `vllm-gaudi` command, plain python), how long it lived, and, read from the output
the test captured, how many vLLM engines it started and the seconds its engines spent in
bucket warmup and in torch.compile; and the seconds this process spent building tiny models.
Records go to `<dir>/<worker>.jsonl`, one JSON object a test; at the end of the session the
controller writes the per-module table to `<dir>/summary.txt` and prints it;
`python -m tests.costs <dir>` prints it again.
"""

from __future__ import annotations

import json
import multiprocessing.util
import os
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

PROFILE_DIR = "TEST_PROFILE_DIR"
COST_MARKERS = ("engine", "process")
# Fixtures whose only use is to start a fresh interpreter.
PROCESS_FIXTURES = ("run_python", "console_script")

# vLLM logs this once per engine it starts (LLM(...) or `vllm serve`).
ENGINE_LINE = re.compile(r"Initializing a V1 LLM engine")
WARMUP_LINE = re.compile(r"HPU warmup: \d+ prompt \+ \d+ decode buckets in ([0-9.]+) s")
COMPILE_LINE = re.compile(r"torch\.compile \([^)]*\): \d+ graphs in warmup \(([0-9.]+) s\)")
_BIN = os.path.dirname(sys.executable)


def process_kind(argv: Any) -> str | None:
    """'job' (a *_job.py script), 'serve' (a vLLM server), 'cli' (vllm-gaudi), 'python' (python
    -c, another script, a console script beside this interpreter); None for a program that
    starts no Python (a library's ldconfig or gcc, git)."""
    args = [os.fspath(a) for a in argv] if isinstance(argv, list | tuple) else [os.fspath(argv)]
    first = os.path.basename(args[0])
    if len(args) > 1 and os.path.basename(args[1]) == "zygote.py":
        return None  # the preloaded interpreter (tests/zygote.py): each job it forks is checked
    interpreter = (
        first.startswith("python")
        or os.path.dirname(args[0]) == _BIN
        or first in ("vllm", "vllm-gaudi", "pip", "uv")
    )
    if not interpreter:
        return None
    joined = " ".join(args)
    if re.search(r"_job\.py\b", joined):
        return "job"
    if "serve" in args or "vllm.entrypoints.openai.api_server" in joined:
        return "serve"
    if first.startswith("vllm-gaudi"):
        return "cli"
    return "python"


_current: pytest.Item | None = None
_STDLIB = os.path.dirname(os.__file__)


def _started_by_a_library() -> bool:
    """Whether the code that asked for the child is a third-party library's own (py-cpuinfo
    runs an interpreter when neural-compressor is first imported, in whichever test imports it):
    the innermost caller outside the standard library and this file lives in site-packages."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name != __file__ and not name.startswith(_STDLIB + os.sep):
            return "site-packages" in name
        frame = frame.f_back
    return False


def _has(marker: str) -> bool:
    return _current is not None and _current.get_closest_marker(marker) is not None


def _check(kind: str, what: str) -> None:
    """Fail the running test if `kind` of child is beyond what its markers say."""
    if _current is None:
        return
    if kind in ("job", "serve", "engine") and not _has("engine"):
        pytest.fail(
            f"{_current.nodeid} starts a vLLM engine ({what}) without the `engine` marker: "
            "mark it @pytest.mark.engine (pytestmark = pytest.mark.engine for a module)",
            pytrace=False,
        )
    if not (_has("engine") or _has("process")):
        pytest.fail(
            f"{_current.nodeid} starts a fresh interpreter ({what}) without a cost marker: mark "
            "it @pytest.mark.process (or engine, if it starts a vLLM engine); "
            "`make test-unit` deselects both",
            pytrace=False,
        )


class _Recorder:
    def __init__(self, directory: Path, worker: str) -> None:
        self.out = directory / f"{worker}.jsonl"
        self.worker = worker
        self.children: list[dict[str, Any]] = []
        self.build_seconds = 0.0

    def child_started(self, kind: str) -> dict[str, Any]:
        entry = {"kind": kind, "start": time.perf_counter(), "seconds": None}
        entry.update(engines=1 if kind == "serve" else 0, warmup_s=0.0, compile_s=0.0)
        self.children.append(entry)
        return entry

    def write(self, nodeid: str, seconds: float) -> None:
        now = time.perf_counter()
        children = [
            {k: v for k, v in c.items() if k != "start"}
            | {"seconds": c["seconds"] if c["seconds"] is not None else now - c["start"]}
            for c in self.children
        ]
        record = {
            "nodeid": nodeid,
            "worker": self.worker,
            "seconds": seconds,
            "build_s": self.build_seconds,
            "children": children,
        }
        with self.out.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self.children, self.build_seconds = [], 0.0


_recorder: _Recorder | None = None


def _read_output(entry: dict[str, Any] | None, kind: str, *streams: Any) -> None:
    engines = 0
    for text in streams:
        if isinstance(text, bytes):
            text = text.decode(errors="replace")
        if not isinstance(text, str):
            continue
        engines += len(ENGINE_LINE.findall(text))
        if entry is not None:
            entry["warmup_s"] += sum(float(s) for s in WARMUP_LINE.findall(text))
            entry["compile_s"] += sum(float(s) for s in COMPILE_LINE.findall(text))
    if entry is not None and kind != "serve":
        entry["engines"] += engines
    if engines:
        _check("engine", f"its {kind} child printed vLLM's engine start")


class Child:
    """A child interpreter a test asked for, checked against the test's markers when it starts
    and, when profiling, recorded; `ended` takes what it printed. subprocess.Popen makes one for
    every child (below); tests/zygote.py for each job it forks."""

    def __init__(self, args: Any, *, checked: bool = True) -> None:
        self.kind = process_kind(args)
        self.profile = None
        if self.kind is not None:
            if checked:
                _check(self.kind, " ".join(os.fspath(x) for x in args)[:160])
            if _recorder is not None:
                self.profile = _recorder.child_started(self.kind)

    def discard(self) -> None:
        """It never started."""
        if _recorder is not None and self.profile in _recorder.children:
            _recorder.children.remove(self.profile)

    def ended(self, *streams: Any) -> None:
        entry = self.profile
        if entry is not None and entry["seconds"] is None:
            entry["seconds"] = time.perf_counter() - entry["start"]
        if self.kind is not None and streams:
            _read_output(entry, self.kind, *streams)


class _CheckedPopen(subprocess.Popen):  # type: ignore[type-arg]
    """subprocess.Popen (which subprocess.run uses) that checks the test's cost markers and,
    when profiling, records the child."""

    def __init__(self, args: Any, *a: Any, **kw: Any) -> None:
        child = Child(args, checked=not _started_by_a_library())
        self._kind, self._profile = child.kind, child.profile
        super().__init__(args, *a, **kw)

    def _ended(self) -> None:
        entry = self._profile
        if entry is not None and entry["seconds"] is None and self.returncode is not None:
            entry["seconds"] = time.perf_counter() - entry["start"]

    def communicate(self, *a: Any, **kw: Any) -> Any:
        out = super().communicate(*a, **kw)
        self._ended()
        if self._kind is not None:
            _read_output(self._profile, self._kind, *out)
        return out

    def wait(self, *a: Any, **kw: Any) -> Any:
        code = super().wait(*a, **kw)
        self._ended()
        return code

    def poll(self) -> Any:
        code = super().poll()
        self._ended()
        return code


_spawnv_passfds = multiprocessing.util.spawnv_passfds


def _checked_spawn(path: Any, args: Any, passfds: Any) -> Any:
    """multiprocessing's spawn start method (torch.multiprocessing's too) starts interpreters
    through this."""
    _check("python", "a multiprocessing spawn")
    if _recorder is not None:
        _recorder.child_started("python")["seconds"] = 0.0  # its lifetime is not tracked
    return _spawnv_passfds(path, args, passfds)


def _time_builds() -> None:
    """Wrap the tiny-model builders so the time of their (uncached) builds counts in build_s."""
    import importlib

    for module_name, names in (
        ("gaudi_testkit.tinymodels", ("build",)),
        ("gaudi_testkit.tinyvision", ("build",)),
        ("vllm_gaudi_platform.commands.demo_model", ("build",)),
    ):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name in names:
            original = getattr(module, name, None)
            if original is None or getattr(original, "_profiled", False):
                continue

            def timed(*a: Any, __original: Any = original, **kw: Any) -> Any:
                start = time.perf_counter()
                try:
                    return __original(*a, **kw)
                finally:
                    if _recorder is not None:
                        _recorder.build_seconds += time.perf_counter() - start

            timed._profiled = True  # type: ignore[attr-defined]
            setattr(module, name, timed)


def pytest_configure(config: pytest.Config) -> None:
    global _recorder
    subprocess.Popen = _CheckedPopen  # type: ignore[misc]
    multiprocessing.util.spawnv_passfds = _checked_spawn
    directory = os.environ.get(PROFILE_DIR)
    if directory:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        _recorder = _Recorder(path, os.environ.get("PYTEST_XDIST_WORKER", "main"))
        _time_builds()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unmarked = [
        f"{item.nodeid} (fixture {name})"
        for item in items
        for name in PROCESS_FIXTURES
        if name in getattr(item, "fixturenames", ())
        and not any(item.get_closest_marker(m) for m in COST_MARKERS)
    ]
    if unmarked:
        raise pytest.UsageError(
            "tests that start fresh interpreters need the `process` (or `engine`) marker:\n  "
            + "\n  ".join(unmarked)
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Any:
    global _current
    _current = item
    start = time.perf_counter()
    try:
        yield
    finally:
        _current = None
        if _recorder is not None:
            _recorder.write(item.nodeid, time.perf_counter() - start)


def pytest_sessionfinish(session: pytest.Session) -> None:
    directory = os.environ.get(PROFILE_DIR)
    if not directory or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    text = summary(Path(directory))
    (Path(directory) / "summary.txt").write_text(text)
    print("\n" + text, file=sys.stderr)


def summary(directory: Path) -> str:
    """The per-module table from the records under `directory`, slowest module first; the
    wall seconds of the two workers add up (they run side by side)."""
    rows: dict[str, dict[str, Any]] = defaultdict(lambda: defaultdict(float))
    for file in sorted(directory.glob("*.jsonl")):
        for line in file.read_text().splitlines():
            r = json.loads(line)
            row = rows[r["nodeid"].split("::", 1)[0]]
            row["tests"] += 1
            row["seconds"] += r["seconds"]
            row["build"] += r["build_s"]
            for c in r["children"]:
                row[c["kind"]] += 1
                row["child"] += c["seconds"]
                row["engines"] += c["engines"]
                row["warmup"] += c["warmup_s"]
                row["compile"] += c["compile_s"]
    header = (
        f"{'module':56} {'tests':>5} {'wall s':>7} {'engines':>7} {'jobs':>4} {'serve':>5} "
        f"{'py':>4} {'child s':>7} {'build s':>7} {'warmup s':>8} {'compile s':>9}"
    )
    lines = [header, "-" * len(header)]
    total: dict[str, float] = defaultdict(float)
    for module, row in sorted(rows.items(), key=lambda kv: -kv[1]["seconds"]):
        row["py"] = row["python"] + row["cli"]
        for key in ("tests", "seconds", "engines", "job", "serve", "py", "child", "build"):
            total[key] += row[key]
        total["warmup"] += row["warmup"]
        total["compile"] += row["compile"]
        lines.append(_row(module, row))
    lines += ["-" * len(header), _row("total (worker seconds)", total)]
    return "\n".join(lines) + "\n"


def _row(name: str, v: Any) -> str:
    return (
        f"{name[:56]:56} {int(v['tests']):5d} {v['seconds']:7.0f} {int(v['engines']):7d} "
        f"{int(v['job']):4d} {int(v['serve']):5d} {int(v['py']):4d} {v['child']:7.0f} "
        f"{v['build']:7.0f} {v['warmup']:8.0f} {v['compile']:9.0f}"
    )


if __name__ == "__main__":
    print(summary(Path(sys.argv[1])), end="")
