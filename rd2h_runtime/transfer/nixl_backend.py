"""NIXL backend (``pip install 'rd2h[nixl]'``): UCX reads between host-memory regions.

Session id: ``"nixl1:" + base64url(zlib(agent metadata))``. NIXL needs the peer's agent
metadata (its UCX worker address plus the remote keys of its registered memory) before it
can read; carrying it inside the session string makes the session self-contained, so no
extra listener, port or round trip is needed and MF_META delivers it like any session.
Metadata grows by roughly 120 bytes per registered region (a few hundred bytes for a
handful of merged regions). The session changes when more memory is registered, so a
Prefill publishes it after registering.

Reads use NIXL's asynchronous transfer request: post, poll until done, error or deadline.
Posting may itself move all the data before it returns (UCX over TCP does), so a request
runs on a :class:`~rd2h_runtime.transfer.base.BlockingCallRunner` thread and ``read``
returns at its deadline regardless. A request still polling at the deadline is released,
which asks UCX to cancel it; if NIXL refuses (the transfer cannot be cancelled yet) the
handle is kept and :meth:`NixlBackend.quiesce` waits for it.

Each backend is an agent of its own, named uniquely, so any number share one process
(a Prefill and a Decode included: tests/runtime/test_transfer_one_process.py).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import importlib
import importlib.util
import ipaddress
import os
import sys
import threading
import time
import uuid
import zlib
from typing import Any, ClassVar, Final

import numpy as np

from rd2h_protocol.errors import TransferError
from rd2h_runtime.transfer.base import BlockingCallRunner, TransferBackend, U64Array

__all__ = ["SESSION_PREFIX", "NixlBackend"]

SESSION_PREFIX: Final = "nixl1:"
# Upper bound of one poll sleep; polling starts at a few microseconds and backs off to it.
_MAX_POLL_SLEEP_S: Final = 0.0005
#: Microseconds NIXL's progress thread sleeps between passes (NIXL's own default spins).
PROGRESS_DELAY_US: Final = 50
_UCX_PLUGIN: Final = "UCX"
# How long close() waits for a running transfer before leaving the agent alive.
_CLOSE_WAIT_S: Final = 5.0

# NIXL raises one exception class per status (nixlNotFoundError for NIXL_ERR_NOT_FOUND, ...);
# the numeric code is looked up from the binding's status enum on first use.
_status_codes: dict[str, int] = {}
# The NIXL build in use (nixl_cu13, nixl_cu12, ...), chosen on first use.
_package: str | None = None


def ipaddress_is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def import_nixl() -> tuple[Any, Any]:
    """NIXL's ``nixl_agent`` and ``nixl_agent_config`` classes."""
    global _package
    # UCX probes InfiniBand when loaded; on hosts without it both processes crash at exit
    # unless its ib module is excluded. Must be set before the first import of nixl.
    os.environ.setdefault("UCX_MODULES", "^ib")
    # NIXL logs every agent creation at INFO to stdout, which would corrupt machine-readable
    # output (rd2h demo --json); warnings and errors still show. NIXL_LOG_LEVEL overrides.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    if _package is None:
        _package = _choose_package()
    api = importlib.import_module(f"{_package}._api")
    _bound_progress_delay(api.nixlBind)
    return api.nixl_agent, api.nixl_agent_config


def _bound_progress_delay(bind: Any) -> None:
    """Make NIXL's progress thread sleep between passes instead of spinning.

    NIXL's Python agent hard-codes the progress-thread delay to 0, and an idle agent then
    burns ~0.7 of a core (measured here); a Prefill engine has one agent per TP rank, so a
    few idle agents starve the compute they are meant to overlap. The config class the
    agent constructor looks up is swapped, once, for a subclass that raises any delay to at
    least :data:`PROGRESS_DELAY_US` (idle cost ~0.03 core).
    """
    base = bind.nixlAgentConfig
    if getattr(base, "_rd2h_bounded", False):
        return
    delay = base.pthrDelay

    class BoundedConfig(base):  # type: ignore[misc,valid-type]
        _rd2h_bounded = True

        @property
        def pthrDelay(self) -> int:
            return int(delay.__get__(self))

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:
            delay.__set__(self, max(int(value), PROGRESS_DELAY_US))

    bind.nixlAgentConfig = BoundedConfig


