"""Synthetic engines in child processes: an engine of :mod:`rd2h_runtime.testing.engines`
built from its spec in a ``multiprocessing`` spawn child (optionally inside a network
namespace), called through a pipe, its death reported on an event pipe.

Apart from :mod:`rd2h_runtime.testing.engines` because it is about where an engine runs,
not what it does: the pipe protocol and the child's lifecycle are the same for both roles,
and only the engines that need real bytes between processes (nixl, mooncake, two hosts)
or a process to kill use it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import traceback
from collections.abc import Iterator
from typing import Any

from rd2h_protocol.producer import DecodeTarget
from rd2h_runtime.testing.engines import DecodeEngine, DecodeSpec, PrefillEngine, PrefillSpec
from rd2h_runtime.testing.netns import enter_host

__all__ = ["EngineProcess", "engine_process"]


def _child_main(
    kind: str,
    spec: DecodeSpec | PrefillSpec,
    conn: multiprocessing.connection.Connection,
    events: multiprocessing.connection.Connection,
) -> None:
    """Child process: build the engine, then run the parent's calls until "close"."""
    os.environ.setdefault("UCX_MODULES", "^ib")
    engine: DecodeEngine | PrefillEngine
    try:
        if spec.netns is not None:  # first: before any socket or engine exists
            enter_host(spec.netns, spec.host)
        if kind == "decode":
            assert isinstance(spec, DecodeSpec)
            engine = DecodeEngine(spec, events)
        else:
            assert isinstance(spec, PrefillSpec)
            engine = PrefillEngine(spec, events)
    except Exception:
        conn.send(("err", traceback.format_exc()))
        return
    conn.send(("ok", None))
    try:
        while True:
            try:
                name, args = conn.recv()
            except EOFError:  # the parent is gone
                return
            if name == "close":
                break
            try:
                conn.send(("ok", getattr(engine, name)(*args)))
            except Exception:
                conn.send(("err", traceback.format_exc()))
    finally:
        engine.close()
    conn.send(("ok", None))


class EngineProcess:
    """An engine in a child process (multiprocessing spawn), called through a pipe."""

    def __init__(self, kind: str, spec: DecodeSpec | PrefillSpec, timeout: float = 60.0) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.events, child_events = ctx.Pipe(duplex=False)
        self.kind = kind
        self.proc = ctx.Process(
            target=_child_main, args=(kind, spec, child, child_events), name=f"{kind}-engine"
        )
        self.proc.start()
        child.close()
        child_events.close()
        self._reply(timeout, "start")

    def _reply(self, timeout: float, what: str) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.kind} engine: no answer to {what} within {timeout} s")
        try:
            status, value = self.conn.recv()
        except EOFError as exc:
            raise RuntimeError(f"{self.kind} engine died during {what}") from exc
        if status != "ok":
            raise RuntimeError(f"{self.kind} engine failed in {what}:\n{value}")
        return value

    def call(self, name: str, *args: Any, timeout: float = 60.0) -> Any:
        self.conn.send((name, args))
        return self._reply(timeout, name)

    def post(self, name: str, *args: Any) -> None:
        """Call without waiting for the answer (for a call the child may die during)."""
        self.conn.send((name, args))

    def target(self) -> DecodeTarget:
        target: DecodeTarget = self.call("target")
        return target

    def death(self, timeout: float) -> tuple[str, float] | None:
        """``(what, monotonic time)`` when the child reported its death, else None."""
        if not self.events.poll(timeout):
            return None
        _, what, at = self.events.recv()
        return what, at

    def close(self, timeout: float = 30.0) -> None:
        """Ask the child to close its engine and exit; kill it if it does not."""
        if self.proc.is_alive():
            with contextlib.suppress(OSError, EOFError, TimeoutError, RuntimeError):
                self.call("close", timeout=timeout)
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()
        self.events.close()


@contextlib.contextmanager
def engine_process(kind: str, spec: DecodeSpec | PrefillSpec) -> Iterator[EngineProcess]:
    proc = EngineProcess(kind, spec)
    try:
        yield proc
    finally:
        proc.close()
