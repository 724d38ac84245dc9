"""One Prefill TP rank bound to the world: endpoint, DEALERs, transfer backend, clock.

Theory of operation
-------------------
:class:`PrefillWorker` owns a sans-IO :class:`~rd2h_protocol.producer.ProducerEndpoint`,
a :class:`~rd2h_runtime.control.PrefillControlClient` (one DEALER per Decode endpoint, one
I/O thread) and a :class:`~rd2h_runtime.transfer.TransferBackend` in which the rank's KV
regions are registered, so that Decode can read them. It takes no protocol decision: it
passes ``time.monotonic()`` as ``now``, executes the endpoint's outputs in order
(:class:`~rd2h_protocol.producer.Connect` and :class:`~rd2h_protocol.producer.Send` go to
the client, :class:`~rd2h_protocol.producer.GateOpened` wakes the compute path,
:class:`~rd2h_protocol.producer.RequestFinished` is reported) and hands the endpoint's
next deadline to the client's timer.

Two threads call into the endpoint: the compute path (the model runner: ``add_request``,
``schedule_chunk``, ``wait_writable``, ``layer_written``, ``end_step``, ``abort``) and the
client's I/O thread (frames from Decode and timers). The endpoint is not thread-safe, so
ONE lock serialises every call into it together with the execution of its outputs; the
outputs of one call are therefore executed before any other call starts. Executing an
output never blocks (the client queues frames), so the lock is held only while the
endpoint computes.
``wait_writable`` waits on a condition of that same lock and is woken by the outputs
(``GateOpened``) of whichever thread reopened the gate: a reply, or an expired lease.

Lock order: this worker's lock, then the client's internal lock (``send``,
``set_timer``); the client never calls into the worker while holding its own lock, so the
two cannot deadlock. Completion callbacks run outside the lock. The lock, the calls, the
trace and the lifecycle are :class:`~rd2h_runtime.worker.EndpointWorker`'s.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from rd2h_protocol.errors import LocalProtocolError
from rd2h_protocol.events import Chunk
from rd2h_protocol.machines import NO_EFFECT, no_effect
from rd2h_protocol.producer import (
    ClaimAnswered,
    Connect,
    DecodeTarget,
    Disconnect,
    GateOpened,
    LayerReplied,
    Output,
    ProducerConfig,
    ProducerEndpoint,
    ProducerStats,
    PublicationView,
    RequestFinished,
    Send,
)
from rd2h_protocol.wire.codec import StepEncoder
from rd2h_runtime.connection_health import (
    DECODE_CONNECTION_HEALTH,
    EFFECT_LOSE,
    EFFECT_RESUME,
    EFFECT_START_GRACE,
    H_LOCAL_CONNECT_FAILED,
    H_LOCAL_DECLARED_DEAD,
    H_RECV_BREAK_UNWATCHED,
    H_RECV_CONNECTED,
    H_RECV_DISCONNECTED,
    H_RECV_HANDSHAKE_FAILED,
    H_TIMER_GRACE_OVER,
    HEALTH_BROKEN,
    HEALTH_UP,
)
from rd2h_runtime.control import (
    ClientEvent,
    ConnectionEvent,
    ConnFrame,
    ControlError,
    ControlOptions,
    PrefillControlClient,
    TimerDue,
)
from rd2h_runtime.regions import layout_regions
from rd2h_runtime.trace import open_tracer
from rd2h_runtime.transfer import TransferBackend
from rd2h_runtime.worker import EndpointWorker

__all__ = ["PrefillMetrics", "PrefillWorker", "layout_regions"]

log = logging.getLogger("rd2h_runtime.prefill")

#: How many readiness -> reply round trips a worker keeps for percentiles.
ROUND_TRIP_SAMPLES: Final = 8192

#: The Decode connection health input of each socket monitor event kind (when watched).
HEALTH_INPUTS: Final[dict[str, str]] = {
    "connected": H_RECV_CONNECTED,
    "disconnected": H_RECV_DISCONNECTED,
    "handshake_failed": H_RECV_HANDSHAKE_FAILED,
    "connect_failed": H_LOCAL_CONNECT_FAILED,
}


@dataclass(slots=True)
class _Health:
    """One Decode connection's :data:`DECODE_CONNECTION_HEALTH` state (lock held)."""

    conn: str
    state: str = HEALTH_UP
    broke_at: float = 0.0  # when it last entered HEALTH_BROKEN


