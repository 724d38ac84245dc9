"""The proxy against hostile clients: deep JSON, slowloris heads, slow bodies, too many connections.

The JSON tests run the proxy in this process (between the fakes of proxy_harness); the
connection tests run ``python -m rd2h_proxy`` as a child process and count its open
file descriptors in /proc/<pid>/fd, with raw sockets on 127.0.0.1 as the clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st
from proxy_harness import (
    HOST,
    async_test,
    bound_socket,
    closed_port,
    cluster,
    start_runner,
)

from rd2h_protocol.rendezvous import MAX_RENDEZVOUS_BYTES, Rendezvous, encode_rendezvous
from rd2h_proxy.config import Backend, ProxyConfig
from rd2h_proxy.payloads import (
    MAX_JSON_CONTAINERS,
    MAX_JSON_DEPTH,
    BadRequest,
    _brackets,
    _deeper_than,
    check_json_shape,
    decode_json_object,
)
from rd2h_proxy.serving import raise_open_file_limit

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
METASERVER = "/v1/metaserver"

# -- the shape of JSON bodies -------------------------------------------------------------


def _depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    return 0


def test_depth_limit_is_exact_and_ignores_strings() -> None:
    at_limit = b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH
    check_json_shape(at_limit)
    assert decode_json_object(b'{"a": ' + at_limit[1:-1] + b"}")["a"]
    with pytest.raises(BadRequest, match=f"more than {MAX_JSON_DEPTH} levels deep"):
        check_json_shape(b"[" + at_limit + b"]")
    with pytest.raises(BadRequest, match="levels deep"):
        check_json_shape(b'{"a":' * (MAX_JSON_DEPTH + 1) + b"1" + b"}" * (MAX_JSON_DEPTH + 1))
    # brackets inside strings, escaped quotes and escaped backslashes do not nest
    text = json.dumps("[{" * 5000 + '\\"[' * 300 + "\\" * 7 + '"').encode()
    check_json_shape(b'{"prompt": ' + text + b', "x": [[1], [2]]}')
    check_json_shape(b"[" + b"[[]]," * 100_000 + b"[]]")  # many brackets, all shallow
    check_json_shape(b"[" + b",".join([b"[" * 100 + b"]" * 100] * 50) + b"]")


@given(
    st.recursive(
        st.none() | st.integers() | st.text(alphabet='[]{}"\\ab'),
        lambda inner: (
            st.lists(inner, max_size=4)
            | st.dictionaries(st.text(alphabet='[]{}"\\', max_size=3), inner, max_size=4)
        ),
        max_leaves=40,
    ),
    st.integers(min_value=0, max_value=8),
)
def test_depth_check_agrees_with_the_decoded_value(value: Any, limit: int) -> None:
    data = json.dumps(value).encode()
    assert _deeper_than(_brackets(data), limit) == (_depth(value) > limit)


def test_container_count_is_bounded() -> None:
    cap = MAX_JSON_CONTAINERS
    check_json_shape(b"[" + b"[]," * (cap - 2) + b"[]]")  # exactly the cap
    with pytest.raises(BadRequest, match=f"more than {cap} JSON arrays and objects"):
        check_json_shape(b"[" + b"{}," * (cap - 1) + b"[]]")
    with pytest.raises(BadRequest, match=f"more than {cap} JSON arrays and objects"):
        check_json_shape(b"[[]," * 100 + b"]" * (2 * cap))  # malformed, mostly closers
    check_json_shape(json.dumps(["[]{}" * cap]).encode())  # brackets in a string are text


def test_body_shape_checks_take_linear_time() -> None:
    # A few MiB each, shaped to reach the slowest path; a check quadratic in size or depth
    # would take minutes here.
    chain = b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH
    chains = b",".join([chain] * (MAX_JSON_CONTAINERS // MAX_JSON_DEPTH - 1))
    bodies = [
        (b"[" * (4 << 20), "levels deep"),  # the reported attack, larger
        (b"[[]," + chains + b"]", "levels deep"),  # no run of "[" over the limit
        (b'[{"a": "[[[[\\"}, ' + b"[[1]]," * (1 << 18) + chain + b"]", "levels deep"),
        (b"[" + b"[]," * (4 << 20) + b"[]]", "arrays and objects"),
        (chains, ""),  # at the limits: accepted
    ]
    started = time.monotonic()
    for data, refusal in bodies:
        if refusal:
            with pytest.raises(BadRequest, match=refusal):
                check_json_shape(data)
        else:
            check_json_shape(data)
    assert time.monotonic() - started < 10.0


def _is_error(answer: Any, status: int, needle: str) -> bool:
    if not isinstance(answer, dict) or not isinstance(answer.get("error"), dict):
        return False
    error = answer["error"]
    return bool(error["code"] == status and needle in error["message"])


DEEP_BODIES = [
    b"[" * 1000,  # the reported body: 1000 open brackets
    b"[" * 1000 + b"]" * 1000,
    b'{"a":' * 500 + b"1" + b"}" * 500,
]


@pytest.mark.timeout(20)
@async_test
async def test_deep_json_is_400_on_every_endpoint(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    async with cluster() as c:
        for path in (COMPLETIONS, CHAT, METASERVER):
            for data in DEEP_BODIES:
                status, answer = await c.complete(path, data)
                assert status == 400, (path, answer)
                assert _is_error(answer, 400, "levels deep"), answer
                assert answer["error"]["type"] == "invalid_request_error"
        stats = c.server.stats
        assert stats.requests_rejected == 2 * len(DEEP_BODIES)
        assert stats.rendezvous_malformed == len(DEEP_BODIES)
        # still serving
        status, answer = await c.complete(COMPLETIONS, {"prompt": "hello"}, "after")
        assert status == 200, answer
        await c.wait_idle()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert errors == []


@pytest.mark.timeout(20)
@async_test
async def test_large_bodies_are_413_and_a_large_request_still_works() -> None:
    async with cluster(max_body_bytes=4096) as c:
        status, answer = await c.complete(COMPLETIONS, {"prompt": "x" * 5000})
        assert status == 413 and _is_error(answer, 413, "4096"), answer

        async def chunked() -> AsyncIterator[bytes]:  # no Content-Length
            yield b'{"prompt": "'
            yield b"x" * 5000
            yield b'"}'

        async with c.http.post(c.proxy_url + COMPLETIONS, data=chunked()) as resp:
            assert resp.status == 413 and _is_error(await resp.json(), 413, "4096")
        big = "y" * (MAX_RENDEZVOUS_BYTES + 1)
        status, answer = await c.complete(METASERVER, {"request_id": big})
        assert status == 413, answer
        status, answer = await c.complete(COMPLETIONS, {"prompt": "z" * 4000}, "fits")
        assert status == 200, answer
        assert c.decode_calls[0].body["prompt"] == "z" * 4000  # sent whole, in slices
        assert c.prefill_calls[0].body["prompt"] == "z" * 4000
        await c.wait_idle()


# -- connections, against a real proxy process --------------------------------------------

#: Bound on each test below, which starts a Python process (slow on a loaded machine).
PROCESS_TEST_TIMEOUT_S = 25.0


def process_test(fn: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[], None]:
    """Run an async test that starts a proxy process, bounded by PROCESS_TEST_TIMEOUT_S."""

    @functools.wraps(fn)
    def wrapper() -> None:
        asyncio.run(asyncio.wait_for(fn(), PROCESS_TEST_TIMEOUT_S))

    return wrapper


def test_open_file_limit_is_raised_to_cover_the_cap(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import resource

    limits = {"soft": 1024, "hard": 1 << 20}
    monkeypatch.setattr(resource, "getrlimit", lambda _: (limits["soft"], limits["hard"]))

    def setrlimit(_: int, new: tuple[int, int]) -> None:
        limits["soft"], limits["hard"] = new

    monkeypatch.setattr(resource, "setrlimit", setrlimit)
    config = ProxyConfig(
        host=HOST, port=9000, prefillers=(Backend(HOST, 1),), decoders=(Backend(HOST, 2),)
    )
    raise_open_file_limit(config)
    need = 8192 + 4096 + 64 + 256
    assert limits == {"soft": need, "hard": 1 << 20} and not caplog.records
    limits.update(soft=1024, hard=4096)  # the hard limit is too low: raise what we may, warn
    raise_open_file_limit(config)
    assert limits == {"soft": 4096, "hard": 4096}
    assert "lower --max-connections" in caplog.text


@dataclass
class ProxyProcess:
    pid: int
    port: int

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    async def baseline(self) -> int:
        """The descriptor count once it is steady (the probe connection closed)."""
        count = -1
        while count != (count := self.fds()):
            await asyncio.sleep(0.1)
        return count

    async def fds_settle(self, target: int, timeout: float) -> int:
        """Wait until the process holds at most ``target`` descriptors; return the count."""
        deadline = time.monotonic() + timeout
        while (count := self.fds()) > target and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return count

    async def get(self, path: str) -> tuple[int, dict[str, Any]]:
        """A well-behaved client: one GET on a fresh connection."""
        reader, writer = await asyncio.open_connection(HOST, self.port)
        try:
            writer.write(
                f"GET {path} HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n".encode()
            )
            raw = await asyncio.wait_for(reader.read(), 3.0)
        finally:
            writer.close()
        head, _, body = raw.partition(b"\r\n\r\n")
        return int(head.split()[1]), json.loads(body)

    async def connection_stats(self) -> dict[str, int]:
        status, health = await self.get("/healthcheck")
        assert status == 200
        stats: dict[str, int] = {**health["stats"], **health["connections"]}
        return stats


@contextlib.contextmanager
def proxy_process(
    *flags: str, prefill_port: int | None = None, decode_port: int | None = None
) -> Iterator[ProxyProcess]:
    """``python -m rd2h_proxy`` on 127.0.0.1 (by default, backends nobody listens on)."""
    port = closed_port()
    cmd = [
        sys.executable,
        "-m",
        "rd2h_proxy",
        "--host",
        HOST,
        "--port",
        str(port),
        "--prefiller-ports",
        str(prefill_port or closed_port()),
        "--decoder-ports",
        str(decode_port or closed_port()),
        *flags,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 8.0
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "the proxy did not come up"
            with contextlib.suppress(OSError), socket.create_connection((HOST, port), 1.0):
                break
            time.sleep(0.05)
        yield ProxyProcess(proc.pid, port)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=5)
        assert proc.returncode == 0, out
        assert "Traceback" not in out and " ERROR " not in out, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


async def _closed_after(reader: asyncio.StreamReader, started: float) -> tuple[float, bytes]:
    """Read until the server closes; return the seconds since ``started`` and what came."""
    got = b""
    with contextlib.suppress(ConnectionError):
        while chunk := await reader.read(65536):
            got += chunk
    return time.monotonic() - started, got


async def _trickle(writer: asyncio.StreamWriter, every_s: float) -> None:
    """Send one byte every ``every_s`` until the server closes the connection."""
    with contextlib.suppress(ConnectionError):
        while not writer.is_closing():
            writer.write(b"a")
            await writer.drain()
            await asyncio.sleep(every_s)


HEADER_TIMEOUT_S = 0.5
SLACK_S = 1.0


@pytest.mark.timeout(30)
@process_test
async def test_slowloris_heads_are_closed_and_descriptors_return() -> None:
    with proxy_process("--header-timeout", str(HEADER_TIMEOUT_S)) as proxy:
        baseline = await proxy.baseline()
        started = time.monotonic()
        conns = [await asyncio.open_connection(HOST, proxy.port) for _ in range(50)]
        head = f"POST {COMPLETIONS} HTTP/1.1\r\nHost: {HOST}\r\nX-Slow: ".encode()
        for _, writer in conns:
            writer.write(head)
        trickles = [asyncio.ensure_future(_trickle(w, 0.05)) for _, w in conns[::2]]
        closes = [asyncio.ensure_future(_closed_after(r, started)) for r, _ in conns]
        await asyncio.sleep(0.2)
        peak = proxy.fds()
        assert peak >= baseline + 50  # held while they trickle

        status, _ = await proxy.get("/healthcheck")  # a good client is served meanwhile
        assert status == 200

        closed = await asyncio.gather(*closes)
        for elapsed, got in closed:
            assert HEADER_TIMEOUT_S - 0.1 <= elapsed <= HEADER_TIMEOUT_S + SLACK_S
            assert got == b""  # closed without an answer
        await asyncio.gather(*trickles)
        for _, writer in conns:
            writer.close()
        after = await proxy.fds_settle(baseline, 2.0)
        assert after <= baseline
        stats = await proxy.connection_stats()
        assert stats["header_timeouts"] == 50
        times = sorted(elapsed for elapsed, _ in closed)
        print(
            f"\n50 slowloris heads, --header-timeout {HEADER_TIMEOUT_S}: proxy fds {baseline} -> "
            f"{peak} -> {after}; closed {times[0]:.2f}..{times[-1]:.2f} s after connecting"
        )


@pytest.mark.timeout(30)
@process_test
async def test_header_deadline_on_a_kept_alive_connection() -> None:
    with proxy_process("--header-timeout", str(HEADER_TIMEOUT_S)) as proxy:
        reader, writer = await asyncio.open_connection(HOST, proxy.port)
        request = f"GET /healthcheck HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode()
        for _ in range(2):
            writer.write(request)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 3.0)
            assert head.startswith(b"HTTP/1.1 200")
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            # an idle kept-alive connection is not cut by the header deadline
            await asyncio.sleep(2 * HEADER_TIMEOUT_S)
        writer.write(request[:10])  # the next head starts, then stalls
        started = time.monotonic()
        elapsed, got = await _closed_after(reader, started)
        assert got == b"" and HEADER_TIMEOUT_S - 0.1 <= elapsed <= HEADER_TIMEOUT_S + SLACK_S
        writer.close()


BODY_TIMEOUT_S = 0.5


@pytest.mark.timeout(30)
@process_test
async def test_slow_bodies_are_408_and_closed() -> None:
    with proxy_process("--body-timeout", str(BODY_TIMEOUT_S)) as proxy:
        baseline = await proxy.baseline()
        started = time.monotonic()
        Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]
        stalled: list[Conn] = []
        trickling: list[Conn] = []
        for i in range(20):
            reader, writer = await asyncio.open_connection(HOST, proxy.port)
            path = METASERVER if i % 4 == 0 else COMPLETIONS
            writer.write(
                f"POST {path} HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
                f"Content-Length: 1000\r\n\r\n{{".encode()
            )
            (stalled if i % 2 else trickling).append((reader, writer))
        trickles = [asyncio.ensure_future(_trickle(w, 0.05)) for _, w in trickling]
        await asyncio.sleep(0.2)
        peak = proxy.fds()
        assert peak >= baseline + 20
        status, _ = await proxy.get("/healthcheck")
        assert status == 200

        # A client that stopped sending gets the 408, then the connection closes.
        closed = await asyncio.gather(*(_closed_after(r, started) for r, _ in stalled))
        for elapsed, got in closed:
            assert BODY_TIMEOUT_S - 0.1 <= elapsed <= BODY_TIMEOUT_S + SLACK_S
            head, _, body = got.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408"), got
            assert b"Connection: close" in head
            assert _is_error(json.loads(body), 408, "did not arrive within 0.5 s")
        # One still sending gets the same; its next bytes may meet a reset instead.
        closed_trickling = await asyncio.gather(*(_closed_after(r, started) for r, _ in trickling))
        for elapsed, got in closed_trickling:
            assert BODY_TIMEOUT_S - 0.1 <= elapsed <= BODY_TIMEOUT_S + SLACK_S
            assert got == b"" or got.startswith(b"HTTP/1.1 408"), got
        await asyncio.gather(*trickles)
        for _, writer in stalled + trickling:
            writer.close()
        after = await proxy.fds_settle(baseline, 2.0)
        assert after <= baseline
        stats = await proxy.connection_stats()
        assert stats["body_timeouts"] == 20
        assert stats["requests_rejected"] == 15 and stats["rendezvous_malformed"] == 5
        times = sorted(elapsed for elapsed, _ in closed + closed_trickling)
        answered = sum(got.startswith(b"HTTP/1.1 408") for _, got in closed + closed_trickling)
        print(
            f"\n20 slow bodies, --body-timeout {BODY_TIMEOUT_S}: proxy fds {baseline} -> {peak} -> "
            f"{after}; closed {times[0]:.2f}..{times[-1]:.2f} s after connecting, "
            f"{answered} of them read the 408 first"
        )


@pytest.mark.timeout(30)
@process_test
async def test_connections_beyond_the_cap_are_refused_at_once() -> None:
    cap, extra = 8, 5
    with proxy_process("--max-connections", str(cap), "--header-timeout", "20") as proxy:
        baseline = await proxy.baseline()
        idle = [await asyncio.open_connection(HOST, proxy.port) for _ in range(cap)]
        deadline = time.monotonic() + 3.0
        while proxy.fds() < baseline + cap:  # the proxy has accepted them all
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)

        started = time.monotonic()
        excess = [await asyncio.open_connection(HOST, proxy.port) for _ in range(extra)]
        refused = await asyncio.gather(*(_closed_after(r, started) for r, _ in excess))
        for elapsed, got in refused:
            assert elapsed < 2.0  # at once, not after the 20 s header deadline
            head, _, body = got.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in head, got
            assert _is_error(json.loads(body), 503, f"{cap} client connections")
        for _, writer in excess:
            writer.close()
        assert proxy.fds() <= baseline + cap

        for reader, writer in idle[:2]:  # slots free up: a good client is served again
            writer.close()
            await reader.read()
        assert await proxy.fds_settle(baseline + cap - 2, 2.0) <= baseline + cap - 2
        stats = await proxy.connection_stats()
        assert stats["refused"] == extra and stats["open"] == cap - 2 + 1

        for _, writer in idle[2:]:
            writer.close()
        after = await proxy.fds_settle(baseline, 2.0)
        assert after <= baseline
        print(
            f"\n--max-connections {cap}: proxy fds {baseline} -> {baseline + cap} with {cap} idle; "
            f"{extra} more answered 503 and closed within "
            f"{max(elapsed for elapsed, _ in refused) * 1000:.0f} ms; fds back to {after}"
        )


def _peak_rss_reset(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        return False
    return True


def _rss(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) << 10
    raise KeyError(key)


@pytest.mark.timeout(30)
@process_test
async def test_a_large_body_costs_the_proxy_about_twice_its_size() -> None:
    """Peak RSS of a real proxy process over one 16 MiB request, Decode and Prefill included.

    The body is held once as bytes until decoded, then as the decoded request plus one
    encoded copy for the backend it is sent to (it was ~6x before the body was read into
    one buffer and sent in slices).
    """
    kv: dict[str, asyncio.Event] = {}
    sent: dict[str, int] = {}

    async def decode(request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        child = f"cmpl-{request.headers['X-Request-Id']}-0"
        sent["decode"] = len(body["prompt"])
        rendezvous = Rendezvous(
            request_id=child,
            remote_engine_id="e",
            remote_host=HOST,
            remote_port=30000,
            remote_tp_size=1,
            remote_cached_tokens=0,
        )
        async with http.post(
            body["kv_transfer_params"]["metaserver"], data=encode_rendezvous(rendezvous)
        ) as resp:
            assert resp.status == 200
        await kv.setdefault(child, asyncio.Event()).wait()
        return web.json_response({"choices": [{"index": 0, "text": "ok"}]})

    async def prefill(request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        sent["prefill"] = len(body["prompt"])
        kv.setdefault(f"cmpl-{request.headers['X-Request-Id']}-0", asyncio.Event()).set()
        return web.json_response({"choices": [{"index": 0, "text": "p"}]})

    runners, ports = [], []
    for handler in (decode, prefill):
        app = web.Application(client_max_size=1 << 30)
        app.router.add_post(COMPLETIONS, handler)
        sock = bound_socket()
        runners.append(await start_runner(app, sock))
        ports.append(sock.getsockname()[1])
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20))
    try:
        with proxy_process(
            "--max-body-bytes", str(64 << 20), decode_port=ports[0], prefill_port=ports[1]
        ) as proxy:
            url = f"http://{HOST}:{proxy.port}{COMPLETIONS}"

            async def complete(rid: str, size: int) -> int:
                data = json.dumps({"model": "m", "prompt": "x" * size}).encode()
                async with http.post(url, data=data, headers={"X-Request-Id": rid}) as resp:
                    assert resp.status == 200, await resp.text()
                return len(data)

            await complete("warm-up", 1 << 20)
            before = _rss(proxy.pid, "VmRSS")
            if not _peak_rss_reset(proxy.pid):
                pytest.skip("/proc/<pid>/clear_refs is not writable here")
            size = await complete("large", 16 << 20)
            growth = _rss(proxy.pid, "VmHWM") - before
            print(
                f"proxy peak RSS growth for a {size / 2**20:.1f} MiB body: "
                f"{growth / 2**20:.1f} MiB = {growth / size:.2f}x"
            )
            assert sent == {"decode": 16 << 20, "prefill": 16 << 20}
            assert growth < 2.6 * size
    finally:
        await http.close()
        for runner in runners:
            await runner.cleanup()
