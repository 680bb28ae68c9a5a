"""A preloaded interpreter that forks the suite's job processes.

Every job script (`tests/**/*_job.py`) runs in a process of its own, and each one spent most of
its CPU time importing torch, transformers and the libraries vLLM imports (about 12 of 16
CPU-seconds on a 2-core machine, with every module byte-compiled). Here one interpreter per test
worker imports those libraries once and forks a child per job; the child takes the job's
environment, working directory, arguments and standard streams, and runs the script as
`python script args` does. vLLM, its plugins and this project's code are not imported before
the fork: the child imports them as a fresh interpreter would, so platform selection, plugin
loading and every environment variable they read happen in the job, under the job's own
environment.

The libraries imported ahead read their own environment variables when they are imported
(TORCH_*, HF_*, OMP_*, PYTHONPATH, ...), so a job is forked only when its environment equals the
preloaded interpreter's in everything but the variables that only vLLM and this project read
(VLLM_*, PT_HPU_*, and pytest's PYTEST_*, which names each test); `for_env()` starts one for
the first two environments a test process asks for and refuses others, which start a fresh
interpreter as before. TEST_ZYGOTE=0 turns it off.

`python -c code` runs the same way (`run_python` in tests/conftest.py, unless a test asks for a
fresh interpreter: one that checks what is imported at start, say).

Run alone: `python tests/zygote.py SOCKET` serves until SIGTERM. The protocol (one connection
per job): the client sends a JSON header `{"argv", "env", "cwd"}` with its stdin, stdout and
stderr as file descriptors; the server answers `{"pid": N}`, then `{"returncode": N}` when the
child exits (negative: the signal that ended it), and closes the connection.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

# Imported before any fork: what vLLM's own import pulls in that does not read VLLM_* (measured
# with the HPU platform in emulation). Modules that start threads when imported (cv2, grpc) and
# torchvision (this project's import hook patches it, see torchvision_schemas.py) are left to
# the child.
PRELOAD = (
    "torch",
    "torch._dynamo",
    "torch._inductor.lowering",
    "torch._inductor.standalone_compile",
    "torch.export",
    "sympy",
    "numpy",
    "transformers",
    "transformers.modeling_utils",
    "safetensors",
    "tokenizers",
    "huggingface_hub",
    "pydantic",
    "fastapi",
    "openai",
    "aiohttp",
    "requests",
    "msgspec",
    "zmq",
    "cbor2",
    "blake3",
)
# Set by vllm/env_override.py before torch's compiler modules read them; a preloaded torch must
# have read the same values.
VLLM_TORCH_SETTINGS = {"TORCHINDUCTOR_COMPILE_THREADS": "1", "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
# Read only by vLLM and this project's packages, which the child imports after the fork, and by
# pytest (PYTEST_CURRENT_TEST names each test: the same preloaded interpreter serves them all).
CHILD_ONLY_PREFIXES = ("VLLM_", "PT_HPU_", "PYTEST_")
START_TIMEOUT_S = 300


def fingerprint(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """What of `env` the preloaded libraries may have read: all but the child-only variables."""
    return tuple(sorted((k, v) for k, v in env.items() if not k.startswith(CHILD_ONLY_PREFIXES)))


# ----------------------------------------------------------------------------- the server


def _serve(path: str) -> dict[str, Any]:
    """Preload, listen on `path`, fork a child per job. Returns only in a child: its job."""
    import importlib

    os.environ.update(VLLM_TORCH_SETTINGS)
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as exc:  # a missing optional library is the child's to import (or not)
            print(f"zygote: not preloaded: {name}: {exc}", file=sys.stderr, flush=True)
    for name in VLLM_TORCH_SETTINGS:  # the child's environment is the job's, set in _become
        os.environ.pop(name)
    threads = len(os.listdir("/proc/self/task"))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    children: dict[int, socket.socket] = {}
    parent = os.getppid()
    import select

    while True:
        ready, _, _ = select.select([listener, wake_r], [], [], 5)
        if os.getppid() != parent:  # the test process is gone: so is the need for this one
            sys.exit(0)
        if wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 512)
            _reap(children)
        if listener not in ready:
            continue
        conn, _ = listener.accept()
        try:
            header, fds = _receive(conn)
        except (OSError, ValueError) as exc:
            print(f"zygote: bad request: {exc}", file=sys.stderr, flush=True)
            conn.close()
            continue
        # A fork copies only this thread: refuse if anything started another since the preload
        # (its locks would stay held in the child). torch's import leaves one native thread,
        # which may have ended since.
        now = len(os.listdir("/proc/self/task"))
        if now > threads:
            _send(conn, {"error": f"{now} threads in the preloaded interpreter, {threads} first"})
            conn.close()
            for fd in fds:
                os.close(fd)
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            for handled in (signal.SIGCHLD, signal.SIGTERM):
                signal.signal(handled, signal.SIG_DFL)
            for s in (listener, *children.values()):
                s.close()
            os.close(wake_r)
            os.close(wake_w)
            _send(conn, {"pid": os.getpid()})
            conn.close()
            return {**header, "fds": fds}
        for fd in fds:
            os.close(fd)
        children[pid] = conn
        _reap(children)  # a child that ended before its entry existed


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                _send(conn, {"returncode": os.waitstatus_to_exitcode(status)})
            conn.close()


def _send(conn: socket.socket, message: dict[str, Any]) -> None:
    conn.sendall(json.dumps(message).encode() + b"\n")


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    size = int.from_bytes(conn.recv(8), "big")
    data, fds, _, _ = socket.recv_fds(conn, size, 3)
    while len(data) < size:
        more = conn.recv(size - len(data))
        if not more:
            raise ValueError("truncated header")
        data += more
    if len(fds) != 3:
        raise ValueError(f"{len(fds)} file descriptors, expected 3")
    return json.loads(data), list(fds)


def _become(job: dict[str, Any]) -> tuple[str, str | None]:
    """Turn this forked child into `python script args` (or `python -c code args`) under the
    job's environment; returns the script's path, or "-c" and the code."""
    import random

    for target, fd in enumerate(job["fds"]):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(job["env"])
    os.chdir(job["cwd"])
    argv = job["argv"]
    if argv[1] == "-c":  # as the interpreter sets them for -c: argv[0] "-c", the cwd first
        target, code = "-c", argv[2]
        sys.argv = ["-c", *argv[3:]]
        sys.path[0] = ""
    else:
        target, code = os.path.abspath(argv[1]), None
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.path.dirname(target)
    random.seed()  # a fresh interpreter's seed, not the zygote's
    with contextlib.suppress(ImportError):
        import numpy

        numpy.random.seed()
    return target, code


# ----------------------------------------------------------------------------- the client


class Zygote:
    """One preloaded interpreter, started by `start` and ended by `stop`."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.dir = tempfile.mkdtemp(prefix="zygote-")
        self.path = os.path.join(self.dir, "socket")
        self.log = os.path.join(self.dir, "log")
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), self.path],
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_ready(self) -> bool:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            if os.path.exists(self.path):
                return True
            time.sleep(0.2)
        return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def run(
        self, argv: Sequence[str], env: Mapping[str, str], timeout: float | None
    ) -> subprocess.CompletedProcess[str] | None:
        """`subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)`, the
        child forked from this interpreter; None if it could not take the job."""
        header = json.dumps({"argv": list(argv), "env": dict(env), "cwd": os.getcwd()}).encode()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with open(os.devnull, "rb") as stdin:
                conn.connect(self.path)
                conn.sendall(len(header).to_bytes(8, "big"))
                socket.send_fds(conn, [header], [stdin.fileno(), out_w, err_w])
        except OSError:
            for fd in (out_r, out_w, err_r, err_w):
                os.close(fd)
            conn.close()
            return None
        finally:
            if conn.fileno() >= 0:
                for fd in (out_w, err_w):
                    with contextlib.suppress(OSError):
                        os.close(fd)
        replies = conn.makefile("r")
        first = json.loads(replies.readline() or '{"error": "no answer"}')
        if "pid" not in first:
            conn.close()
            for fd in (out_r, err_r):
                os.close(fd)
            return None
        pid = first["pid"]
        streams: dict[int, bytes] = {}
        readers = [
            threading.Thread(target=_drain, args=(fd, streams), daemon=True)
            for fd in (out_r, err_r)
        ]
        for reader in readers:
            reader.start()
        code: list[int] = []
        waiter = threading.Thread(target=lambda: code.append(_returncode(replies)), daemon=True)
        waiter.start()
        waiter.join(timeout)
        if waiter.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            waiter.join(30)
            for reader in readers:
                reader.join(5)
            conn.close()
            out, err = _texts(streams, out_r, err_r)
            raise subprocess.TimeoutExpired(list(argv), timeout or 0, out, err)
        for reader in readers:
            reader.join()
        conn.close()
        return subprocess.CompletedProcess(list(argv), code[0], *_texts(streams, out_r, err_r))


