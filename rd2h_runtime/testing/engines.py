"""Synthetic Prefill and Decode engines: every TP rank of one role, in this process or a child.

An *engine* is what one vLLM instance would be: all TP ranks of one role, each rank a
:class:`~rd2h_runtime.prefill.PrefillWorker` or :class:`~rd2h_runtime.decode.DecodeWorker`
with its own transfer backend and its own sockets (the ranks of one engine share a process,
as threads, because the Decode main pool is one TP-shared buffer). Engines run in-process
(loopback backend, deterministic) or in a child process started with ``multiprocessing``
spawn (nixl, mooncake: real bytes between processes), driven through a pipe by
:class:`~rd2h_runtime.testing.child_engines.EngineProcess`. Sockets are on 127.0.0.1 with
ports chosen at run time, unless a spec names its ``host`` (and, for Decode, its
``port``); a child engine can also run in a network namespace of its own (``netns``, see
:mod:`rd2h_runtime.testing.netns`), so that two engines on one machine talk over a real
link as two hosts would.

Decode verifies every destination byte against the pattern Prefill wrote
(:meth:`~rd2h_runtime.testing.synthetic.DecodeDestinations.verify`). ``rd2h demo`` and the
end-to-end tests drive these engines. The fault knobs of the specs (a Decode read delay, a
Decode that SIGKILLs itself when a given read starts, a Prefill that SIGKILLs itself after
publishing a given layer, a layout mismatch, a compute path that writes before its gate
opens) exist to show the protocol's recovery; each reports its time of death on an event
pipe first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rd2h_protocol.consumer import ConsumerConfig
from rd2h_protocol.producer import DecodeTarget, ProducerConfig, RequestFinished
from rd2h_protocol.wire.layout import DestinationLayout
from rd2h_protocol.wire.messages import ALL_CAPABILITIES
from rd2h_runtime.control import BindError, ControlOptions
from rd2h_runtime.decode import DecodeWorker, Outcome
from rd2h_runtime.decode_reads import MAX_BATCHED_READS
from rd2h_runtime.prefill import PrefillWorker
from rd2h_runtime.testing.synthetic import (
    BlockAllocator,
    DecodeDestinations,
    Mismatch,
    PrefillCache,
    PrefillRankDriver,
    RequestSpec,
    SyntheticModel,
)
from rd2h_runtime.transfer import TransferBackend, create_backend
from rd2h_runtime.transfer.base import U64Array

HOST = "127.0.0.1"

# Short heartbeats so a killed peer's connection is noticed fast; small queues are plenty.
FAST_CONTROL = ControlOptions(
    heartbeat_ivl_s=0.2,
    heartbeat_timeout_s=1.0,
    heartbeat_ttl_s=2.0,
    reconnect_grace_s=1.0,
    idle_poll_s=0.5,
)


# -- fault-injecting backend -----------------------------------------------------------------


class HookedBackend(TransferBackend):
    """Wraps a backend: runs ``before_read(n)`` (n = 1, 2, ...) before each read."""

    name = "hooked"

    def __init__(self, inner: TransferBackend, before_read: Callable[[int], None]) -> None:
        super().__init__(role=inner.role, host=inner.host)
        self._inner = inner
        self._before = before_read
        self._count = 0

    @property
    def session_id(self) -> str:
        return self._inner.session_id

    def _register(self, regions: list[tuple[int, int]]) -> None:
        self._inner.register(regions)

    def _read(
        self, session: str, remote: U64Array, local: U64Array, lengths: U64Array, deadline: float
    ) -> None:
        self._count += 1
        self._before(self._count)
        self._inner.read(session, remote, local, lengths, timeout_s=deadline - time.monotonic())

    def quiesce(self, timeout_s: float) -> bool:
        return self._inner.quiesce(timeout_s)

    def _close(self) -> None:
        self._inner.close()


def die(events: multiprocessing.connection.Connection | None, what: str) -> None:
    """Report the time of death on ``events``, then SIGKILL this process (no cleanup)."""
    if events is not None:
        with contextlib.suppress(OSError):
            events.send(("died", what, time.monotonic()))
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(10)  # never reached: SIGKILL cannot be caught


# -- Decode engine ---------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeSpec:
    """One Decode engine: model, TP size, backend and the knobs tests turn."""

    model: SyntheticModel
    d_tp: int = 1
    backend: str = "loopback"
    num_blocks: int = 256
    contiguous: bool = False
    seed: int = 7
    kv_load_timeout_s: float = 30.0
    park_timeout_s: float = 2.0
    read_timeout_s: float = 5.0
    read_delay_s: float = 0.0
    max_batched_reads: int = MAX_BATCHED_READS  # plans one engine read may take (1: each alone)
    die_at_read: int | None = None  # SIGKILL the process when this read (1-based) starts
    compat: str | None = None
    capabilities: tuple[str, ...] = ALL_CAPABILITIES
    mismatch_layer: int | None = None  # this layer's destination lacks the LIC8 scale
    control: ControlOptions = FAST_CONTROL
    host: str = HOST  # ROUTERs and backend bind / advertise this address
    port: int = 0  # rank 0's port (ranks on port..port+d_tp-1); 0: any free run of ports
    netns: str | None = None  # child engines only: run in this network namespace
    trace_dir: str | None = None  # protocol traces of every rank go here (rd2h_runtime.trace)


@dataclass(frozen=True)
class DecodeResult:
    """A request's outcome on a Decode engine (all ranks) and the byte check."""

    ext_id: str
    ok: bool  # done on every rank
    terminal: bool  # terminal on every rank
    codes: tuple[str | None, ...]  # per rank: None (done) or the error code name
    at: float  # monotonic time the last rank reported
    mismatches: tuple[Mismatch, ...]  # byte check (only run for ok requests)


