"""The 1P1D (or xPyD) proxy: one OpenAI-compatible endpoint in front of prefill and decode
instances that exchange KV blocks through HpuNixlConnector.

Each /v1/completions or /v1/chat/completions request goes first to a prefill instance, asked for
one token with `kv_transfer_params.do_remote_decode`, which computes the prompt's KV cache and
keeps its blocks for the decode side; then to a decode instance with the `kv_transfer_params` the
prefill answer returned, which pulls those blocks and generates the answer, streamed back as is.
Instances of each kind are used in turn (round robin); one that could not be reached, timed out
or failed (5xx) sits out a cool-down, while the others take its turns.

What a client gets back:
- a body that is not a JSON object: 400, naming what was wrong;
- an instance's own 4xx (a prompt past max_model_len, a bad parameter): that status and the
  instance's message, as is (the client's mistake, not an outage);
- an instance that cannot be reached or fails: 502; one that does not answer in time: 504;
- with an API key (`--api-key`, or VLLM_API_KEY as for `vllm serve`): 401 without
  `Authorization: Bearer <key>`; the client's Authorization header goes on to the instances.
`GET /health` probes every instance: 200 when at least one prefill and one decode instance
answer, else 503, each instance's state in the body. `GET /v1/models` is a decode instance's.

vLLM's own router (`vllm-router`) does the same for fleets; this proxy needs nothing beyond what
vLLM's server already depends on (fastapi, uvicorn, httpx).
"""

# No `from __future__ import annotations`: FastAPI reads the route functions' annotations at run
# time, and `Request` is imported inside build_app (httpx and fastapi load only when serving).
import asyncio
import copy
import json
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

logger = logging.getLogger(f"vllm.{__name__}")

ROUTES = ("/v1/completions", "/v1/chat/completions")
COOLDOWN_S = 10.0  # how long an instance that failed is skipped while others can serve
HEALTH_TIMEOUT_S = 2.0