def _choose_package() -> str:
    # The `nixl` meta package picks a CUDA build (nixl_cu12/nixl_cu13) from torch, and
    # imports torch to do so when torch is installed without CUDA: seconds of start-up for
    # a choice that does not matter for host memory. When torch is not loaded yet, take the
    # first installed build directly; otherwise (e.g. inside vLLM) follow the meta package so
    # the process keeps a single NIXL/UCX copy.
    if "torch" not in sys.modules and "nixl" not in sys.modules:
        try:
            meta_installed = importlib.util.find_spec("nixl") is not None
        except (ValueError, ImportError):
            meta_installed = False
        if meta_installed:
            for name in ("nixl_cu13", "nixl_cu12", "nixl_rocm"):
                if importlib.util.find_spec(name) is not None:
                    return name
    import nixl

    return str(nixl._api.__name__.rsplit(".", 1)[0])


def _code(exc: BaseException) -> int | None:
    """NIXL's status code for one of its exceptions (``None`` for other exceptions)."""
    if not _status_codes and _package is not None:
        bindings = importlib.import_module(f"{_package}._bindings")
        for status_name, value in bindings.nixl_status_t.__members__.items():
            words = status_name.removeprefix("NIXL_ERR_").split("_")
            _status_codes["nixl" + "".join(w.capitalize() for w in words) + "Error"] = int(value)
    return _status_codes.get(type(exc).__name__)


def encode_session(metadata: bytes) -> str:
    """Session string carrying NIXL agent metadata."""
    return SESSION_PREFIX + base64.urlsafe_b64encode(zlib.compress(metadata)).decode("ascii")


def decode_session(session: str) -> bytes:
    """Agent metadata from a session string; :class:`TransferError` when malformed."""
    if not session.startswith(SESSION_PREFIX):
        raise TransferError(
            f"not a NIXL session (expected prefix {SESSION_PREFIX!r}): {session[:40]!r}"
        )
    try:
        return zlib.decompress(base64.urlsafe_b64decode(session[len(SESSION_PREFIX) :]))
    except (binascii.Error, zlib.error, ValueError) as exc:
        raise TransferError(f"malformed NIXL session: {exc}") from exc


