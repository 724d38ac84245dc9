"""Protocol trace: every endpoint call of a worker, with its ``now`` and outputs, as NDJSON.

Off by default. A worker traces when it is given a directory (``trace_dir``; the vLLM
connector's ``kv_connector_extra_config`` key of that name; ``rd2h demo --trace DIR``) or
when ``RD2H_TRACE_DIR`` is set. When off, the worker holds ``None`` instead of a
:class:`Tracer`: the cost is one attribute check per call.

When on, the I/O and compute threads only append a tuple of references to a deque
(under the worker's lock, so the order of the records is the order of the endpoint
calls); a background writer thread turns them into JSON lines, so encoding, checksums
and file I/O stay off the threads that carry the protocol.

One file per worker (a TP rank: one process per rank under vLLM), named
``<role>-r<rank>-<pid>-<n>.ndjson``, rotated by size into ``...-<n>.<part>.ndjson``. Every
part starts with a header line (``"k": "hdr"``) holding the endpoint's configuration, the
clock domain (host and boot id: ``time.monotonic()`` is comparable within one) and the
part number. Records (``"k"``):

- ``call``: one endpoint input and its outputs: ``t`` (the ``now`` passed), ``op`` (the
  endpoint method), ``a`` (its arguments, complete, frames as base64, so that the call can
  be replayed), ``o`` (one summary per output; request ids bounded to
  :data:`MAX_IDS` plus a count ``nids``; frames as size ``n`` and CRC-32 ``crc``), ``e``
  (the exception it raised, if any).
- ``gate``: a Prefill ``wait_writable`` that had to wait: ``layer``, ``t0``, ``t1``, ``ok``.
- ``read``: a Decode batched read: ``read_id``, ``layer``, ``t0``, ``t1``, ``bytes``,
  ``ok``, ``err``.
- ``drop``: records lost because the writer fell behind (``count``).
- ``mark``: a moment outside the endpoint, ``what`` at ``t`` with the ids of its request
  (``req``: vLLM's, ``ext``: the transfer's). The vLLM connector's scheduler side writes
  them into a stream of its own (role ``marks``, :func:`open_marks`): a request's
  admission, its load noticed, its first step scheduled, Prefill's answer.

``rd2h trace`` (:mod:`rd2h_app.timeline`) merges traces into a timeline;
``rd2h trace check`` (:mod:`rd2h_protocol.checker.replay`) replays them.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any, Final

import msgspec

# What a record says of an output or a frame is the checker's to read back (a replay
# recomputes it), so it is stated there; the names stay exported here for the writer's users.
from rd2h_protocol.checker.traces import MARKS_ROLE, MAX_IDS, frame_summary, summarize_output

__all__ = [
    "ENV_VAR",
    "MARKS_ROLE",
    "MAX_IDS",
    "Tracer",
    "frame_summary",
    "open_marks",
    "open_tracer",
    "summarize_output",
]

ENV_VAR: Final = "RD2H_TRACE_DIR"
FORMAT_VERSION: Final = 1
DEFAULT_MAX_BYTES: Final = 256 << 20  # per part
DEFAULT_KEEP: Final = 16  # parts kept per worker (older ones are deleted)
_MAX_QUEUED: Final = 1 << 20  # records waiting for the writer; beyond: counted as dropped
_FLUSH_S: Final = 0.2

_files = itertools.count()
log = logging.getLogger("rd2h_runtime.trace")
_json = msgspec.json.Encoder()


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


def _arg(value: Any) -> Any:
    """A call argument as JSON: errors as dicts; the rest as msgspec encodes it (frames
    as base64 strings, sequences as arrays, in C)."""
    if isinstance(value, BaseException):
        code = getattr(value, "code", None)
        return {
            "error": type(value).__name__,
            "message": str(value),
            "code": code.name if code is not None else None,
            "transient": bool(getattr(value, "transient", False)),
            "backend_code": getattr(value, "backend_code", None),
        }
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    return value


class Tracer:
    """Records one worker's endpoint calls, gate waits and reads into NDJSON files.

    :meth:`call`, :meth:`gate` and :meth:`read` only append to a deque; a daemon thread
    writes. :meth:`close` writes what is left and closes the file.
    """

    def __init__(
        self,
        directory: str,
        role: str,
        rank: int,
        config: Any,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        keep: int = DEFAULT_KEEP,
        name: str = "",
    ) -> None:
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.role = role
        self.rank = rank
        self._stem = os.path.join(directory, f"{role}-r{rank}-{os.getpid()}-{next(_files)}")
        self._max_bytes = max_bytes
        self._keep = keep
        self._header: dict[str, Any] = {
            "k": "hdr",
            "v": FORMAT_VERSION,
            "role": role,
            "rank": rank,
            "name": name,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "boot": _boot_id(),
            "stream": os.path.basename(self._stem),
            "mono": time.monotonic(),
            "wall": time.time(),
            "config": msgspec.to_builtins(config),
        }
        self._queue: collections.deque[tuple[Any, ...]] = collections.deque()
        #: CPU time the writer thread spent formatting and writing (for benchmarks).
        self.writer_cpu_s = 0.0
        self._dropped = 0
        self._part = 0
        self._written = 0
        self._paths: list[str] = []
        self._file = self._open_part()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"rd2h-trace-{role}-{rank}", daemon=True
        )
        self._thread.start()

    @property
    def paths(self) -> list[str]:
        """The parts written so far (deleted ones excluded)."""
        return list(self._paths)

    # -- recording (any thread; cheap) ----------------------------------------------------

    def call(
        self,
        op: str,
        now: float,
        args: dict[str, Any] | None,
        outputs: Sequence[Any] | None,
        error: BaseException | None = None,
        *,
        payloads: Sequence[bytes] | None = None,
    ) -> None:
        """An endpoint call ``op`` at ``now`` and its outputs (or the error it raised);
        ``payloads``: the encoded frames of its ``Send`` outputs, in order, when the caller
        has them (else the writer encodes them again)."""
        if len(self._queue) >= _MAX_QUEUED:
            self._dropped += 1
            return
        self._queue.append(("call", op, now, args, outputs, error, payloads))

    def gate(self, layer: int, t0: float, t1: float, ok: bool) -> None:
        """A ``wait_writable`` on ``layer`` that waited from ``t0`` to ``t1``."""
        self._queue.append(("gate", layer, t0, t1, ok))

    def read(
        self,
        read_id: int,
        layer: str,
        t0: float,
        t1: float,
        nbytes: int,
        ndesc: int,
        error: BaseException | None,
    ) -> None:
        """A batched read from ``t0`` to ``t1``."""
        self._queue.append(("read", read_id, layer, t0, t1, nbytes, ndesc, error))

    def mark(self, what: str, now: float, **fields: str | int | float) -> None:
        """A moment outside the endpoint (``what`` at ``now``: a scheduler or proxy step),
        with fields that name its request (``req``: vLLM's id, ``ext``: the transfer's)."""
        if len(self._queue) >= _MAX_QUEUED:
            self._dropped += 1
            return
        self._queue.append(("mark", what, now, fields))

    # -- writer ----------------------------------------------------------------------------

    def _open_part(self) -> Any:
        path = f"{self._stem}.ndjson" if self._part == 0 else f"{self._stem}.{self._part}.ndjson"
        f = open(path, "wb")  # noqa: SIM115 - closed by _rotate / close
        line = _json.encode({**self._header, "part": self._part}) + b"\n"
        f.write(line)
        self._written = len(line)
        self._paths.append(path)
        while len(self._paths) > self._keep:
            old = self._paths.pop(0)
            with contextlib.suppress(OSError):
                os.unlink(old)
        return f

    def _format(self, item: tuple[Any, ...]) -> dict[str, Any]:
        kind = item[0]
        if kind == "call":
            _, op, now, args, outputs, error, payloads = item
            rec: dict[str, Any] = {"k": "call", "t": now, "op": op}
            if args:
                rec["a"] = {k: _arg(v) for k, v in args.items()}
                frame = args.get("frame")
                if isinstance(frame, bytes | bytearray | memoryview):
                    rec["in"] = frame_summary(bytes(frame), fields=False)
            if outputs is not None:
                sent = iter(payloads or ())
                rec["o"] = [
                    summarize_output(
                        o, next(sent) if payloads and type(o).__name__ == "Send" else None
                    )
                    for o in outputs
                ]
            if error is not None:
                rec["e"] = _arg(error)
            return rec
        if kind == "mark":
            _, what, now, fields = item
            return {"k": "mark", "t": now, "what": what, **fields}
        if kind == "gate":
            _, layer, t0, t1, ok = item
            return {"k": "gate", "layer": layer, "t0": t0, "t1": t1, "ok": ok}
        _, read_id, layer, t0, t1, nbytes, ndesc, error = item
        return {
            "k": "read",
            "read_id": read_id,
            "layer": layer,
            "t0": t0,
            "t1": t1,
            "bytes": nbytes,
            "desc": ndesc,
            "ok": error is None,
            "err": None if error is None else _arg(error),
        }

    def _drain(self) -> None:
        queue = self._queue
        lines: list[bytes] = []
        while queue:
            item = queue.popleft()
            try:
                lines.append(_json.encode(self._format(item)))
            except Exception as exc:  # never lose the writer to one odd record
                lines.append(_json.encode({"k": "bad", "what": repr(exc)[:200]}))
            # Hand the GIL over after each record: a protocol thread waiting for it would
            # otherwise wait for the interpreter's switch interval (5 ms).
            time.sleep(0)
        if self._dropped:
            dropped, self._dropped = self._dropped, 0
            lines.append(_json.encode({"k": "drop", "count": dropped}))
        for line in lines:
            if self._written >= self._max_bytes:
                self._file.close()
                self._part += 1
                self._file = self._open_part()
            self._file.write(line + b"\n")
            self._written += len(line) + 1
        if lines:
            self._file.flush()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(_FLUSH_S)
            start = time.thread_time()
            self._drain()
            self.writer_cpu_s += time.thread_time() - start

    def flush(self) -> None:
        """Write everything recorded so far (for tests; the writer does it on its own)."""
        self._wake.set()
        deadline = time.monotonic() + 5.0
        while self._queue and time.monotonic() < deadline:
            time.sleep(0.005)
        self._wake.clear()

    def close(self) -> None:
        """Write what is left and close the file. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake.set()
        self._thread.join(10.0)
        self._drain()
        self._file.close()


def open_marks(trace_dir: str | None, source: str) -> Tracer | None:
    """A tracer for the marks of ``source`` (e.g. "decode scheduler"), in a stream of
    role :data:`MARKS_ROLE`; None when tracing is off."""
    return open_tracer(trace_dir, MARKS_ROLE, 0, {"source": source}, name=source)


def open_tracer(
    trace_dir: str | None, role: str, rank: int, config: Any, *, name: str = ""
) -> Tracer | None:
    """A :class:`Tracer` writing under ``trace_dir`` (or ``$RD2H_TRACE_DIR``); None when
    neither is set (tracing off)."""
    directory = trace_dir or os.environ.get(ENV_VAR) or None
    if directory is None:
        return None
    try:
        return Tracer(
            directory, role, rank, config, name=name, max_bytes=DEFAULT_MAX_BYTES, keep=DEFAULT_KEEP
        )
    except Exception:  # a trace must never stop a worker
        log.exception("cannot trace %s rank %d into %s; tracing off", role, rank, directory)
        return None
