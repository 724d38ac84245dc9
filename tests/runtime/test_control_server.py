"""DecodeControlServer against raw ZMQ DEALERs: v1 framing, isolation of reads, bounds."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import zmq

from rd2h_protocol.errors import ConfigError, ErrorCode, LocalProtocolError
from rd2h_runtime.control import (
    BindError,
    ControlOptions,
    DecodeControlServer,
    PeerFrame,
    PeerSendFailed,
    QueueFull,
    ServerEvent,
)

pytestmark = pytest.mark.timeout(20)

WAIT_S = 5.0


class Recorder:
    """A handler that records events (and optionally reacts) so a test can wait for them."""

    def __init__(self, react: Callable[[ServerEvent], None] | None = None) -> None:
        self.events: list[ServerEvent] = []
        self._cond = threading.Condition()
        self._react = react

    def __call__(self, event: ServerEvent) -> None:
        with self._cond:
            self.events.append(event)
            self._cond.notify_all()
        if self._react is not None:
            self._react(event)

    def frames(self) -> list[PeerFrame]:
        with self._cond:
            return [e for e in self.events if isinstance(e, PeerFrame)]

    def wait_frames(self, n: int) -> list[PeerFrame]:
        deadline = time.monotonic() + WAIT_S
        with self._cond:
            while len([e for e in self.events if isinstance(e, PeerFrame)]) < n:
                left = deadline - time.monotonic()
                assert left > 0, f"only {self.events!r} after {WAIT_S} s, wanted {n} frames"
                self._cond.wait(left)
            return [e for e in self.events if isinstance(e, PeerFrame)]

    def wait_for(self, kind: type) -> object:
        deadline = time.monotonic() + WAIT_S
        with self._cond:
            while True:
                for e in self.events:
                    if isinstance(e, kind):
                        return e
                left = deadline - time.monotonic()
                assert left > 0, f"no {kind.__name__} in {self.events!r} after {WAIT_S} s"
                self._cond.wait(left)


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture(autouse=True)
def no_leftover_threads() -> Iterator[None]:
    yield
    left = [t.name for t in threading.enumerate() if t.name.startswith("rd2h-control")]
    assert not left, f"I/O threads still running after the test: {left}"


def dealer(ctx: zmq.Context[zmq.Socket[bytes]], server: DecodeControlServer) -> zmq.Socket[bytes]:
    """A raw v1-style Prefill DEALER: no routing id, LINGER 0, bounded receive wait."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(WAIT_S * 1000))
    sock.connect(server.endpoint)
    return sock


def start_server(
    handler: Callable[[ServerEvent], None] | None, **options: object
) -> DecodeControlServer:
    server = DecodeControlServer(
        "127.0.0.1",
        0,
        handler=handler,
        options=ControlOptions(**options),  # type: ignore[arg-type]
    )
    server.start()
    return server


