"""What a Prefill and a Decode worker share: the plumbing around their sans-IO endpoint.

Theory of operation
-------------------
:class:`EndpointWorker` owns what does not depend on the role. ONE lock (and a condition
on it) serialises every call into the endpoint together with the execution of its
outputs, so the outputs of one call are executed before any other call starts; each call
gets ``time.monotonic()`` as ``now`` (:meth:`~EndpointWorker._call`). The trace records
every call with its outputs, or the error it raised (:meth:`~EndpointWorker._traced`).
After the outputs, the endpoint's next deadline is handed to the control channel's
timer, then the waiters are woken (last, just before the lock is released). What a call
reports to the caller's callback (:class:`~rd2h_protocol.producer.RequestFinished` on
Prefill, :class:`~rd2h_runtime.decode.Outcome` on Decode) is reported outside the lock. An
exception on a thread that carries the endpoint's input (the channel's handler thread:
Prefill's I/O thread, Decode's dispatcher; Decode's read worker) is kept in
:attr:`~EndpointWorker.errors` and logged, never let loose on that thread. Closing stops
the channel, the role's own threads, the tracer and the backend (when owned), in that
order.

The lock is not taken in arrival order: a call someone waits on (the caller's API, a read's
end on Decode) goes before the channel's handler thread's next event. The handler steps
aside between two events while such a call waits (:meth:`~EndpointWorker._urgently`), for
at most ``_STEP_ASIDE_S``. Otherwise a peer whose frames are dear to handle would make
each of another peer's steps (its admission, its read's end, its release) wait for one of
them in turn: the handler takes the lock again as soon as it lets go of it.

A role (:class:`~rd2h_runtime.prefill.PrefillWorker`,
:class:`~rd2h_runtime.decode.DecodeWorker`) builds its endpoint and control channel,
executes its endpoint's outputs (:meth:`~EndpointWorker._apply`) and turns the channel's
events into endpoint calls (:meth:`~EndpointWorker._handle`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Final, Generic, Protocol, TypeVar

from rd2h_runtime.control import ControlClosed, ControlStats, QueueFull
from rd2h_runtime.trace import Tracer
from rd2h_runtime.transfer import TransferBackend

__all__ = ["EndpointWorker"]

# The longest the channel's handler waits for the calls that go before its next event: a
# caller that never stops calling cannot starve the peers.
_STEP_ASIDE_S: Final = 0.05

CLOSE_TIMEOUT_S: Final = 10.0

OutputT = TypeVar("OutputT")
KeyT = TypeVar("KeyT", contravariant=True)
EventT = TypeVar("EventT")


class _Reported(Protocol):
    @property
    def ext_req_id(self) -> str: ...


ReportT = TypeVar("ReportT", bound=_Reported)


class _Endpoint(Protocol[OutputT]):
    def get_timer(self) -> float | None: ...
    def handle_timer(self, now: float) -> list[OutputT]: ...
    def requests(self) -> dict[str, str]: ...


class _Channel(Protocol[KeyT]):
    @property
    def running(self) -> bool: ...
    @property
    def stats(self) -> ControlStats: ...
    def send(self, key: KeyT, payload: bytes, /) -> None: ...
    def set_timer(self, deadline: float | None) -> None: ...
    def close(self, timeout: float | None = None) -> None: ...


class _Counters(Protocol):
    frames_sent: int
    send_failures: int
    handler_errors: int


_W = TypeVar("_W", bound="EndpointWorker[Any, Any, Any, Any]")


class EndpointWorker(Generic[OutputT, ReportT, KeyT, EventT]):
    """A sans-IO endpoint bound to a control channel, a transfer backend and a clock.

    A role sets, in its constructor, ``_endpoint``, ``_control`` (whose handler thread calls
    :meth:`_on_event`), ``metrics`` and, when tracing is on, ``_tracer``; if the
    constructor fails after this one ran, it calls :meth:`_abandon` before it raises.
    """

    #: The role, as log lines and errors name it ("Prefill", "Decode").
    _ROLE: ClassVar[str]
    #: The role's logger.
    _log: ClassVar[logging.Logger]
    #: The name of the role's report callback, for the log.
    _CALLBACK: ClassVar[str]
    #: The warning logged when a frame is dropped (its key and the error).
    _DROPPED: ClassVar[str]
    #: Whether :meth:`_execute` records the traced call, with the frames its outputs sent
    #: as encoded; otherwise :meth:`_traced` records it and the trace encodes them again.
    _TRACE_SENT: ClassVar[bool] = False

    _endpoint: _Endpoint[OutputT]
    _control: _Channel[KeyT]
    metrics: _Counters

    def __init__(
        self,
        backend: TransferBackend,
        own_backend: bool,
        on_report: Callable[[ReportT], None] | None,
    ) -> None:
        self._backend = backend
        self._own_backend = own_backend
        self._on_report = on_report
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        # Calls waiting for (or holding) the lock that go before the handler's next event.
        self._urgent = 0
        self._gate = threading.Condition(threading.Lock())
        self._errors: list[BaseException] = []
        self._closed = False
        # None unless tracing is on (trace_dir or $RD2H_TRACE_DIR): see rd2h_runtime.trace.
        self._tracer: Tracer | None = None
        # The call _traced held back for _execute to record (with _TRACE_SENT).
        self._trace_call: tuple[str, float, dict[str, object] | None] | None = None

    # -- views -----------------------------------------------------------------------------

    @property
    def backend(self) -> TransferBackend:
        """The transfer backend this rank registered its memory with."""
        return self._backend

    @property
    def control_stats(self) -> ControlStats:
        """A snapshot of the control channel's counters (Prefill's client, Decode's ROUTER)."""
        return self._control.stats

    @property
    def errors(self) -> list[BaseException]:
        """Exceptions caught on the worker's threads (a bug if not empty)."""
        with self._lock:
            return list(self._errors)

    def requests(self) -> dict[str, str]:
        """``{ext_id: state}`` of every request the endpoint holds (not finished yet)."""
        with self._lock:
            return self._endpoint.requests()

    @property
    def healthy(self) -> bool:
        """The I/O thread runs and nothing raised on the worker's threads."""
        with self._lock:
            return self._control.running and not self._errors

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the control channel, the role's threads, the tracer, the backend (if owned).

        Idempotent. Waiters on the lock's condition are woken and see the worker closed.
        """
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        try:
            self._control.close(CLOSE_TIMEOUT_S)
        finally:
            self._stop_threads()
            if self._tracer is not None:
                self._tracer.close()
            if self._own_backend:
                self._backend.close()

    def __enter__(self: _W) -> _W:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _abandon(self) -> None:
        """A constructor failed: close the tracer (if open) and the backend (if owned)."""
        if self._tracer is not None:
            self._tracer.close()
        if self._own_backend:
            self._backend.close()

    def _stop_threads(self) -> None:
        """Stop the role's own threads (the channel is closed already)."""

    # -- calls into the endpoint -----------------------------------------------------------

    def _call(
        self,
        fn: Callable[[float], list[OutputT]],
        op: str = "",
        args: dict[str, object] | None = None,
    ) -> None:
        """Run one endpoint call and its outputs under the lock; report completions after.

        ``op`` and ``args`` name the call for the trace (when tracing is on).
        """
        with self._urgently():
            if self._closed:
                raise ControlClosed(f"the {self._ROLE} worker is closed")
            reported = self._execute(self._traced(fn, time.monotonic(), op, args))
        self._report(reported)

    @contextlib.contextmanager
    def _ahead(self) -> Iterator[None]:
        """While inside, the channel's handler steps aside before its next event: for
        several locked sections in a row that must not let an event in between."""
        with self._gate:
            self._urgent += 1
        try:
            yield
        finally:
            with self._gate:
                self._urgent -= 1
                if not self._urgent:
                    self._gate.notify_all()

    @contextlib.contextmanager
    def _urgently(self) -> Iterator[None]:
        """The lock, for a call that goes before the channel handler's next event."""
        with self._ahead(), self._lock:
            yield

    def _traced(
        self,
        fn: Callable[[float], list[OutputT]],
        now: float,
        op: str,
        args: dict[str, object] | None,
    ) -> list[OutputT]:
        """``fn(now)``, recorded in the trace when tracing is on. Lock held.

        With ``_TRACE_SENT`` the record is made by the :meth:`_execute` of these outputs,
        which follows at once under the same lock (so that it holds the frames as sent,
        encoded once).
        """
        tracer = self._tracer
        if tracer is None:
            return fn(now)
        try:
            outputs = fn(now)
        except Exception as exc:
            tracer.call(op, now, args, None, exc)
            raise
        if self._TRACE_SENT:
            self._trace_call = (op, now, args)
        else:
            tracer.call(op, now, args, outputs)
        return outputs

    def _timer_due(self, now: float) -> list[ReportT]:
        """The endpoint's deadlines at or before ``now``. Lock held."""
        return self._execute(self._traced(self._endpoint.handle_timer, now, "handle_timer", None))

    def _execute(self, outputs: list[OutputT]) -> list[ReportT]:
        """Execute ``outputs`` in order (lock held), then re-arm the timer."""
        sent: list[bytes] | None = [] if self._TRACE_SENT and self._tracer is not None else None
        reported, wake = self._apply(outputs, sent)
        with contextlib.suppress(ControlClosed):  # closing: no timer can matter any more
            self._control.set_timer(self._next_timer())
        if sent is not None and self._trace_call is not None and self._tracer is not None:
            op, now, args = self._trace_call
            self._trace_call = None
            self._tracer.call(op, now, args, outputs, payloads=sent)
        if wake:
            # Last, so that a woken waiter (a gate on Prefill) finds the lock about to be
            # released rather than sleeping again on it while this call finishes.
            self._cond.notify_all()
        return reported

    def _apply(
        self, outputs: list[OutputT], sent: list[bytes] | None
    ) -> tuple[list[ReportT], bool]:
        """The role executes ``outputs`` in order (lock held), appending the frames it
        sends to ``sent`` (when not None): what to report, and whether to wake waiters."""
        raise NotImplementedError

    def _next_timer(self) -> float | None:
        """When the channel's timer should fire next: the endpoint's next deadline."""
        return self._endpoint.get_timer()

    def _send(self, key: KeyT, payload: bytes) -> None:
        try:
            self._control.send(key, payload)
        except (QueueFull, ControlClosed) as exc:
            self.metrics.send_failures += 1
            self._log.warning(self._DROPPED, key, exc)
        else:
            self.metrics.frames_sent += 1

    # -- reports and the threads that carry input ------------------------------------------

    def _report(self, reported: list[ReportT]) -> None:
        callback = self._on_report
        if callback is None:
            return
        for item in reported:
            try:
                callback(item)
            except Exception:
                self._log.exception("%s callback raised for %s", self._CALLBACK, item.ext_req_id)

    def _wait_until(self, ready: Callable[[], bool], deadline: float) -> bool:
        """Wait on the condition (lock held) until ``ready()``; False once past ``deadline``."""
        while not ready():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._cond.wait(left)
        return True

    def _on_event(self, event: EventT) -> None:
        """The control channel's handler thread (Prefill's I/O thread, Decode's dispatcher):
        one event, handled under the lock."""
        reported: list[ReportT] = []
        with self._gate:  # step aside for the calls waiting (see the module's docstring)
            self._gate.wait_for(lambda: not self._urgent, _STEP_ASIDE_S)
        try:
            with self._lock:
                if self._closed:
                    return
                reported = self._handle(event, time.monotonic())
        except Exception as exc:
            # Never let a bug kill the thread that carries every reply; keep it visible.
            self._caught(exc, "error while handling %r", type(event).__name__)
        self._report(reported)

    def _handle(self, event: EventT, now: float) -> list[ReportT]:
        """The role turns a channel event into endpoint calls (lock held, not closed)."""
        raise NotImplementedError

    def _caught(self, exc: Exception, what: str, *args: object) -> None:
        """An exception on a thread that must carry on: kept in ``errors`` and logged."""
        with self._lock:
            self._errors.append(exc)
            self.metrics.handler_errors += 1
        self._log.exception(f"{self._ROLE} worker: {what}", *args)
