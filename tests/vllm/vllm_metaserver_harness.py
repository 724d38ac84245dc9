"""A real aiohttp metaserver on 127.0.0.1 (port chosen at run time) for rd2h tests."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class Script:
    """What the server answers: one entry per request (the last one repeats).

    An int is an HTTP status; ``"hang"`` answers nothing for 30 s (a stalled proxy).
    """

    replies: list[int | str] = field(default_factory=lambda: [200])
    bodies: list[bytes] = field(default_factory=list)
    times: list[float] = field(default_factory=list)


class MetaServer:
    """A real aiohttp metaserver in its own thread and loop."""

    def __init__(self) -> None:
        self.script = Script()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._runner: web.AppRunner | None = None
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        self.url = f"http://127.0.0.1:{self.port}/v1/metaserver"

    async def _handle(self, request: web.Request) -> web.Response:
        script = self.script
        script.bodies.append(await request.read())
        script.times.append(time.monotonic())
        index = min(len(script.bodies), len(script.replies)) - 1
        reply = script.replies[index]
        if reply == "hang":
            await asyncio.sleep(30)
            return web.Response(status=200)
        assert isinstance(reply, int)
        return web.json_response({"status": "recorded" if reply < 400 else "error"}, status=reply)

    async def _start(self) -> int:
        app = web.Application()
        app.router.add_post("/v1/metaserver", self._handle)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        sockets = site._server.sockets  # type: ignore[union-attr]
        return int(sockets[0].getsockname()[1])

    async def _stop(self) -> None:
        assert self._runner is not None
        await self._runner.cleanup()
        # Handlers still "hanging" would be destroyed pending: cancel them properly.
        current = asyncio.current_task()
        pending = [task for task in asyncio.all_tasks() if task is not current]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