class DecodeEngine:
    """All Decode TP ranks of one engine, with their destinations."""

    def __init__(
        self,
        spec: DecodeSpec,
        events: multiprocessing.connection.Connection | None = None,
    ) -> None:
        self.spec = spec
        self.dest = DecodeDestinations(spec.model, spec.d_tp, spec.num_blocks)
        self.alloc = BlockAllocator(spec.num_blocks, spec.seed, contiguous=spec.contiguous)
        self.ids: dict[str, tuple[list[int], list[int]]] = {}
        self._events = events
        self._reads = 0
        self._reads_lock = threading.Lock()
        self.workers = self._start()

    def _layers(self, rank: int) -> list[tuple[str, DestinationLayout]]:
        layers = self.dest.layers(rank)
        bad = self.spec.mismatch_layer
        if bad is not None:
            # Decode expects no LIC8 scale on this layer while Prefill sends one.
            name, d = layers[bad]
            layers[bad] = (name, dataclasses.replace(d, scale=None))
        return layers

    def _before_read(self, _: int) -> None:
        spec = self.spec
        with self._reads_lock:  # counted across the engine's ranks
            self._reads += 1
            n = self._reads
        if spec.die_at_read is not None and n >= spec.die_at_read:
            die(self._events, f"decode read {n}")
        if spec.read_delay_s:
            time.sleep(spec.read_delay_s)

    def _backend(self) -> TransferBackend:
        inner = create_backend(self.spec.backend, role="decode", host=self.spec.host)
        if self.spec.die_at_read is None and not self.spec.read_delay_s:
            return inner
        return HookedBackend(inner, self._before_read)

    def _start(self) -> list[DecodeWorker]:
        """Bind the ranks on consecutive ports base..base+d_tp-1 (retry on a clash, unless
        the spec fixes the base port)."""
        spec = self.spec
        last: Exception | None = None
        for _ in range(1 if spec.port else 20):
            workers: list[DecodeWorker] = []
            try:
                for rank in range(spec.d_tp):
                    base = spec.port or (workers[0].port if workers else 0)
                    port = base + rank if base else 0
                    config = ConsumerConfig(
                        d_rank=rank,
                        d_tp=spec.d_tp,
                        layers=self._layers(rank),
                        capabilities=spec.capabilities,
                        compat=spec.compat,
                        kv_load_timeout_s=spec.kv_load_timeout_s,
                        park_timeout_s=spec.park_timeout_s,
                    )
                    workers.append(
                        DecodeWorker(
                            config,
                            self._backend(),
                            host=spec.host,
                            port=port,
                            regions=self.dest.regions(rank),
                            control_options=spec.control,
                            read_timeout_s=spec.read_timeout_s,
                            trace_dir=spec.trace_dir,
                            max_batched_reads=spec.max_batched_reads,
                        )
                    )
                return workers
            except BindError as exc:
                last = exc
                for w in workers:
                    w.close()
        if spec.port:
            raise RuntimeError(f"cannot bind {spec.host}:{spec.port} (+{spec.d_tp - 1}): {last}")
        raise RuntimeError(f"no free run of {spec.d_tp} ports: {last}")

    @property
    def base_port(self) -> int:
        return self.workers[0].port

    def target(self) -> DecodeTarget:
        """What the rendezvous tells Prefill about this engine."""
        return DecodeTarget(self.spec.host, self.base_port, self.spec.d_tp)

    def add(self, requests: Sequence[RequestSpec]) -> None:
        """Allocate destinations for the requests and register them on every rank."""
        for spec in requests:
            main_n, idx_n = self.spec.model.blocks_for(spec.tokens)
            main, idx = self.alloc.allocate(main_n), self.alloc.allocate(idx_n)
            self.ids[spec.ext_id] = (main, idx)
            for w in self.workers:
                w.add_request(spec.ext_id, main, idx)

    def wait(self, ext_ids: Sequence[str], timeout: float) -> dict[str, DecodeResult]:
        """Each request's outcome on every rank (waiting up to ``timeout`` in all)."""
        deadline = time.monotonic() + timeout
        out: dict[str, DecodeResult] = {}
        for ext in ext_ids:
            outcomes: list[Outcome | None] = [
                w.wait_finished(ext, max(0.0, deadline - time.monotonic())) for w in self.workers
            ]
            terminal = all(o is not None for o in outcomes)
            ok = terminal and all(o is not None and o.ok for o in outcomes)
            mismatches: tuple[Mismatch, ...] = ()
            if ok:
                mismatches = tuple(self.dest.verify(ext, *self.ids[ext]))
            out[ext] = DecodeResult(
                ext,
                ok,
                terminal,
                tuple(
                    None if o is None or o.ok else (o.code.name if o.code else "?")
                    for o in outcomes
                ),
                max((o.at for o in outcomes if o is not None), default=0.0),
                mismatches,
            )
        return out

    def release(self, ext_ids: Sequence[str], timeout: float = 10.0) -> bool:
        """vLLM finished the requests: release them everywhere; True when every block is free."""
        ok = True
        for ext in ext_ids:
            for w in self.workers:
                if not w.release(ext):
                    ok = w.wait_releasable(ext, timeout) and ok
            main, idx = self.ids.pop(ext, ([], []))
            self.alloc.free(main)
            self.alloc.free(idx)
        return ok

    def quiesce(self, timeout: float) -> bool:
        """Wait until no transfer-engine call of any rank can still write a destination
        (a timed-out call some engines cannot cancel runs on); True when none can."""
        deadline = time.monotonic() + timeout
        return all(w.backend.quiesce(max(0.0, deadline - time.monotonic())) for w in self.workers)

    def state(self) -> dict[str, Any]:
        """Health and leftovers of every rank."""
        return {
            "idle": [w.is_idle() for w in self.workers],
            "healthy": [w.healthy for w in self.workers],
            "errors": [repr(e) for w in self.workers for e in w.errors],
            "requests": [w.requests() for w in self.workers],
            "stats": [dataclasses.asdict(w.stats) for w in self.workers],
            "metrics": [dataclasses.asdict(w.metrics) for w in self.workers],
        }

    def close(self) -> None:
        for w in self.workers:
            w.close()


