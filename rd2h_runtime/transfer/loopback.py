"""In-process backend: ``ctypes.memmove`` between regions registered in this process.

For tests and single-process demos. The session id names an entry of a process-wide
registry, so a "peer" is another :class:`LoopbackBackend` of the same process. Both sides
of every descriptor are checked against what the two backends registered before a single
byte moves, so a bad address is a :class:`TransferError`, never a segfault.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
import time
import weakref
from typing import Any, ClassVar, Final

from rd2h_protocol.errors import TransferError
from rd2h_runtime.transfer.base import TransferBackend, U64Array

__all__ = ["LoopbackBackend"]

_PREFIX: Final = "loopback:"
# How many descriptors are copied between two deadline checks.
_DEADLINE_STRIDE: Final = 64

_registry: weakref.WeakValueDictionary[str, LoopbackBackend] = weakref.WeakValueDictionary()
_registry_lock = threading.Lock()
_counter = itertools.count(1)


class LoopbackBackend(TransferBackend):
    """Copies with ``memmove`` from another loopback backend of this process."""

    name: ClassVar[str] = "loopback"
    option_names: ClassVar[tuple[str, ...]] = ()

    def __init__(self, *, role: str, host: str = "127.0.0.1", **options: Any) -> None:
        self._check_options(options)
        super().__init__(role=role, host=host)
        self._session = f"{_PREFIX}{os.getpid()}:{next(_counter)}"
        with _registry_lock:
            _registry[self._session] = self

    @property
    def session_id(self) -> str:
        return self._session

    def _register(self, regions: list[tuple[int, int]]) -> None:
        # Nothing to tell an engine: the RegionSet kept by the base class is the registry.
        return None

    def _read(
        self, session: str, remote: U64Array, local: U64Array, lengths: U64Array, deadline: float
    ) -> None:
        with _registry_lock:
            peer = _registry.get(session)
        if peer is None or peer.closed:
            raise TransferError(
                f"loopback session {session!r} is not a live backend of this process "
                f"(pid {os.getpid()})"
            )
        bad = peer._local.first_outside(remote, lengths)
        if bad >= 0:
            raise TransferError(
                f"remote range {int(remote[bad]):#x}+{int(lengths[bad])} (descriptor {bad}) "
                f"is outside the regions registered by loopback session {session!r}"
            )
        dst, src, size = local.tolist(), remote.tolist(), lengths.tolist()
        for start in range(0, len(size), _DEADLINE_STRIDE):
            if time.monotonic() > deadline:
                raise TransferError(
                    f"loopback read timed out after {start} of {len(size)} descriptors",
                    transient=True,
                )
            stop = start + _DEADLINE_STRIDE
            for d, s, n in zip(dst[start:stop], src[start:stop], size[start:stop], strict=True):
                ctypes.memmove(d, s, n)

    def _close(self) -> None:
        with _registry_lock:
            if _registry.get(self._session) is self:
                del _registry[self._session]
