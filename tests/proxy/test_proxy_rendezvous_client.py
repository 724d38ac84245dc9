"""Decode's real rendezvous client (rd2h_vllm.metaserver) against a real ``rd2h proxy``.

The proxy, fake Prefill and fake Decode run on 127.0.0.1 (proxy_harness.py); the fake
Decode posts nothing itself: the test posts each rendezvous with the client Decode's
connector uses, idempotent exactly when the proxy said so in Decode's kv_transfer_params.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from proxy_harness import HOST, Cluster, async_test, cluster

from rd2h_protocol.rendezvous import METASERVER_IDEMPOTENT_KEY, Rendezvous
from rd2h_proxy.payloads import COMPLETIONS
from rd2h_vllm.config import MetaserverOptions
from rd2h_vllm.metaserver import MetaserverClient, PostResult

OPTIONS = MetaserverOptions(
    timeout_s=2.0, max_attempts=4, backoff_s=0.01, backoff_max_s=0.02, deadline_s=6.0
)


class AnswerLosingRelay:
    """A TCP relay in front of the proxy that loses the first connection's answer: the
    request reaches the proxy, and the client's connection is cut when the answer starts
    coming back. Later connections are relayed both ways."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.connections = 0
        self.answers_lost = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._accept, HOST, 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"http://{HOST}:{port}/v1/metaserver"

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.close()  # every relayed read sees the end of its stream
        await asyncio.gather(*self._tasks)
        await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self.connections += 1
        up_reader, up_writer = await asyncio.open_connection(HOST, self.target_port)
        self._writers += [writer, up_writer]
        try:
            if self.connections == 1:
                to_proxy = asyncio.ensure_future(_pipe(reader, up_writer))
                await up_reader.read(1)  # the proxy is answering: it has the rendezvous
                writer.transport.abort()  # ... and the client never sees the answer
                self.answers_lost += 1
                to_proxy.cancel()
                await asyncio.gather(to_proxy, return_exceptions=True)
            else:
                await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            up_writer.close()
            writer.close()


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError):  # the far side closing ends the relay too
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()
    dst.close()


async def _through_proxy(c: Cluster, request_id: str) -> asyncio.Task[tuple[int, Any]]:
    """Start a one-prompt completion through the proxy; returns once Decode has it."""
    c.decode_posts = False
    exchange = asyncio.ensure_future(
        c.complete(COMPLETIONS, {"model": "m", "prompt": "hi", "max_tokens": 3}, request_id)
    )
    await c.until(lambda: len(c.decode_calls) == 1)
    return exchange


def _rendezvous(request_id: str) -> Rendezvous:
    return Rendezvous(
        request_id=request_id,
        remote_engine_id="decode-engine-0",
        remote_host=HOST,
        remote_port=30000,
        remote_tp_size=2,
        remote_cached_tokens=0,
    )


@async_test
async def test_a_lost_answer_is_posted_again_and_the_proxy_dispatches_once() -> None:
    async with cluster() as c:
        c.decode_hold = asyncio.Event()  # Decode's request lives on until the post is over
        exchange = await _through_proxy(c, "lost")
        params = c.decode_calls[0].body["kv_transfer_params"]
        assert params[METASERVER_IDEMPOTENT_KEY] is True
        relay = AnswerLosingRelay(int(c.proxy_url.rsplit(":", 1)[1]))
        client = MetaserverClient(OPTIONS)
        try:
            url = await relay.start()
            result = await client.post(
                url, _rendezvous("cmpl-lost-0"), idempotent=params[METASERVER_IDEMPOTENT_KEY]
            )
        finally:
            await client.aclose()
            await relay.close()
        assert result == PostResult("cmpl-lost-0", 200, attempts=2)
        assert relay.answers_lost == 1 and relay.connections == 2
        # The proxy saw the rendezvous twice and dispatched Prefill once.
        stats = c.server.stats
        assert (stats.rendezvous_recorded, stats.rendezvous_duplicate) == (1, 1)
        assert stats.dispatches_started == 1 and len(c.prefill_calls) == 1
        c.decode_hold.set()
        status, body = await exchange
        assert status == 200, body
        assert body["choices"] == [{"index": 0, "text": "decoded:cmpl-lost-0"}]
        await c.wait_idle()


@async_test
async def test_a_long_prefill_dispatch_does_not_delay_the_answer() -> None:
    async with cluster() as c:
        c.prefill_delay_s = 2 * OPTIONS.timeout_s  # longer than any attempt may take
        exchange = await _through_proxy(c, "slow")
        params = c.decode_calls[0].body["kv_transfer_params"]
        client = MetaserverClient(OPTIONS)
        start = time.monotonic()
        try:
            result = await client.post(
                params["metaserver"],
                _rendezvous("cmpl-slow-0"),
                idempotent=params[METASERVER_IDEMPOTENT_KEY],
            )
        finally:
            await client.aclose()
        assert result == PostResult("cmpl-slow-0", 200, attempts=1)
        assert time.monotonic() - start < c.prefill_delay_s  # answered before Prefill did
        status, body = await exchange
        assert status == 200, body
        assert len(c.prefill_calls) == 1 and c.server.stats.rendezvous_duplicate == 0
        await c.wait_idle()
