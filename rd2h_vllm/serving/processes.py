"""Child processes: vLLM OpenAI servers (Prefill, Decode, plain, vLLM's NixlConnector)
and ``rd2h proxy``.

Every child runs in its own session (process group), so stopping it reaches vLLM's
engine-core and worker processes too: SIGTERM to the group, then SIGKILL to the group
after a grace period. Every child started here is also killed at interpreter exit
(:func:`stop_all`), so an interrupted run leaves nothing behind. Output goes to a log
file per child; a child that dies or does not come up in time raises
:class:`ServerError` with the tail of its log.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal, TypeAlias

from rd2h_vllm.serving.model import TinyModel

HOST: Final = "127.0.0.1"
#: "prefill"/"decode": RD2H's connector; "plain": none; "nixl_connector": vLLM's own
#: NixlConnector (``kv_both``, the baseline RD2H is measured against).
Role: TypeAlias = Literal["prefill", "decode", "plain", "nixl_connector"]
Backend: TypeAlias = Literal["nixl", "mooncake"]
BACKENDS: Final[tuple[Backend, ...]] = ("nixl", "mooncake")

#: Environment of every child: offline, no usage stats, UCX off InfiniBand, OpenMP threads
#: unbound (two servers on a small host must not both pin core 0), INFO logs.
CHILD_ENV: Final[Mapping[str, str]] = {
    "UCX_MODULES": "^ib",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
    "VLLM_LOGGING_LEVEL": "INFO",  # the logs are files; keep the connector's INFO lines
}


#: Runs the child command with PR_SET_PDEATHSIG = SIGTERM (kept across exec), so the
#: child's leader is told to stop when the process that started it dies, even by SIGKILL.
_LAUNCHER: Final = (
    "import ctypes, os, signal, sys; "
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM); "
    "os.getppid() == int(sys.argv[1]) or sys.exit(1); "
    "os.execvp(sys.argv[2], sys.argv[2:])"
)


#: ``ServerSpec.env`` for a TP 1 server whose model runner lives in the engine-core
#: process (vLLM's uniproc executor) instead of a worker process of its own: one vLLM
#: import fewer at start-up (about 20 s on two cores) and no worker IPC per step. The
#: connector's worker side then runs in the engine-core process.
IN_PROCESS_WORKER: Final[Mapping[str, str]] = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


#: Log lines worth showing when a request failed: vLLM's errors, RD2H's warnings.
_PROBLEM: Final = re.compile(
    r" ERROR |WARNING .*\[(worker|connector|scheduler|prefill|decode|metaserver)\.py:"
    r"|WARNING rd2h"
)


#: An exception line of a log: ``SomeError: message`` (after vLLM's line prefix).
_CAUSE: Final = re.compile(r"\b\w+(Error|Exception): .*$")


class ServerError(RuntimeError):
    """A child process died, refused to start or did not become ready in time."""


_HANDED_OUT: set[int] = set()  # ports free_port returned: not returned twice


def free_port(count: int = 1) -> int:
    """The first of ``count`` consecutive TCP ports on 127.0.0.1 that are free now (and not
    handed out before by this process, as a child may not have bound it yet)."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((HOST, 0))
            first: int = sock.getsockname()[1]
        wanted = set(range(first, first + count))
        if first + count > 65535 or wanted & _HANDED_OUT:
            continue
        held: list[socket.socket] = []
        try:
            for port in range(first, first + count):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                held.append(s)
                s.bind((HOST, port))
            _HANDED_OUT.update(wanted)
            return first
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise ServerError(f"no {count} consecutive free ports on {HOST}")


_LIVE: dict[int, ManagedProcess] = {}


def stop_all() -> None:
    """Kill every child process group this module started and that is still alive."""
    for proc in list(_LIVE.values()):
        proc.kill()


atexit.register(stop_all)


