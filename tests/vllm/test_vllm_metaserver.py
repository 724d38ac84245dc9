"""rd2h_vllm.metaserver against a real aiohttp server on 127.0.0.1 (port chosen at run time).

Retries of a POST the server received are tested with ``idempotent=True`` (a metaserver
that recognises a repeat, as ``rd2h proxy`` does); test_vllm_metaserver_example_proxy.py
covers the other kind.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import threading
import time

import pytest
from vllm_metaserver_harness import MetaServer

from rd2h_protocol.errors import ErrorCode
from rd2h_protocol.rendezvous import Rendezvous, decode_rendezvous
from rd2h_vllm.config import MetaserverOptions
from rd2h_vllm.metaserver import (
    MetaserverClient,
    MetaserverRejected,
    MetaserverUnavailable,
    PostResult,
    RendezvousPoster,
    backoff_delay,
)

FAST = MetaserverOptions(
    timeout_s=2.0, max_attempts=4, backoff_s=0.02, backoff_max_s=0.05, deadline_s=10.0
)


def rendezvous(request_id: str = "cmpl-abc-0") -> Rendezvous:
    return Rendezvous(
        request_id=request_id,
        remote_engine_id="decode-engine",
        remote_host="127.0.0.1",
        remote_port=20050,
        remote_tp_size=2,
        remote_cached_tokens=0,
    )


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def post_once(
    options: MetaserverOptions, url: str, rv: Rendezvous, *, idempotent: bool = False
) -> PostResult:
    client = MetaserverClient(options)
    try:
        return await client.post(url, rv, idempotent=idempotent)
    finally:
        await client.aclose()


def test_delivered_first_try_and_body_is_the_rendezvous(server: MetaServer) -> None:
    rv = rendezvous()
    result = asyncio.run(post_once(FAST, server.url, rv))
    assert result.status == 200 and result.attempts == 1
    assert result.legacy_error is False
    assert len(server.script.bodies) == 1
    assert decode_rendezvous(server.script.bodies[0]) == rv


def test_5xx_is_retried_with_backoff_until_delivered(server: MetaServer) -> None:
    server.script.replies = [503, 502, 500, 200]
    result = asyncio.run(post_once(FAST, server.url, rendezvous(), idempotent=True))
    assert result.status == 200 and result.attempts == 4
    gaps = [b - a for a, b in zip(server.script.times, server.script.times[1:], strict=False)]
    # Waits of 0.02, 0.04, then capped at 0.05 s between attempts (small slack for timers).
    for gap, retry in zip(gaps, (1, 2, 3), strict=True):
        assert gap >= backoff_delay(FAST, retry) * 0.9


def test_4xx_fails_at_once_without_retry(server: MetaServer) -> None:
    server.script.replies = [404]
    with pytest.raises(MetaserverRejected) as exc:
        asyncio.run(post_once(FAST, server.url, rendezvous("cmpl-x-1")))
    assert exc.value.status == 404
    assert exc.value.attempts == 1
    assert exc.value.request_id == "cmpl-x-1"
    assert exc.value.code == ErrorCode.UNKNOWN_REQUEST
    assert "HTTP 404" in str(exc.value)
    assert len(server.script.bodies) == 1


def test_persistent_5xx_gives_up_after_max_attempts(server: MetaServer) -> None:
    server.script.replies = [500]
    options = MetaserverOptions(
        timeout_s=2.0, max_attempts=3, backoff_s=0.01, backoff_max_s=0.01, deadline_s=10.0
    )
    with pytest.raises(MetaserverUnavailable) as exc:
        asyncio.run(post_once(options, server.url, rendezvous(), idempotent=True))
    assert exc.value.attempts == 3 and exc.value.deadline is False
    assert "HTTP 500" in str(exc.value)
    assert len(server.script.bodies) == 3


def test_5xx_from_a_metaserver_that_is_not_idempotent_is_final(server: MetaServer) -> None:
    # It received the POST; posting again would be a new dispatch there.
    server.script.replies = [503, 200]
    with pytest.raises(MetaserverUnavailable) as exc:
        asyncio.run(post_once(FAST, server.url, rendezvous()))
    assert exc.value.attempts == 1 and exc.value.deadline is False
    assert "HTTP 503" in str(exc.value) and "final" in str(exc.value)
    assert len(server.script.bodies) == 1


@pytest.mark.parametrize("status", [500, 404])
def test_legacy_switch_counts_http_errors_as_delivered(server: MetaServer, status: int) -> None:
    server.script.replies = [status]
    legacy = MetaserverOptions(
        timeout_s=2.0,
        max_attempts=4,
        backoff_s=0.01,
        backoff_max_s=0.01,
        deadline_s=10.0,
        legacy_errors_delivered=True,
    )
    result = asyncio.run(post_once(legacy, server.url, rendezvous()))
    assert result.status == status and result.legacy_error is True
    assert result.attempts == 1


def test_transport_errors_are_retried_then_reported() -> None:
    # Refused connections: never sent, so retried for any metaserver (idempotent or not).
    url = f"http://127.0.0.1:{closed_port()}/v1/metaserver"
    options = MetaserverOptions(
        timeout_s=1.0, max_attempts=3, backoff_s=0.01, backoff_max_s=0.01, deadline_s=10.0
    )
    with pytest.raises(MetaserverUnavailable) as exc:
        asyncio.run(post_once(options, url, rendezvous()))
    assert exc.value.attempts == 3
    assert "ConnectError" in str(exc.value)


def test_stalled_server_is_bounded_by_the_overall_deadline(server: MetaServer) -> None:
    server.script.replies = ["hang"]
    options = MetaserverOptions(
        timeout_s=0.3, max_attempts=100, backoff_s=0.05, backoff_max_s=0.1, deadline_s=0.8
    )
    start = time.monotonic()
    with pytest.raises(MetaserverUnavailable) as exc:
        asyncio.run(post_once(options, server.url, rendezvous(), idempotent=True))
    elapsed = time.monotonic() - start
    assert exc.value.deadline is True
    assert exc.value.code == ErrorCode.TIMEOUT
    assert "Timeout" in str(exc.value)
    assert 0.5 <= elapsed < 3.0
    assert 2 <= len(server.script.bodies) < 100


def test_poster_runs_many_posts_on_one_thread(server: MetaServer) -> None:
    server.script.replies = [503, 200]  # the first post ever sees one 503, then all succeed
    threads_before = threading.active_count()
    # A generous per-attempt timeout: on a loaded CI host 200 concurrent posts may be slow.
    options = MetaserverOptions(
        timeout_s=20.0, max_attempts=4, backoff_s=0.02, backoff_max_s=0.05, deadline_s=40.0
    )
    with RendezvousPoster(options) as poster:
        assert threading.active_count() == threads_before + 1
        futures = [
            poster.post(server.url, rendezvous(f"cmpl-p-{i}"), idempotent=True) for i in range(200)
        ]
        assert threading.active_count() == threads_before + 1  # no thread per request
        results = [f.result(timeout=30) for f in futures]
    assert threading.active_count() == threads_before
    assert {r.request_id for r in results} == {f"cmpl-p-{i}" for i in range(200)}
    assert all(r.status == 200 for r in results)
    # The 503 was retried; every attempt reached the server (nothing lost, nothing extra).
    assert max(r.attempts for r in results) >= 2
    assert sum(r.attempts for r in results) == len(server.script.bodies) >= 201


def test_poster_reports_failures_through_the_future(server: MetaServer) -> None:
    server.script.replies = [409]
    with RendezvousPoster(FAST) as poster:
        future = poster.post(server.url, rendezvous())
        with pytest.raises(MetaserverRejected):
            future.result(timeout=10)


def test_poster_close_cancels_posts_in_flight(server: MetaServer) -> None:
    server.script.replies = ["hang"]
    poster = RendezvousPoster(
        MetaserverOptions(
            timeout_s=30.0, max_attempts=1, backoff_s=0.1, backoff_max_s=0.1, deadline_s=30.0
        )
    )
    future = poster.post(server.url, rendezvous())
    deadline = time.monotonic() + 10
    while not server.script.bodies and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.script.bodies, "the post never reached the server"
    start = time.monotonic()
    poster.close()
    assert time.monotonic() - start < 5
    with pytest.raises(concurrent.futures.CancelledError):
        future.result(timeout=1)
    with pytest.raises(RuntimeError, match="closed"):
        poster.post(server.url, rendezvous())
