"""rd2h_vllm.metaserver against a metaserver like the existing example proxy.

That proxy answers a rendezvous POST only once the Prefill dispatch has finished and
dispatches again for every POST it receives (example_proxy_harness.py). Its "long"
dispatch here lasts 3 s against a client whose per-attempt timeout is 1 s and whose
deadline is 2.5 s, the proportions of a >27 s prefill against v1's 5 s / ~27 s client.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import time

import msgspec
import pytest
from example_proxy_harness import ExampleProxy

from rd2h_protocol.rendezvous import Rendezvous, decode_rendezvous
from rd2h_vllm.config import MetaserverOptions
from rd2h_vllm.metaserver import (
    MetaserverClient,
    MetaserverUnavailable,
    PostResult,
    RendezvousPoster,
)

LONG_DISPATCH_S = 3.0
#: Shorter than the dispatch in every bound v1 had: per attempt, and overall.
OPTIONS = MetaserverOptions(
    timeout_s=1.0, max_attempts=5, backoff_s=0.01, backoff_max_s=0.01, deadline_s=2.5
)
RENDEZVOUS = Rendezvous(
    request_id="cmpl-long-0",
    remote_engine_id="decode-engine",
    remote_host="127.0.0.1",
    remote_port=20050,
    remote_tp_size=1,
    remote_cached_tokens=0,
)


async def post(
    url: str, *, idempotent: bool = False, response_timeout_s: float = 60.0
) -> PostResult:
    client = MetaserverClient(dataclasses.replace(OPTIONS, response_timeout_s=response_timeout_s))
    try:
        return await client.post(url, RENDEZVOUS, idempotent=idempotent)
    finally:
        await client.aclose()


@pytest.mark.timeout(30)
def test_a_slow_answer_to_a_delivered_post_is_awaited_and_never_reposted() -> None:
    with ExampleProxy(dispatch_s=LONG_DISPATCH_S) as proxy:
        start = time.monotonic()
        result = asyncio.run(post(proxy.url))
        elapsed = time.monotonic() - start
    assert result == PostResult("cmpl-long-0", 200, attempts=1)
    assert elapsed >= LONG_DISPATCH_S  # answered after the dispatch, past the deadline
    assert proxy.seen.dispatches == 1 and proxy.seen.answered == 1
    assert [decode_rendezvous(body) for body in proxy.seen.posts] == [RENDEZVOUS]


@pytest.mark.timeout(30)
def test_the_retrying_policy_would_redispatch_and_fail_against_this_proxy() -> None:
    # What v1 did to every metaserver, and what the client still does for an idempotent
    # one: re-post after the per-attempt timeout, give up at the deadline. Against the
    # example proxy that is several dispatches of one request and a failed request.
    with (
        ExampleProxy(dispatch_s=LONG_DISPATCH_S) as proxy,
        pytest.raises(MetaserverUnavailable) as exc,
    ):
        asyncio.run(post(proxy.url, idempotent=True))
    assert exc.value.deadline is True
    assert proxy.seen.dispatches >= 2 and proxy.seen.answered == 0


@pytest.mark.timeout(30)
def test_a_dispatch_failure_is_final_and_not_reposted() -> None:
    with (
        ExampleProxy(dispatch_s=0.1, answer_status=500) as proxy,
        pytest.raises(MetaserverUnavailable) as exc,
    ):
        asyncio.run(post(proxy.url))
    assert exc.value.attempts == 1 and exc.value.deadline is False
    assert "HTTP 500" in str(exc.value)
    assert proxy.seen.dispatches == 1


@pytest.mark.timeout(30)
def test_a_lost_answer_to_a_delivered_post_is_not_reposted_nor_a_failure() -> None:
    with ExampleProxy(dispatch_s=0.1, drop_answer=True) as proxy:
        result = asyncio.run(post(proxy.url))
    # Delivered, answer unknown: Decode's own load deadline decides if the KV never comes.
    assert result == PostResult("cmpl-long-0", None, attempts=1)
    assert proxy.seen.dispatches == 1 and proxy.seen.answered == 0


@pytest.mark.timeout(30)
def test_an_answer_that_never_comes_is_bounded_by_the_response_timeout() -> None:
    with ExampleProxy(dispatch_s=60.0) as proxy:
        start = time.monotonic()
        result = asyncio.run(post(proxy.url, response_timeout_s=0.5))
        assert 0.5 <= time.monotonic() - start < 5.0
    assert result == PostResult("cmpl-long-0", None, attempts=1)
    assert proxy.seen.dispatches == 1


@pytest.mark.timeout(30)
def test_cancelling_a_pending_post_closes_it_at_the_proxy() -> None:
    with ExampleProxy(dispatch_s=60.0) as proxy, RendezvousPoster(OPTIONS) as poster:
        future = poster.post(proxy.url, RENDEZVOUS)
        deadline = time.monotonic() + 10
        while not proxy.seen.posts:
            assert time.monotonic() < deadline, "the post never reached the proxy"
            time.sleep(0.01)
        assert future.cancel()
        while proxy.seen.cancelled == 0:
            assert time.monotonic() < deadline, "the proxy never saw the post go away"
            time.sleep(0.01)
        with pytest.raises(concurrent.futures.CancelledError):
            future.result(timeout=1)
    assert proxy.seen.dispatches == 1 and proxy.seen.answered == 0


@pytest.mark.timeout(60)
def test_many_long_dispatches_at_once_each_keep_their_connection() -> None:
    # Every pending POST holds a connection until its dispatch ends. Under a pool cap
    # below the number of live requests the others would wait for a slot longer than the
    # per-phase timeout (production's 5 s here, so 100 connects at once are no race on a
    # loaded host) and fail or post again.
    options = MetaserverOptions(timeout_s=5.0, deadline_s=30.0)
    count = 100
    with ExampleProxy(dispatch_s=6.0) as proxy, RendezvousPoster(options) as poster:
        futures = [
            poster.post(proxy.url, msgspec.structs.replace(RENDEZVOUS, request_id=f"cmpl-m-{i}"))
            for i in range(count)
        ]
        results = [future.result(timeout=30) for future in futures]
    assert all(r.status == 200 and r.attempts == 1 for r in results)
    assert {r.request_id for r in results} == {f"cmpl-m-{i}" for i in range(count)}
    assert proxy.seen.dispatches == count
