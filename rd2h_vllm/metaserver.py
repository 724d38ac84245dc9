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

Delivery policy (required-departures.md item 12, revised for the existing example proxy)
------------------------------------------------------------------------------------------
A retried POST is safe only where the metaserver recognises a repeat. Two kinds exist:

* An *idempotent* metaserver (``rd2h proxy``) records the rendezvous and answers at once
  (item 13) and treats an identical repeat of a child's rendezvous as a duplicate, never a
  second Prefill dispatch. It says so in the ``kv_transfer_params`` it hands Decode
  (:data:`~rd2h_protocol.rendezvous.METASERVER_IDEMPOTENT_KEY`). Its posts keep the
  item-12 policy: each attempt bounded by ``timeout_s``; transport errors (connect, send,
  read, timeout) and 5xx answers retried with exponential backoff (``backoff_s``, doubling,
  capped at ``backoff_max_s``), at most ``max_attempts`` attempts, none started later than
  ``deadline_s`` after the first.
* Any other metaserver, such as the existing example proxy, which answers only once its
  Prefill dispatch has finished (a long prompt: minutes) and dispatches again on every
  POST it receives. A POST is retried only while it provably never reached it (connect,
  pool or send failures; ``timeout_s`` bounds each of those phases, ``max_attempts`` and
  ``deadline_s`` as above). Once the request is sent it is never sent again, and its
  answer may take up to ``response_timeout_s`` (``metaserver_response_timeout_s``, 600 s:
  a backstop only, the scheduler cancels the POST when its request ends). An
  answer that does not come (the connection dropped, or that time passed) does not fail
  the request: the POST was delivered, and Decode's own ``kv_load_timeout_s`` fails a
  request whose KV never comes. A 5xx answer is final (the proxy's dispatch failed).

The v1 client re-posted after 5 s and gave up after ~27 s: against the example proxy every
prompt whose prefill took longer failed, after up to 5 dispatches of the same request.

The scheduler cancels a request's pending POST when the request finishes or is aborted,
so a slow answer never outlives its request (the client side of the example proxy's
connection closes; a closed connection is how that proxy learns the request is gone).

A 4xx answer is final in both cases: the proxy refused this rendezvous (unknown child,
conflict, malformed) and asking again cannot help. Failures raise
:class:`MetaserverRejected` (4xx) or :class:`MetaserverUnavailable` (not delivered, or a
final 5xx); the connector fails the request and reports its destination blocks as load
errors.

v1 treated ANY HTTP error status as delivered (legacy proxies answer 500 for extra
prompt-list children). That is available only behind the explicit
``legacy_errors_delivered`` switch; the result then records the status it swallowed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import httpx

from rd2h_protocol.errors import ErrorCode, ProtocolError
from rd2h_protocol.rendezvous import Rendezvous, encode_rendezvous
from rd2h_vllm.config import MetaserverOptions

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_BODY_EXCERPT = 300  # characters of an error body kept in the message

#: Failures before the request was completely sent: the metaserver cannot have acted on
#: it, so posting again never makes a second dispatch.
_NOT_SENT: Final = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.PoolTimeout,
    httpx.WriteError,
    httpx.WriteTimeout,
    httpx.LocalProtocolError,
    httpx.UnsupportedProtocol,
    httpx.ProxyError,
)


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
    """Not delivered (every attempt failed, or the deadline passed), or a final 5xx."""

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

    ``status`` is None when a non-idempotent metaserver received the POST but its answer
    never came (the connection dropped, or ``response_timeout_s`` passed); the POST was
    not sent again. ``legacy_error`` is True when the status was an error counted as
    delivered under ``legacy_errors_delivered`` (v1 behaviour).
    """

    request_id: str
    status: int | None
    attempts: int
    legacy_error: bool = False


def backoff_delay(options: MetaserverOptions, retry: int) -> float:
    """Seconds to wait before retry number ``retry`` (1 for the first retry)."""
    return float(min(options.backoff_s * (2 ** (retry - 1)), options.backoff_max_s))


def _describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class MetaserverClient:
    """Posts rendezvous from inside a running event loop (one pooled AsyncClient).

    ``options.response_timeout_s`` bounds the wait for a non-idempotent metaserver's
    answer to a POST it received (see the module docstring). ``transport`` lets tests inject an
    ``httpx`` transport; ``clock`` and ``sleep`` are the monotonic clock and the async
    sleep (injectable for the same reason).
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
        # Pool: rendezvous are tiny and bursty; keep-alive connections to the one proxy
        # make each post a single round trip. No cap on open connections: the example
        # proxy holds each POST's connection until its dispatch ends, so live requests
        # bound them, and a cap would turn a busy Decode's rendezvous into pool timeouts.
        # Idle connections are dropped after 2 s, before common servers drop them
        # (uvicorn: 5 s): a POST written into a connection the server is closing fails
        # after sending, and to such a proxy that is never re-sent.
        self._client = httpx.AsyncClient(
            transport=transport,
            limits=httpx.Limits(
                max_connections=None, max_keepalive_connections=16, keepalive_expiry=2.0
            ),
            headers={"content-type": "application/json"},
        )

    async def post(
        self, url: str, rendezvous: Rendezvous, *, idempotent: bool = False
    ) -> PostResult:
        """POST ``rendezvous`` to ``url`` with the delivery policy of the module docstring.

        ``idempotent``: the metaserver declared that it recognises a repeated rendezvous
        and answers at once (``rd2h proxy``); only then is a POST it may have received
        sent again.
        """
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
            sending = min(opts.timeout_s, left)
            timeout = httpx.Timeout(
                sending, read=sending if idempotent else self.options.response_timeout_s
            )
            try:
                response = await self._client.post(url, content=body, timeout=timeout)
            except _NOT_SENT as exc:
                last_reason = _describe(exc)
            except httpx.TransportError as exc:  # sent; the answer was lost or is late
                last_reason = _describe(exc)
                if not idempotent:
                    logger.warning(
                        "rendezvous of %r was sent to %s but no answer came (%s); not sending "
                        "it again (the metaserver may have dispatched it)",
                        request_id,
                        url,
                        last_reason,
                    )
                    return PostResult(request_id, None, attempts)
            else:
                status = response.status_code
                if status < 400:
                    return PostResult(request_id, status, attempts)
                if opts.legacy_errors_delivered:
                    return PostResult(request_id, status, attempts, legacy_error=True)
                if status < 500:
                    raise MetaserverRejected(request_id, status, response.text, attempts=attempts)
                last_reason = f"HTTP {status}: {response.text[:_BODY_EXCERPT]}"
                if not idempotent:
                    raise MetaserverUnavailable(
                        request_id,
                        f"{last_reason} (final: the metaserver received the POST and does "
                        "not recognise a repeat)",
                        attempts=attempts,
                        deadline=False,
                    )
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
        self,
        options: MetaserverOptions,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
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

    def post(
        self, url: str, rendezvous: Rendezvous, *, idempotent: bool = False
    ) -> concurrent.futures.Future[PostResult]:
        """Start posting ``rendezvous`` to ``url``; returns immediately.

        Cancelling the future cancels the POST (and closes its connection).
        """
        if self._closed:
            raise RuntimeError("RendezvousPoster is closed")
        return self._run(self._client.post(url, rendezvous, idempotent=idempotent))

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