class ManagedProcess:
    """A child in its own process group, logging to ``log_path``."""

    def __init__(
        self, name: str, cmd: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None
    ) -> None:
        self.name = name
        self.cmd = list(cmd)
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            log.write(f"$ {' '.join(self.cmd)}\n".encode())
            log.flush()
            self.popen = subprocess.Popen(
                [sys.executable, "-c", _LAUNCHER, str(os.getpid()), *self.cmd],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **CHILD_ENV, **(env or {})},
                start_new_session=True,
            )
        self.pid = self.popen.pid
        self._kill_at: float | None = None
        _LIVE[self.pid] = self

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the log (route listings left out)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        kept = [line for line in text.splitlines() if "Route: " not in line]
        return "\n".join(kept[-lines:])

    def log_problems(self, lines: int = 6) -> list[str]:
        """The last ``lines`` errors, and warnings of RD2H's modules, from the log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return []
        return [line for line in text.splitlines() if _PROBLEM.search(line)][-lines:]

    def _signal_group(self, sig: int) -> bool:
        try:
            os.killpg(self.pid, sig)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def _group_alive(self) -> bool:
        return self._signal_group(0)

    def terminate(self, grace_s: float = 10.0) -> None:
        """SIGTERM the process group and return; :meth:`reap` SIGKILLs it after ``grace_s``."""
        if self._kill_at is None:
            self._kill_at = time.monotonic() + grace_s
            self._signal_group(signal.SIGTERM)

    def reap(self, wait: bool = False) -> bool:
        """After :meth:`terminate`: True once the group is gone. SIGKILLs it when its grace
        ran out; ``wait`` waits for that instead of answering at once."""
        deadline = self._kill_at if self._kill_at is not None else time.monotonic()
        while self.alive() or self._group_alive():
            if time.monotonic() >= deadline:
                self.kill()
                return True
            if not wait:
                return False
            time.sleep(0.1)
        self.kill()  # reaps the leader, forgets the process
        return True

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace_s``; reap the leader."""
        self.terminate(grace_s)
        self.reap(wait=True)

    def kill(self) -> None:
        """SIGKILL the whole process group at once (no grace) and reap the leader."""
        self._signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)
        _LIVE.pop(self.pid, None)

    def set_cpu_priority(self, nice: int) -> None:
        """Run the child's whole session (process group) at CPU niceness ``nice`` (>= 0).

        Where the kernel groups CPU time by session (autogroup scheduling, the default of
        most distributions), sessions share the CPUs first and a process's own nice only
        weighs inside its session: the session's autogroup nice is what lets other
        servers run. Both are set, for the processes that exist now; best effort (a
        kernel without autogroups has no ``/proc/<pid>/autogroup``, and only root may
        lower a nice value again).
        """
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PGRP, self.pid, nice)
        with contextlib.suppress(OSError):
            Path(f"/proc/{self.pid}/autogroup").write_text(str(nice))

    def group_pids(self) -> list[int]:
        """Every process of the child's process group now (from ``/proc``)."""
        pids: list[int] = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2 :].split()  # state, ppid, pgrp, ...
            if len(fields) > 2 and int(fields[2]) == self.pid:
                pids.append(int(entry.name))
        return sorted(pids)

    def pin_cpus(self, cpus: Collection[int]) -> int:
        """Set the CPU affinity of every thread of every process of the group to ``cpus``
        (what ``taskset -a -p`` does per process); the number of threads pinned.

        Processes and threads started later inherit it from their parent thread, so call
        it again once a server is up: some pin threads of their own (vLLM's CPU worker
        binds its main thread to a core of its choosing)."""
        pinned = 0
        for pid in self.group_pids():
            try:
                tids = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
            except OSError:
                continue
            for tid in tids:
                with contextlib.suppress(OSError):  # a thread that exited meanwhile
                    os.sched_setaffinity(tid, cpus)
                    pinned += 1
        return pinned

    def log_causes(self, lines: int = 3) -> list[str]:
        """The last distinct exception lines (``...Error: message``) of the log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return []
        causes: list[str] = []
        for line in text.splitlines():
            match = _CAUSE.search(line)
            if match and "ulimit" not in line and match.group(0) not in causes:
                causes.append(match.group(0))
        return causes[-lines:]

    def fail(self, what: str) -> ServerError:
        """A :class:`ServerError` saying ``what`` with this child's exit status, the
        exceptions its log names and the log's last lines."""
        code = self.popen.poll()
        state = f"exited with {code}" if code is not None else "still running"
        causes = "".join(f"\n  {c}" for c in self.log_causes())
        return ServerError(
            f"{self.name} {what} ({state}){'; exceptions:' if causes else ''}{causes}\n"
            f"log {self.log_path}, last lines:\n{self.log_tail()}"
        )

    def wait_http(self, url: str, deadline: float) -> None:
        """Poll ``url`` until it answers 200; raise when the child dies or time runs out."""
        while True:
            if not self.alive():
                raise self.fail("died while starting")
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise self.fail(f"not ready at {url} within the deadline")
            time.sleep(0.25)


