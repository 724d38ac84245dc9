"""Fake vLLM Prefill and Decode servers around a real proxy, all on 127.0.0.1.

The fakes speak the OpenAI subset the proxy relies on and behave like vLLM with the RD2H
connector, in miniature:

* Decode derives its child ids from X-Request-Id as vLLM does (``cmpl-<id>-<i>`` per
  prompt, ``chatcmpl-<id>``), gives each an internal id with vLLM's 9-character random
  suffix, posts one rendezvous per child to the metaserver URL it was handed (request_id
  = the EXTERNAL id), then waits until Prefill has "sent" every child's KV before it
  answers (JSON, or an SSE stream).
* Prefill derives the same child ids from its own X-Request-Id and body, picks each child's
  rendezvous out of kv_transfer_params (a missing entry is a 400, as in the reference), and
  marks that child's KV as sent.

Each server runs in its own AppRunner with handler_cancellation=True, so a dropped
connection cancels the handler the way vLLM aborts a request whose client has gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import secrets
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, ParamSpec

import aiohttp
from aiohttp import web

from rd2h_protocol.rendezvous import (
    MalformedRendezvous,
    Rendezvous,
    encode_rendezvous,
    params_for_child,
)
from rd2h_protocol.topology import external_request_id
from rd2h_proxy import ProxyConfig, create_app
from rd2h_proxy.config import Backend
from rd2h_proxy.server import ProxyServer
from rd2h_proxy.serving import SERVER_KEY, start

TEST_TIMEOUT_S = 9.0  # every test must finish in under 10 s
HOST = "127.0.0.1"

P = ParamSpec("P")


def async_test(fn: Callable[P, Awaitable[None]]) -> Callable[P, None]:
    """Run an async test on a fresh loop, bounded by TEST_TIMEOUT_S."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> None:
        async def bounded() -> None:
            await asyncio.wait_for(fn(*args, **kwargs), TEST_TIMEOUT_S)

        asyncio.run(bounded())

    return wrapper


def bound_socket() -> socket.socket:
    """A listening TCP socket on 127.0.0.1 with a port chosen by the kernel."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((HOST, 0))
    sock.listen(128)
    sock.setblocking(False)
    return sock


def closed_port() -> int:
    """A port on 127.0.0.1 that nobody listens on (connecting is refused)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
    return port


async def start_runner(app: web.Application, sock: socket.socket) -> web.AppRunner:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    return runner


def vllm_child_ids(path: str, request_id: str, body: dict[str, Any]) -> list[str]:
    """Child ids as vLLM's OpenAI server names them (before the engine's suffix)."""
    if path.endswith("/chat/completions"):
        return [f"chatcmpl-{request_id}"]
    prompt = body["prompt"]
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [f"cmpl-{request_id}-0"]
    return [f"cmpl-{request_id}-{i}" for i in range(len(prompt))]


@dataclass
class Call:
    """One request a fake server received."""

    node: int
    path: str
    request_id: str
    body: dict[str, Any]
    headers: dict[str, str]


