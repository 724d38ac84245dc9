"""The proxy's HTTP bodies at its edges: a client's request body read whole within its
limits (or refused), a body sent to a backend in slices, and OpenAI-style errors, whole or
as the last event of an SSE stream.

Apart from :mod:`rd2h_proxy.server` because they hold no proxy state: they depend on
aiohttp and the bytes alone, while the server decides which request goes where.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Final

import msgspec

from rd2h_protocol.errors import MissingExtra

try:
    import aiohttp
    from aiohttp import web
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise MissingExtra("aiohttp", "proxy") from exc

__all__ = [
    "CLIENT_GONE",
    "SEND_CHUNK",
    "BodyRefused",
    "json_error",
    "read_body",
    "refuse",
    "send_slices",
    "stream_error",
]

log = logging.getLogger("rd2h.proxy")

# Errors raised when the client of a streaming response has gone away.
CLIENT_GONE: Final = (ConnectionResetError, ConnectionError)
#: Bodies go to the backends in slices this large, so the socket layer never copies a whole
#: body into its send buffer (asyncio before 3.12 does, for a write it cannot send at once).
SEND_CHUNK: Final = 1 << 20


def json_error(status: int, message: str, kind: str) -> web.Response:
    """An OpenAI-style error body."""
    body = {"error": {"message": message, "type": kind, "code": status}}
    return web.json_response(body, status=status)


class BodyRefused(Exception):
    """A request body the proxy will not take (too large, or too slow to arrive)."""

    def __init__(self, status: int, message: str, kind: str, *, close: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.close = close  # the body is still arriving: close instead of draining it


async def _read_all(content: aiohttp.StreamReader, length: int | None, limit: int) -> bytearray:
    """The body from ``content`` into one buffer: the only copy of it the proxy makes."""
    if length is not None:
        body = bytearray(length)
        view = memoryview(body)
        filled = 0
        while filled < length:
            chunk = await content.readany()
            if not chunk or len(chunk) > length - filled:
                raise BodyRefused(
                    400,
                    "the request body does not match its Content-Length",
                    "invalid_request_error",
                )
            view[filled : filled + len(chunk)] = chunk
            filled += len(chunk)
        return body
    body = bytearray()
    while chunk := await content.readany():
        if len(body) + len(chunk) > limit:
            raise BodyRefused(
                413, f"the request body exceeds the {limit}-byte limit", "invalid_request_error"
            )
        body += chunk
    return body


async def send_slices(payload: bytes) -> AsyncIterator[memoryview]:
    """``payload`` in :data:`SEND_CHUNK` slices; it is freed once the last one is sent."""
    view = memoryview(payload)
    for start in range(0, len(view), SEND_CHUNK):
        yield view[start : start + SEND_CHUNK]


async def read_body(request: web.Request, limit: int, timeout_s: float) -> bytearray:
    """The whole request body, within ``timeout_s`` and ``limit`` bytes, else
    :class:`BodyRefused` (a 408 exactly when it did not arrive in time).

    The deadline covers the whole body, not the gaps between its chunks: a client that
    trickles a byte now and then is cut as surely as one that stops.
    """
    length = request.content_length
    if length is not None and length > limit:
        raise BodyRefused(
            413,
            f"the request body has {length} bytes; the proxy accepts {limit}",
            "invalid_request_error",
        )
    try:
        return await asyncio.wait_for(_read_all(request.content, length, limit), timeout_s)
    except asyncio.TimeoutError:
        raise BodyRefused(
            408, f"the request body did not arrive within {timeout_s:g} s", "timeout", close=True
        ) from None


async def refuse(request: web.Request, exc: BodyRefused) -> web.StreamResponse:
    """Answer a refused body; one still arriving is not drained (aiohttp would linger)."""
    response = json_error(exc.status, str(exc), exc.kind)
    if not exc.close:
        return response
    log.debug("client %s: %s; closing the connection", request.remote, exc)
    response.force_close()
    with contextlib.suppress(ConnectionError):
        await response.prepare(request)
        await response.write_eof()
    request.protocol.force_close()  # the answer is flushed first, then the socket closes
    return response


async def stream_error(stream: web.StreamResponse, status: int, message: str) -> None:
    """End an SSE stream with an error event (a blank line first ends any partial event)."""
    event = {"error": {"message": message, "type": "upstream_error", "code": status}}
    try:
        await stream.write(b"\n\ndata: " + msgspec.json.encode(event) + b"\n\n")
        await stream.write_eof()
    except CLIENT_GONE:
        pass
