"""The servers of tests/serving: which configurations exist, when each server runs.

A vLLM server takes about a minute to start on two cores (three processes import vLLM
one after the other), so the pool

* knows every server each configuration (a cluster) needs, and the order the collected
  tests use the clusters in (:meth:`ServerPool.plan`, from the session's items);
* starts each server once, ahead of use (up to ``max_units`` servers at a time, a TP 2
  server counting twice), so start-ups overlap each other and earlier tests; a server
  runs in the background (:meth:`VllmServer.set_background`) until a test asks for its
  cluster, and the servers of the cluster in use run at full priority, so start-ups take
  only the CPU the test leaves;
* stops each server after the last test that needs it, and starts a server again if a
  test killed it and a later one needs it.

Servers are named ``<model>-<backend>[-tp2]/<role>``; a cluster is a list of Prefill
servers and a list of Decode servers, plus its own ``rd2h proxy``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from rd2h_vllm.serving.cluster import PDCluster
from rd2h_vllm.serving.model import ModelKind, TinyModel
from rd2h_vllm.serving.processes import (
    IN_PROCESS_WORKER,
    POLLING_PREFILL_NICE,
    Backend,
    ServerSpec,
    VllmServer,
)

Env = Mapping[str, str]

#: Every server start-up gets this long (two cores, several start-ups at once).
START_TIMEOUT_S: Final = 360.0
#: Prefill computes at most this many tokens per step: prompts span several steps (the
#: layer-by-layer publication repeats per step) and a long prompt's prefill can be
#: killed half-way.
PREFILL_STEP_TOKENS: Final = 32
#: Decode gives up on a transfer after this long (the default is 120 s).
KV_LOAD_TIMEOUT_S: Final = 20.0
#: Prefill frees a Prefill-first request no Decode claimed after this long (default 120 s).
CLAIM_TIMEOUT_S: Final = 15.0
#: The cluster whose servers trace (protocol and scheduler marks).
TRACED: Final = "llama-mooncake"
#: Transfer figures the tests recorded (printed at the end of the run).
FIGURES: list[str] = []


def traced(trace_dir: Path) -> Path:
    """Where the :data:`TRACED` cluster's servers write their traces."""
    return trace_dir / TRACED


@dataclass(frozen=True)
class ClusterDef:
    """A configuration: the servers (by name) behind one proxy."""

    prefill: tuple[str, ...]
    decode: tuple[str, ...]

    @property
    def servers(self) -> tuple[str, ...]:
        return (*self.prefill, *self.decode)


def server_specs(
    models: Callable[[ModelKind], TinyModel], trace_dir: Path
) -> dict[str, Callable[[], ServerSpec]]:
    """Every server the tests may start, by name (specs built lazily: models on demand).

    llama-nixl (the fault tests' configuration) runs as ``vllm serve`` does by default,
    with a worker process per server, and its Decode recomputes what a failed transfer
    could not deliver (``kv_load_failure_policy`` "recompute"). The other TP 1 servers
    keep the model runner in the engine-core process (:data:`IN_PROCESS_WORKER`), which
    saves a vLLM import per start-up; their Decode fails a request whose KV transfer
    fails (vLLM's default policy), so a transfer problem shows as an error. The llama-mooncake
    servers write their protocol traces and scheduler marks under :func:`traced` of
    ``trace_dir`` (``rd2h trace requests`` is tested on them).
    """
    specs: dict[str, Callable[[], ServerSpec]] = {}
    backends: tuple[Backend, ...] = ("nixl", "mooncake")
    kinds: tuple[ModelKind, ...] = ("llama", "deepseek")
    for kind in kinds:
        for backend in backends:
            base = f"{kind}-{backend}"
            default = base == "llama-nixl"
            env = {} if default else IN_PROCESS_WORKER
            policy = {"kv_load_failure_policy": "recompute"} if default else {}
            trace = {"trace_dir": str(traced(trace_dir))} if base == TRACED else {}

            def prefill(
                kind: ModelKind = kind,
                backend: Backend = backend,
                env: Env = env,
                trace: Env = trace,
            ) -> ServerSpec:
                return ServerSpec(
                    models(kind),
                    "prefill",
                    backend,
                    max_num_batched_tokens=PREFILL_STEP_TOKENS,
                    extra_config={"claim_timeout_s": CLAIM_TIMEOUT_S, **trace},
                    env=env,
                )

            def decode(
                kind: ModelKind = kind,
                backend: Backend = backend,
                env: Env = env,
                policy: Env = policy,
                trace: Env = trace,
            ) -> ServerSpec:
                return ServerSpec(
                    models(kind),
                    "decode",
                    backend,
                    extra_config={"kv_load_timeout_s": KV_LOAD_TIMEOUT_S, **trace},
                    transfer_config=policy,
                    env=env,
                )

            specs[f"{base}/prefill"] = prefill
            specs[f"{base}/decode"] = decode
    # MLA: every Prefill TP rank holds the whole latent cache, so Prefill TP 2 -> Decode
    # TP 1 needs no head split (GQA's KV heads split over Prefill ranks is refused).
    specs["deepseek-nixl-tp2/prefill"] = lambda: ServerSpec(
        models("deepseek"), "prefill", "nixl", tp=2, ready_nice=POLLING_PREFILL_NICE
    )
    return specs