@dataclass(slots=True)
class PrefillMetrics:
    """Runtime counters of one worker (the endpoint's own are in ``stats``)."""

    gate_waits: int = 0  # wait_writable calls that found the storage busy
    gate_wait_s: float = 0.0  # total time spent waiting for gates
    gate_timeouts: int = 0  # wait_writable calls that gave up
    frames_sent: int = 0
    send_failures: int = 0  # frames the client refused (queue full or closed)
    disconnects: int = 0  # Decode connections that broke or failed (ZMQ monitor)
    reconnects: int = 0  # broken connections that came back within the grace
    handler_errors: int = 0  # exceptions caught on the I/O thread


class PrefillWorker(EndpointWorker[Output, RequestFinished, str, ClientEvent]):
    """One Prefill TP rank: a producer endpoint bound to DEALERs, a backend and a clock.

    ``config.session`` is replaced by ``backend.session_id`` (taken after registration,
    since some engines put the registered memory in it): Decode passes the MF_META session
    to its backend to reach this rank's memory, so nothing else can be right.
    ``regions`` default to :func:`~rd2h_runtime.regions.layout_regions` of
    ``config.layers``. The backend is closed with the worker when ``own_backend`` is True.

    ``on_finished`` is called (outside the lock, on whichever thread produced it) with
    every :class:`RequestFinished`; without it, results are kept until
    :meth:`wait_finished` or :meth:`take_finished` collects them.

    ``declare_dead_on_disconnect``: when the control client reports that an established
    connection to a Decode endpoint broke (the peer closed it, or ZMQ's heartbeat timed
    out) and it does not come back within ``reconnect_grace_s`` of the control options,
    tell the endpoint (``connection_lost``) so that publications a v1 peer can never answer
    stop holding their storage once their lease has run out. A connection that comes back
    in time (a peer stalled past the heartbeat timeout by a loaded machine) carries on: the
    DEALER keeps its routing id, and every publication still waiting for its reply is sent
    again under its seq (``connection_resumed``), so a readiness or a reply lost with the
    old connection costs nothing; a Decode without the ``resend`` capability gets no
    resend, and such a publication waits for its lease. A readiness queued by ZMQ during
    the break can overtake the resent ones: Decode sees a gap and fails what the lost
    one carried (a loss, never a wrong byte).
    """

    _ROLE = "Prefill"
    _log = log
    _CALLBACK = "on_finished"
    # The frame is lost; the publication's lease expires and reopens its gates.
    _DROPPED = "frame for %s dropped: %s"
    _TRACE_SENT = True
    _endpoint: ProducerEndpoint
    _control: PrefillControlClient
    metrics: PrefillMetrics

    def __init__(
        self,
        config: ProducerConfig,
        backend: TransferBackend,
        *,
        regions: Sequence[tuple[int, int]] | None = None,
        control_options: ControlOptions | None = None,
        on_finished: Callable[[RequestFinished], None] | None = None,
        own_backend: bool = True,
        name: str | None = None,
        declare_dead_on_disconnect: bool = True,
        trace_dir: str | None = None,
    ) -> None:
        super().__init__(backend, own_backend, on_finished)
        self._declare_dead = declare_dead_on_disconnect
        self._grace_s = (control_options or ControlOptions()).reconnect_grace_s
        # Decode endpoint -> the health of its connection (lock held).
        self._health: dict[str, _Health] = {}
        self._finished: dict[str, RequestFinished] = {}
        self._claim_answers: dict[str, ClaimAnswered] = {}  # (lock held) for claim()
        self.metrics = PrefillMetrics()
        # Readiness -> reply times of the latest publications (seconds), for percentiles.
        self._round_trips: collections.deque[float] = collections.deque(maxlen=ROUND_TRIP_SAMPLES)
        try:
            backend.register(
                list(regions) if regions is not None else layout_regions(config.layers)
            )
            self.config = dataclasses.replace(config, session=backend.session_id)
            self._endpoint = ProducerEndpoint(self.config)
            self._encoder = StepEncoder()  # under the lock, like the endpoint
            self._tracer = open_tracer(
                trace_dir, "prefill", config.p_rank, self.config, name=name or ""
            )
            self._control = PrefillControlClient(
                handler=self._on_event,
                options=control_options,
                name=name or f"p{config.p_rank}",
            )
            self._control.start()
        except BaseException:
            self._abandon()
            raise

    # -- compute path ----------------------------------------------------------------------

    def add_request(self, ext_req_id: str, target: DecodeTarget) -> None:
        """Register a request to publish to the Decode engine ``target``."""
        self._call(
            lambda now: self._endpoint.add_request(ext_req_id, target, now),
            "add_request",
            {"ext_req_id": ext_req_id, "target": (target.host, target.base_port, target.d_tp)},
        )

    def schedule_chunk(
        self,
        ext_req_id: str,
        main_block_ids: Sequence[int],
        indexer_block_ids: Sequence[int],
        main_start_block: int,
        indexer_start_block: int,
        final: bool,
    ) -> None:
        """Schedule the request's blocks of the current step (before its first layer)."""
        self._call(
            lambda now: self._endpoint.schedule_chunk(
                Chunk(
                    ext_req_id=ext_req_id,
                    main_block_ids=main_block_ids,
                    indexer_block_ids=indexer_block_ids,
                    main_start=main_start_block,
                    indexer_start=indexer_start_block,
                    final=final,
                ),
                now,
            ),
            "schedule_chunk",
            None
            if self._tracer is None
            else {
                "ext_req_id": ext_req_id,
                "main_block_ids": tuple(main_block_ids),
                "indexer_block_ids": tuple(indexer_block_ids),
                "main_start_block": main_start_block,
                "indexer_start_block": indexer_start_block,
                "final": final,
            },
        )

    def wait_writable(self, layer_idx: int, timeout: float) -> bool:
        """Block until the storage ``layer_idx`` writes may be overwritten; False on timeout.

        Woken by every reply or expired lease that reopens a gate. Under the "raise" read
        failure policy a failed read of that storage raises
        :class:`~rd2h_protocol.errors.TransferError` here (once), as v1 does.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            if self._can_overwrite(layer_idx):
                return True
            self.metrics.gate_waits += 1
            start = time.monotonic()
            ok = False
            try:
                while not self._can_overwrite(layer_idx):
                    left = deadline - time.monotonic()
                    if left <= 0 or self._closed:
                        self.metrics.gate_timeouts += 1
                        return False
                    self._cond.wait(left)
                ok = True
                return True
            finally:
                end = time.monotonic()
                self.metrics.gate_wait_s += end - start
                if self._tracer is not None:
                    self._tracer.gate(layer_idx, start, end, ok)

    def can_overwrite(self, layer_idx: int) -> bool:
        """Whether the storage of ``layer_idx`` is free now (never blocks)."""
        with self._lock:
            return self._can_overwrite(layer_idx)

    def layer_written(self, layer_idx: int) -> None:
        """Layer ``layer_idx`` of the current step is in storage: publish it.

        Call only after :meth:`wait_writable` returned True for this layer (the endpoint
        raises :class:`~rd2h_protocol.errors.LocalProtocolError` otherwise).
        """
        self._call(
            lambda now: self._endpoint.layer_written(layer_idx, now),
            "layer_written",
            None if self._tracer is None else {"layer_idx": layer_idx},
        )

    def end_step(self) -> None:
        """The engine step is over (requests whose chunk missed a layer fail)."""
        self._call(self._endpoint.end_step, "end_step")

    def abort(self, ext_ids: Iterable[str], reason: str = "aborted by Prefill") -> None:
        """Stop publishing these requests; their v2 Decode endpoints are told ``reason``."""
        ids = list(ext_ids)
        self._call(
            lambda now: self._endpoint.abort(ids, reason, now),
            "abort",
            {"ext_ids": ids, "reason": reason},
        )

    def keep_request(self, ext_req_id: str) -> None:
        """Prefill-first: keep a computed request for the Decode that will claim it.

        Raises :class:`~rd2h_protocol.errors.LocalProtocolError` when this Prefill cannot
        keep one (its message says why and names the Decode-first proxy).
        """
        self._call(
            lambda now: self._endpoint.keep_request(ext_req_id, now),
            "keep_request",
            {"ext_req_id": ext_req_id},
        )

    def claim(self, ext_req_id: str, target: DecodeTarget, chunk: Chunk) -> ClaimAnswered:
        """A Decode claims a kept request: publish every layer of ``chunk`` to ``target``
        now; the answer to send it back (refused: unknown, claimed already, unusable)."""
        self._call(
            lambda now: self._endpoint.claim(ext_req_id, target, chunk, now),
            "claim",
            None
            if self._tracer is None
            else {
                "ext_req_id": ext_req_id,
                "target": (target.host, target.base_port, target.d_tp),
                "main_block_ids": tuple(chunk.main_block_ids),
                "indexer_block_ids": tuple(chunk.indexer_block_ids),
                "main_start_block": chunk.main_start,
                "indexer_start_block": chunk.indexer_start,
                "final": chunk.final,
            },
        )
        with self._lock:
            return self._claim_answers.pop(ext_req_id)

    # -- completions -----------------------------------------------------------------------

    def wait_finished(self, ext_req_id: str, timeout: float) -> RequestFinished | None:
        """Wait for (and take) the request's :class:`RequestFinished`; None on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            if not self._wait_until(lambda: ext_req_id in self._finished, deadline):
                return None
            return self._finished.pop(ext_req_id)

    def take_finished(self) -> list[RequestFinished]:
        """Every result not collected yet, in completion order (without a callback)."""
        with self._lock:
            out = list(self._finished.values())
            self._finished.clear()
            return out

    # -- views -----------------------------------------------------------------------------

    @property
    def session(self) -> str:
        """The transfer session Decode reads this rank's memory through."""
        return self.config.session

    @property
    def stats(self) -> ProducerStats:
        """A snapshot of the endpoint's counters."""
        with self._lock:
            return dataclasses.replace(self._endpoint.stats)

    def round_trips(self) -> list[float]:
        """Readiness -> terminal reply times of the latest publications, in seconds."""
        with self._lock:
            return list(self._round_trips)

    def gates(self) -> dict[int, tuple[str, int]]:
        """``{slot: (state, outstanding publications)}`` (see the endpoint)."""
        with self._lock:
            return self._endpoint.gates()

    def publications(self) -> dict[int, PublicationView]:
        """Every publication still waiting for its reply."""
        with self._lock:
            return self._endpoint.publications()

    def is_idle(self) -> bool:
        """True when the endpoint holds no per-request state."""
        with self._lock:
            return self._endpoint.is_idle()

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the I/O thread, close every socket, close the backend (if owned). Idempotent.

        Waiters in :meth:`wait_writable` return False.
        """
        super().close()

    # -- internals -------------------------------------------------------------------------

    def _can_overwrite(self, layer_idx: int) -> bool:
        """The endpoint's ``can_overwrite``. Lock held. Under the "raise" policy it raises a
        failed read's error once (a change of state): the trace records that call."""
        if self._tracer is None:
            return self._endpoint.can_overwrite(layer_idx)
        try:
            return self._endpoint.can_overwrite(layer_idx)
        except Exception as exc:
            now = time.monotonic()
            self._tracer.call("can_overwrite", now, {"layer_idx": layer_idx}, None, exc)
            raise

    def _apply(
        self, outputs: list[Output], sent: list[bytes] | None
    ) -> tuple[list[RequestFinished], bool]:
        finished: list[RequestFinished] = []
        wake = False
        for out in outputs:
            if isinstance(out, Send):
                payload = self._encoder.encode(out.msg)
                self._send(out.conn, payload)
                if sent is not None:
                    sent.append(payload)
            elif isinstance(out, GateOpened):
                wake = True
            elif isinstance(out, RequestFinished):
                finished.append(out)
            elif isinstance(out, LayerReplied):
                self._round_trips.append(out.round_trip_s)
            elif isinstance(out, ClaimAnswered):
                self._claim_answers[out.ext_req_id] = out
            elif isinstance(out, Disconnect):
                # The endpoint declared the peer dead: a fresh DEALER next time.
                _HEALTH.fire(self, self._health_of(out.conn), H_LOCAL_DECLARED_DEAD)
                self._control.disconnect(out.conn)
                log.warning("Decode endpoint %s: %s; declaring it dead", out.conn, out.reason)
            elif isinstance(out, Connect):
                try:
                    self._control.connect(out.conn)
                except ControlError as exc:
                    # Frames for it fail in send() too; its leases expire and free the gates.
                    self.metrics.send_failures += 1
                    log.warning("cannot open the DEALER to %s: %s", out.conn, exc)
            else:  # pragma: no cover - the endpoint has no other output
                raise LocalProtocolError(f"unexpected endpoint output {out!r}")
        if finished and self._on_report is None:
            for f in finished:
                self._finished[f.ext_req_id] = f
            wake = True
        return (finished if self._on_report is not None else []), wake

    def _next_timer(self) -> float | None:
        """The endpoint's next deadline or the end of a reconnect grace, the earlier."""
        due = self._endpoint.get_timer()
        grace_end = min(
            (h.broke_at + self._grace_s for h in self._health.values() if h.state == HEALTH_BROKEN),
            default=None,
        )
        if grace_end is not None:
            due = grace_end if due is None else min(due, grace_end)
        return due

    def _health_of(self, conn: str) -> _Health:
        """``conn``'s :data:`DECODE_CONNECTION_HEALTH` record, ``up`` when new. Lock held."""
        health = self._health.get(conn)
        if health is None:
            health = self._health[conn] = _Health(conn)
        return health

    def _connection_event(self, event: ConnectionEvent[str], now: float) -> list[RequestFinished]:
        """A Decode connection came up, broke, or could not be made. Lock held.

        A broken connection gets ``reconnect_grace_s`` to come back before it counts as
        lost; a DEALER that cannot even be created counts as lost at once. A break is
        acted on only for a watched connection (see :mod:`rd2h_runtime.connection_health`).
        """
        conn = event.conn
        health_input = HEALTH_INPUTS[event.kind]
        if event.kind != "connected":
            self.metrics.disconnects += 1
            if not self._declare_dead or conn not in self._endpoint.connections():
                health_input = H_RECV_BREAK_UNWATCHED
        what = (
            f"cannot be opened ({event.address})" if event.kind == "connect_failed" else event.kind
        )
        finished: list[RequestFinished] = []
        _HEALTH.fire(self, self._health_of(conn), health_input, now, what, finished)
        return finished

    def _grace_over(self, now: float) -> list[RequestFinished]:
        """Declare lost every broken connection whose grace ran out. Lock held."""
        finished: list[RequestFinished] = []
        what = f"broken and not back within {self._grace_s:.1f} s"
        for health in list(self._health.values()):
            if health.state == HEALTH_BROKEN and health.broke_at + self._grace_s <= now:
                _HEALTH.fire(self, health, H_TIMER_GRACE_OVER, now, what, finished)
        return finished

    # -- the effects of DECODE_CONNECTION_HEALTH (``what``: what happened to it) -----------

    def _fx_resume(
        self, health: _Health, now: float, _what: str, finished: list[RequestFinished]
    ) -> None:
        """The broken connection came back within its grace."""
        conn = health.conn
        self.metrics.reconnects += 1
        log.info("Decode endpoint %s: connection back after %.1f s", conn, now - health.broke_at)
        # What was in flight may have gone down with the old connection.
        finished += self._execute(
            self._traced(
                lambda t: self._endpoint.connection_resumed(conn, t),
                now,
                "connection_resumed",
                {"conn": conn},
            )
        )

    def _fx_start_grace(
        self, health: _Health, now: float, what: str, _finished: list[RequestFinished]
    ) -> None:
        """A watched connection broke: it has ``reconnect_grace_s`` to come back."""
        log.warning(
            "Decode endpoint %s: connection %s; waiting %.1f s for it to come back",
            health.conn,
            what,
            self._grace_s,
        )
        health.broke_at = now
        self._control.set_timer(self._next_timer())

    def _fx_lose(
        self, health: _Health, now: float, what: str, finished: list[RequestFinished]
    ) -> None:
        """The connection is lost: past its grace, or its DEALER cannot be created."""
        finished += self._connection_lost(health.conn, what, now)

    def _connection_lost(self, conn: str, reason: str, now: float) -> list[RequestFinished]:
        """A Decode connection is gone for good (peer dead or unreachable). Lock held.

        The endpoint decides what that means for its publications (requests fail now,
        gates reopen no earlier than their leases); the DEALER is replaced so that frames
        queued for the old connection are never delivered late to a restarted peer, and
        the next publication starts a fresh handshake from a fresh routing id.
        """
        if conn not in self._endpoint.connections():
            return []
        log.warning("Decode endpoint %s: connection %s, declaring it lost", conn, reason)
        self._control.disconnect(conn)
        return self._execute(
            self._traced(
                lambda t: self._endpoint.connection_lost(conn, t),
                now,
                "connection_lost",
                {"conn": conn},
            )
        )

    def _handle(self, event: ClientEvent, now: float) -> list[RequestFinished]:
        """The client's I/O thread: frames from Decode, timers, connection events."""
        finished: list[RequestFinished] = []
        if isinstance(event, ConnFrame):
            finished = self._execute(
                self._traced(
                    lambda t: self._endpoint.receive(event.conn, event.payload, t),
                    now,
                    "receive",
                    None if self._tracer is None else {"conn": event.conn, "frame": event.payload},
                )
            )
        elif isinstance(event, TimerDue):
            finished = self._grace_over(now)
            finished += self._timer_due(now)
        elif isinstance(event, ConnectionEvent):
            finished = self._connection_event(event, now)
        return finished


# -- the table drives the action: each declared effect bound to its handler ----------------

_HEALTH: Final = DECODE_CONNECTION_HEALTH.bind(
    {
        NO_EFFECT: no_effect,
        EFFECT_RESUME: PrefillWorker._fx_resume,
        EFFECT_START_GRACE: PrefillWorker._fx_start_grace,
        EFFECT_LOSE: PrefillWorker._fx_lose,
    }
)