#: CPU niceness of a Prefill at TP > 1 sharing a CPU host with its Decode, once it is
#: ready (:attr:`ServerSpec.ready_nice`). While its requests wait for Decode's reads, vLLM
#: keeps stepping: its engine core and workers poll for the next step (the workers spin on
#: sched_yield). On two cores a TP 2 Prefill took both for up to 17 s (``perf``); the
#: Decode beside it got no CPU, missed its handshake and heartbeats, and failed the
#: request (HTTP 500). Niced, it leaves Decode the CPU it needs.
POLLING_PREFILL_NICE: Final = 10
#: CPU niceness of a server in the background (:meth:`VllmServer.set_background`): its
#: session weighs 110 against a full-priority session's 1024 (the kernel's nice weights).
#: On two cores, servers starting at full priority beside the servers of a running test
#: left those without CPU for seconds at a time: up to 3 s with threads runnable here,
#: and in a CI run long enough for a Decode's 10 s NIXL read of its Prefill to time out.
BACKGROUND_NICE: Final = 10


@dataclass(frozen=True)
class ServerSpec:
    """One vLLM OpenAI server to start.

    ``role`` "prefill" and "decode" add RD2H's ``--kv-transfer-config`` (kv_producer /
    kv_consumer over ``backend``); "plain" is a single instance without a connector;
    "nixl_connector" runs vLLM's own NixlConnector (``kv_both``, host buffers, its side
    channel on a free port: :data:`NIXL_CONNECTOR_ENV`), for the baseline behind
    ``vllm-router``.
    ``extra_config`` is merged into ``kv_connector_extra_config``, ``transfer_config``
    into the ``--kv-transfer-config`` object itself (e.g. ``kv_load_failure_policy``);
    ``env`` is added to the server's environment (e.g. :data:`IN_PROCESS_WORKER`).
    ``ready_nice`` is the CPU niceness of the server's processes once it is ready (0 leaves
    it; see :meth:`ManagedProcess.set_cpu_priority`). ``cpus`` (empty: any) pins every
    thread of the server's processes to those CPUs at launch and again once it is ready
    (:meth:`ManagedProcess.pin_cpus`).
    ``host`` is the address its HTTP server binds and is reached at; ``netns`` (None: this
    process's) the network namespace it runs in (``ip netns exec``, which also mounts that
    namespace's /sys, where UCX finds the network devices; see
    :mod:`rd2h_runtime.testing.netns`). Across namespaces the KV travels over the link
    addresses given in ``env`` (``VLLM_HOST_IP``, ``UCX_NET_DEVICES``, NixlConnector's
    ``VLLM_NIXL_SIDE_CHANNEL_HOST``) and ``extra_config`` (RD2H's ``advertise_host``).
    """

    model: TinyModel
    role: Role
    backend: Backend = "nixl"
    tp: int = 1
    max_model_len: int = 8192
    max_num_batched_tokens: int | None = None
    kv_cache_bytes: int = 64 << 20
    dtype: str = "float32"
    extra_config: Mapping[str, Any] = field(default_factory=dict)
    transfer_config: Mapping[str, Any] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    extra_args: tuple[str, ...] = ()
    ready_nice: int = 0
    cpus: tuple[int, ...] = ()
    host: str = HOST
    netns: str | None = None


