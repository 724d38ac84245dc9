"""The rendezvous client: Decode posts each child request's rendezvous to the metaserver.

Theory of operation
-------------------
The proxy hands Decode a metaserver URL in ``kv_transfer_params``; once Decode has
allocated a request's destinations it POSTs the request's
:class:`~rd2h_protocol.rendezvous.Rendezvous` there as JSON. The scheduler must never
wait on the network, so posts run on ONE asyncio event loop in ONE background thread
(:class:`RendezvousPoster`), all sharing one pooled ``httpx.AsyncClient``: a thousand
concurrent rendezvous cost a thousand coroutines, not a thousand threads. Code already
running an event loop uses :class:`MetaserverClient` directly.

Retry policy (required-departures.md item 12): transport errors (connect, read,
timeout) and 5xx answers are retried with exponential backoff (``backoff_s``, doubling,
capped at ``backoff_max_s``) for at most ``max_attempts`` attempts and never past
``deadline_s`` after the first attempt; each attempt's timeout is cut to the time left.
A 4xx answer is final: the proxy refused this rendezvous (unknown child, conflict,
malformed) and asking again cannot help. Failures raise :class:`MetaserverRejected`
(4xx) or :class:`MetaserverUnavailable` (retries or deadline exhausted); the connector
fails the request and reports its destination blocks as load errors.

v1 treated ANY HTTP error status as delivered (legacy proxies answer 500 for extra
prompt-list children). That is available only behind the explicit
``legacy_errors_delivered`` switch; the result then records the status it swallowed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

from rd2h_protocol.errors import ErrorCode, ProtocolError
from rd2h_protocol.rendezvous import Rendezvous, encode_rendezvous
from rd2h_vllm.config import MetaserverOptions

_T = TypeVar("_T")
_BODY_EXCERPT = 300  # characters of an error body kept in the message


class MetaserverError(ProtocolError):
    """The rendezvous of ``request_id`` was not delivered; the request must fail."""

    def __init__(
        self, message: str, request_id: str, *, attempts: int, code: ErrorCode = ErrorCode.UNKNOWN
    ) -> None:
        super().__init__(message, code)
        self.request_id = request_id
        self.attempts = attempts


class MetaserverRejected(MetaserverError):
    """The metaserver answered 4xx: it refused this rendezvous; not retried."""

    def __init__(self, request_id: str, status: int, body: str, *, attempts: int) -> None:
        super().__init__(
            f"metaserver refused the rendezvous of {request_id!r} with HTTP {status}: "
            f"{body[:_BODY_EXCERPT]}",
            request_id,
            attempts=attempts,
            code=ErrorCode.UNKNOWN_REQUEST,
        )
        self.status = status
        self.body = body


class MetaserverUnavailable(MetaserverError):
    """Every attempt failed with a transport error or 5xx, or the deadline passed."""

    def __init__(self, request_id: str, reason: str, *, attempts: int, deadline: bool) -> None:
        super().__init__(
            f"rendezvous of {request_id!r} not delivered after {attempts} attempt(s)"
            f"{' (deadline reached)' if deadline else ''}: {reason}",
            request_id,
            attempts=attempts,
            code=ErrorCode.TIMEOUT if deadline else ErrorCode.UNKNOWN,
        )
        self.deadline = deadline


@dataclass(frozen=True, slots=True)
class PostResult:
    """A delivered rendezvous: the final HTTP status and how many attempts it took.

    ``legacy_error`` is True when the status was an error counted as delivered under
    ``legacy_errors_delivered`` (v1 behaviour).
    """

    request_id: str
    status: int
    attempts: int
    legacy_error: bool = False


def backoff_delay(options: MetaserverOptions, retry: int) -> float:
    """Seconds to wait before retry number ``retry`` (1 for the first retry)."""
    return float(min(options.backoff_s * (2 ** (retry - 1)), options.backoff_max_s))


class MetaserverClient:
    """Posts rendezvous from inside a running event loop (one pooled AsyncClient).

    ``transport`` lets tests inject an ``httpx`` transport; ``clock`` and ``sleep`` are
    the monotonic clock and the async sleep (injectable for the same reason).
    """

    def __init__(
        self,
        options: MetaserverOptions,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Coroutine[Any, Any, None]] = asyncio.sleep,
    ) -> None:
        self.options = options
        self._clock = clock
        self._sleep = sleep
        # Pool limits: rendezvous are tiny and bursty; keep-alive connections to the one
        # proxy make each post a single round trip.
        self._client = httpx.AsyncClient(
            transport=transport,
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=16),
            headers={"content-type": "application/json"},
        )

    async def post(self, url: str, rendezvous: Rendezvous) -> PostResult:
        """POST ``rendezvous`` to ``url`` with the retry policy of the module docstring."""
        opts = self.options
        body = encode_rendezvous(rendezvous)
        request_id = rendezvous.request_id
        start = self._clock()
        attempts = 0
        last_reason = "no attempt made"
        while True:
            left = opts.deadline_s - (self._clock() - start)
            if left <= 0:
                raise MetaserverUnavailable(
                    request_id, last_reason, attempts=attempts, deadline=True
                )
            attempts += 1
            try:
                response = await self._client.post(
                    url, content=body, timeout=min(opts.timeout_s, left)
                )
            except httpx.TransportError as exc:  # connect/read/write errors and timeouts
                last_reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            else:
                status = response.status_code
                if status < 400:
                    return PostResult(request_id, status, attempts)
                if opts.legacy_errors_delivered:
                    return PostResult(request_id, status, attempts, legacy_error=True)
                if status < 500:
                    raise MetaserverRejected(request_id, status, response.text, attempts=attempts)
                last_reason = f"HTTP {status}: {response.text[:_BODY_EXCERPT]}"
            if attempts >= opts.max_attempts:
                raise MetaserverUnavailable(
                    request_id, last_reason, attempts=attempts, deadline=False
                )
            delay = backoff_delay(opts, attempts)
            left = opts.deadline_s - (self._clock() - start)
            if delay >= left:
                raise MetaserverUnavailable(
                    request_id, last_reason, attempts=attempts, deadline=True
                )
            await self._sleep(delay)

    async def aclose(self) -> None:
        """Close the pooled connections."""
        await self._client.aclose()


class RendezvousPoster:
    """Posts rendezvous from synchronous code (the vLLM scheduler) without blocking it.

    One daemon thread runs one event loop and one :class:`MetaserverClient`;
    :meth:`post` returns at once with a ``concurrent.futures.Future`` that resolves to a
    :class:`PostResult` or raises a :class:`MetaserverError`. Poll it with ``done()`` or
    attach ``add_done_callback`` (callbacks run on the poster's thread: keep them short).
    """

    def __init__(
        self, options: MetaserverOptions, *, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self.options = options
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="rd2h-metaserver", daemon=True
        )
        self._thread.start()
        self._client = self._run(self._make_client(options, transport)).result()
        self._closed = False

    @staticmethod
    async def _make_client(
        options: MetaserverOptions, transport: httpx.AsyncBaseTransport | None
    ) -> MetaserverClient:
        # Created on the loop's own thread so its pool binds to that loop.
        return MetaserverClient(options, transport=transport)

    def _run(self, coro: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def post(self, url: str, rendezvous: Rendezvous) -> concurrent.futures.Future[PostResult]:
        """Start posting ``rendezvous`` to ``url``; returns immediately."""
        if self._closed:
            raise RuntimeError("RendezvousPoster is closed")
        return self._run(self._client.post(url, rendezvous))

    def close(self, timeout_s: float = 5.0) -> None:
        """Cancel posts still running, close the pool and stop the thread."""
        if self._closed:
            return
        self._closed = True

        async def shutdown() -> None:
            current = asyncio.current_task()
            pending = [t for t in asyncio.all_tasks() if t is not current]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            await self._client.aclose()

        try:
            self._run(shutdown()).result(timeout_s)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout_s)
            if not self._thread.is_alive():
                self._loop.close()

    def __enter__(self) -> RendezvousPoster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