# -- Prefill engine --------------------------------------------------------------------------


@dataclass(frozen=True)
class PrefillSpec:
    """One Prefill engine: model, TP size, backend and the knobs tests turn."""

    model: SyntheticModel
    p_tp: int = 1
    backend: str = "loopback"
    lease_ms: int = 10_000
    protocol: str = "v2"
    compat: str = ""
    read_failure_policy: str = "isolate"
    handshake_timeout_s: float = 5.0
    seed: int = 3
    contiguous: bool = False  # hand out block ids in runs instead of shuffled
    gate_timeout_s: float = 30.0
    die_after_layer: tuple[int, int] | None = None  # (step, layer): SIGKILL after publishing
    write_before_wait: bool = False
    control: ControlOptions = FAST_CONTROL
    host: str = HOST  # the backend binds / advertises this address
    netns: str | None = None  # child engines only: run in this network namespace
    trace_dir: str | None = None  # protocol traces of every rank go here (rd2h_runtime.trace)


@dataclass
class PrefillRank:
    worker: PrefillWorker
    cache: PrefillCache
    driver: PrefillRankDriver
    finished: dict[str, tuple[RequestFinished, float]] = field(default_factory=dict)


class PrefillEngine:
    """All Prefill TP ranks of one engine; each rank runs its compute path on a thread."""

    def __init__(
        self,
        spec: PrefillSpec,
        events: multiprocessing.connection.Connection | None = None,
    ) -> None:
        self.spec = spec
        self._events = events
        self.alloc = BlockAllocator(spec.model.num_blocks, spec.seed, contiguous=spec.contiguous)
        self.ids: dict[str, tuple[list[int], list[int]]] = {}
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self.run_errors: list[str] = []
        self.ranks: list[PrefillRank] = []
        try:
            for rank in range(spec.p_tp):
                self.ranks.append(self._make_rank(rank))
        except BaseException:
            self.close()
            raise

    def _make_rank(self, rank: int) -> PrefillRank:
        spec = self.spec
        cache = PrefillCache(spec.model)
        finished: dict[str, tuple[RequestFinished, float]] = {}

        def on_finished(f: RequestFinished) -> None:
            with self._cond:
                finished[f.ext_req_id] = (f, time.monotonic())
                self._cond.notify_all()

        config = ProducerConfig(
            p_rank=rank,
            p_tp=spec.p_tp,
            session="",
            layers=cache.layers(),
            lease_ms=spec.lease_ms,
            protocol=spec.protocol,  # type: ignore[arg-type]
            compat=spec.compat,
            read_failure_policy=spec.read_failure_policy,  # type: ignore[arg-type]
            handshake_timeout_s=spec.handshake_timeout_s,
        )
        worker = PrefillWorker(
            config,
            create_backend(spec.backend, role="prefill", host=spec.host),
            regions=cache.regions(),
            control_options=spec.control,
            on_finished=on_finished,
            name=f"p{rank}-{os.getpid()}",
            trace_dir=spec.trace_dir,
        )
        on_layer = None
        if spec.die_after_layer is not None and rank == 0:
            at = spec.die_after_layer

            def on_layer(step: int, layer: int) -> None:
                if (step, layer) == at:
                    die(self._events, f"prefill step {step} layer {layer}")

        driver = PrefillRankDriver(
            worker,
            cache,
            gate_timeout_s=spec.gate_timeout_s,
            write_before_wait=spec.write_before_wait,
            on_layer=on_layer,
        )
        return PrefillRank(worker, cache, driver, finished)

    def add(self, requests: Sequence[RequestSpec], target: DecodeTarget) -> None:
        """Register requests for one Decode engine; physical blocks are shared by all ranks
        (one scheduler), each rank writes its own copy."""
        model = self.spec.model
        for spec in requests:
            main_n, idx_n = model.blocks_for(spec.tokens)
            main, idx = self.alloc.allocate(main_n), self.alloc.allocate(idx_n)
            self.ids[spec.ext_id] = (main, idx)
            for r in self.ranks:
                r.worker.add_request(spec.ext_id, target)
                r.driver.add(spec, main, idx)

    def release(self, ext_ids: Sequence[str]) -> None:
        """The requests are finished on every rank: forget them and free their blocks
        (what the scheduler does once RequestFinished says no read can need them)."""
        with self._cond:
            for ext in ext_ids:
                for r in self.ranks:
                    r.driver.requests.pop(ext, None)
                    r.finished.pop(ext, None)
                main, idx = self.ids.pop(ext, ([], []))
                self.alloc.free(main)
                self.alloc.free(idx)

    def start(self) -> None:
        """Run every rank's steps on its own thread (returns at once)."""

        def run(rank: PrefillRank) -> None:
            try:
                rank.driver.run_all()
            except Exception:
                with self._cond:
                    self.run_errors.append(traceback.format_exc())

        self._threads = [
            threading.Thread(target=run, args=(r,), name=f"compute-{i}", daemon=True)
            for i, r in enumerate(self.ranks)
        ]
        for t in self._threads:
            t.start()

    def join(self, timeout: float) -> bool:
        """Wait for the compute threads; True when all ended."""
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    def run(self, timeout: float = 60.0) -> list[str]:
        """start() + join(); returns the compute errors."""
        self.start()
        if not self.join(timeout):
            raise TimeoutError(f"Prefill compute did not finish within {timeout} s")
        return list(self.run_errors)

    def wait(
        self, ext_ids: Sequence[str], timeout: float
    ) -> dict[str, list[tuple[RequestFinished, float] | None]]:
        """Each request's RequestFinished (and its time) on every rank."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                done = all(ext in r.finished for r in self.ranks for ext in ext_ids)
                left = deadline - time.monotonic()
                if done or left <= 0:
                    break
                self._cond.wait(left)
            return {ext: [r.finished.get(ext) for r in self.ranks] for ext in ext_ids}

    def state(self) -> dict[str, Any]:
        return {
            "idle": [r.worker.is_idle() for r in self.ranks],
            "healthy": [r.worker.healthy for r in self.ranks],
            "errors": [repr(e) for r in self.ranks for e in r.worker.errors],
            "gates": [r.worker.gates() for r in self.ranks],
            "requests": [r.worker.requests() for r in self.ranks],
            "stats": [dataclasses.asdict(r.worker.stats) for r in self.ranks],
            "metrics": [dataclasses.asdict(r.worker.metrics) for r in self.ranks],
            "round_trips": [r.worker.round_trips() for r in self.ranks],
            "run_errors": list(self.run_errors),
        }

    def close(self) -> None:
        for r in self.ranks:
            r.worker.close()