@dataclass
class Cluster:
    """Shared state and knobs of the fakes, plus the proxy under test."""

    proxy_url: str = ""
    client: aiohttp.ClientSession | None = None
    app: web.Application | None = None
    # knobs
    prefill_status: int = 200
    prefill_delay_s: float = 0.0
    prefill_gate: asyncio.Event | None = None  # Prefill waits on it after "sending" the KV
    decode_kv_timeout_s: float = 5.0
    decode_posts_per_child: int = 1
    decode_posts: bool = True
    decode_error: tuple[int, str] | None = None
    decode_crash: bool = False  # Decode drops the connection instead of answering
    decode_hold: asyncio.Event | None = None  # Decode waits on it before answering
    stream_gate: asyncio.Event | None = None  # streaming Decode waits after its first event
    stream_headers_early: bool = False  # streaming Decode sends headers before waiting for KV
    reset_status: dict[str, int] = field(default_factory=dict)  # url -> status
    cached_tokens: int = 0
    # observations
    prefill_calls: list[Call] = field(default_factory=list)
    decode_calls: list[Call] = field(default_factory=list)
    decode_aborted: list[str] = field(default_factory=list)
    decode_holding: int = 0  # Decode requests waiting on decode_hold right now
    decode_in_flight: dict[int, int] = field(default_factory=dict)
    metaserver_answers: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    delivered: dict[str, Rendezvous] = field(default_factory=dict)
    resets: list[str] = field(default_factory=list)
    _kv: dict[str, asyncio.Event] = field(default_factory=dict)

    def kv_event(self, external_id: str) -> asyncio.Event:
        return self._kv.setdefault(external_id, asyncio.Event())

    @property
    def server(self) -> ProxyServer:
        assert self.app is not None
        return self.app[SERVER_KEY]

    @property
    def http(self) -> aiohttp.ClientSession:
        assert self.client is not None
        return self.client

    async def post(
        self, path: str, body: Any, request_id: str | None = None
    ) -> aiohttp.ClientResponse:
        headers = {"X-Request-Id": request_id} if request_id else {}
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        return await self.http.post(self.proxy_url + path, data=data, headers=headers)

    async def complete(
        self, path: str, body: Any, request_id: str | None = None
    ) -> tuple[int, Any]:
        async with await self.post(path, body, request_id) as resp:
            text = await resp.text()
            try:
                return resp.status, json.loads(text)
            except json.JSONDecodeError:
                return resp.status, text

    async def until(self, condition: Callable[[], bool], timeout: float = 3.0) -> None:
        """Wait until ``condition()`` holds (things the other side does asynchronously)."""
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"condition not reached within {timeout} s")
            await asyncio.sleep(0.01)

    async def wait_idle(self, timeout: float = 3.0) -> None:
        """Wait until the proxy holds no per-request state at all."""
        deadline = time.monotonic() + timeout
        while not self.server.idle:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"proxy not idle: {len(self.server.registry)} parents, "
                    f"{self.server.registry.child_count} children, "
                    f"{len(self.server._tasks)} tasks"
                )
            await asyncio.sleep(0.01)

    # -- fake Prefill ------------------------------------------------------------------------

    def prefill_app(self, node: int) -> web.Application:
        async def generate(request: web.Request) -> web.Response:
            body = await request.json()
            rid = request.headers.get("X-Request-Id", "")
            self.prefill_calls.append(Call(node, request.path, rid, body, dict(request.headers)))
            if self.prefill_delay_s:
                await asyncio.sleep(self.prefill_delay_s)
            if self.prefill_status != 200 and self.prefill_gate is None:
                return web.json_response({"error": "prefill exploded"}, status=self.prefill_status)
            if body.get("max_tokens") != 1 or body.get("stream") is not False:
                return web.json_response({"error": "not a prefill request"}, status=400)
            params = body.get("kv_transfer_params") or {}
            try:
                picked = {
                    c: params_for_child(params, c) for c in vllm_child_ids(request.path, rid, body)
                }
            except MalformedRendezvous as exc:
                return web.json_response({"error": str(exc)}, status=400)
            for child, rendezvous in picked.items():
                self.delivered[child] = rendezvous
                self.kv_event(child).set()  # "all layers sent"
            if self.prefill_gate is not None:
                await self.prefill_gate.wait()
                if self.prefill_status != 200:  # failing only after the KV went out
                    return web.json_response({"error": "late failure"}, status=self.prefill_status)
            return web.json_response({"id": rid, "choices": [{"index": 0, "text": "P"}]})

        async def reset(request: web.Request) -> web.Response:
            url = f"http://{request.host}"
            self.resets.append(url)
            status = self.reset_status.get(url, 200)
            return web.Response(status=status, text="reset" if status == 200 else "nope")

        app = web.Application()
        app.router.add_post("/v1/completions", generate)
        app.router.add_post("/v1/chat/completions", generate)
        app.router.add_post("/reset_prefix_cache", reset)
        return app

    # -- fake Decode -------------------------------------------------------------------------

    def decode_app(self, node: int) -> web.Application:
        async def post_rendezvous(url: str, rendezvous: Rendezvous) -> int:
            status = 0
            for _ in range(self.decode_posts_per_child):
                async with self.http.post(
                    url,
                    data=encode_rendezvous(rendezvous),
                    headers={"Content-Type": "application/json"},
                ) as resp:
                    status = resp.status
                    self.metaserver_answers.append((status, await resp.json()))
            return status

        async def generate(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            rid = request.headers.get("X-Request-Id", "")
            self.decode_calls.append(Call(node, request.path, rid, body, dict(request.headers)))
            self.decode_in_flight[node] = self.decode_in_flight.get(node, 0) + 1
            try:
                return await serve(request, body, rid)
            except asyncio.CancelledError:
                self.decode_aborted.append(rid)  # vLLM aborts a request whose client left
                raise
            finally:
                self.decode_in_flight[node] -= 1

        async def serve(request: web.Request, body: dict[str, Any], rid: str) -> web.StreamResponse:
            if self.decode_error is not None:
                status, text = self.decode_error
                return web.json_response({"error": text}, status=status)
            params = body["kv_transfer_params"]
            assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
            children = vllm_child_ids(request.path, rid, body)
            stream: web.StreamResponse | None = None
            if body.get("stream") and self.stream_headers_early:
                stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await stream.prepare(request)
                await stream.write(b"")  # push the headers out now
            if self.decode_posts:
                for child in children:
                    internal = f"{child}-{secrets.token_hex(4)}"  # vLLM's engine suffix
                    rendezvous = Rendezvous(
                        request_id=external_request_id(internal),
                        remote_engine_id=f"decode-engine-{node}",
                        remote_host=HOST,
                        remote_port=30000 + 16 * node,
                        remote_tp_size=2,
                        remote_cached_tokens=self.cached_tokens,
                    )
                    status = await post_rendezvous(params["metaserver"], rendezvous)
                    if status != 200:
                        return web.json_response({"error": f"metaserver {status}"}, status=500)
            try:
                await asyncio.wait_for(
                    asyncio.gather(*(self.kv_event(c).wait() for c in children)),
                    self.decode_kv_timeout_s,
                )
            except asyncio.TimeoutError:
                if stream is not None:
                    await stream.write(b'data: {"error": "kv load timeout"}\n\n')
                    return stream
                return web.json_response({"error": "kv load timeout"}, status=500)
            if self.decode_crash:
                assert request.transport is not None
                request.transport.abort()  # the connection drops mid-exchange
                return web.Response()
            if self.decode_hold is not None:
                self.decode_holding += 1
                try:
                    await self.decode_hold.wait()
                finally:
                    self.decode_holding -= 1
            texts = [f"decoded:{c}" for c in children]
            if not body.get("stream"):
                choices = [{"index": i, "text": t} for i, t in enumerate(texts)]
                return web.json_response({"id": rid, "node": node, "choices": choices})
            if stream is None:
                stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await stream.prepare(request)
            for i, text in enumerate(texts):
                event = {"id": rid, "choices": [{"index": i, "text": text}]}
                await stream.write(f"data: {json.dumps(event)}\n\n".encode())
                if i == 0 and self.stream_gate is not None:
                    await self.stream_gate.wait()
                await asyncio.sleep(0.005)
            await stream.write(b"data: [DONE]\n\n")
            await stream.write_eof()
            return stream

        async def reset(request: web.Request) -> web.Response:
            url = f"http://{request.host}"
            self.resets.append(url)
            status = self.reset_status.get(url, 200)
            return web.Response(status=status, text="reset" if status == 200 else "nope")

        app = web.Application()
        app.router.add_post("/v1/completions", generate)
        app.router.add_post("/v1/chat/completions", generate)
        app.router.add_post("/reset_prefix_cache", reset)
        return app


@contextlib.asynccontextmanager
async def cluster(
    n_prefill: int = 1,
    n_decode: int = 1,
    extra_decoders: tuple[Backend, ...] = (),
    extra_prefillers: tuple[Backend, ...] = (),
    **proxy_options: Any,
) -> AsyncIterator[Cluster]:
    """Start ``n_prefill`` + ``n_decode`` fakes and a proxy in front of them."""
    c = Cluster()
    runners: list[web.AppRunner] = []
    prefillers: list[Backend] = list(extra_prefillers)
    decoders: list[Backend] = list(extra_decoders)
    try:
        for i in range(n_prefill):
            sock = bound_socket()
            runners.append(await start_runner(c.prefill_app(i), sock))
            prefillers.append(Backend(HOST, sock.getsockname()[1]))
        for i in range(n_decode):
            sock = bound_socket()
            runners.append(await start_runner(c.decode_app(i), sock))
            decoders.append(Backend(HOST, sock.getsockname()[1]))
        sock = bound_socket()
        options: dict[str, Any] = {"connect_timeout_s": 2.0, **proxy_options}
        config = ProxyConfig(
            host=HOST,
            port=sock.getsockname()[1],
            prefillers=tuple(prefillers),
            decoders=tuple(decoders),
            **options,
        )
        c.app = create_app(config)
        runners.insert(0, await start(c.app, sock=sock))  # as `rd2h proxy` serves it
        c.proxy_url = f"http://{HOST}:{config.port}"
        c.client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TEST_TIMEOUT_S))
        yield c
    finally:
        if c.client is not None:
            await c.client.close()
        for runner in runners:
            await runner.cleanup()