CLUSTERS: Final[Mapping[str, ClusterDef]] = {
    **{
        f"{k}-{b}": ClusterDef((f"{k}-{b}/prefill",), (f"{k}-{b}/decode",))
        for k in ("llama", "deepseek")
        for b in ("nixl", "mooncake")
    },
    # Prefill TP 2 in front of the TP 1 Decode of deepseek-nixl.
    "deepseek-nixl-tp2": ClusterDef(("deepseek-nixl-tp2/prefill",), ("deepseek-nixl/decode",)),
}


class ServerPool:
    """Starts, shares and stops the servers of the planned clusters (module docstring)."""

    def __init__(
        self,
        specs: Mapping[str, Callable[[], ServerSpec]],
        log_dir: Path,
        max_units: int = 6,
    ) -> None:
        self.specs = specs
        self.log_dir = log_dir
        self.max_units = max_units
        self.servers: dict[str, VllmServer] = {}
        self.clusters: dict[str, PDCluster] = {}
        self.order: list[str] = []  # cluster name of each planned test, in run order
        self.step = 0  # tests finished so far
        self.startup_s: dict[str, float] = {}  # server label -> seconds to /health
        self.launches: dict[str, int] = {}
        self.stopping: list[VllmServer] = []  # sent SIGTERM, not reaped yet
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="serving-pool", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        """Record each server's start-up time when /health first answers (0.5 s steps)."""
        while not self._closed.wait(0.5):
            with self._lock:
                pending = [s for s in self.servers.values() if not s.ready_s]
            for server in pending:
                if server.probe():
                    self.startup_s[server.name] = server.ready_s

    # -- planning --------------------------------------------------------------------------

    def plan(self, order: Sequence[str]) -> None:
        """The cluster each test will use, in run order; unknown names fail now."""
        unknown = sorted(set(order) - set(CLUSTERS))
        if unknown:
            raise KeyError(f"unknown clusters {unknown}; known: {sorted(CLUSTERS)}")
        self.order = list(order)
        self.prefetch()

    def _uses(self, server: str) -> list[int]:
        return [i for i, c in enumerate(self.order) if server in CLUSTERS[c].servers]

    def _needed_later(self, server: str) -> bool:
        return any(i >= self.step for i in self._uses(server))

    def _upcoming_servers(self) -> list[str]:
        seen: list[str] = []
        for cluster in self.order[self.step :]:
            seen += [s for s in CLUSTERS[cluster].servers if s not in seen]
        return seen

    @staticmethod
    def _units(spec: ServerSpec) -> int:
        return spec.tp

    def _live_units(self) -> int:
        return sum(self._units(s.spec) for s in self.servers.values())

    # -- life cycle ------------------------------------------------------------------------

    def _launch(self, name: str) -> VllmServer:
        spec = self.specs[name]()
        count = self.launches.get(name, 0) + 1
        self.launches[name] = count
        label = name.replace("/", "-") + (f"-run{count}" if count > 1 else "")
        server = VllmServer(spec, self.log_dir, name=label)
        with self._lock:
            self.servers[name] = server
        return server

    def prefetch(self) -> None:
        """Launch upcoming servers, in order of first use, while capacity allows (in the
        background: only :meth:`cluster` brings servers to the foreground)."""
        for name in self._upcoming_servers():
            if name in self.servers:
                continue
            units = self._units(self.specs[name]())
            if self.servers and self._live_units() + units > self.max_units:
                break
            self._launch(name).set_background(True)

    def _foreground(self, names: Collection[str]) -> None:
        """Servers ``names`` at full priority, every other one in the background."""
        with self._lock:
            servers = list(self.servers.items())
        for name, server in servers:
            server.set_background(name not in names)

    def cluster(self, name: str) -> PDCluster:
        """The ready cluster ``name`` (servers started or restarted as needed)."""
        definition = CLUSTERS[name]
        for server_name in definition.servers:
            server = self.servers.get(server_name)
            if server is not None and not server.alive():
                self.drop(server_name)  # killed by a test, or died: start it again
            if server_name not in self.servers:
                self._launch(server_name)
        self._foreground(definition.servers)
        for server_name in definition.servers:
            server = self.servers[server_name]
            server.wait_ready(START_TIMEOUT_S)
            self.startup_s[server.name] = server.ready_s
        existing = self.clusters.get(name)
        members = [self.servers[s] for s in definition.servers]
        if existing is not None and all(
            a is b for a, b in zip([*existing.prefill, *existing.decode], members, strict=True)
        ):
            existing.check_alive()
            return existing
        if existing is not None:
            existing.stop()
        cluster = PDCluster(
            name,
            [self.servers[s] for s in definition.prefill],
            [self.servers[s] for s in definition.decode],
            self.log_dir,
        ).wait_ready()
        self.clusters[name] = cluster
        return cluster

    def server(self, name: str) -> VllmServer:
        """A running server by name (after :meth:`cluster` made it ready)."""
        return self.servers[name]

    def drop(self, server_name: str) -> None:
        """Stop a server (SIGTERM now, reaped later) and forget it and its clusters."""
        for cname in [c for c in self.clusters if server_name in CLUSTERS[c].servers]:
            self.clusters.pop(cname).stop()
        with self._lock:
            server = self.servers.pop(server_name, None)
        if server is not None:
            server.terminate()
            self.stopping.append(server)

    def finished(self) -> None:
        """One planned test finished: stop what no later test needs, start what is next."""
        self.step += 1
        for cname in list(self.clusters):
            if cname not in self.order[self.step :]:
                self.clusters.pop(cname).stop()
        for name in list(self.servers):
            if not self._needed_later(name):
                self.drop(name)
        self.stopping = [s for s in self.stopping if not s.reap()]
        self.prefetch()

    def close(self) -> None:
        """Stop everything (SIGTERM to all at once, SIGKILL what outlives its grace)."""
        self._closed.set()
        for cluster in self.clusters.values():
            cluster.stop()
        self.clusters.clear()
        for name in list(self.servers):
            self.drop(name)
        for server in self.stopping:
            server.reap(wait=True)
        self.stopping.clear()


def wait_until(
    what: str,
    condition: Callable[[], bool],
    timeout_s: float = 15.0,
    detail: Callable[[], str] = str,
    interval_s: float = 0.2,
) -> None:
    """Poll ``condition`` until it holds; fail with ``what`` and ``detail()`` after the limit."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached within {timeout_s} s; {detail()}")
        time.sleep(interval_s)
