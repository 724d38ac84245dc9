"""Two-endpoint read check of a transfer backend (``rd2h check-read``).

This module runs the check: the driver that starts both sides here, the test source for
tests and benchmarks (:func:`prefill_source`), and the command line; the sides themselves,
each runnable alone on its host, are :mod:`rd2h_runtime.testing.check_read_sides`.

Proves, independently of vLLM and of the control protocol, that one backend can move real
bytes from a Prefill process to a Decode process on the hosts at hand:

1. Prefill creates the backend, fills a source buffer with a deterministic pattern,
   registers it and answers on a control socket (ZMQ REP) with its session id, buffer
   address, length, pattern seed and the buffer's SHA-256.
2. Decode creates its backend, registers a destination and reads:
   - several non-contiguous ranges at odd, non-zero source offsets into permuted
     destination offsets, checked byte for byte against the pattern, with the bytes
     between them checked untouched (this also warms the connection up);
   - the whole buffer in ``--chunk``-byte descriptors of one batched read, timed, checked
     against Prefill's SHA-256;
   - two reads that must fail cleanly with ``TransferError`` (a range past the end of the
     registered source, and a wrong session), each followed by a read that must succeed.
3. Decode reports its verdict to Prefill; both print it. Exit status 0 only on PASS, and the
   last line printed says PASS or FAIL and why.

``--role prefill`` / ``--role decode`` run one side (two hosts: give Decode ``--host`` and
``--port`` of Prefill). Without ``--role`` both run here as two child processes (the
``loopback`` backend, which cannot cross processes, runs both sides as threads of this
process instead). Every wait is bounded by ``--timeout``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Final

from rd2h_protocol.errors import ConfigError, ProtocolError
from rd2h_runtime.testing.check_read_sides import (
    DEFAULT_CHUNK,
    DEFAULT_SEED,
    DEFAULT_SIZE,
    DEFAULT_TIMEOUT_S,
    CheckResult,
    control_socket,
    pattern,
    recv_json,
    run_decode,
    scatter_ranges,
    serve_prefill,
)

__all__ = [
    "CheckResult",
    "SourceInfo",
    "main",
    "pattern",
    "prefill_source",
    "run_check_read",
    "scatter_ranges",
]

_READY_PREFIX: Final = "CONTROL "
_RESULT_PREFIX: Final = "RESULT "


def _parse_options(items: Sequence[str]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--option expects key=value, got {item!r}")
        options[key] = int(value) if value.lstrip("-").isdigit() else value
    return options


# ------------------------------------------------------------------------------ driver
def run_check_read(
    backend: str,
    role: str | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    size: int = DEFAULT_SIZE,
    *,
    chunk: int = DEFAULT_CHUNK,
    seed: int = DEFAULT_SEED,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    options: dict[str, Any] | None = None,
    on_ready: Callable[[str], None] | None = None,
) -> CheckResult:
    """Run the check for ``role`` (``"prefill"``, ``"decode"`` or ``None`` for both here).

    Never raises for a failed check: errors become a failing :class:`CheckResult`.
    """
    if size <= 0 or chunk <= 0:
        return CheckResult(False, f"size and chunk must be positive (got {size}, {chunk})", backend)
    try:
        if role == "prefill":
            return serve_prefill(
                backend,
                host=host,
                port=port,
                size=size,
                seed=seed,
                timeout_s=timeout_s,
                options=options,
                on_ready=on_ready,
            )
        if role == "decode":
            if not port:
                return CheckResult(False, "--role decode needs --port of Prefill", backend)
            return run_decode(
                backend, host=host, port=port, chunk=chunk, timeout_s=timeout_s, options=options
            )
        if role is not None:
            return CheckResult(
                False, f"role must be prefill, decode or none; got {role!r}", backend
            )
        if backend == "loopback":
            return _both_in_threads(backend, host, size, chunk, seed, timeout_s, options)
        return _both_in_processes(backend, host, size, chunk, seed, timeout_s, options)
    except (ProtocolError, ImportError, TimeoutError, OSError) as exc:
        return CheckResult(False, f"{type(exc).__name__}: {exc}", backend, role or "both")


def _both_in_threads(
    backend: str,
    host: str,
    size: int,
    chunk: int,
    seed: int,
    timeout_s: float,
    options: dict[str, Any] | None,
) -> CheckResult:
    ready: queue.Queue[str] = queue.Queue()
    outcome: dict[str, CheckResult] = {}

    def prefill() -> None:
        outcome["prefill"] = run_check_read(
            backend, "prefill", host, 0, size, seed=seed, timeout_s=timeout_s,
            options=options, on_ready=ready.put,
        )  # fmt: skip

    thread = threading.Thread(target=prefill, name="rd2h-check-prefill", daemon=True)
    thread.start()
    try:
        endpoint = ready.get(timeout=timeout_s)
    except queue.Empty:
        thread.join(0.1)
        return outcome.get("prefill") or CheckResult(False, "Prefill did not start", backend)
    port = int(endpoint.rsplit(":", 1)[1])
    result = run_check_read(
        backend, "decode", host, port, size, chunk=chunk, timeout_s=timeout_s, options=options
    )
    # Decode always reports to Prefill, which then returns at once.
    thread.join(min(timeout_s, 10.0))
    return CheckResult(**{**asdict(result), "role": "both"})


def _child_args(
    backend: str, role: str, host: str, port: int, size: int, chunk: int, seed: int,
    timeout_s: float, options: dict[str, Any] | None,
) -> list[str]:  # fmt: skip
    args = [
        sys.executable, "-m", "rd2h_runtime.testing.check_read", "--backend", backend,
        "--role", role, "--host", host, "--port", str(port), "--size", str(size),
        "--chunk", str(chunk), "--seed", str(seed), "--timeout", str(timeout_s),
    ]  # fmt: skip
    for key, value in (options or {}).items():
        args += ["--option", f"{key}={value}"]
    return args


def _pump(
    proc: subprocess.Popen[str], name: str, lines: queue.Queue[tuple[str, str | None]]
) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.put((name, line.rstrip("\n")))
    lines.put((name, None))  # end of output


def _both_in_processes(
    backend: str,
    host: str,
    size: int,
    chunk: int,
    seed: int,
    timeout_s: float,
    options: dict[str, Any] | None,
) -> CheckResult:
    deadline = time.monotonic() + timeout_s
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    lines: queue.Queue[tuple[str, str | None]] = queue.Queue()
    output: dict[str, list[str]] = {"prefill": [], "decode": []}
    procs: dict[str, subprocess.Popen[str]] = {}

    def start(role: str, port: int) -> None:
        proc = subprocess.Popen(
            _child_args(backend, role, host, port, size, chunk, seed, timeout_s, options),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        procs[role] = proc
        threading.Thread(target=_pump, args=(proc, role, lines), daemon=True).start()

    def failed(reason: str) -> CheckResult:
        # One-line reason (it becomes the last line printed); the children's last output
        # goes to the details, printed above it.
        last = [f"{r}: {line}" for r in ("prefill", "decode") for line in output[r][-15:]]
        verdicts = [
            line.split("FAIL: ", 1)[1]
            for r in ("decode", "prefill")
            for line in output[r]
            if line.startswith("FAIL: ")
        ]
        why = f"{reason}: {verdicts[0]}" if verdicts else reason
        return CheckResult(False, why, backend, details=["child output:", *last])

    try:
        start("prefill", 0)
        port = 0
        ended: set[str] = set()
        while len(ended) < len(procs):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return failed(f"timed out after {timeout_s}s")
            try:
                role, line = lines.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                ended.add(role)
                procs[role].wait(max(0.1, deadline - time.monotonic()))
                if role == "prefill" and "decode" not in procs:
                    return failed("Prefill exited before it was ready")
                continue
            output[role].append(line)
            if role == "prefill" and line.startswith(_READY_PREFIX) and "decode" not in procs:
                port = int(line.rsplit(":", 1)[1])
                start("decode", port)
        decode_result = _parse_result(output["decode"])
        if decode_result is None:
            return failed("Decode printed no result")
        codes = {role: proc.returncode for role, proc in procs.items()}
        if decode_result.ok and any(codes.values()):
            return failed(f"a child failed (exit codes {codes})")
        return CheckResult(**{**asdict(decode_result), "role": "both"})
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)


@dataclass(frozen=True)
class SourceInfo:
    """A running Prefill source, as Decode sees it (see :func:`prefill_source`)."""

    backend: str
    session: str
    addr: int
    length: int
    seed: int
    sha256: str


@contextlib.contextmanager
def prefill_source(
    backend: str,
    size: int,
    *,
    host: str = "127.0.0.1",
    seed: int = DEFAULT_SEED,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    options: dict[str, Any] | None = None,
) -> Iterator[SourceInfo]:
    """Run a Prefill source of ``size`` pattern bytes; yield what a reader needs.

    For tests and benchmarks that read from a real peer with their own Decode backend: the
    source runs in a child process (in a thread for ``loopback``, which cannot cross
    processes) and stays registered until the ``with`` block ends.
    """
    import zmq

    ready: queue.Queue[str] = queue.Queue()
    output: list[str] = []
    proc: subprocess.Popen[str] | None = None
    thread: threading.Thread | None = None
    if backend == "loopback":

        def serve() -> None:
            serve_prefill(
                backend, host=host, size=size, seed=seed, timeout_s=timeout_s,
                options=options, on_ready=ready.put,
            )  # fmt: skip

        thread = threading.Thread(target=serve, name="rd2h-source", daemon=True)
        thread.start()
    else:
        proc = subprocess.Popen(
            _child_args(backend, "prefill", host, 0, size, DEFAULT_CHUNK, seed, timeout_s, options),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

        def pump() -> None:
            assert proc is not None and proc.stdout is not None
            for line in proc.stdout:
                output.append(line.rstrip("\n"))
                if line.startswith(_READY_PREFIX):
                    ready.put(line[len(_READY_PREFIX) :].strip())
            ready.put("")  # exited

        threading.Thread(target=pump, name="rd2h-source-output", daemon=True).start()
    try:
        endpoint = ready.get(timeout=timeout_s)
        if not endpoint:
            verdicts = [line for line in output if line.startswith("FAIL: ")]
            said = verdicts[-1] if verdicts else " | ".join(output[-5:])
            raise RuntimeError(f"{backend} source exited: {said}")
        with control_socket(zmq.REQ, timeout_s) as sock:
            sock.connect(endpoint)
            sock.send_json({"op": "hello", "backend": backend})
            info = recv_json(sock, f"answer from the {backend} source")
            if info.get("op") != "source":
                raise RuntimeError(f"{backend} source refused: {info!r}")
            try:
                yield SourceInfo(
                    backend, str(info["session"]), int(info["addr"]), int(info["length"]),
                    int(info["seed"]), str(info["sha256"]),
                )  # fmt: skip
            finally:
                # Always release the source, also when the reader failed.
                with contextlib.suppress(TimeoutError, zmq.ZMQError):
                    sock.send_json({"op": "result", "result": {"ok": True, "reason": "done"}})
                    recv_json(sock, "goodbye from the source")
    finally:
        if proc is not None:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if thread is not None:
            thread.join(10)


def _parse_result(lines: list[str]) -> CheckResult | None:
    for line in reversed(lines):
        if line.startswith(_RESULT_PREFIX):
            return CheckResult(**json.loads(line[len(_RESULT_PREFIX) :]))
    return None


def _report(result: CheckResult, role: str | None) -> None:
    for line in result.details:
        print(f"  {line}")
    if result.seconds > 0:
        print(
            f"throughput: {result.bytes_read} bytes in {result.seconds * 1e3:.1f} ms "
            f"({result.descriptors} descriptors) = {result.gib_per_s:.2f} GiB/s"
        )
    if role is not None:
        print(_RESULT_PREFIX + json.dumps(asdict(result)))
    print(result.verdict, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """``rd2h check-read``: exit 0 only on PASS; the last line says PASS or FAIL and why."""
    parser = argparse.ArgumentParser(
        prog="rd2h check-read",
        description="Two-endpoint read check of a transfer backend (real bytes, verified).",
    )
    parser.add_argument(
        "--backend", required=True, help="loopback, cma, nixl, mooncake or memfabric"
    )
    parser.add_argument("--role", choices=("prefill", "decode"), help="omit to run both here")
    parser.add_argument("--host", default="127.0.0.1", help="Prefill's control/engine address")
    parser.add_argument("--port", type=int, default=0, help="Prefill's control port (0: pick)")
    parser.add_argument("--size", type=int, default=DEFAULT_SIZE, help="source bytes")
    parser.add_argument("--chunk", type=int, default=DEFAULT_CHUNK, help="bytes per descriptor")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds")
    parser.add_argument(
        "--option", action="append", default=[], metavar="KEY=VALUE",
        help="backend option, e.g. protocol=device_rdma (repeatable)",
    )  # fmt: skip
    args = parser.parse_args(argv)

    def announce(endpoint: str) -> None:
        print(_READY_PREFIX + endpoint, flush=True)

    try:
        options = _parse_options(args.option)
    except ConfigError as exc:
        print(f"FAIL: {exc}", flush=True)
        return 1
    result = run_check_read(
        args.backend,
        args.role,
        args.host,
        args.port,
        args.size,
        chunk=args.chunk,
        seed=args.seed,
        timeout_s=args.timeout,
        options=options,
        on_ready=announce,
    )
    _report(result, args.role)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
