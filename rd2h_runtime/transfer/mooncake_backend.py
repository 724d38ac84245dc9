"""Mooncake backend (``pip install 'rd2h[mooncake]'``): Mooncake's transfer engine over TCP.

Metadata goes peer to peer (``P2PHANDSHAKE``): no etcd or metadata server. The session id
is ``"<host>:<rpc port>"``; the reader fetches the peer's registered segments from that port
on first use and caches them, so a Prefill registers its memory before it publishes the
session.

Facts that shaped this module (mooncake-transfer-engine-non-cuda 0.3.13):

- One batch of about 4096 slices fails with ``-1`` (the TCP lane queue is full) while 2048
  works, so reads are split into batches of at most :data:`MAX_BATCH_SLICES` descriptors.
- The TCP transport writes into whatever local address it is given; the base class checks
  local ranges against the registered regions first.
- The batched read is a blocking C call with its own timeout (``MC_TRANSFER_TIMEOUT``
  seconds, at least 5, default 30, plus one nanosecond per byte) and no cancel. It runs on a
  :class:`~rd2h_runtime.transfer.base.BlockingCallRunner` so ``read`` returns at its own
  deadline; :meth:`MooncakeBackend.quiesce` waits for the engine call to end.
- Each backend owns a ``TransferEngine`` with its own RPC port, so several share one
  process (a Prefill and a Decode included: tests/runtime/test_transfer_one_process.py).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, ClassVar, Final

from rd2h_protocol.errors import ConfigError, TransferError
from rd2h_runtime.transfer.base import BlockingCallRunner, TransferBackend, U64Array

__all__ = ["MAX_BATCH_SLICES", "PROTOCOLS", "MooncakeBackend"]

#: Most descriptors handed to the engine in one batch (4096 overflow its TCP lane queue).
MAX_BATCH_SLICES: Final = 2048
PROTOCOLS: Final = ("tcp", "rdma")
_METADATA: Final = "P2PHANDSHAKE"
# How long close() waits for a timed-out engine call before leaving the engine alive.
_CLOSE_WAIT_S: Final = 5.0


class MooncakeBackend(TransferBackend):
    """Batched reads through ``mooncake.engine.TransferEngine``."""

    name: ClassVar[str] = "mooncake"
    option_names: ClassVar[tuple[str, ...]] = ("protocol", "device_name", "max_batch_slices")

    def __init__(
        self,
        *,
        role: str,
        host: str = "127.0.0.1",
        protocol: str = "tcp",
        device_name: str = "",
        max_batch_slices: int = MAX_BATCH_SLICES,
        **options: Any,
    ) -> None:
        self._check_options(options)
        super().__init__(role=role, host=host)
        if protocol not in PROTOCOLS:
            raise ConfigError(
                f"mooncake protocol must be one of {', '.join(PROTOCOLS)}; got {protocol!r}"
            )
        if not 1 <= int(max_batch_slices) <= MAX_BATCH_SLICES:
            raise ConfigError(
                f"max_batch_slices must be in [1, {MAX_BATCH_SLICES}]; got {max_batch_slices}"
            )
        self._batch = int(max_batch_slices)
        # The engine logs every set-up step at INFO through glog on stderr; keep warnings
        # and errors only unless the user chose a level (must be set before the import).
        os.environ.setdefault("GLOG_minloglevel", "1")
        try:
            from mooncake.engine import TransferEngine
        except ModuleNotFoundError:
            raise  # the factory turns this into MissingExtra naming the pip extra
        except ImportError as exc:
            raise ConfigError(
                f"mooncake is installed but its engine library does not load ({exc}); it "
                "links the RDMA user-space libraries even for TCP: "
                "apt-get install libibverbs1 librdmacm1"
            ) from exc

        self._engine: Any = TransferEngine()
        ret = self._engine.initialize(host, _METADATA, protocol, device_name)
        if ret != 0:
            raise TransferError(
                f"mooncake TransferEngine.initialize({host!r}, {_METADATA}, {protocol!r}) "
                f"returned {ret}",
                int(ret),
            )
        self._session = f"{host}:{self._engine.get_rpc_port()}"
        self._runner = BlockingCallRunner("mooncake")
        self._lock = threading.Lock()

    @property
    def session_id(self) -> str:
        return self._session

    def _register(self, regions: list[tuple[int, int]]) -> None:
        addrs = [a for a, _ in regions]
        sizes = [n for _, n in regions]
        with self._lock:
            ret = self._engine.batch_register_memory(addrs, sizes)
        if ret != 0:
            raise TransferError(
                f"mooncake batch_register_memory of {len(regions)} region(s) returned {ret}",
                int(ret),
            )

    def _read(
        self, session: str, remote: U64Array, local: U64Array, lengths: U64Array, deadline: float
    ) -> None:
        total = int(lengths.shape[0])
        batches = [
            (local[i : i + self._batch], remote[i : i + self._batch], lengths[i : i + self._batch])
            for i in range(0, total, self._batch)
        ]

        def run_batches() -> None:
            for index, (dst, src, size) in enumerate(batches):
                if time.monotonic() >= deadline:
                    # The caller has given up (or is about to): start no more engine work.
                    raise TransferError(
                        f"mooncake read from {session!r} timed out after {index} of "
                        f"{len(batches)} batches",
                        transient=True,
                    )
                ret = self._engine.batch_transfer_sync_read(
                    session, dst.tolist(), src.tolist(), size.tolist()
                )
                if ret != 0:
                    raise TransferError(
                        f"mooncake batch_transfer_sync_read from {session!r} returned {ret} "
                        f"(batch {index + 1} of {len(batches)}, {size.shape[0]} descriptors; "
                        "an unknown session, a dead peer or a remote range outside its "
                        "registered memory all look like this)",
                        int(ret),
                    )

        self._runner.run(run_batches, deadline, f"mooncake read from {session!r}")

    def quiesce(self, timeout_s: float) -> bool:
        return self._runner.wait_idle(timeout_s)

    def _close(self) -> None:
        if not self._runner.wait_idle(_CLOSE_WAIT_S):
            # An engine call is still running on its thread: freeing the engine under it
            # would crash the process, so the engine stays alive until exit.
            return
        self._engine = None
