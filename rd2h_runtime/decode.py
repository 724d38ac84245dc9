"""One Decode TP rank bound to the world: endpoint, ROUTER, read worker, transfer backend.

Theory of operation
-------------------
:class:`DecodeWorker` owns a sans-IO :class:`~rd2h_protocol.consumer.ConsumerEndpoint`,
a :class:`~rd2h_runtime.control.DecodeControlServer` (the rank's ROUTER: an I/O thread,
and a dispatcher thread that hands each peer's frames to this worker fairly),
a read worker thread and a :class:`~rd2h_runtime.transfer.TransferBackend` in which the
rank's destinations are registered. It takes no protocol decision: it passes
``time.monotonic()`` as ``now`` and executes the endpoint's outputs in order --
:class:`~rd2h_protocol.consumer.Reply` / :class:`~rd2h_protocol.consumer.SendAbort` go to
the ROUTER, :class:`~rd2h_protocol.consumer.StartRead` goes to the read worker's queue,
:class:`~rd2h_protocol.consumer.RequestDone` / :class:`~rd2h_protocol.consumer.RequestFailed`
/ :class:`~rd2h_protocol.consumer.Releasable` are recorded for the caller -- and hands the
endpoint's next deadline to the ROUTER's timer.

The socket loop never runs a read (departure 7): a plan is turned into descriptors
(:func:`~rd2h_runtime.planning.build_descriptors`) and read on the read worker, bounded by
``read_timeout_s`` and by the plan's ``finish_by`` (receipt plus lease, after which
Prefill may reuse the storage); the outcome goes back to the endpoint with
``read_finished``. So ACKs, replies and ABORTs for other peers keep flowing while a read
runs. A read whose ``start_by`` passed before the worker got to it is not started: it is
reported as a ``LEASE_EXPIRED`` failure, as the endpoint asks.

Inline reads. Handing a plan to the read worker costs a thread hand-off (a queue wake-up
and the GIL) per layer, which a small layer's round trip feels (issue 23). So the
dispatcher runs a plan itself, right after the frame that produced it, when all of these
hold (:meth:`DecodeWorker._inline_ok`):

* the backend reads on the calling thread, so a read that returned or raised has nothing
  left running (loopback and cma by default; ``inline_read_bytes`` opts another in or
  turns the path off);
* the plan is small: at most ``inline_read_bytes`` (1 MiB by default) and at most
  :data:`INLINE_READ_PIECES` block pieces (an upper bound on its descriptors). On loopback
  and cma such a read costs about what decoding and planning one large readiness costs
  the dispatcher anyway (``python -m benchmarks.bench_control_floor`` prints both); that
  is the longest the other peers' frames wait behind it. The dispatcher charges that time
  to the frame's peer, so the fair inbox counts it against the peer that asked for the
  read;
* the read worker has nothing queued or running (``_pending_reads`` is 0), so an inline
  read never overtakes a queued one nor takes a plan from a batch it could have joined;
* the frame's call started exactly one read (a handshake that serves several parked
  readiness messages queues them, to be batched).

The read runs outside the worker's lock, as on the read worker, with the same bounds
(``start_by``, ``read_timeout_s``, ``finish_by``), the same records and the same
``read_finished``; the reply is queued from the dispatcher. A layer then crosses two
threads on Decode instead of three (I/O -> dispatcher -> I/O, no read worker between). The
control server asks its handler not to run data reads; these are the bounded exception
its fairness accounting covers. Reads stay one at a time: whoever reads
holds ``_read_lock``; the dispatcher only tries it, and when the read worker holds it (a
read a caller's ``add_request`` queued in between) the plan goes to the read worker's queue
instead, so the dispatcher never waits for a read it did not start. Should a failed
inline read leave an engine call running after all (a backend opted in wrongly), its
outliving and its report go to the read worker (:class:`_Ran`), never blocking the
dispatcher. A plan the worker's close overtook is dropped, as queued plans are.

Three threads call into the endpoint (the caller, the dispatcher, the read worker); ONE
lock serialises every call together with the execution of its outputs, which never
block (the ROUTER queues frames, the read queue is unbounded and holds at most one plan
per readiness message). Lock order: this worker's lock, then the server's internal lock;
``_read_lock`` is never held together with either.
The lock, the calls, the trace and the lifecycle are
:class:`~rd2h_runtime.worker.EndpointWorker`'s. How one read runs (batching, bounds,
records) is :mod:`rd2h_runtime.decode_reads`; the log of refused peer input
:mod:`rd2h_runtime.decode_refusals`.

``read_timeout_s`` should stay below half the Prefill lease: a read that starts at its
``start_by`` then ends (or is abandoned) before the lease can expire on Prefill, so
Prefill never reuses storage under a read that might still report success.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from rd2h_protocol.consumer import (
    ConsumerConfig,
    ConsumerEndpoint,
    ConsumerStats,
    Output,
    Releasable,
    Reply,
    RequestDone,
    RequestFailed,
    SendAbort,
    StartRead,
)
from rd2h_protocol.errors import ErrorCode, LocalProtocolError, TransferError
from rd2h_protocol.plan import ReadPlan
from rd2h_protocol.wire.codec import encode
from rd2h_runtime.control import (
    ConnectionEvent,
    ControlOptions,
    DecodeControlServer,
    PeerFrame,
    PeerSendFailed,
    ServerEvent,
    TimerDue,
)
from rd2h_runtime.decode_reads import (
    CALLER_THREAD_BACKENDS,
    INLINE_READ_BYTES,
    INLINE_READ_PIECES,
    MAX_BATCHED_READS,
    DecodeMetrics,
    ReadRecord,
    plan_within,
    read_batch,
)
from rd2h_runtime.decode_refusals import RefusalLog
from rd2h_runtime.planning import Descriptors, build_descriptors
from rd2h_runtime.regions import destination_regions
from rd2h_runtime.trace import open_tracer
from rd2h_runtime.transfer import TransferBackend
from rd2h_runtime.worker import CLOSE_TIMEOUT_S, EndpointWorker

__all__ = [
    "INLINE_READ_BYTES",
    "INLINE_READ_PIECES",
    "DecodeMetrics",
    "DecodeWorker",
    "Outcome",
    "ReadRecord",
    "destination_regions",
]

log = logging.getLogger("rd2h_runtime.decode")

_OUTLIVE_POLL_S: Final = 5.0  # how often a failed read's running engine call is checked


@dataclass(slots=True)
class _Ran:
    """Reads the dispatcher ran inline that failed while an engine call of theirs still
    ran: the read worker outlives that call, then reports them (with their ``errors``)."""

    batch: list[StartRead]
    errors: list[TransferError | None]


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a request ended on this rank: done (``ok``) or failed with ``code``/``message``."""

    ext_req_id: str
    ok: bool
    code: ErrorCode | None = None
    message: str = ""
    at: float = 0.0  # time.monotonic() when the endpoint reported it


