"""The I/O thread both control-plane socket sets run on.

One thread owns every ZMQ socket of a socket set and blocks in ``zmq.Poller.poll`` with a
real timeout: min(time to the armed deadline, ``idle_poll_s``). Other threads never touch
those sockets; they append to a locked queue and wake the loop through an inproc PAIR pair
(the write end is used only under the lock, which is what makes a PAIR shareable). A
``_wake_pending`` flag keeps at most one wake message in flight however many frames are
queued. Each loop turn: drain wake-ups, run connect/disconnect commands, read the readable
sockets (delivering events), fire the timer if due, then hand queued frames to ZMQ with
NOBLOCK sends, so nothing the loop does can block on a peer.

Events go to a handler called on this thread, or, without a handler, to a bounded
:class:`EventQueue`; while that queue is full the loop stops polling its sockets for input
(ZMQ's own queues then apply back-pressure to the peers) and resumes when ``recv`` makes room.

A socket set built with ``fair=True`` (the Decode server) files events in a
:class:`~rd2h_runtime.control._inbox.FairInbox` instead: per-peer byte budgets on arrival
and fair delivery across peers. Its handler then runs on a second thread, the dispatcher,
so that the I/O thread keeps draining ZMQ (whose queues are bounded in messages, not bytes)
and refusing what is over budget while a handler works on a large frame.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import replace
from typing import Any, Final, Generic, TypeVar

import zmq

from rd2h_runtime.control._common import (
    ConnectionKind,
    ControlClosed,
    ControlError,
    ControlOptions,
    ControlStats,
    EventQueue,
)
from rd2h_runtime.control._inbox import Admission, FairInbox
from rd2h_runtime.control._sockets import MONITOR_EVENTS, configure, drain, read_monitor

# Peers whose over-budget frames were logged (once each); older ones are forgotten first.
_LOGGED_PEERS: Final = 4096

log = logging.getLogger("rd2h_runtime.control")

EventT = TypeVar("EventT")
_LoopT = TypeVar("_LoopT", bound="IOLoop[Any]")

_wake_ids = iter(range(1 << 62))  # next() on an iterator is atomic under the GIL


class IOLoop(Generic[EventT]):
    """Thread, wake-up, timer and event delivery shared by the server and the client.

    Subclasses implement the ``_setup`` / ``_teardown`` / ``_process_commands`` /
    ``_on_ready`` / ``_flush`` hooks, all of which run on the I/O thread only.
    """

    def __init__(
        self,
        *,
        handler: Callable[[EventT], None] | None,
        options: ControlOptions | None,
        context: zmq.Context[zmq.Socket[bytes]] | None,
        fair: bool = False,
    ) -> None:
        self._options = options if options is not None else ControlOptions()
        self._handler = handler
        self._external_ctx = context
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        # _lock guards _state, _stopping, _deadline, _wake_pending, _waker and the
        # subclasses' outgoing queues and command lists.
        self._lock = threading.Lock()
        self._state = "new"  # new -> starting -> running -> closed
        self._stopping = False
        self._dead = False  # the I/O thread has exited
        self._deadline: float | None = None
        self._wake_pending = False
        self._waker: zmq.Socket[bytes] | None = None
        self._thread: threading.Thread | None = None
        self._io_ident: int | None = None
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._fatal: BaseException | None = None
        self._stats = ControlStats()
        o = self._options
        self._inbox: FairInbox[EventT] | None = None
        self._queue: EventQueue[EventT] | None = None
        if fair:
            self._inbox = FairInbox(
                peer_bytes=o.peer_inbound_bytes,
                total_bytes=o.inbound_bytes,
                capacity=o.incoming_capacity,
                peer_backlog=o.peer_backlog_s if handler is not None else None,
            )
        elif handler is None:
            self._queue = EventQueue(o.incoming_capacity, self._wake)
        # fair and handler: the dispatcher thread calls the handler.
        self._dispatcher: threading.Thread | None = None
        self._over_budget_logged: dict[Hashable, None] = {}
        # I/O-thread-only state: the poller and what each socket should be polled for.
        self._poller = zmq.Poller()
        self._want: dict[zmq.Socket[bytes], int] = {}
        self._have: dict[zmq.Socket[bytes], int] = {}
        self._flags_dirty = True
        self._could_read = True

    # --- public, any thread ------------------------------------------------------------------

    def start(self) -> None:
        """Start the I/O thread and wait until its sockets are up (or raise why not).

        Raises within ``startup_timeout_s``: :class:`BindError` (server) when binding fails,
        :class:`ControlError` when the thread cannot start, :class:`ControlClosed` after close.
        """
        with self._lock:
            if self._state != "new":
                raise ControlClosed(f"{self._describe()}: start() called twice or after close()")
            self._state = "starting"
        if self._external_ctx is None:
            ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
            # Each endpoint costs a socket, its monitor PAIR and ZMQ's end of that PAIR;
            # ZMQ's default cap (1023 sockets) would bite long before max_connections.
            wanted = 3 * self._options.max_connections + 16
            ctx.set(zmq.MAX_SOCKETS, min(wanted, ctx.get(zmq.SOCKET_LIMIT)))
            self._ctx = ctx
        else:
            self._ctx = self._external_ctx
        thread = threading.Thread(target=self._run, name=self._thread_name(), daemon=True)
        self._thread = thread
        try:
            thread.start()
        except RuntimeError as exc:
            self._abort_start(thread_ran=False)
            raise self._startup_failure(exc) from exc
        if not self._ready.wait(self._options.startup_timeout_s):
            # Setup does no network wait, so this means the process is starved or wedged.
            with self._lock:
                self._stopping = True
            self._abort_start(thread_ran=True)
            raise ControlError(
                f"{self._describe()}: I/O thread not ready within "
                f"{self._options.startup_timeout_s} s"
            )
        if self._startup_error is not None:
            self._abort_start(thread_ran=True)
            raise self._startup_failure(self._startup_error) from self._startup_error
        if self._inbox is not None and self._handler is not None:
            dispatcher = threading.Thread(
                target=self._dispatch, name=self._thread_name() + "-dispatch", daemon=True
            )
            self._dispatcher = dispatcher
            try:
                dispatcher.start()
            except RuntimeError as exc:
                with self._lock:
                    self._stopping = True
                    self._wake_locked()
                self._abort_start(thread_ran=True)
                raise self._startup_failure(exc) from exc
        with self._lock:
            if self._state == "starting":
                self._state = "running"

    def set_timer(self, deadline: float | None) -> None:
        """Arm the one timer at ``deadline`` (``time.monotonic()`` seconds; None disarms).

        Replaces the previous deadline. When it passes, a :class:`TimerDue` event is
        delivered once; re-arm from the handler (e.g. with an endpoint's ``get_timer()``).
        Thread-safe; from another thread it wakes the loop when the deadline moves earlier.
        """
        with self._lock:
            self._check_running()
            old = self._deadline
            self._deadline = deadline
            earlier = deadline is not None and (old is None or deadline < old)
            if earlier and threading.get_ident() != self._io_ident:
                self._wake_locked()

    def recv(self, timeout: float | None = None) -> EventT | None:
        """Next event when no handler was given; None after ``timeout`` seconds.

        Thread-safe (several threads may wait). Raises :class:`ControlClosed` once the set is
        closed and every queued event has been taken.
        """
        if self._handler is not None:
            raise ControlError(f"{self._describe()}: recv() is unavailable with a handler")
        if self._state == "new":
            raise ControlClosed(f"{self._describe()}: not started")
        if self._inbox is None:
            assert self._queue is not None
            return self._queue.get(timeout)
        taken = self._inbox.get(timeout)
        if taken is None:
            return None
        key, event, charged = taken
        if key is not None:
            # The consumer's time is not ours to measure: a peer's share is its bytes.
            self._inbox.done(key, charged, charged * 1e-9)
        if self._inbox.room() <= 1:
            self._wake()  # the loop may have stopped reading at capacity
        return event

    @property
    def stats(self) -> ControlStats:
        """A snapshot of the counters."""
        with self._lock:
            return replace(self._stats)

    @property
    def options(self) -> ControlOptions:
        """The options this set runs with."""
        return self._options

    @property
    def running(self) -> bool:
        """True between a successful ``start()`` and ``close()`` while the I/O thread lives."""
        return self._state == "running" and not self._dead

    def close(self, timeout: float | None = None) -> None:
        """Stop the I/O thread, close every socket and the context this set owns. Idempotent.

        Waits up to ``timeout`` (default ``close_timeout_s``) for the thread; raises
        :class:`ControlError` if it is still running then (a handler that never returns).
        Queued outgoing frames are dropped. Called from the handler, it returns at once and
        the loop stops when the handler returns.
        """
        with self._lock:
            if self._state == "closed":
                return
            self._state = "closed"
            self._stopping = True
            self._wake_locked()
        if self._queue is not None:
            self._queue.close()
        if self._inbox is not None:
            self._inbox.close(drop=self._handler is not None)
        me = threading.get_ident()
        threads = [t for t in (self._thread, self._dispatcher) if t is not None]
        if any(t.ident == me for t in threads):
            return  # called from the handler: the threads stop once it returns
        limit = self._options.close_timeout_s if timeout is None else timeout
        give_up = time.monotonic() + limit
        for thread in threads:
            thread.join(max(0.0, give_up - time.monotonic()))
            if thread.is_alive():
                raise ControlError(
                    f"{self._describe()}: {thread.name} still running {limit} s after "
                    "close() (is the handler blocked?)"
                )

    def __enter__(self: _LoopT) -> _LoopT:
        if self._state == "new":
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- helpers for subclasses (any thread, under _lock where noted) -------------------------

    def _check_running(self) -> None:
        """Raise ControlClosed unless running. Call with _lock held."""
        if self._state != "running" or self._dead:
            why = "failed" if self._fatal is not None else self._state
            raise ControlClosed(f"{self._describe()}: not running ({why})")

    def _on_io_thread(self) -> bool:
        return threading.get_ident() == self._io_ident

    def _wake_locked(self) -> None:
        """Make the loop's poll return soon. Call with _lock held."""
        if self._wake_pending or self._waker is None:
            return
        self._wake_pending = True
        # Again means the reader already holds unread wake-ups: the loop will run anyway.
        with contextlib.suppress(zmq.Again):
            self._waker.send(b"", zmq.NOBLOCK)

    def _wake(self) -> None:
        with self._lock:
            self._wake_locked()

    # --- subclass hooks (I/O thread) ----------------------------------------------------------

    def _describe(self) -> str:
        raise NotImplementedError

    def _thread_name(self) -> str:
        raise NotImplementedError

    def _startup_failure(self, exc: BaseException) -> ControlError:
        return ControlError(f"{self._describe()}: cannot start: {exc}")

    def _timer_event(self, now: float) -> EventT:
        raise NotImplementedError

    def _setup(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        raise NotImplementedError

    def _teardown(self) -> None:
        raise NotImplementedError

    def _process_commands(self) -> None:
        """Run queued connect/disconnect requests (client)."""

    def _on_ready(self, sock: zmq.Socket[bytes], events: int) -> None:
        raise NotImplementedError

    def _flush(self) -> None:
        raise NotImplementedError

    # --- I/O-thread helpers -------------------------------------------------------------------

    def _configure(self, sock: zmq.Socket[bytes]) -> None:
        """Options every control socket gets (:func:`~rd2h_runtime.control._sockets.configure`)."""
        configure(sock, self._options)

    def _monitor(self, sock: zmq.Socket[bytes]) -> zmq.Socket[bytes] | None:
        """Attach a monitor PAIR to ``sock`` (when enabled) and poll it for input."""
        if not self._options.monitor:
            return None
        mon = sock.get_monitor_socket(MONITOR_EVENTS)
        mon.setsockopt(zmq.LINGER, 0)
        self._set_want(mon, zmq.POLLIN)
        return mon

    def _close_monitored(self, sock: zmq.Socket[bytes], mon: zmq.Socket[bytes] | None) -> None:
        """Close a socket and its monitor (monitor first, so its inproc name is released)."""
        self._forget(sock)
        if mon is not None:
            self._forget(mon)
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            mon.close(linger=0)
        sock.close(linger=0)

    def _read_monitor(self, mon: zmq.Socket[bytes]) -> list[tuple[ConnectionKind, str]]:
        """Drain up to a budget of monitor events, keeping the ones we surface."""
        return read_monitor(mon, self._read_budget(), self._stats)

    def _set_want(self, sock: zmq.Socket[bytes], flags: int) -> None:
        if self._want.get(sock) != flags:
            self._want[sock] = flags
            self._flags_dirty = True

    def _forget(self, sock: zmq.Socket[bytes]) -> None:
        self._want.pop(sock, None)
        if self._have.pop(sock, None) is not None:
            self._poller.unregister(sock)

    def _room(self) -> int | None:
        """Free event slots where reading stops at capacity (queue mode); None: no limit."""
        if self._queue is not None:
            return self._queue.room()
        if self._inbox is not None and self._handler is None:
            return self._inbox.room()
        return None

    def _read_budget(self) -> int:
        """How many events this turn may deliver from one socket."""
        room = self._room()
        if room is None:
            return self._options.recv_batch
        return max(0, min(self._options.recv_batch, room))

    def _admits(self, key: Hashable, nbytes: int) -> bool:
        """Whether a frame of ``nbytes`` from ``key`` fits the budgets (``fair`` sets only);
        a refusal is counted, and logged the first time for each peer."""
        assert self._inbox is not None
        admitted = self._inbox.admits(key, nbytes)
        if admitted != "ok":
            self._over_budget(key, admitted, nbytes)
        return admitted == "ok"

    def _deliver_from(self, key: Hashable, event: EventT, nbytes: int) -> None:
        """File ``event`` from peer ``key`` after :meth:`_admits` (``fair`` sets only)."""
        assert self._inbox is not None
        if self._inbox.put_from(key, event, nbytes) != "ok":  # only if the caller skipped
            self._over_budget(key, "peer", nbytes)

    def _over_budget(self, key: Hashable, which: Admission, nbytes: int) -> None:
        self._stats.dropped_over_budget += 1
        self._stats.dropped_over_budget_bytes += nbytes
        if key in self._over_budget_logged:
            return
        self._stats.peers_over_budget += 1
        self._over_budget_logged[key] = None
        if len(self._over_budget_logged) > _LOGGED_PEERS:
            del self._over_budget_logged[next(iter(self._over_budget_logged))]
        assert self._inbox is not None
        o = self._options
        if which == "peer":
            budget = (
                f"its budget of {o.peer_inbound_bytes} bytes received but not yet handled "
                f"({self._inbox.peer_held(key)} held); raise "
                "ControlOptions.peer_inbound_bytes if this peer is legitimate"
            )
        elif which == "backlog":
            budget = (
                f"its budget of {o.peer_backlog_s} s of handler time received but not yet "
                f"handled ({self._inbox.peer_held(key)} bytes held, at the time per byte its "
                "recent frames took); raise ControlOptions.peer_backlog_s if this peer is "
                "legitimate"
            )
        else:
            budget = (
                f"the budget of {o.inbound_bytes} bytes received but not yet handled from "
                f"all peers ({self._inbox.held_bytes} held); raise "
                "ControlOptions.inbound_bytes if the load is legitimate"
            )
        log.warning(
            "%s: dropping a frame of %d bytes from peer %r: over %s. Its further "
            "over-budget frames are dropped and counted in stats.dropped_over_budget "
            "without another log line.",
            self._describe(),
            nbytes,
            key,
            budget,
        )

    def _dispatch(self) -> None:
        """The dispatcher thread (``fair`` sets with a handler): events to the handler,
        fairly across peers, each charged to its peer with the time the handler took."""
        inbox, handler = self._inbox, self._handler
        assert inbox is not None and handler is not None
        while True:
            try:
                taken = inbox.get(None)
            except ControlClosed:
                return
            assert taken is not None
            key, event, charged = taken
            if self._stopping:
                return
            start = time.perf_counter()
            try:
                handler(event)
            except Exception:
                self._stats.handler_errors += 1
                log.exception("%s: handler raised on %r", self._describe(), type(event).__name__)
            del taken, event  # freed before its bytes leave the budget, not at the next get
            if key is not None:
                inbox.done(key, charged, time.perf_counter() - start)

    def _deliver(self, event: EventT) -> None:
        """Hand one event to the handler or the queue. Never raises."""
        if self._inbox is not None:
            self._inbox.put(event)  # events of no peer: bounded by their sources
            return
        if self._handler is not None:
            try:
                self._handler(event)
            except Exception:
                # A handler bug must not kill the thread that carries every reply.
                self._stats.handler_errors += 1
                log.exception("%s: handler raised on %r", self._describe(), type(event).__name__)
            return
        assert self._queue is not None
        if not self._queue.put(event):
            # Only events not read from a socket (send failures) can meet a full queue.
            self._stats.dropped_events += 1
            log.warning("%s: incoming queue full, dropped %r", self._describe(), event)

    # --- the thread ---------------------------------------------------------------------------

    def _abort_start(self, *, thread_ran: bool) -> None:
        """Undo a failed start() on the caller's thread."""
        with self._lock:
            self._state = "closed"
        if self._queue is not None:
            self._queue.close()
        if self._inbox is not None:
            self._inbox.close(drop=True)
        thread = self._thread
        if thread_ran and thread is not None:
            # The thread closes its sockets and the owned context itself on every exit path.
            thread.join(self._options.close_timeout_s)
            if thread.is_alive():
                log.error("%s: I/O thread did not exit after a failed start", self._describe())
        elif self._external_ctx is None and self._ctx is not None:
            self._ctx.term()  # no thread ever ran, so no socket exists in this context

    def _run(self) -> None:
        self._io_ident = threading.get_ident()
        ctx = self._ctx
        assert ctx is not None
        reader: zmq.Socket[bytes] | None = None
        try:
            address = f"inproc://rd2h-control-wake-{next(_wake_ids)}"
            reader = ctx.socket(zmq.PAIR)
            reader.setsockopt(zmq.LINGER, 0)
            reader.bind(address)
            writer = ctx.socket(zmq.PAIR)
            writer.setsockopt(zmq.LINGER, 0)
            writer.connect(address)
            with self._lock:
                self._waker = writer
            self._poller.register(reader, zmq.POLLIN)
            self._setup(ctx)
        except BaseException as exc:
            self._startup_error = exc
            self._shutdown(reader)
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop(reader)
        except BaseException as exc:
            # A bug in this module: make it visible, and fail later calls instead of hanging.
            self._fatal = exc
            log.exception("%s: I/O thread failed", self._describe())
        finally:
            self._shutdown(reader)

    def _loop(self, reader: zmq.Socket[bytes]) -> None:
        idle_cap = self._options.idle_poll_s
        while not self._stopping:
            room = self._room()
            can_read = room is None or room > 0
            if self._flags_dirty or can_read != self._could_read:
                self._apply_flags(can_read)
            timeout = idle_cap
            deadline = self._deadline
            # An overdue timer that cannot be delivered (queue full) must not make us spin.
            if deadline is not None and can_read:
                timeout = min(idle_cap, max(0.0, deadline - time.monotonic()))
            ready = self._poller.poll(math.ceil(timeout * 1000))
            if any(sock is reader for sock, _ in ready):
                drain(reader)
            with self._lock:
                self._wake_pending = False
            if self._stopping:
                return
            self._process_commands()
            for sock, events in ready:
                if sock is not reader:
                    self._on_ready(sock, events)
            self._fire_timer()
            self._flush()

    def _apply_flags(self, can_read: bool) -> None:
        for sock, want in self._want.items():
            flags = want if can_read else want & ~zmq.POLLIN
            if self._have.get(sock, 0) != flags:
                self._poller.register(sock, flags)  # flags == 0 unregisters
                if flags:
                    self._have[sock] = flags
                else:
                    self._have.pop(sock, None)
        self._flags_dirty = False
        self._could_read = can_read

    def _fire_timer(self) -> None:
        now = time.monotonic()
        if self._read_budget() == 0:
            return  # the queue is full; recv() making room wakes us
        with self._lock:
            deadline = self._deadline
            if deadline is None or now < deadline:
                return
            self._deadline = None
        self._stats.timers_fired += 1
        self._deliver(self._timer_event(now))

    def _shutdown(self, reader: zmq.Socket[bytes] | None) -> None:
        try:
            self._teardown()
        except Exception:
            log.exception("%s: error while closing sockets", self._describe())
        with self._lock:
            self._dead = True
            waker, self._waker = self._waker, None
        if waker is not None:
            waker.close(linger=0)
        if reader is not None:
            reader.close(linger=0)
        if self._queue is not None:
            self._queue.close()
        if self._inbox is not None:
            self._inbox.close(drop=self._handler is not None)
        if self._external_ctx is None and self._ctx is not None:
            # Every socket of this context was created and closed on this thread.
            self._ctx.term()
