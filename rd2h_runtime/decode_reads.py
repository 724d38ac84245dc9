"""How a Decode rank runs a read: a batch of plans of one Prefill session as ONE engine
read, what it records, and the bounds under which a plan is small enough to read inline.

:class:`~rd2h_runtime.decode.DecodeWorker` decides when a plan is read and on which thread
(its read worker, or its dispatcher for an inline read) and reports the outcome to its
endpoint; what happens inside one read -- the ``start_by`` check, connecting, planning
descriptors, the engine call bounded by ``read_timeout_s`` and the earliest ``finish_by``,
the counters and per-plan records -- depends on the backend and the plans alone, so it
stands apart here, the same whichever thread runs it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from rd2h_protocol.consumer import StartRead
from rd2h_protocol.errors import ProtocolError, TransferError
from rd2h_protocol.plan import ReadPlan
from rd2h_runtime.planning import Descriptors
from rd2h_runtime.trace import Tracer
from rd2h_runtime.transfer import TransferBackend

__all__ = [
    "CALLER_THREAD_BACKENDS",
    "INLINE_READ_BYTES",
    "INLINE_READ_PIECES",
    "MAX_BATCHED_READS",
    "DecodeMetrics",
    "PlannerBug",
    "ReadRecord",
    "joined_descriptors",
    "plan_within",
    "read_batch",
]

# The Decode worker's logger: a read's failures are logged as the worker's own.
log = logging.getLogger("rd2h_runtime.decode")

#: By default, at most this many queued plans (layers) go into one engine read.
MAX_BATCHED_READS: Final = 64
#: By default, the dispatcher runs a plan of at most this many bytes itself (an inline
#: read, see :mod:`rd2h_runtime.decode`) on a backend that reads on the calling thread.
INLINE_READ_BYTES: Final = 1 << 20
#: An inline read's plan has at most this many block pieces (a block of one component of
#: one request: an upper bound on its descriptors, which coalescing only lowers).
INLINE_READ_PIECES: Final = 256
#: Backends whose ``read`` runs on the calling thread and leaves nothing running once it
#: returned or raised: inline reads are on for them by default.
CALLER_THREAD_BACKENDS: Final = frozenset({"loopback", "cma"})


class PlannerBug(Exception):
    """The descriptors of a read do not cover exactly the bytes its plan owns."""


def plan_within(plan: ReadPlan, max_bytes: int, max_pieces: int) -> bool:
    """Whether ``plan`` moves at most ``max_bytes`` in at most ``max_pieces`` block pieces
    (a piece is one block of one component of one request, so the pieces bound the plan's
    descriptors from above). Stops at the first request past either bound."""
    main, idx = plan.main, plan.indexer
    main_block = sum(c.block_bytes for c in main)
    idx_block = sum(c.block_bytes for c in idx)
    nbytes = pieces = 0
    for r in plan.requests:
        m, i = len(r.main_src), len(r.indexer_src)
        nbytes += m * main_block + i * idx_block
        pieces += m * len(main) + i * len(idx)
        if nbytes > max_bytes or pieces > max_pieces:
            return False
    return True


def joined_descriptors(descs: Sequence[Descriptors]) -> tuple[Any, Any, Any]:
    """The descriptor arrays of several plans as one read's (no copy for a single plan)."""
    if len(descs) == 1:
        return descs[0].remote_addrs, descs[0].local_addrs, descs[0].lengths
    return (
        np.concatenate([d.remote_addrs for d in descs]),
        np.concatenate([d.local_addrs for d in descs]),
        np.concatenate([d.lengths for d in descs]),
    )


@dataclass(frozen=True, slots=True)
class ReadRecord:
    """One plan's read as the read worker ran it (for per-layer metrics).

    ``nbytes`` and ``descriptors`` are 0 when the read failed before it was planned;
    ``error`` is None on success. ``seconds``: the plan's share of its engine read's time,
    by bytes (an engine read moves several plans when they were queued together), so that
    bytes over seconds summed over plans is the rate while reading.
    """

    layer_name: str
    nbytes: int
    descriptors: int
    seconds: float
    error: TransferError | None