#: Environment of a "nixl_connector" server besides its side-channel port
#: (``VLLM_NIXL_SIDE_CHANNEL_PORT``, chosen free per server). RD2H's plugin bounds NIXL's
#: progress-thread delay to 50 us there as RD2H's nixl backend does for its own agents
#: (NIXL's Python agent spins at delay 0), so both sides of a comparison get the same
#: bound. The plugin then imports NIXL before vLLM does, which keeps vLLM from setting
#: UCX_RCACHE_MAX_UNRELEASED itself: it is set here to vLLM's value.
NIXL_CONNECTOR_ENV: Final[Mapping[str, str]] = {
    "VLLM_NIXL_SIDE_CHANNEL_HOST": HOST,
    "RD2H_BOUND_NIXL_PROGRESS": "1",
    "UCX_RCACHE_MAX_UNRELEASED": "1024",
}


def kv_transfer_config(spec: ServerSpec, kv_port: int | None) -> dict[str, Any] | None:
    """The ``--kv-transfer-config`` object of ``spec`` (None for a plain server)."""
    if spec.role == "plain":
        return None
    if spec.role == "nixl_connector":
        baseline: dict[str, Any] = {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_both",
            "kv_buffer_device": "cpu",
        }
        if spec.extra_config:
            baseline["kv_connector_extra_config"] = dict(spec.extra_config)
        baseline.update(spec.transfer_config)
        return baseline
    extra = {"transfer_backend": spec.backend, "advertise_host": HOST, **spec.extra_config}
    config: dict[str, Any] = {
        "kv_connector": "SfaRemoteD2HConnector",
        "kv_role": "kv_consumer" if spec.role == "decode" else "kv_producer",
        "kv_connector_extra_config": extra,
    }
    if kv_port is not None:
        # Decode: Prefill's control connections (Decode-first); Prefill: Decode's
        # introductions (Prefill-first, behind a standard router). kv_port + TP rank each.
        config["kv_port"] = kv_port
    config.update(spec.transfer_config)
    return config


def server_command(spec: ServerSpec, port: int, kv_port: int | None = None) -> list[str]:
    """The command line of ``spec``'s server on ``port`` (RD2H's ports from ``kv_port``)."""
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--host",
        spec.host,
        "--port",
        str(port),
        "--model",
        str(spec.model.path),
        "--served-model-name",
        spec.model.name,
        "--dtype",
        spec.dtype,
        "--max-model-len",
        str(spec.max_model_len),
        "--kv-cache-memory-bytes",
        str(spec.kv_cache_bytes),
        "--enforce-eager",
        "--seed",
        "0",
        "--tensor-parallel-size",
        str(spec.tp),
        *spec.model.server_args,
    ]
    if spec.max_num_batched_tokens is not None:
        cmd += ["--max-num-batched-tokens", str(spec.max_num_batched_tokens)]
    transfer = kv_transfer_config(spec, kv_port)
    if transfer is not None:
        cmd += ["--kv-transfer-config", json.dumps(transfer)]
    return [*cmd, *spec.extra_args]


