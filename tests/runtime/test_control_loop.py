"""The I/O loop both socket sets share: timers, no busy polling, heartbeats, shutdown."""

from __future__ import annotations

import itertools
import os
import selectors
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from rd2h_protocol.errors import ConfigError
from rd2h_runtime.control import (
    ClientEvent,
    ConnectionEvent,
    ControlClosed,
    ControlError,
    ControlOptions,
    DecodeControlServer,
    PeerFrame,
    PrefillControlClient,
    ServerEvent,
    TimerDue,
    parse_conn,
    tcp_url,
)

pytestmark = pytest.mark.timeout(20)

WAIT_S = 5.0
Ctx = zmq.Context[zmq.Socket[bytes]]


@pytest.fixture(autouse=True)
def no_leftover_threads() -> Iterator[None]:
    yield
    left = [t.name for t in threading.enumerate() if t.name.startswith("rd2h-control")]
    assert not left, f"I/O threads still running after the test: {left}"


class Events:
    """Handler collecting events; ``wait`` returns the first one matching a predicate."""

    def __init__(self) -> None:
        self.items: list[object] = []
        self.cond = threading.Condition()

    def __call__(self, event: object) -> None:
        with self.cond:
            self.items.append(event)
            self.cond.notify_all()

    def wait(self, cls: type, timeout: float = WAIT_S, **fields: object) -> object | None:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for e in self.items:
                    if isinstance(e, cls) and all(getattr(e, k) == v for k, v in fields.items()):
                        return e
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.cond.wait(left)


def server_with(handler: object, **options: object) -> DecodeControlServer:
    server = DecodeControlServer(
        "127.0.0.1",
        0,
        handler=handler,  # type: ignore[arg-type]
        options=ControlOptions(**options),  # type: ignore[arg-type]
    )
    server.start()
    return server


# --- timers -----------------------------------------------------------------------------------


def test_timer_fires_once_at_its_deadline() -> None:
    events = Events()
    server = server_with(events, idle_poll_s=5.0)
    try:
        deadline = time.monotonic() + 0.2
        server.set_timer(deadline)
        fired = events.wait(TimerDue)
        assert isinstance(fired, TimerDue)
        # Never early; late by at most a generous scheduling tolerance.
        assert deadline <= fired.now < deadline + 0.5
        time.sleep(0.1)
        assert sum(isinstance(e, TimerDue) for e in events.items) == 1
        assert server.stats.timers_fired == 1
    finally:
        server.close()


def test_moving_the_deadline_earlier_wakes_the_loop() -> None:
    events = Events()
    # With a 5 s idle poll, only the wake-up can make a 0.1 s timer fire within a second.
    server = server_with(events, idle_poll_s=5.0)
    try:
        server.set_timer(time.monotonic() + 30.0)
        time.sleep(0.05)  # the loop is now asleep on the 30 s deadline (capped at 5 s)
        deadline = time.monotonic() + 0.1
        server.set_timer(deadline)
        fired = events.wait(TimerDue, timeout=1.0)
        assert isinstance(fired, TimerDue) and fired.now >= deadline
    finally:
        server.close()


def test_disarmed_timer_does_not_fire() -> None:
    events = Events()
    server = server_with(events)
    try:
        server.set_timer(time.monotonic() + 0.1)
        server.set_timer(None)
        assert events.wait(TimerDue, timeout=0.4) is None
    finally:
        server.close()


def test_handler_rearms_the_timer_like_an_endpoint() -> None:
    fired: list[float] = []
    done = threading.Event()
    period = 0.02

    def on_event(event: ServerEvent) -> None:
        if isinstance(event, TimerDue):
            fired.append(event.now)
            if len(fired) < 10:
                server.set_timer(event.now + period)  # handle_timer, then get_timer()
            else:
                done.set()

    server = server_with(on_event)
    try:
        server.set_timer(time.monotonic() + period)
        assert done.wait(WAIT_S)
        gaps = [b - a for a, b in itertools.pairwise(fired)]
        assert all(gap >= period for gap in gaps), gaps
    finally:
        server.close()


def test_timer_reaches_a_queue_consumer() -> None:
    client = PrefillControlClient()
    client.start()
    try:
        deadline = time.monotonic() + 0.05
        client.set_timer(deadline)
        event = client.recv(WAIT_S)
        assert isinstance(event, TimerDue) and event.now >= deadline
    finally:
        client.close()


# --- no busy polling --------------------------------------------------------------------------