class NixlBackend(TransferBackend):
    """Reads through a NIXL agent with the UCX plugin (host memory, ``DRAM`` segments)."""

    name: ClassVar[str] = "nixl"
    option_names: ClassVar[tuple[str, ...]] = ("agent_name", "num_threads")

    def __init__(
        self,
        *,
        role: str,
        host: str = "127.0.0.1",
        agent_name: str | None = None,
        num_threads: int = 0,
        **options: Any,
    ) -> None:
        self._check_options(options)
        super().__init__(role=role, host=host)
        if ipaddress_is_loopback(host):
            # Bound to a loopback host, every peer is on this machine: keep UCX on the
            # loopback device. Left to choose, UCX's TCP transport connects through the
            # host's external interface, which both leaves loopback and stalls each small
            # read for a scheduler tick (~4 ms here). UCX reads this when the agent starts.
            os.environ.setdefault("UCX_NET_DEVICES", "lo")
        nixl_agent, nixl_agent_config = import_nixl()
        self._agent_name = agent_name or f"rd2h-{self.role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            config = nixl_agent_config(
                enable_prog_thread=True, backends=[_UCX_PLUGIN], num_threads=int(num_threads)
            )
            self._agent = nixl_agent(self._agent_name, config)
        except Exception as exc:
            raise TransferError(f"NIXL agent creation failed: {exc}", _code(exc)) from exc
        if _UCX_PLUGIN not in self._agent.backends:
            raise TransferError(
                f"NIXL has no {_UCX_PLUGIN} plugin here (available: {self._agent.plugin_list})"
            )
        # One agent call at a time: the agent is created without NIXL's own thread sync.
        self._lock = threading.Lock()
        self._session: str | None = None
        self._peers: dict[str, str] = {}  # session -> remote agent name
        self._connected: set[str] = set()  # sessions whose connection connect() made
        self._unfinished: list[Any] = []  # timed-out handles NIXL could not cancel
        self._runner = BlockingCallRunner("nixl")

    @property
    def session_id(self) -> str:
        with self._lock:
            if self._session is None:
                self._session = encode_session(self._agent.get_agent_metadata())
            return self._session

    def _register(self, regions: list[tuple[int, int]]) -> None:
        descs = [(addr, length, 0, "") for addr, length in regions]
        with self._lock:
            try:
                self._agent.register_memory(descs, "DRAM", backends=[_UCX_PLUGIN])
            except Exception as exc:
                raise TransferError(f"NIXL register_memory failed: {exc}", _code(exc)) from exc
            self._session = None  # the metadata now lists more memory

    def _peer(self, session: str) -> str:
        name = self._peers.get(session)
        if name is None:
            metadata = decode_session(session)
            try:
                loaded = self._agent.add_remote_agent(metadata)
            except Exception as exc:
                raise TransferError(
                    f"NIXL could not load the peer's metadata: {exc}", _code(exc)
                ) from exc
            name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            self._peers[session] = name
        return name

    def connect(self, session: str, *, timeout_s: float) -> None:
        """Load the peer's metadata and let UCX make its connection now: on a loaded host
        the first transfer to a new peer spent seconds here, inside its read deadline."""
        self._ensure_open()
        with self._lock:
            if session in self._connected:
                return
        self._runner.run(
            lambda: self._connect(session),
            time.monotonic() + timeout_s,
            f"NIXL connection to session {session[:24]}...",
        )

    def _connect(self, session: str) -> None:
        with self._lock:
            if session in self._connected:
                return
            peer = self._peer(session)
            make_connection = getattr(self._agent, "make_connection", None)
            if make_connection is not None:  # older NIXL: the first transfer connects
                try:
                    make_connection(peer)
                except Exception as exc:
                    raise TransferError(
                        f"NIXL could not connect to {peer!r}: {exc}", _code(exc)
                    ) from exc
            self._connected.add(session)

    def _read(
        self, session: str, remote: U64Array, local: U64Array, lengths: U64Array, deadline: float
    ) -> None:
        zeros = np.zeros(lengths.shape[0], dtype=np.uint64)
        local_descs = np.stack([local, lengths, zeros], axis=1)
        remote_descs = np.stack([remote, lengths, zeros], axis=1)
        # Posting can itself move the data before it returns (UCX over TCP does), so the
        # whole request runs on the runner's thread and read() returns at the deadline.
        self._runner.run(
            lambda: self._transfer(session, local_descs, remote_descs, deadline),
            deadline,
            f"NIXL read from session {session[:24]}...",
        )

    def _transfer(
        self, session: str, local_descs: U64Array, remote_descs: U64Array, deadline: float
    ) -> None:
        with self._lock:
            self._reap()
            peer = self._peer(session)
            try:
                handle = self._agent.initialize_xfer(
                    "READ",
                    self._agent.get_xfer_descs(local_descs, "DRAM"),
                    self._agent.get_xfer_descs(remote_descs, "DRAM"),
                    peer,
                    backends=[_UCX_PLUGIN],
                )
            except Exception as exc:
                raise TransferError(
                    f"NIXL refused the read from {peer!r} ({local_descs.shape[0]} descriptors; "
                    f"a remote range outside the peer's registered memory is NOT_FOUND): {exc}",
                    _code(exc),
                ) from exc
            try:
                state = self._agent.transfer(handle)
                sleep = 0.000005
                while state == "PROC":
                    if time.monotonic() >= deadline:
                        self._abandon(handle)
                        raise TransferError(
                            f"NIXL read from {peer!r} timed out",
                            transient=not self._unfinished,
                        )
                    time.sleep(sleep)
                    sleep = min(sleep * 2, _MAX_POLL_SLEEP_S)
                    state = self._agent.check_xfer_state(handle)
            except TransferError:
                raise
            except Exception as exc:
                self._abandon(handle)
                raise TransferError(f"NIXL read from {peer!r} failed: {exc}", _code(exc)) from exc
            if state != "DONE":
                self._abandon(handle)
                raise TransferError(f"NIXL read from {peer!r} ended in state {state}")
            handle.release()

    def _abandon(self, handle: Any) -> None:
        """Release (cancel) a handle; keep it for :meth:`quiesce` if NIXL cannot yet."""
        try:
            handle.release()
        except Exception:
            self._unfinished.append(handle)

    def _reap(self) -> None:
        still = []
        for handle in self._unfinished:
            try:
                state = self._agent.check_xfer_state(handle)
            except Exception:
                state = "ERR"
            if state == "PROC":
                still.append(handle)
                continue
            try:
                handle.release()
            except Exception:
                still.append(handle)
        self._unfinished = still

    def quiesce(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + max(0.0, float(timeout_s))
        if not self._runner.wait_idle(timeout_s):
            return False
        while True:
            with self._lock:
                self._reap()
                if not self._unfinished:
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(_MAX_POLL_SLEEP_S)

    def _close(self) -> None:
        if not self.quiesce(_CLOSE_WAIT_S):
            # A transfer is still running on the runner's thread; dropping the agent under
            # it could crash the process, so the agent stays alive until exit.
            return
        with self._lock:
            for name in set(self._peers.values()):
                # The peer may be gone already; then there is nothing left to release.
                with contextlib.suppress(Exception):
                    self._agent.remove_remote_agent(name)
            self._peers.clear()
            # The agent (and its registrations) go with the last reference; NIXL has no
            # explicit destroy in its Python API.
            self._agent = None
