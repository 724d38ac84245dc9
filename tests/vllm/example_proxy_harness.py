"""A metaserver that behaves like the existing example proxy, for rd2h tests.

It answers a rendezvous POST only once the Prefill dispatch that POST started has
finished, and every POST it receives starts a dispatch of its own (it recognises no
repeat). The dispatch here is a wait of ``dispatch_s`` seconds, short in tests but
longer than the client's per-attempt timeout, which is what a long prompt's prefill is
to the real proxy. A real aiohttp server on 127.0.0.1 (port chosen at run time) in its
own thread; ``handler_cancellation`` makes a client that closes its connection cancel
the handler, so a cancelled POST is observable here.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class Observed:
    """What the proxy saw, in arrival order (appended on the server's thread)."""

    posts: list[bytes] = field(default_factory=list)  # every body received
    dispatches: int = 0  # Prefill dispatches started (one per POST received)
    answered: int = 0  # answers sent
    cancelled: int = 0  # handlers cancelled because the client went away


class ExampleProxy:
    """``dispatch_s``: how long each dispatch takes before the answer goes out;
    ``answer_status``: the answer's HTTP status; ``drop_answer``: close the connection
    instead of answering once the dispatch is over."""

    def __init__(
        self, *, dispatch_s: float, answer_status: int = 200, drop_answer: bool = False
    ) -> None:
        self.dispatch_s = dispatch_s
        self.answer_status = answer_status
        self.drop_answer = drop_answer
        self.seen = Observed()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._runner: web.AppRunner | None = None
        port = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        self.url = f"http://127.0.0.1:{port}/v1/metaserver"

    async def _handle(self, request: web.Request) -> web.Response:
        self.seen.posts.append(await request.read())
        self.seen.dispatches += 1
        try:
            await asyncio.sleep(self.dispatch_s)
        except asyncio.CancelledError:
            self.seen.cancelled += 1
            raise
        if self.drop_answer:
            assert request.transport is not None
            request.transport.abort()
            return web.Response()
        self.seen.answered += 1
        return web.json_response({"dispatched": True}, status=self.answer_status)

    async def _start(self) -> int:
        app = web.Application()
        app.router.add_post("/v1/metaserver", self._handle)
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        sockets = site._server.sockets  # type: ignore[union-attr]
        return int(sockets[0].getsockname()[1])

    def __enter__(self) -> ExampleProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        assert self._runner is not None
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