class VllmServer(ManagedProcess):
    """A running vLLM OpenAI server (see :func:`start_server`)."""

    def __init__(self, spec: ServerSpec, log_dir: Path, name: str | None = None) -> None:
        self.spec = spec
        self.port = free_port()
        self.kv_port = free_port(spec.tp) if spec.role in ("prefill", "decode") else None
        env = dict(spec.env)
        #: NixlConnector's side channel (handshakes): side_channel_port + TP rank.
        self.side_channel_port: int | None = None
        if spec.role == "nixl_connector":
            self.side_channel_port = free_port(spec.tp)
            env = {
                **NIXL_CONNECTOR_ENV,
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.side_channel_port),
                **env,
            }
        self.host = spec.host
        self.url = f"http://{spec.host}:{self.port}"
        self.started_at = time.monotonic()
        self.ready_s = 0.0
        self.background = False  # see set_background()
        label = name or f"{spec.role}-{spec.model.kind}-{spec.backend}-tp{spec.tp}"
        cmd = server_command(spec, self.port, self.kv_port)
        if spec.netns is not None:
            cmd = ["ip", "netns", "exec", spec.netns, *cmd]
        super().__init__(label, cmd, log_dir / f"{label}.log", env=env)
        if spec.cpus:
            self.pin_cpus(spec.cpus)

    def wait_ready(self, timeout_s: float = 240.0) -> None:
        """Wait for ``/health``; records the start-up time in ``ready_s``."""
        if not self.ready_s:
            self.wait_http(self.url + "/health", self.started_at + timeout_s)
            self._became_ready()

    def probe(self) -> bool:
        """One quick ``/health`` check without waiting; records ``ready_s`` on success."""
        if not self.ready_s and self.alive():
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as resp:
                    if resp.status == 200:
                        self._became_ready()
            except (urllib.error.URLError, OSError):
                pass
        return bool(self.ready_s)

    def _became_ready(self) -> None:
        """Record the start-up time; from now on run at the spec's ``ready_nice``."""
        self.ready_s = time.monotonic() - self.started_at
        if self.spec.cpus:
            self.pin_cpus(self.spec.cpus)
        if self.spec.ready_nice and not self.background:
            self.set_cpu_priority(self.spec.ready_nice)

    def set_background(self, background: bool) -> None:
        """Run at :data:`BACKGROUND_NICE` (``True``) or at full priority again (the spec's
        ``ready_nice`` once ready): a server starting ahead of its use takes only the CPU
        the servers in use leave (root only lowers a nice value again; best effort)."""
        if background == self.background:
            return
        self.background = background
        if background:
            self.set_cpu_priority(BACKGROUND_NICE)
        else:
            self.set_cpu_priority(self.spec.ready_nice if self.ready_s else 0)


def start_server(
    spec: ServerSpec, log_dir: Path, name: str | None = None, timeout_s: float = 240.0
) -> VllmServer:
    """Start one server and wait until it is ready (killed again if it is not)."""
    server = VllmServer(spec, log_dir, name)
    try:
        server.wait_ready(timeout_s)
    except BaseException:
        server.stop(grace_s=2.0)
        raise
    return server


def start_servers(
    specs: Sequence[ServerSpec], log_dir: Path, timeout_s: float = 240.0
) -> list[VllmServer]:
    """Start several servers at once (they import vLLM in parallel), wait for all."""
    servers = [VllmServer(spec, log_dir) for spec in specs]
    try:
        for server in servers:
            server.wait_ready(timeout_s)
    except BaseException:
        for server in servers:
            server.stop(grace_s=2.0)
        raise
    return servers


class ProxyProcess(ManagedProcess):
    """``rd2h proxy`` in front of Prefill and Decode servers."""

    def __init__(
        self,
        prefillers: Sequence[VllmServer],
        decoders: Sequence[VllmServer],
        log_dir: Path,
        extra_args: Sequence[str] = (),
        name: str = "proxy",
    ) -> None:
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "rd2h_proxy",
            "--host",
            HOST,
            "--port",
            str(self.port),
            "--prefiller-hosts",
            *(s.host for s in prefillers),
            "--prefiller-ports",
            *(str(s.port) for s in prefillers),
            "--decoder-hosts",
            *(s.host for s in decoders),
            "--decoder-ports",
            *(str(s.port) for s in decoders),
            *extra_args,
        ]
        super().__init__(name, cmd, log_dir / f"{name}.log")


def start_proxy(
    prefillers: Sequence[VllmServer],
    decoders: Sequence[VllmServer],
    log_dir: Path,
    timeout_s: float = 30.0,
    name: str = "proxy",
) -> ProxyProcess:
    """Start ``rd2h proxy`` (log ``<name>.log``) and wait for its ``/healthcheck``."""
    proxy = ProxyProcess(prefillers, decoders, log_dir, name=name)
    try:
        proxy.wait_http(proxy.url + "/healthcheck", time.monotonic() + timeout_s)
    except BaseException:
        proxy.stop(grace_s=2.0)
        raise
    return proxy