class DecodeWorker(EndpointWorker[Output, Outcome, bytes, ServerEvent]):
    """One Decode TP rank: a consumer endpoint bound to a ROUTER, a read worker, a backend.

    The ROUTER binds ``host:port`` (``port`` 0: an ephemeral port, read it back from
    :attr:`port`). ``regions`` default to
    :func:`~rd2h_runtime.regions.destination_regions` of ``config.layers``. The backend is
    closed with the worker when ``own_backend`` is True. ``on_outcome`` is called (outside
    the lock) with every :class:`Outcome`; outcomes are also kept until
    :meth:`release`, for :meth:`wait_finished`. ``planner`` turns a read plan into the
    descriptors of one batched read (benchmarks swap in a baseline to compare).
    ``max_batched_reads``: at most this many plans queued together (one Prefill session)
    go into one engine read; 1 reads each plan on its own. ``inline_read_bytes``: the
    largest plan the dispatcher reads itself when the read worker is idle (see the module
    docstring); None: :data:`INLINE_READ_BYTES` on a backend known to read on the calling
    thread (loopback, cma), 0 (never) on the others; 0 turns inline reads off. Give a
    positive value for another backend only if its ``read`` leaves nothing running once
    it returned or raised, and its small reads are fast (no network round trip). It is
    kept as :attr:`inline_read_bytes` and may be changed while the worker runs.
    """

    _ROLE = "Decode"
    _log = log
    _CALLBACK = "on_outcome"
    # The reply is lost: Prefill's lease covers it.
    _DROPPED = "reply to %r dropped: %s"
    _endpoint: ConsumerEndpoint
    _control: DecodeControlServer
    metrics: DecodeMetrics

    def __init__(
        self,
        config: ConsumerConfig,
        backend: TransferBackend,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        regions: Sequence[tuple[int, int]] | None = None,
        control_options: ControlOptions | None = None,
        read_timeout_s: float = 10.0,
        on_outcome: Callable[[Outcome], None] | None = None,
        own_backend: bool = True,
        planner: Callable[[ReadPlan], Descriptors] = build_descriptors,
        on_read: Callable[[ReadRecord], None] | None = None,
        trace_dir: str | None = None,
        max_batched_reads: int = MAX_BATCHED_READS,
        inline_read_bytes: int | None = None,
    ) -> None:
        super().__init__(backend, own_backend, on_outcome)
        if max_batched_reads < 1:
            raise LocalProtocolError(f"max_batched_reads must be >= 1, got {max_batched_reads}")
        self._max_batch = max_batched_reads
        if inline_read_bytes is None:
            inline_read_bytes = INLINE_READ_BYTES if backend.name in CALLER_THREAD_BACKENDS else 0
        if inline_read_bytes < 0:
            raise LocalProtocolError(f"inline_read_bytes must be >= 0, got {inline_read_bytes}")
        #: The largest plan (bytes) the dispatcher reads itself; 0: never. Read under the lock.
        self.inline_read_bytes = inline_read_bytes
        self.config = config
        self._on_read = on_read
        self._planner = planner
        self._read_timeout_s = read_timeout_s
        self._endpoint = ConsumerEndpoint(config)
        self._tracer = open_tracer(trace_dir, "decode", config.d_rank, config)
        self._outcomes: dict[str, Outcome] = {}
        self._releasable: set[str] = set()
        self._reads: queue.SimpleQueue[StartRead | _Ran | None] = queue.SimpleQueue()
        # Plans started and not reported yet: queued, being read (here or inline), outlived.
        self._pending_reads = 0
        # Held by whoever runs an engine read (and, on the read worker, outlives a failed
        # one): reads stay one at a time. Never held with self._lock.
        self._read_lock = threading.Lock()
        # True while the dispatcher executes a frame's outputs (lock held): a StartRead
        # among them may become an inline read.
        self._dispatching = False
        # The plan the dispatcher runs once the frame's call released the lock (dispatcher
        # only).
        self._inline: StartRead | None = None
        self.metrics = DecodeMetrics()
        self._refusals = RefusalLog()
        self._reader = threading.Thread(
            target=self._read_loop, name=f"rd2h-decode-reader-{config.d_rank}", daemon=True
        )
        try:
            backend.register(
                list(regions) if regions is not None else destination_regions(config.layers)
            )
            self._control = DecodeControlServer(
                host, port, handler=self._on_event, options=control_options
            )
            self._control.start()
        except BaseException:
            self._abandon()
            raise
        self._reader.start()

    # -- caller API ------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The port the ROUTER is bound to."""
        return self._control.port

    @property
    def host(self) -> str:
        """The host the ROUTER is bound on."""
        return self._control.host

    def add_request(
        self, ext_req_id: str, main_block_ids: Sequence[int], indexer_block_ids: Sequence[int]
    ) -> None:
        """Register the request's destination block ids (logical order) on this rank."""
        main, idx = list(main_block_ids), list(indexer_block_ids)
        self._call(
            lambda now: self._endpoint.add_request(ext_req_id, main, idx, now),
            "add_request",
            {"ext_req_id": ext_req_id, "main_block_ids": main, "indexer_block_ids": idx},
        )

    def abort(self, ext_ids: Iterable[str], reason: str = "aborted by Decode") -> None:
        """Fail these requests now (``ABORTED``); their v2 Prefill peers are told."""
        ids = list(ext_ids)
        self._call(
            lambda now: self._endpoint.abort(ids, reason, now),
            "abort",
            {"ext_ids": ids, "reason": reason},
        )

    def release(self, ext_req_id: str) -> bool:
        """vLLM is done with the request: True if its blocks may be freed now.

        Otherwise a read may still write them, and :meth:`wait_releasable` says when they
        may. The request's outcome is forgotten.
        """
        with self._ahead():  # no frame handled between the two
            self._call(
                lambda now: self._endpoint.release(ext_req_id, now),
                "release",
                {"ext_req_id": ext_req_id},
            )
            with self._lock:
                self._outcomes.pop(ext_req_id, None)
                if ext_req_id in self._releasable:
                    self._releasable.discard(ext_req_id)
                    return True
                return False

    def wait_releasable(self, ext_req_id: str, timeout: float) -> bool:
        """Wait until a released request's blocks may be freed; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            if not self._wait_until(lambda: ext_req_id in self._releasable, deadline):
                return False
            self._releasable.discard(ext_req_id)
            return True

    def wait_finished(self, ext_req_id: str, timeout: float) -> Outcome | None:
        """The request's outcome on this rank, waiting up to ``timeout``; None on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            if not self._wait_until(lambda: ext_req_id in self._outcomes, deadline):
                return None
            return self._outcomes[ext_req_id]

    def outcomes(self) -> dict[str, Outcome]:
        """Every outcome not released yet."""
        with self._lock:
            return dict(self._outcomes)

    # -- views -----------------------------------------------------------------------------

    @property
    def stats(self) -> ConsumerStats:
        """A snapshot of the endpoint's counters."""
        with self._lock:
            return dataclasses.replace(self._endpoint.stats)

    def in_flight_reads(self) -> dict[int, tuple[str, ...]]:
        """Reads in flight and the requests whose blocks they write."""
        with self._lock:
            return self._endpoint.in_flight_reads()

    def is_idle(self) -> bool:
        """No per-request state left: in the endpoint, the read queue or the outcomes."""
        with self._lock:
            return (
                self._endpoint.is_idle()
                and not self._pending_reads
                and not self._outcomes
                and not self._releasable
            )

    @property
    def healthy(self) -> bool:
        """The I/O thread and the read worker run and nothing raised on them."""
        return super().healthy and self._reader.is_alive()

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the ROUTER and the read worker, close the backend (if owned). Idempotent.

        A read in progress is waited for (it is bounded by ``read_timeout_s``); queued
        plans are dropped.
        """
        super().close()

    def _stop_threads(self) -> None:
        self._reads.put(None)
        self._reader.join(self._read_timeout_s + CLOSE_TIMEOUT_S)

    # -- internals -------------------------------------------------------------------------

    def _apply(self, outputs: list[Output], sent: list[bytes] | None) -> tuple[list[Outcome], bool]:
        reported: list[Outcome] = []
        wake = False
        for out in outputs:
            if isinstance(out, Reply | SendAbort):
                self._send(out.peer, encode(out.msg))
            elif isinstance(out, StartRead):
                if self._inline_ok(out, outputs):
                    self._inline = out  # the dispatcher reads it once the lock is released
                else:
                    self._reads.put(out)
                self._pending_reads += 1
            elif isinstance(out, RequestDone):
                reported.append(Outcome(out.ext_req_id, True, at=time.monotonic()))
            elif isinstance(out, RequestFailed):
                reported.append(
                    Outcome(out.ext_req_id, False, out.code, out.message, time.monotonic())
                )
            elif isinstance(out, Releasable):
                self._releasable.add(out.ext_req_id)
                wake = True
            else:  # pragma: no cover - the endpoint has no other output
                raise LocalProtocolError(f"unexpected endpoint output {out!r}")
        for outcome in reported:
            # The endpoint reports each request once; keep the first in any case.
            self._outcomes.setdefault(outcome.ext_req_id, outcome)
            wake = True
        return reported, wake

    def _inline_ok(self, start: StartRead, outputs: list[Output]) -> bool:
        """Whether the dispatcher reads ``start`` itself (lock held; the module docstring
        says why each condition)."""
        limit = self.inline_read_bytes
        if not (self._dispatching and limit and self._inline is None and not self._pending_reads):
            return False
        if sum(isinstance(out, StartRead) for out in outputs) != 1:
            return False
        return plan_within(start.plan, limit, INLINE_READ_PIECES)

    def _on_event(self, event: ServerEvent) -> None:
        """The dispatcher: the event (under the lock), then the inline read it started."""
        queued = self._pending_reads
        super()._on_event(event)
        start, self._inline = self._inline, None
        if start is not None:
            self._read_inline(start)
        elif self._pending_reads > queued:
            # A read went to the read worker: let it run now (a sleep lets go of the
            # interpreter), so that a short read's end is reported, ahead of the next
            # event (see EndpointWorker._urgently), instead of after it.
            time.sleep(0)

    def _read_inline(self, start: StartRead) -> None:
        """Run ``start`` on the dispatcher (no lock held) and report it, as the read worker
        would; never waits for a read it did not start. Never raises."""
        try:
            if self._closed:
                return  # dropped, as the plans still queued at close are
            if not self._read_lock.acquire(blocking=False):
                # The read worker is reading (a plan a caller's call queued meanwhile): it
                # takes this one next; _pending_reads counts it already.
                self._reads.put(start)
                return
            try:
                errors, records = self._read_batch([start])
                self.metrics.inline_reads += 1
                running = any(e is not None for e in errors) and not self._backend.quiesce(0.0)
            finally:
                self._read_lock.release()
            self._observe_read(records)
            if running:
                # Outliving the engine call may take long: the read worker does it, then
                # reports the read.
                log.error(
                    "inline read %d failed and its %s call still runs: this backend should "
                    "not read inline (inline_read_bytes=0)",
                    start.plan.read_id,
                    self._backend.name,
                )
                self._reads.put(_Ran([start], errors))
                return
            self._finish([start], errors)
        except Exception as exc:
            self._caught(exc, "error in inline read %d", start.plan.read_id)

    def _handle(self, event: ServerEvent, now: float) -> list[Outcome]:
        """The ROUTER's dispatcher thread: frames, timers, delivery failures."""
        reported: list[Outcome] = []
        if isinstance(event, PeerFrame):
            before = RefusalLog.counts(self._endpoint)
            outs = self._traced(
                lambda t: self._endpoint.receive(event.peer, event.payload, t),
                now,
                "receive",
                None if self._tracer is None else {"peer": event.peer, "frame": event.payload},
            )
            self._dispatching = True
            try:
                reported = self._execute(outs)
            finally:
                self._dispatching = False
            self._refusals.note(self._endpoint, event.peer, before, now)
        elif isinstance(event, TimerDue):
            reported = self._timer_due(now)
        elif isinstance(event, PeerSendFailed):
            self.metrics.send_failures += 1
        elif isinstance(event, ConnectionEvent):
            pass  # Prefill's leases and re-handshakes deal with lost connections
        return reported

    def _read_loop(self) -> None:
        backlog: list[StartRead | _Ran | None] = []  # taken from the queue, not in this batch
        while True:
            item = backlog.pop(0) if backlog else self._reads.get()
            if item is None:
                return
            if isinstance(item, _Ran):  # an inline read whose engine call ran on
                with self._read_lock:
                    self._outlive(item.batch[0].plan.read_id)
                self._finish(item.batch, item.errors)
                continue
            batch = [item]
            if not backlog:
                self._take_queued(batch, backlog)
            with self._read_lock:
                errors, records = self._read_batch(batch)
                if any(error is not None for error in errors):
                    self._outlive(batch[0].plan.read_id)
            self._observe_read(records)
            self._finish(batch, errors)

    def _finish(self, batch: list[StartRead], errors: list[TransferError | None]) -> None:
        """Report the reads of ``batch`` to the endpoint (``read_finished``) and execute
        its outputs, then report completions (no lock held on entry). Never raises."""
        reported: list[Outcome] = []
        try:
            with self._urgently():  # a read's end goes before the dispatcher's next frame
                self._pending_reads -= len(batch)
                if self._closed:
                    return
                for done, error in zip(batch, errors, strict=True):
                    read_id = done.plan.read_id
                    outs = self._traced(
                        functools.partial(self._endpoint.read_finished, read_id, error),
                        time.monotonic(),
                        "read_finished",
                        None if self._tracer is None else {"read_id": read_id, "error": error},
                    )
                    reported += self._execute(outs)
        except Exception as exc:
            self._caught(exc, "error after read %d", batch[0].plan.read_id)
        self._report(reported)

    def _take_queued(self, batch: list[StartRead], backlog: list[StartRead | _Ran | None]) -> None:
        """Add the reads already queued behind ``batch[0]`` from the same Prefill session,
        in order, so that one engine call moves them all: several layers ready at once
        (a claimed Prefill-first request, a Decode that fell behind) pay one read's fixed
        cost. The first read of another session (or the close, or an inline read to
        outlive) stays for the next round."""
        session = batch[0].plan.session
        while len(batch) < self._max_batch:
            try:
                queued = self._reads.get_nowait()
            except queue.Empty:
                return
            if not isinstance(queued, StartRead) or queued.plan.session != session:
                backlog.append(queued)
                return
            batch.append(queued)

    def _outlive(self, read_id: int) -> None:
        """Wait until no engine call of a failed read can still write the destination.

        A read that timed out may leave its engine call running (some engines cannot cancel
        one). Until that call ended, the read is not reported: its requests stay in flight
        on the endpoint, so their blocks are not released to vLLM under a late write (S3),
        even after their load timeout failed them. A call that never ends keeps them for
        good: a leak that is logged, never a corruption.
        """
        if self._backend.quiesce(0.0):
            return
        self.metrics.reads_outlived += 1
        waited = 0.0
        while not self._backend.quiesce(_OUTLIVE_POLL_S):
            if self._closed:
                return
            waited += _OUTLIVE_POLL_S
            log.warning(
                "read %d failed, but its %s call still runs %.0f s later: its blocks stay "
                "held until it ends",
                read_id,
                self._backend.name,
                waited,
            )

    def _read_batch(
        self, batch: list[StartRead]
    ) -> tuple[list[TransferError | None], list[ReadRecord]]:
        """Run ``batch`` as one engine read (:func:`~rd2h_runtime.decode_reads.read_batch`);
        ``_read_lock`` held (by the read worker or the dispatcher)."""
        return read_batch(
            batch,
            backend=self._backend,
            planner=self._planner,
            read_timeout_s=self._read_timeout_s,
            metrics=self.metrics,
            tracer=self._tracer,
        )

    def _observe_read(self, records: list[ReadRecord]) -> None:
        """Hand the reads just run to ``on_read`` (on the thread that ran them: the read
        worker or, for an inline read, the dispatcher; no lock held)."""
        if self._on_read is None:
            return
        for record in records:
            try:
                self._on_read(record)
            except Exception:
                log.exception("on_read callback raised")
