"""The proxy's routing rules and its failure answers, with no vLLM server behind it."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
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


# --- bad input, upstream answers, health, models, API key, cool-down (fake instances) ------------
PREFILL, PREFILL_2, DECODE = "http://prefill-a:8100", "http://prefill-b:8100", "http://decode:8200"
KV_PARAMS = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1]}


class _Wire(httpx.AsyncByteStream):
    """An answer's body as it comes off a connection: streamed once (httpx's own responses built
    from content are already read, and the proxy streams the decode answer)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    async def __aiter__(self):
        yield self.data


def _answer(status: int, payload: dict) -> httpx.Response:
    body = json.dumps(payload).encode()
    return httpx.Response(status, headers={"content-type": "application/json"}, stream=_Wire(body))


class Instances:
    """Fake prefill and decode instances behind an httpx transport: each answers as configured
    and records what it was sent."""

    def __init__(self) -> None:
        self.seen: list[httpx.Request] = []
        self.down: set[str] = set()  # hosts that refuse connections
        self.answers: dict[str, tuple[int, dict]] = {}  # host -> (status, JSON) for completions

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        host = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if host in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/health":
            return _answer(200, {})
        if request.url.path == "/v1/models":
            return _answer(200, {"object": "list", "data": [{"id": "tiny"}]})
        if host in self.answers:
            status, payload = self.answers[host]
            return _answer(status, payload)
        if host == DECODE:
            return _answer(200, {"choices": [{"text": " world"}]})
        return _answer(200, {"choices": [], "kv_transfer_params": KV_PARAMS})

    def hosts(self, path: str) -> list[str]:
        return [f"http://{r.url.host}:{r.url.port}" for r in self.seen if r.url.path == path]


def proxy_client(instances: Instances, prefills=(PREFILL,), **kwargs) -> TestClient:
    app = proxy.build_app(
        list(prefills), [DECODE], timeout=5, transport=httpx.MockTransport(instances), **kwargs
    )
    return TestClient(app)


@pytest.mark.parametrize(
    ("body", "says"),
    [(b"", "empty"), (b"{not json", "not JSON"), (b'[{"prompt": "a"}]', "list, not an object")],
)
def test_a_body_that_is_not_a_json_object_gets_400_and_reaches_no_instance(body, says):
    instances = Instances()

    answer = proxy_client(instances).post("/v1/completions", content=body)

    assert answer.status_code == 400
    assert says in answer.json()["error"]["message"]
    assert instances.seen == []


def test_a_prefill_instances_own_4xx_reaches_the_client_as_is():
    instances = Instances()
    message = {"error": {"message": "maximum context length is 512 tokens", "code": 400}}
    instances.answers[PREFILL] = (400, message)

    answer = proxy_client(instances).post("/v1/completions", json={"prompt": "x" * 9000})

    assert answer.status_code == 400 and answer.json() == message
    assert instances.hosts("/v1/completions") == [PREFILL]  # no decode for a refused prompt


def test_a_decode_instances_own_4xx_reaches_the_client_as_is():
    instances = Instances()
    instances.answers[DECODE] = (422, {"error": {"message": "bad temperature"}})

    answer = proxy_client(instances).post("/v1/completions", json={"prompt": "hi"})

    assert answer.status_code == 422 and answer.json()["error"]["message"] == "bad temperature"


def test_a_completion_goes_through_prefill_then_decode_with_the_kv_params():
    instances = Instances()

    answer = proxy_client(instances).post("/v1/completions", json={"prompt": "hi"})

    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == " world"
    decode_request = next(r for r in instances.seen if r.url.host == "decode")
    assert json.loads(decode_request.content)["kv_transfer_params"] == KV_PARAMS


def test_health_is_503_with_each_instances_state_when_none_of_a_kind_answers():
    instances = Instances()
    instances.down = {PREFILL}

    answer = proxy_client(instances).get("/health")

    assert answer.status_code == 503
    assert answer.json()["prefill"][PREFILL].startswith("unreachable")
    assert answer.json()["decode"][DECODE] == "ok"


def test_health_is_200_when_a_prefill_and_a_decode_instance_answer():
    instances = Instances()
    instances.down = {PREFILL}

    answer = proxy_client(instances, prefills=(PREFILL, PREFILL_2)).get("/health")

    assert answer.status_code == 200, answer.json()
    assert answer.json()["prefill"][PREFILL_2] == "ok"


def test_models_come_from_a_decode_instance():
    answer = proxy_client(Instances()).get("/v1/models")

    assert answer.status_code == 200 and answer.json()["data"][0]["id"] == "tiny"


@pytest.mark.parametrize("header", [None, "Bearer wrong"])
def test_with_an_api_key_a_request_without_it_gets_401(header):
    instances = Instances()
    headers = {"Authorization": header} if header else {}
    client = proxy_client(instances, api_key="sekret")

    for answer in (
        client.post("/v1/completions", json={"prompt": "hi"}, headers=headers),
        client.get("/v1/models", headers=headers),
    ):
        assert answer.status_code == 401
        assert "Authorization: Bearer" in answer.json()["error"]["message"]
    assert instances.seen == []


def test_with_an_api_key_the_clients_header_goes_on_to_both_instances():
    instances = Instances()
    client = proxy_client(instances, api_key="sekret")

    answer = client.post(
        "/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer sekret"}
    )

    assert answer.status_code == 200
    assert [r.headers.get("authorization") for r in instances.seen] == ["Bearer sekret"] * 2


def test_a_prefill_instance_that_failed_sits_out_its_cool_down():
    instances = Instances()
    instances.down = {PREFILL}
    client = proxy_client(instances, prefills=(PREFILL, PREFILL_2))

    statuses = [client.post("/v1/completions", json={"prompt": "hi"}).status_code for _ in range(4)]

    # The first turn falls on the dead instance (502, naming it); then only the live one serves.
    assert statuses == [502, 200, 200, 200]
    assert instances.hosts("/v1/completions").count(PREFILL) == 1


def test_the_pool_tries_a_failed_instance_again_after_its_cool_down():
    now = [0.0]
    pool = proxy.Pool(["a", "b"], cooldown=10.0, clock=lambda: now[0])
    assert [pool.pick(), pool.pick()] == ["a", "b"]
    pool.failed("a")
    assert [pool.pick(), pool.pick()] == ["b", "b"]
    now[0] = 11.0
    assert {pool.pick(), pool.pick()} == {"a", "b"}
    pool.failed("a")
    pool.failed("b")  # every one cooling down: the one whose cool-down ends first is tried
    assert pool.pick() == "a"


def test_the_proxy_listens_on_this_machine_only_unless_told():
    import inspect

    from vllm_gaudi_platform import cli

    args = cli.build_parser().parse_args(["proxy", "--prefill", PREFILL, "--decode", DECODE])
    assert args.host == "127.0.0.1" and args.api_key is None
    assert inspect.signature(proxy.serve).parameters["host"].default == "127.0.0.1"
