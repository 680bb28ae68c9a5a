"""The proxy's routing rules and its failure answers, with no vLLM server behind it."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from tests.connectors import cluster
from vllm_gaudi_connectors import proxy


def test_prefill_request_asks_for_one_token_kept_for_a_remote_decode():
    body = {"prompt": "hi", "max_tokens": 50, "stream": True, "stream_options": {}}

    req = proxy.prefill_request(body)

    assert req["max_tokens"] == 1 and req["stream"] is False and "stream_options" not in req
    assert req["kv_transfer_params"]["do_remote_decode"] is True
    assert body["max_tokens"] == 50  # the client's body is left for the decode request


def test_url_lists_are_split_on_commas_and_checked():
    assert proxy.parse_urls("http://a:1, http://b:2/", "--prefill") == ["http://a:1", "http://b:2"]
    with pytest.raises(ValueError, match="--decode"):
        proxy.parse_urls("localhost:8200", "--decode")
    with pytest.raises(ValueError, match="at least one URL"):
        proxy.parse_urls(" , ", "--prefill")


def test_unreachable_prefill_instance_gives_502_naming_it():
    dead = f"http://127.0.0.1:{cluster.free_port()}"
    client = TestClient(proxy.build_app([dead], [dead], timeout=5))

    answer = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})

    assert answer.status_code == 502
    assert dead in answer.json()["error"]["message"]


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A server that accepts connections and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(sock.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    sock.close()


def test_prefill_instance_that_never_answers_gives_504_after_the_timeout(silent_server):
    client = TestClient(proxy.build_app([silent_server], [silent_server], timeout=1.5))
    started = time.monotonic()

    answer = client.post("/v1/chat/completions", json={"messages": [], "max_tokens": 4})

    assert answer.status_code == 504
    assert "timed out" in answer.json()["error"]["message"]
    assert time.monotonic() - started < 10


def test_cli_names_the_wheel_to_install_when_connectors_are_absent(monkeypatch, capsys):
    import importlib.util

    from vllm_gaudi_platform import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "vllm_gaudi_connectors" else real(name, *a),
    )

    status = cli.main(["proxy", "--prefill", "http://a:1", "--decode", "http://b:2"])

    assert status == 2
    assert "pip install vllm-gaudi-connectors" in capsys.readouterr().err