def _drain(fd: int, into: dict[int, bytes]) -> None:
    chunks = []
    with open(fd, "rb", closefd=True) as stream:
        while chunk := stream.read1(1 << 16):
            chunks.append(chunk)
    into[fd] = b"".join(chunks)


def _returncode(replies: Any) -> int:
    line = replies.readline()
    if not line:
        return -signal.SIGKILL  # the zygote itself went away
    return int(json.loads(line)["returncode"])


def _texts(streams: dict[int, bytes], *fds: int) -> tuple[str, str]:
    """As subprocess's text mode decodes them: the locale's encoding, universal newlines."""
    import locale

    encoding = locale.getpreferredencoding(False)
    texts = [
        streams.get(fd, b"").decode(encoding, errors="replace").replace("\r\n", "\n") for fd in fds
    ]
    return texts[0].replace("\r", "\n"), texts[1].replace("\r", "\n")


_LOCK = threading.Lock()
_ZYGOTES: dict[tuple[tuple[str, str], ...], Zygote | None] = {}
MAX_ZYGOTES = 2  # per test process; other environments start fresh interpreters


def for_env(env: Mapping[str, str]) -> Zygote | None:
    """The preloaded interpreter for a job under `env`, started on first use; None if the job
    must start a fresh interpreter (TEST_ZYGOTE=0 always does)."""
    if os.environ.get("TEST_ZYGOTE", "1") == "0":
        return None
    key = fingerprint(env)
    with _LOCK:
        if key not in _ZYGOTES:
            if len(_ZYGOTES) >= MAX_ZYGOTES:
                return None
            zygote = Zygote(dict(key))
            _ZYGOTES[key] = zygote if zygote.wait_ready() else None
            if _ZYGOTES[key] is None:
                zygote.stop()
        return _ZYGOTES[key]