def _thread_cpu_s(name: str) -> float:
    """CPU time (user + system) a live thread of this process used so far, from /proc."""
    (thread,) = [t for t in threading.enumerate() if t.name == name]
    assert thread.native_id is not None
    with open(f"/proc/self/task/{thread.native_id}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return ticks / os.sysconf("SC_CLK_TCK")


def test_idle_loop_sleeps_in_the_poller() -> None:
    server = server_with(Events(), idle_poll_s=0.05)
    try:
        server.set_timer(time.monotonic() + 60.0)  # armed but far: the loop must still sleep
        name = f"rd2h-control-router-127.0.0.1:{server.port}"
        before = _thread_cpu_s(name)
        time.sleep(1.0)
        used = _thread_cpu_s(name) - before
        # A 1 ms busy poll would burn most of a core; 20 idle wake-ups cost next to nothing.
        assert used < 0.1, f"I/O thread used {used:.3f} s CPU in 1 s of idleness"
    finally:
        server.close()


# --- heartbeats -------------------------------------------------------------------------------


class FreezableRelay:
    """A TCP relay on 127.0.0.1 that can stop forwarding while keeping its connections open.

    Frozen, the peer behind it still looks alive to TCP but sends nothing, which only ZMQ
    heartbeats can detect.
    """

    def __init__(self, target_port: int) -> None:
        self._target = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._frozen = threading.Event()
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self._thread = threading.Thread(target=self._run, name="test-relay", daemon=True)
        self._thread.start()

    def freeze(self) -> None:
        self._frozen.set()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(WAIT_S)
        for s in [self._listener, *self._socks]:
            s.close()

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ, None)
        paused = False
        while not self._stop.is_set():
            if self._frozen.is_set() and not paused:
                for s in self._socks:  # stop reading: bytes pile up in the kernel buffers
                    sel.unregister(s)
                paused = True
            for key, _ in sel.select(0.05):
                if key.data is None:
                    down, _ = self._listener.accept()
                    up = socket.create_connection(("127.0.0.1", self._target))
                    self._socks += [down, up]
                    if not paused:
                        sel.register(down, selectors.EVENT_READ, up)
                        sel.register(up, selectors.EVENT_READ, down)
                    continue
                src: socket.socket = key.fileobj  # type: ignore[assignment]
                data = src.recv(65536)
                if not data:
                    sel.unregister(src)
                    sel.unregister(key.data)
                    continue
                key.data.sendall(data)
        sel.close()


FAST_HEARTBEAT: dict[str, float] = {
    "heartbeat_ivl_s": 0.1,
    "heartbeat_timeout_s": 0.3,
    "heartbeat_ttl_s": 1.0,
}


def test_client_heartbeat_detects_a_silent_decode_endpoint() -> None:
    ctx: Ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    relay = FreezableRelay(port)
    events = Events()
    options = ControlOptions(**FAST_HEARTBEAT)  # type: ignore[arg-type]
    client = PrefillControlClient(handler=events, options=options)
    client.start()
    try:
        conn = f"127.0.0.1:{relay.port}"
        client.connect(conn)
        assert events.wait(ConnectionEvent, kind="connected", conn=conn) is not None
        time.sleep(0.5)  # heartbeats flow through the live relay: no disconnect
        assert events.wait(ConnectionEvent, timeout=0.0, kind="disconnected") is None
        relay.freeze()
        t0 = time.monotonic()
        assert events.wait(ConnectionEvent, kind="disconnected", conn=conn) is not None
        assert time.monotonic() - t0 < 2.0
    finally:
        client.close()
        relay.close()
        ctx.destroy(linger=0)


def test_server_heartbeat_detects_a_silent_prefill_peer() -> None:
    events = Events()
    server = server_with(events, **FAST_HEARTBEAT)
    relay = FreezableRelay(server.port)
    ctx: Ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{relay.port}")
    try:
        dealer.send(b"hello")
        assert events.wait(PeerFrame, payload=b"hello") is not None
        assert events.wait(ConnectionEvent, kind="connected") is not None
        relay.freeze()
        disconnected = events.wait(ConnectionEvent, kind="disconnected")
        assert isinstance(disconnected, ConnectionEvent) and disconnected.conn is None
        assert disconnected.address == server.endpoint
    finally:
        server.close()
        relay.close()
        ctx.destroy(linger=0)


# --- lifecycle --------------------------------------------------------------------------------


def test_close_joins_every_thread_and_is_idempotent() -> None:
    before = set(threading.enumerate())
    server = server_with(Events())
    client = PrefillControlClient()
    client.start()
    client.send(f"127.0.0.1:{server.port}", b"x")
    # The server's I/O thread and its dispatcher (which runs the handler), the client's.
    assert len(set(threading.enumerate()) - before) == 3
    client.close()
    server.close()
    client.close()
    server.close()
    assert set(threading.enumerate()) == before
    with pytest.raises(ControlClosed):
        server.send(b"peer", b"x")
    with pytest.raises(ControlClosed):
        client.send("127.0.0.1:1", b"x")
    with pytest.raises(ControlClosed):
        server.set_timer(1.0)
    with pytest.raises(ControlClosed):
        client.start()