def parse_urls(value: str, flag: str) -> list[str]:
    """Split a comma-separated URL list; refuse an empty one or one without http(s)://."""
    urls = [u.strip().rstrip("/") for u in value.split(",") if u.strip()]
    if not urls:
        raise ValueError(f"{flag} needs at least one URL, e.g. {flag} http://localhost:8100")
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{flag}: {url!r} is not a URL; write it as http://HOST:PORT")
    return urls


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill instance's request: one token, no streaming, KV kept for a remote decode."""
    req = copy.deepcopy(body)
    req["max_tokens"] = 1
    if "max_completion_tokens" in req:
        req["max_completion_tokens"] = 1
    req["stream"] = False
    req.pop("stream_options", None)
    req["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    return req


def parse_body(raw: bytes) -> dict[str, Any] | str:
    """The request's JSON object, or why it is not one (the 400's message)."""
    if not raw.strip():
        return 'the request body is empty: send a JSON object, e.g. {"prompt": ..., ...}'
    try:
        body = json.loads(raw)
    except ValueError as exc:
        return f"the request body is not JSON ({exc}): send a JSON object"
    if not isinstance(body, dict):
        return f"the request body is a JSON {type(body).__name__}, not an object: send one request"
    return body


class Pool:
    """The instances of one kind, used in turn. One that failed sits out `cooldown` seconds while
    another can serve; when every one is cooling down, the one whose cool-down ends first is
    tried (a request is never refused without trying an instance)."""

    def __init__(
        self, urls: Sequence[str], cooldown: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.urls = list(urls)
        self.cooldown = cooldown
        self.clock = clock
        self.next = 0
        self.cooling: dict[str, float] = {}  # url -> end of its cool-down

    def pick(self) -> str:
        now = self.clock()
        for offset in range(len(self.urls)):
            url = self.urls[(self.next + offset) % len(self.urls)]
            if self.cooling.get(url, 0.0) <= now:
                self.next = (self.next + offset + 1) % len(self.urls)
                return url
        return min(self.urls, key=lambda u: self.cooling[u])

    def failed(self, url: str) -> None:
        self.cooling[url] = self.clock() + self.cooldown

    def served(self, url: str) -> None:
        self.cooling.pop(url, None)


def build_app(
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    timeout: float = 300.0,
    connect_timeout: float = 10.0,
    *,
    api_key: str | None = None,
    cooldown: float = COOLDOWN_S,
    transport: Any = None,
) -> Any:
    """The proxy as a FastAPI app (tests and `serve` run it; `transport`: httpx's, for tests)."""
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    prefills, decodes = Pool(prefill_urls, cooldown), Pool(decode_urls, cooldown)
    limits = httpx.Timeout(timeout, connect=connect_timeout)
    app = FastAPI(title="vllm-gaudi proxy")
    state: dict[str, httpx.AsyncClient] = {}

    def client() -> httpx.AsyncClient:
        if "client" not in state:
            state["client"] = httpx.AsyncClient(timeout=limits, transport=transport)
        return state["client"]

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse(status_code=status, content={"error": {"message": message}})

    def refused(request: Request) -> JSONResponse | None:
        """401 unless the request carries the proxy's API key (when it has one)."""
        if api_key is None:
            return None
        given = request.headers.get("authorization", "")
        if secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            return None
        return error(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'")

    def forwarded(request: Request) -> dict[str, str]:
        auth = request.headers.get("authorization")
        return {"Authorization": auth} if auth else {}

    def passed_on(status: int, content: bytes, media_type: str | None) -> Response:
        return Response(content=content, status_code=status, media_type=media_type)

    async def prefill(route: str, body: dict, headers: dict) -> tuple[dict | None, Response | None]:
        url = prefills.pick()
        try:
            answer = await client().post(url + route, json=prefill_request(body), headers=headers)
        except httpx.TimeoutException:
            prefills.failed(url)
            return None, error(504, f"prefill instance {url} timed out after {timeout:g} s")
        except httpx.HTTPError as exc:
            prefills.failed(url)
            return None, error(502, f"prefill instance {url} failed: {exc!r}")
        if 400 <= answer.status_code < 500:  # the request's fault: the instance's own answer
            prefills.served(url)
            return None, passed_on(
                answer.status_code, answer.content, answer.headers.get("content-type")
            )
        if answer.status_code != 200:
            prefills.failed(url)
            return None, error(502, f"prefill instance {url}: {answer.status_code} {answer.text}")
        prefills.served(url)
        kv_params = answer.json().get("kv_transfer_params")
        if not kv_params:
            return None, error(
                502,
                f"prefill instance {url} returned no kv_transfer_params: is it started "
                'with --kv-transfer-config \'{"kv_connector": "HpuNixlConnector", '
                '"kv_role": "kv_producer", ...}\'?',
            )
        return kv_params, None

    async def handle(route: str, request: Request) -> Response:
        denied = refused(request)
        if denied is not None:
            return denied
        body = parse_body(await request.body())
        if isinstance(body, str):
            return error(400, body)
        headers = forwarded(request)
        kv_params, failure = await prefill(route, body, headers)
        if failure is not None:
            return failure
        decode_url = decodes.pick()
        decode_body = dict(body)
        decode_body["kv_transfer_params"] = kv_params
        try:
            request_out = client().build_request(
                "POST", decode_url + route, json=decode_body, headers=headers
            )
            upstream = await client().send(request_out, stream=True)
        except httpx.TimeoutException:
            decodes.failed(decode_url)
            return error(504, f"decode instance {decode_url} timed out after {timeout:g} s")
        except httpx.HTTPError as exc:
            decodes.failed(decode_url)
            return error(502, f"decode instance {decode_url} failed: {exc!r}")
        if upstream.status_code != 200:
            content = await upstream.aread()
            await upstream.aclose()
            if 400 <= upstream.status_code < 500:
                decodes.served(decode_url)
                return passed_on(
                    upstream.status_code, content, upstream.headers.get("content-type")
                )
            decodes.failed(decode_url)
            text = content.decode(errors="replace")
            return error(502, f"decode instance {decode_url}: {upstream.status_code} {text}")
        decodes.served(decode_url)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            except httpx.HTTPError as exc:
                # Headers are sent: the client sees a truncated body and this log line.
                logger.error("decode instance %s failed mid-answer: %r", decode_url, exc)
            finally:
                await upstream.aclose()

        return StreamingResponse(
            relay(),
            status_code=200,
            media_type=upstream.headers.get("content-type", "application/json"),
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        denied = refused(request)
        if denied is not None:
            return denied
        url = decodes.pick()
        try:
            answer = await client().get(url + "/v1/models", headers=forwarded(request))
        except httpx.HTTPError as exc:
            decodes.failed(url)
            return error(502, f"decode instance {url} failed: {exc!r}")
        return passed_on(answer.status_code, answer.content, answer.headers.get("content-type"))

    async def probe(url: str) -> str:
        try:
            answer = await client().get(url + "/health", timeout=HEALTH_TIMEOUT_S)
        except httpx.HTTPError as exc:
            return f"unreachable: {type(exc).__name__}"
        return "ok" if answer.status_code == 200 else f"unhealthy: {answer.status_code}"

    @app.get("/health")
    async def health() -> JSONResponse:
        urls = [*prefill_urls, *decode_urls]
        states = dict(zip(urls, await asyncio.gather(*(probe(u) for u in urls)), strict=True))
        report = {
            "prefill": {u: states[u] for u in prefill_urls},
            "decode": {u: states[u] for u in decode_urls},
        }
        ready = all(any(s == "ok" for s in kind.values()) for kind in report.values())
        return JSONResponse(status_code=200 if ready else 503, content=report)

    @app.on_event("shutdown")
    async def close() -> None:
        if "client" in state:
            await state["client"].aclose()

    return app


def serve(
    prefill: str,
    decode: str,
    port: int,
    host: str = "127.0.0.1",
    timeout: float = 300.0,
    api_key: str | None = None,
) -> int:
    """Run the proxy until interrupted (`vllm-gaudi proxy`). The API key defaults to
    VLLM_API_KEY, as `vllm serve`'s does."""
    import uvicorn

    key = api_key or os.environ.get("VLLM_API_KEY") or None
    app = build_app(
        parse_urls(prefill, "--prefill"), parse_urls(decode, "--decode"), timeout, api_key=key
    )
    uvicorn.run(app, host=host, port=port, log_level="warning")
    return 0