def run(
    argv: Sequence[str], env: Mapping[str, str], timeout: float | None
) -> subprocess.CompletedProcess[str] | None:
    """`argv` (`python script args` or `python -c code args`) forked from the preloaded
    interpreter for `env`, with the cost markers checked as for any child; None where it must
    start fresh (the caller then starts it)."""
    from tests import costs

    child = costs.Child(list(argv))  # the markers are checked before any interpreter starts
    preloaded = for_env(env)
    proc = None
    if preloaded is not None:
        try:
            proc = preloaded.run(argv, env, timeout)
        except subprocess.TimeoutExpired as timed_out:
            child.ended(timed_out.stdout, timed_out.stderr)
            raise
    if proc is None:
        child.discard()  # refused or none for this environment: started fresh by the caller
        return None
    child.ended(proc.stdout, proc.stderr)
    return proc


def stop_all() -> None:
    with _LOCK:
        for zygote in _ZYGOTES.values():
            if zygote is not None:
                zygote.stop()
        _ZYGOTES.clear()


if __name__ == "__main__":
    _job = _serve(sys.argv[1])  # returns only in a forked child
    _script, _code = _become(_job)
    del _job
    if _code is None:
        import runpy

        runpy.run_path(_script, run_name="__main__")
    else:
        import types

        _main = types.ModuleType("__main__")
        sys.modules["__main__"] = _main
        exec(compile(_code, "<string>", "exec"), _main.__dict__)
