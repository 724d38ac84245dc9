"""PrefillControlClient against raw ZMQ ROUTERs and our server: framing, isolation, bounds."""

from __future__ import annotations

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
    ConnFrame,
    ControlError,
    ControlOptions,
    DecodeControlServer,
    PeerFrame,
    PrefillControlClient,
    QueueFull,
    ServerEvent,
    TimerDue,
)

pytestmark = pytest.mark.timeout(20)

WAIT_S = 5.0
Ctx = zmq.Context[zmq.Socket[bytes]]


@pytest.fixture
def ctx() -> Iterator[Ctx]:
    context: Ctx = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture(autouse=True)
def no_leftover_threads() -> Iterator[None]:
    yield
    left = [t.name for t in threading.enumerate() if t.name.startswith("rd2h-control")]
    assert not left, f"I/O threads still running after the test: {left}"


def router(ctx: Ctx) -> tuple[zmq.Socket[bytes], str]:
    """A raw v1-style Decode ROUTER on an ephemeral port, and its "host:port"."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(WAIT_S * 1000))
    sock.bind("tcp://127.0.0.1:*")
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(endpoint, bytes)
    return sock, endpoint.decode().removeprefix("tcp://")


def dead_conn() -> str:
    """A "host:port" nobody listens on (a port the kernel just handed out and released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"127.0.0.1:{port}"


def fill(client: PrefillControlClient, conn: str, capacity: int) -> None:
    """Send to a dead ``conn`` until both ZMQ's queue and ours are full, which is when
    ``send`` raises QueueFull and the I/O thread can no longer move a frame into ZMQ."""
    deadline = time.monotonic() + WAIT_S
    stable = 0
    while stable < 2:
        assert time.monotonic() < deadline, f"{conn} never filled up"
        try:
            client.send(conn, b"to-dead")
            stable = 0
        except QueueFull as exc:
            assert conn in str(exc) and str(capacity) in str(exc)
            time.sleep(0.05)
            stable = stable + 1 if client.pending(conn) == capacity else 0


def next_frame(client: PrefillControlClient) -> ConnFrame:
    deadline = time.monotonic() + WAIT_S
    while True:
        event = client.recv(max(0.0, deadline - time.monotonic()))
        assert event is not None, "no frame within the wait"
        if isinstance(event, ConnFrame):
            return event


def start_client(**options: object) -> PrefillControlClient:
    client = PrefillControlClient(options=ControlOptions(**options))  # type: ignore[arg-type]
    client.start()
    return client


def test_v1_framing_one_frame_out_empty_delimiter_in(ctx: Ctx) -> None:
    r, conn = router(ctx)
    client = start_client()
    try:
        client.send(conn, b"\x93\xc4\x07mf_meta")
        frames = r.recv_multipart()
        assert len(frames) == 2 and frames[1] == b"\x93\xc4\x07mf_meta"
        identity = frames[0]
        # Our own routing id (ZMQ reserves ids that start with a zero byte for its own).
        assert identity.startswith(b"rd2h-") and len(identity) == 21
        r.send_multipart([identity, b"", b"ACK"])
        assert next_frame(client) == ConnFrame(conn, b"ACK")
        r.send_multipart([identity, b"", b"", b"two", b""])
        r.send_multipart([identity, b""])  # nothing left: ignored
        r.send_multipart([identity, b"", b"a", b"b"])  # two left: ignored
        r.send_multipart([identity, b"three"])  # no delimiter: still exactly one frame
        assert next_frame(client).payload == b"two"
        assert next_frame(client).payload == b"three"
        stats = client.stats
        assert stats.malformed_frames == 2 and stats.frames_in == 3 and stats.frames_out == 1
    finally:
        client.close()


def test_dead_endpoint_does_not_stall_a_live_one(ctx: Ctx) -> None:
    r, live = router(ctx)
    dead = dead_conn()
    client = start_client(sndhwm=4, rcvhwm=4, outgoing_capacity=4)
    try:
        fill(client, dead, 4)
        t0 = time.monotonic()
        got: list[bytes] = []
        for i in range(20):
            # The live endpoint's small queue refills as it drains: retry is back-pressure.
            while True:
                try:
                    client.send(live, b"%d" % i)
                    break
                except QueueFull:
                    got.append(r.recv_multipart()[1])
        while len(got) < 20:
            got.append(r.recv_multipart()[1])
        assert got == [b"%d" % i for i in range(20)]
        assert time.monotonic() - t0 < WAIT_S
        assert client.pending(dead) == 4
        assert sorted(client.connections()) == sorted([dead, live])
    finally:
        client.close()


def test_disconnect_drops_queued_frames_and_reconnects_with_a_new_identity(ctx: Ctx) -> None:
    r, live = router(ctx)
    dead = dead_conn()
    client = start_client(sndhwm=2, rcvhwm=2, outgoing_capacity=3)
    try:
        fill(client, dead, 3)
        assert client.disconnect(dead) == 3
        assert client.disconnect(dead) == 0
        assert client.stats.dropped_outgoing == 3 and client.stats.queue_full >= 2
        client.send(live, b"first")
        first_id, payload = r.recv_multipart()
        assert payload == b"first"
        client.disconnect(live)
        client.send(live, b"second")
        second_id, payload = r.recv_multipart()
        assert payload == b"second" and second_id != first_id
        assert client.connections() == [live]
    finally:
        client.close()


def test_a_reconnect_keeps_the_routing_id(ctx: Ctx) -> None:
    # ZMQ reconnects a broken connection by itself; the Decode side must see the same peer,
    # so that its replies to frames of the old connection reach this DEALER.
    r, live = router(ctx)
    client = start_client()
    try:
        client.send(live, b"before")
        first_id, payload = r.recv_multipart()
        assert payload == b"before"
        r.close(linger=0)
        deadline = time.monotonic() + WAIT_S
        while True:  # the same port again, as a restarted Decode would bind it
            try:
                r = ctx.socket(zmq.ROUTER)
                r.setsockopt(zmq.LINGER, 0)
                r.setsockopt(zmq.RCVTIMEO, int(WAIT_S * 1000))
                r.bind(f"tcp://{live}")
                break
            except zmq.ZMQError:
                r.close(linger=0)
                assert time.monotonic() < deadline, f"{live} did not become free"
                time.sleep(0.05)
        client.send(live, b"after")
        second_id, payload = r.recv_multipart()
        assert payload == b"after" and second_id == first_id
    finally:
        client.close()
        r.close(linger=0)


def test_connection_events_follow_the_peer(ctx: Ctx) -> None:
    r, live = router(ctx)
    client = start_client()
    try:
        client.connect(live)
        events: list[ClientEvent] = []
        while not any(isinstance(e, ConnectionEvent) and e.kind == "connected" for e in events):
            event = client.recv(WAIT_S)
            assert event is not None, f"no connected event in {events!r}"
            events.append(event)
        r.close(linger=0)  # the Decode side goes away
        while not any(isinstance(e, ConnectionEvent) and e.kind == "disconnected" for e in events):
            event = client.recv(WAIT_S)
            assert event is not None, f"no disconnected event in {events!r}"
            events.append(event)
        assert all(isinstance(e, ConnectionEvent) and e.conn == live for e in events)
        assert client.stats.connected == 1 and client.stats.disconnected == 1
    finally:
        client.close()


def test_bad_connection_names_and_connection_limit() -> None:
    client = start_client(max_connections=2)
    try:
        for bad in ("localhost", "host:", ":123", "127.0.0.1:0", "127.0.0.1:70000", "h:1x"):
            with pytest.raises(ConfigError):
                client.send(bad, b"x")
        client.connect(dead_conn())
        client.connect(dead_conn())
        with pytest.raises(ControlError, match="max_connections"):
            client.send(dead_conn(), b"x")
        assert len(client.connections()) == 2
    finally:
        client.close()


def test_ping_pong_1000_messages_with_our_server() -> None:
    def echo(event: ServerEvent) -> None:
        if isinstance(event, PeerFrame):
            server.send(event.peer, b"pong:" + event.payload)

    server = DecodeControlServer("127.0.0.1", 0, handler=echo)
    server.start()
    client = start_client()
    try:
        conn = f"127.0.0.1:{server.port}"
        for i in range(1000):
            client.send(conn, b"%d" % i)
            assert next_frame(client) == ConnFrame(conn, b"pong:%d" % i)
        assert server.stats.frames_in == 1000 and client.stats.frames_in == 1000
        assert server.stats.malformed_frames == 0 and client.stats.malformed_frames == 0
    finally:
        client.close()
        server.close()


def test_handler_can_open_a_new_endpoint_and_send_at_once(ctx: Ctx) -> None:
    r, live = router(ctx)

    def on_event(event: ClientEvent) -> None:
        # Runs on the I/O thread, which therefore gets no wake-up: the loop must still
        # open the DEALER and flush within this turn.
        if isinstance(event, TimerDue):
            client.send(live, b"from-the-handler")

    client = PrefillControlClient(handler=on_event, options=ControlOptions(idle_poll_s=5.0))
    client.start()
    try:
        t0 = time.monotonic()
        client.set_timer(t0)
        frames = r.recv_multipart()
        assert frames[1] == b"from-the-handler"
        assert time.monotonic() - t0 < 2.0  # well under the 5 s idle poll
    finally:
        client.close()
