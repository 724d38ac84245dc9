"""The ordered runner of the Prefill compute path's calls into the Prefill worker.

A layer may be written on the device before its event is done: :class:`Publisher` keeps
the endpoint's view in program order (chunks, layers, step ends) while letting the
compute path go on. It is apart from :mod:`rd2h_vllm.worker.prefill` because it is a
small thread-and-queue utility that knows nothing of requests or the protocol.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from rd2h_vllm.destinations import ScatterEvent

__all__ = ["Publisher"]

logger = logging.getLogger(__name__)


class Publisher:
    """Runs the compute path's calls into the Prefill worker in order.

    A call runs inline when nothing is queued; a layer whose device event is not done yet
    is queued behind it on a thread that waits for the event, and every later call queues
    behind it too, so the endpoint sees chunks, layers and step ends in program order.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending = 0
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.errors: list[BaseException] = []

    def run(self, fn: Callable[[], None], event: ScatterEvent | None = None) -> None:
        with self._cond:
            inline = self._pending == 0 and (event is None or event.query())
            if not inline:
                self._pending += 1
        if inline:
            fn()
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="rd2h-publisher", daemon=True)
            self._thread.start()

        def job() -> None:
            if event is not None:
                event.synchronize()
            fn()

        self._queue.put(job)

    def drain(self, timeout: float) -> bool:
        """Wait until every queued call ran; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                job()
            except Exception as exc:  # never kill the thread that orders publications
                logger.exception("RD2H publisher: a queued call raised")
                self.errors.append(exc)
            finally:
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(10.0)
