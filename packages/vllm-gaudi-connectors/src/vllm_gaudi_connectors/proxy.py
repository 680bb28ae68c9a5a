"""The 1P1D (or xPyD) proxy: one OpenAI-compatible endpoint in front of prefill and decode
instances that exchange KV blocks through HpuNixlConnector.

Each /v1/completions or /v1/chat/completions request goes first to a prefill instance, asked for
one token with `kv_transfer_params.do_remote_decode`, which computes the prompt's KV cache and
keeps its blocks for the decode side; then to a decode instance with the `kv_transfer_params` the
prefill answer returned, which pulls those blocks and generates the answer, streamed back as is.
Instances of each kind are used in turn (round robin). A failed or timed-out prefill or decode
gives the client an HTTP error (502/504), never a hang.

Uses only what vLLM's server already depends on (fastapi, uvicorn, httpx).
"""

# No `from __future__ import annotations`: FastAPI reads the route functions' annotations at run
# time, and `Request` is imported inside build_app (httpx and fastapi load only when serving).
import copy
import itertools
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

logger = logging.getLogger(f"vllm.{__name__}")

ROUTES = ("/v1/completions", "/v1/chat/completions")


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


def build_app(
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    timeout: float = 300.0,
    connect_timeout: float = 10.0,
) -> Any:
    """The proxy as a FastAPI app (tests and `serve` run it)."""
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    prefills = itertools.cycle(prefill_urls)
    decodes = itertools.cycle(decode_urls)
    limits = httpx.Timeout(timeout, connect=connect_timeout)
    app = FastAPI(title="vllm-gaudi proxy")
    state: dict[str, httpx.AsyncClient] = {}

    def client() -> httpx.AsyncClient:
        if "client" not in state:
            state["client"] = httpx.AsyncClient(timeout=limits)
        return state["client"]

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse(status_code=status, content={"error": {"message": message}})

    async def handle(route: str, request: Request) -> Response:
        body = await request.json()
        prefill_url, decode_url = next(prefills), next(decodes)
        try:
            answer = await client().post(prefill_url + route, json=prefill_request(body))
        except httpx.TimeoutException:
            return error(504, f"prefill instance {prefill_url} timed out after {timeout:g} s")
        except httpx.HTTPError as exc:
            return error(502, f"prefill instance {prefill_url} failed: {exc!r}")
        if answer.status_code != 200:
            return error(502, f"prefill instance {prefill_url}: {answer.status_code} {answer.text}")
        kv_params = answer.json().get("kv_transfer_params")
        if not kv_params:
            return error(
                502,
                f"prefill instance {prefill_url} returned no kv_transfer_params: is it started "
                'with --kv-transfer-config \'{"kv_connector": "HpuNixlConnector", '
                '"kv_role": "kv_producer", ...}\'?',
            )
        decode_body = dict(body)
        decode_body["kv_transfer_params"] = kv_params
        try:
            upstream = await client().send(
                client().build_request("POST", decode_url + route, json=decode_body), stream=True
            )
        except httpx.TimeoutException:
            return error(504, f"decode instance {decode_url} timed out after {timeout:g} s")
        except httpx.HTTPError as exc:
            return error(502, f"decode instance {decode_url} failed: {exc!r}")
        if upstream.status_code != 200:
            text = (await upstream.aread()).decode(errors="replace")
            await upstream.aclose()
            return error(502, f"decode instance {decode_url}: {upstream.status_code} {text}")

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

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"prefill": list(prefill_urls), "decode": list(decode_urls)}

    @app.on_event("shutdown")
    async def close() -> None:
        if "client" in state:
            await state["client"].aclose()

    return app


def serve(
    prefill: str,
    decode: str,
    port: int,
    host: str = "0.0.0.0",
    timeout: float = 300.0,
) -> int:
    """Run the proxy until interrupted (`vllm-gaudi proxy`)."""
    import uvicorn

    app = build_app(parse_urls(prefill, "--prefill"), parse_urls(decode, "--decode"), timeout)
    uvicorn.run(app, host=host, port=port, log_level="warning")
    return 0