@dataclass(slots=True)
class DecodeMetrics:
    """Runtime counters of one worker (the endpoint's own are in ``stats``)."""

    reads: int = 0
    read_failures: int = 0
    reads_not_started: int = 0  # start_by passed while queued
    read_bytes: int = 0
    descriptors: int = 0
    plan_s: float = 0.0  # total time turning plans into descriptors
    read_s: float = 0.0  # total time inside backend.read
    inline_reads: int = 0  # reads the dispatcher ran (or found too late) itself: inline
    frames_sent: int = 0
    send_failures: int = 0  # replies the server refused or could not deliver
    handler_errors: int = 0  # exceptions caught on the dispatcher or the read worker
    reads_outlived: int = 0  # failed reads whose engine call ran on (reported when it ended)
    batched_reads: int = 0  # engine reads that moved several plans (layers) at once


def read_batch(
    batch: list[StartRead],
    *,
    backend: TransferBackend,
    planner: Callable[[ReadPlan], Descriptors],
    read_timeout_s: float,
    metrics: DecodeMetrics,
    tracer: Tracer | None,
) -> tuple[list[TransferError | None], list[ReadRecord]]:
    """Run the plans of ``batch`` (one Prefill session) as ONE engine read on ``backend``:
    the error to report for each (None on success) and the records of the plans read,
    counted in ``metrics``. Never raises. The caller holds the worker's read lock (reads
    stay one at a time).

    A plan whose ``start_by`` passed is not started (its own error); the others share
    the read's outcome, bounded by the earliest ``finish_by`` among them.
    """
    records: list[ReadRecord] = []
    now = time.monotonic()
    errors: list[TransferError | None] = [None] * len(batch)
    started: list[int] = []
    for i, item in enumerate(batch):
        if item.may_start(now):
            started.append(i)
        else:
            metrics.reads_not_started += 1
            errors[i] = item.not_started(now)
    if not started:
        return errors, records
    plans = [batch[i].plan for i in started]
    finish_by = min((f for i in started if (f := batch[i].finish_by) is not None), default=None)
    session = plans[0].session
    descs: list[Descriptors] = []
    start = time.monotonic()
    try:
        # Connecting touches no Prefill memory: it may take until the lease's end, and
        # the read's own timeout starts after it.
        connect_s = read_timeout_s
        if finish_by is not None:
            connect_s = max(connect_s, finish_by - start)
        backend.connect(session, timeout_s=connect_s)
        start = time.monotonic()
        try:
            for plan in plans:
                desc = planner(plan)
                planned, described = plan.total_bytes, desc.total_bytes
                if described != planned:
                    # A planner bug must be loud: never report a read done that moved
                    # less (or more) than its plan owns.
                    raise PlannerBug(
                        f"read {plan.read_id}: the plan owns {planned} bytes but its "
                        f"{len(desc)} descriptors cover {described}"
                    )
                descs.append(desc)
        finally:
            metrics.plan_s += time.monotonic() - start
        start = time.monotonic()
        timeout_s = read_timeout_s
        if finish_by is not None:
            # Past finish_by Prefill may reuse the storage: reading on is worthless.
            timeout_s = min(timeout_s, finish_by - start)
        remote, local, lengths = joined_descriptors(descs)
        try:
            backend.read(session, remote, local, lengths, timeout_s=timeout_s)
        finally:
            metrics.read_s += time.monotonic() - start
    except TransferError as exc:
        error: TransferError | None = exc
    except PlannerBug as exc:
        log.error("%s", exc)
        error = TransferError(str(exc))
    except ProtocolError as exc:
        # A plan the planner refuses (addresses past 64 bits): fail the read, not the
        # thread; retrying it cannot help.
        error = TransferError(f"read {plans[0].read_id} could not be planned: {exc.message}")
    except Exception as exc:
        log.exception("read %d raised", plans[0].read_id)
        error = TransferError(f"read {plans[0].read_id} raised {exc!r}")
    else:
        error = None
    end = time.monotonic()
    batch_bytes = sum(d.total_bytes for d in descs) if error is None else 0
    for n, i in enumerate(started):
        plan = plans[n]
        errors[i] = error
        nbytes = ndesc = 0
        if error is None:
            nbytes, ndesc = descs[n].total_bytes, len(descs[n])
            metrics.reads += 1
            metrics.read_bytes += nbytes
            metrics.descriptors += ndesc
        else:
            metrics.read_failures += 1
        share = nbytes / batch_bytes if batch_bytes else 1 / len(started)
        records.append(ReadRecord(plan.layer_name, nbytes, ndesc, (end - start) * share, error))
        if tracer is not None:
            tracer.read(plan.read_id, plan.layer_name, start, end, nbytes, ndesc, error)
    if len(started) > 1:
        metrics.batched_reads += 1
    return errors, records
