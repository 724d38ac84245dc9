"""Rendezvous posts of Decode's scheduler side: who posts, what waits, what a failure means.

Decode's :class:`~rd2h_vllm.scheduler.SchedulerSide` queues each request's rendezvous
during a step (:class:`QueuedPost`), posts them through a :class:`Poster` once the
step's metadata is built, and turns a post that failed or was cancelled into a
:class:`~rd2h_vllm.metadata.LoadFailure` for a later step (:func:`post_failure`). These
pieces are apart from the scheduler side because they are the seam to
:mod:`rd2h_vllm.metaserver` (tests give the scheduler side a poster of their own) and
hold no per-request state.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import Protocol

from rd2h_protocol.errors import ErrorCode
from rd2h_protocol.rendezvous import Rendezvous
from rd2h_vllm.metadata import LoadFailure
from rd2h_vllm.metaserver import MetaserverError, PostResult

__all__ = ["Poster", "QueuedPost", "post_failure"]


def post_failure(
    req_id: str, ext_id: str, future: concurrent.futures.Future[PostResult]
) -> LoadFailure | None:
    """The load failure a finished rendezvous post means, if any."""
    if future.cancelled():
        return LoadFailure(
            req_id=req_id,
            ext_id=ext_id,
            code=int(ErrorCode.ABORTED),
            message="rendezvous post cancelled (connector shutting down)",
        )
    exc = future.exception()
    if exc is None:
        return None
    code = exc.code if isinstance(exc, MetaserverError) else ErrorCode.UNKNOWN
    return LoadFailure(req_id=req_id, ext_id=ext_id, code=int(code), message=str(exc))


class Poster(Protocol):
    """What posts a rendezvous without blocking (``RendezvousPoster`` in production)."""

    def post(
        self, url: str, rendezvous: Rendezvous, *, idempotent: bool = False
    ) -> concurrent.futures.Future[PostResult]:
        """Start posting; the future raises ``MetaserverError`` on failure and cancelling
        it cancels the post."""


@dataclass(frozen=True, slots=True)
class QueuedPost:
    """A rendezvous waiting for the end of the step to be posted."""

    req_id: str
    url: str
    rendezvous: Rendezvous
    idempotent: bool