def test_v1_framing_one_frame_in_identity_empty_payload_out(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    rec = Recorder()
    server = start_server(rec)
    try:
        assert server.port > 0
        d = dealer(ctx, server)
        d.send(b"\x93\xc4\x07mf_meta")
        (frame,) = rec.wait_frames(1)
        assert frame.payload == b"\x93\xc4\x07mf_meta"
        assert isinstance(frame.peer, bytes) and frame.peer
        server.send(frame.peer, b"ACK")
        assert d.recv_multipart() == [b"", b"ACK"]
        assert server.stats.frames_in == 1
        deadline = time.monotonic() + WAIT_S
        while server.stats.frames_out != 1:  # counted just after ZMQ took the frame
            assert time.monotonic() < deadline
            time.sleep(0.001)
    finally:
        server.close()


def test_empty_frames_dropped_and_wrong_frame_counts_ignored(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    rec = Recorder()
    server = start_server(rec)
    try:
        d = dealer(ctx, server)
        d.send_multipart([b"", b"one"])  # a DEALER that adds the REQ-style delimiter
        d.send_multipart([b"", b"", b"two", b""])
        d.send_multipart([b""])  # nothing left: ignored
        d.send_multipart([b"a", b"b"])  # two frames left: ignored
        d.send_multipart([b"x", b"", b"y"])
        d.send(b"three")
        frames = rec.wait_frames(3)
        assert [f.payload for f in frames] == [b"one", b"two", b"three"]
        assert len({f.peer for f in frames}) == 1
        assert server.stats.malformed_frames == 3
        assert server.stats.frames_in == 3
    finally:
        server.close()


def test_replies_flow_while_a_read_runs_on_a_worker(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    release = threading.Event()
    workers: list[threading.Thread] = []

    def slow_read(peer: bytes) -> None:
        release.wait(WAIT_S)  # stands for a long data read
        server.send(peer, b"read_done")

    def react(event: ServerEvent) -> None:
        if not isinstance(event, PeerFrame):
            return
        if event.payload == b"read_ready":
            worker = threading.Thread(target=slow_read, args=(event.peer,))
            workers.append(worker)
            worker.start()
        else:
            server.send(event.peer, b"ack:" + event.payload)

    server = start_server(Recorder(react))
    try:
        d = dealer(ctx, server)
        d.send(b"read_ready")
        for i in range(5):
            d.send(b"abort-%d" % i)
            assert d.recv_multipart() == [b"", b"ack:abort-%d" % i]
        assert not release.is_set()
        release.set()
        assert d.recv_multipart() == [b"", b"read_done"]
    finally:
        release.set()
        for w in workers:
            w.join(WAIT_S)
        server.close()


def test_bind_clash_raises_naming_host_and_port() -> None:
    first = start_server(Recorder())
    try:
        t0 = time.monotonic()
        second = DecodeControlServer("127.0.0.1", first.port, handler=Recorder())
        with pytest.raises(BindError) as info:
            second.start()
        assert time.monotonic() - t0 < second.options.startup_timeout_s
        err = info.value
        assert err.host == "127.0.0.1" and err.port == first.port
        assert "127.0.0.1" in str(err) and str(first.port) in str(err)
        assert "in use" in str(err)
        assert not second.running
        second.close()  # harmless after a failed start
        assert first.running
    finally:
        first.close()


def test_send_queue_full_raises_then_drains(
    ctx: zmq.Context[zmq.Socket[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    rec = Recorder()
    server = start_server(rec, outgoing_capacity=8)
    entered = threading.Event()
    release = threading.Event()
    flush = server._flush

    def held_flush() -> None:
        # The handler no longer runs on the I/O thread, so hold the I/O thread here
        # instead: the queue cannot drain while it waits.
        if not release.is_set():
            entered.set()
            release.wait(WAIT_S)
        flush()

    try:
        d = dealer(ctx, server)
        d.send(b"hello")
        peer = rec.wait_frames(1)[0].peer
        monkeypatch.setattr(server, "_flush", held_flush)
        server.set_timer(time.monotonic())  # a loop turn, which stops in held_flush
        assert entered.wait(WAIT_S)
        for i in range(8):
            server.send(peer, b"%d" % i)
        with pytest.raises(QueueFull, match="8"):
            server.send(peer, b"overflow")
        assert server.stats.queue_full == 1
        release.set()
        assert [d.recv_multipart()[1] for _ in range(8)] == [b"%d" % i for i in range(8)]
    finally:
        release.set()
        server.close()


def test_reply_to_unknown_peer_is_reported_not_raised() -> None:
    rec = Recorder()
    server = start_server(rec)
    try:
        server.send(b"\x00gone", b"read_done")
        failed = rec.wait_for(PeerSendFailed)
        assert failed == PeerSendFailed(b"\x00gone", b"read_done", "unreachable")
        assert server.stats.send_failures == 1
    finally:
        server.close()


def test_oversize_frames_refused_both_ways(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    rec = Recorder()
    server = start_server(rec, max_frame_bytes=1024)
    try:
        with pytest.raises(LocalProtocolError) as info:
            server.send(b"peer", b"x" * 1025)
        assert info.value.code == ErrorCode.TOO_LARGE
        big = dealer(ctx, server)
        big.send(b"x" * 4096)  # ZMQ_MAXMSGSIZE: the server drops this connection
        small = dealer(ctx, server)
        small.send(b"fits")
        (frame,) = rec.wait_frames(1)
        assert frame.payload == b"fits"
        time.sleep(0.1)
        assert [f.payload for f in rec.frames()] == [b"fits"]
    finally:
        server.close()


def test_handler_errors_are_counted_and_the_loop_survives(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    def react(event: ServerEvent) -> None:
        if isinstance(event, PeerFrame):
            if event.payload == b"boom":
                raise RuntimeError("handler bug")
            server.send(event.peer, b"ok")

    server = start_server(Recorder(react))
    try:
        d = dealer(ctx, server)
        d.send(b"boom")
        d.send(b"fine")
        assert d.recv_multipart() == [b"", b"ok"]
        assert server.stats.handler_errors == 1
    finally:
        server.close()


def test_queue_mode_applies_back_pressure_without_loss(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    server = start_server(None, incoming_capacity=4)
    try:
        d = dealer(ctx, server)
        for i in range(50):
            d.send(b"%d" % i)
        time.sleep(0.2)  # the loop fills the queue, then stops reading
        got: list[bytes] = []
        while len(got) < 50:
            event = server.recv(WAIT_S)
            assert event is not None, f"stalled after {len(got)} frames"
            if isinstance(event, PeerFrame):
                got.append(event.payload)
        assert got == [b"%d" % i for i in range(50)]
        assert server.stats.dropped_events == 0
    finally:
        server.close()


def test_a_peer_that_stops_reading_gets_send_failures_not_a_stall(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    def react(event: ServerEvent) -> None:
        if isinstance(event, PeerFrame):
            if event.payload == b"flood-me":
                for _ in range(50):  # 50 MiB toward a peer that never reads
                    server.send(event.peer, b"x" * (1 << 20))
            else:
                server.send(event.peer, b"pong")

    rec = Recorder(react)
    server = start_server(rec, sndhwm=1)
    try:
        stuck = dealer(ctx, server)
        stuck.setsockopt(zmq.RCVHWM, 1)
        stuck.send(b"flood-me")
        failed = rec.wait_for(PeerSendFailed)
        assert isinstance(failed, PeerSendFailed) and failed.reason == "queue_full"
        healthy = dealer(ctx, server)
        healthy.send(b"ping")
        assert healthy.recv_multipart() == [b"", b"pong"]
        stats = server.stats
        assert stats.send_failures >= 1
        assert stats.send_failures + stats.frames_out >= 50
    finally:
        server.close()


# --- hostile peers: byte budgets and fairness ---------------------------------------------------


def test_frames_over_a_peers_byte_budget_are_dropped_counted_and_logged_once(
    ctx: zmq.Context[zmq.Socket[bytes]], caplog: pytest.LogCaptureFixture
) -> None:
    release = threading.Event()

    def react(event: ServerEvent) -> None:
        if isinstance(event, PeerFrame) and event.payload.startswith(b"F"):
            release.wait(WAIT_S)  # the flood's first frame holds the handler

    rec = Recorder(react)
    # One frame of max_frame_bytes in service and one waiting, per peer.
    server = start_server(rec, max_frame_bytes=1024, peer_inbound_bytes=2 * (1024 + 256))
    caplog.set_level(logging.WARNING, logger="rd2h_runtime.control")
    try:
        flooder = ctx.socket(zmq.DEALER)
        flooder.setsockopt(zmq.IDENTITY, b"flooder")
        flooder.setsockopt(zmq.LINGER, 0)
        flooder.connect(server.endpoint)
        for i in range(20):
            flooder.send(b"F%03d" % i + b"x" * 1000)
        deadline = time.monotonic() + WAIT_S
        while server.stats.dropped_over_budget < 18:
            assert time.monotonic() < deadline, server.stats
            time.sleep(0.01)
        # Another peer has a budget of its own: its frame goes first, though it came last.
        other = dealer(ctx, server)
        other.send(b"other")
        deadline = time.monotonic() + WAIT_S
        while server.stats.frames_in < 3:
            assert time.monotonic() < deadline, server.stats
            time.sleep(0.01)
        release.set()
        frames = rec.wait_frames(3)
        assert [f.payload[:4] for f in frames] == [b"F000", b"othe", b"F001"]
        stats = server.stats
        assert (stats.frames_in, stats.dropped_over_budget, stats.peers_over_budget) == (3, 18, 1)
        assert stats.dropped_over_budget_bytes == 18 * 1004
    finally:
        release.set()
        server.close()
    lines = [r.getMessage() for r in caplog.records if "over its budget" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "b'flooder'" in lines[0] and "2560 bytes" in lines[0], lines[0]
    assert "ControlOptions.peer_inbound_bytes" in lines[0], lines[0]


def test_a_peer_whose_frames_are_dear_waits_behind_the_others(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    order: list[bytes] = []

    def react(event: ServerEvent) -> None:
        if isinstance(event, PeerFrame):
            order.append(event.payload)
            if event.payload.startswith(b"slow"):
                time.sleep(0.05)  # 1.5 s of backlog in all: ample time for the second peer

    server = start_server(Recorder(react))
    try:
        slow = dealer(ctx, server)
        for i in range(30):
            slow.send(b"slow%d" % i)
        deadline = time.monotonic() + WAIT_S
        while not order:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        quick = dealer(ctx, server)
        for i in range(5):
            quick.send(b"quick%d" % i)
        deadline = time.monotonic() + WAIT_S
        while len(order) < 35:
            assert time.monotonic() < deadline, order
            time.sleep(0.01)
        # Each quick frame waits at most for the slow frame in service, not the backlog.
        last_quick = max(i for i, p in enumerate(order) if p.startswith(b"quick"))
        slow_before = sum(1 for p in order[:last_quick] if p.startswith(b"slow"))
        assert slow_before <= 8, order
        assert [p for p in order if p.startswith(b"slow")] == [b"slow%d" % i for i in range(30)]
    finally:
        server.close()


def test_budgets_must_hold_one_largest_frame() -> None:
    with pytest.raises(ConfigError, match="peer_inbound_bytes"):
        ControlOptions(max_frame_bytes=4096, peer_inbound_bytes=4096)
    options = ControlOptions(max_frame_bytes=4096)
    assert options.peer_inbound_bytes == 3 * (4096 + 256) // 2
    assert options.inbound_bytes == 16 * (4096 + 256)


def test_large_frames_arrive_uncopied_small_ones_as_bytes(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    rec = Recorder()
    server = start_server(rec)
    try:
        d = dealer(ctx, server)
        big = bytes(range(256)) * 1024  # 256 KiB: a view of ZMQ's buffer, not a copy
        d.send(big)
        d.send(b"small")
        first, second = rec.wait_frames(2)
        assert isinstance(first.payload, memoryview) and first.payload == big
        assert isinstance(second.payload, bytes) and second.payload == b"small"
    finally:
        server.close()


def test_a_burst_passes_zmqs_one_frame_queue_in_order_without_loss(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    # With one frame queued per peer (peer_queued_frames=1), ZMQ stops reading the
    # connection when that is full, so a burst waits in TCP, it is not dropped.
    rec = Recorder()
    server = start_server(rec, peer_queued_frames=1)
    try:
        d = dealer(ctx, server)
        for i in range(2000):
            d.send(b"%d" % i)
        frames = rec.wait_frames(2000)
        assert [f.payload for f in frames] == [b"%d" % i for i in range(2000)]
        assert server.stats.dropped_over_budget == 0
    finally:
        server.close()