def test_close_wakes_a_blocked_recv() -> None:
    client = PrefillControlClient()
    client.start()
    outcome: list[BaseException] = []

    def consumer() -> None:
        try:
            client.recv(timeout=None)
        except BaseException as exc:
            outcome.append(exc)

    t = threading.Thread(target=consumer)
    t.start()
    time.sleep(0.05)
    client.close()
    t.join(WAIT_S)
    assert not t.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], ControlClosed)


def test_close_from_the_handler_stops_the_loop() -> None:
    def on_event(event: ServerEvent) -> None:
        if isinstance(event, TimerDue):
            server.close()

    server = server_with(on_event)
    name = f"rd2h-control-router-127.0.0.1:{server.port}"
    server.set_timer(time.monotonic())
    deadline = time.monotonic() + WAIT_S
    while any(t.name == name for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the loop kept running after close()"
        time.sleep(0.01)
    assert not server.running


def test_close_raises_when_the_handler_never_returns() -> None:
    release = threading.Event()

    def on_event(event: ServerEvent) -> None:
        if isinstance(event, TimerDue):
            release.wait(WAIT_S)

    server = server_with(on_event)
    server.set_timer(time.monotonic())
    time.sleep(0.05)
    with pytest.raises(ControlError, match="still running"):
        server.close(timeout=0.1)
    release.set()
    server.close()  # idempotent: the first call already asked the loop to stop
    deadline = time.monotonic() + WAIT_S
    while any(t.name.startswith("rd2h-control") for t in threading.enumerate()):
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_an_external_context_is_left_open() -> None:
    ctx: Ctx = zmq.Context()
    try:
        server = DecodeControlServer("127.0.0.1", 0, handler=Events(), context=ctx)
        server.start()
        server.close()
        probe = ctx.socket(zmq.PAIR)  # raises if the server had terminated the context
        probe.close(linger=0)
        assert not ctx.closed
    finally:
        ctx.destroy(linger=0)


def test_use_before_start_and_double_start() -> None:
    client = PrefillControlClient()
    with pytest.raises(ControlClosed):
        client.send("127.0.0.1:1", b"x")
    with pytest.raises(ControlClosed):
        client.recv(0.0)
    client.start()
    try:
        with pytest.raises(ControlClosed, match="twice"):
            client.start()
    finally:
        client.close()
    never_started = PrefillControlClient()
    never_started.close()
    never_started.close()


def test_recv_needs_queue_mode() -> None:
    server = server_with(Events())
    try:
        with pytest.raises(ControlError, match="handler"):
            server.recv(0.0)
    finally:
        server.close()


# --- configuration ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"heartbeat_ivl_s": 1.0, "heartbeat_timeout_s": 1.0}, "exceed"),
        ({"heartbeat_ttl_s": 7000.0}, "6553.5"),
        ({"outgoing_capacity": 0}, "outgoing_capacity"),
        ({"idle_poll_s": -1.0}, "idle_poll_s"),
        ({"reconnect_ivl_s": 2.0, "reconnect_ivl_max_s": 1.0}, "reconnect_ivl_max_s"),
    ],
)
def test_bad_options_are_refused(options: dict[str, float], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        ControlOptions(**options)  # type: ignore[arg-type]


def test_bad_server_address_is_refused_before_any_socket() -> None:
    with pytest.raises(ConfigError):
        DecodeControlServer("", 5000)
    with pytest.raises(ConfigError):
        DecodeControlServer("127.0.0.1", 65536)


@pytest.mark.parametrize(
    ("conn", "host", "port", "url"),
    [
        ("127.0.0.1:5000", "127.0.0.1", 5000, "tcp://127.0.0.1:5000"),
        ("decode-0.svc:65535", "decode-0.svc", 65535, "tcp://decode-0.svc:65535"),
        ("[fe80::1]:1", "fe80::1", 1, "tcp://[fe80::1]:1"),
    ],
)
def test_connection_names(conn: str, host: str, port: int, url: str) -> None:
    assert parse_conn(conn) == (host, port)
    assert tcp_url(host, port) == url


def test_client_events_type_alias_covers_timer() -> None:
    # ClientEvent is what a binding annotates its handler with; TimerDue must be part of it.
    event: ClientEvent = TimerDue(1.0)
    assert isinstance(event, TimerDue)
