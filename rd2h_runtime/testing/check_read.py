"""Two-endpoint read check of a transfer backend (``rd2h check-read``).

Over 600 lines: both sides, the driver and the test source share one REP-socket exchange.

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
import hashlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from rd2h_protocol.errors import ConfigError, ProtocolError, TransferError

__all__ = [
    "CheckResult",
    "SourceInfo",
    "main",
    "pattern",
    "prefill_source",
    "run_check_read",
    "scatter_ranges",
]

DEFAULT_SIZE: Final = 64 << 20
DEFAULT_CHUNK: Final = 1 << 20
DEFAULT_TIMEOUT_S: Final = 60.0
DEFAULT_SEED: Final = 20250607
SCATTER_RANGES: Final = 8
_SENTINEL: Final = 0xA5
_READY_PREFIX: Final = "CONTROL "
_RESULT_PREFIX: Final = "RESULT "

U8Array = npt.NDArray[np.uint8]


@dataclass(frozen=True)
class CheckResult:
    """Outcome of one check. ``ok`` is the verdict; ``reason`` says why in one line."""

    ok: bool
    reason: str
    backend: str
    role: str = "both"
    bytes_read: int = 0
    seconds: float = 0.0
    descriptors: int = 0
    details: list[str] = field(default_factory=list)

    @property
    def gib_per_s(self) -> float:
        """Throughput of the timed full read (0 when it did not run)."""
        return self.bytes_read / self.seconds / 2**30 if self.seconds > 0 else 0.0

    @property
    def verdict(self) -> str:
        """The last line the CLI prints."""
        return f"{'PASS' if self.ok else 'FAIL'}: {self.reason}"


def pattern(size: int, seed: int) -> U8Array:
    """The deterministic source bytes both sides can compute on their own."""
    return np.random.Generator(np.random.PCG64(seed)).integers(0, 256, size, dtype=np.uint8)


def scatter_ranges(size: int, count: int = SCATTER_RANGES) -> list[tuple[int, int, int]]:
    """``count`` ``(src_offset, dst_offset, length)`` ranges for the scattered read.

    Source ranges sit in every other slot of ``2 * count`` slots, starting 3 bytes into the
    slot (odd, non-zero offsets with gaps between them); destinations take the slots in
    reverse order, so neither side is contiguous and the order is permuted.
    """
    slot = size // (2 * count)
    if slot < 8:
        raise ConfigError(f"size {size} is too small for {count} scattered ranges")
    length = slot - 5
    out = []
    for i in range(count):
        src = (2 * i + 1) * slot + 3
        dst = (2 * (count - 1 - i)) * slot + 1
        out.append((src, dst, length))
    return out


def _wrong_session(backend: str, session: str) -> str:
    """A well-formed session that names no live peer, per backend's session syntax."""
    if backend == "loopback":
        return "loopback:0:0"
    if backend == "nixl":
        from rd2h_runtime.transfer.nixl_backend import encode_session

        return encode_session(b"not nixl agent metadata")
    host = session.rsplit(":", 1)[0]
    return f"{host}:1"  # port 1 (tcpmux) is never a transfer engine


def _parse_options(items: Sequence[str]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--option expects key=value, got {item!r}")
        options[key] = int(value) if value.lstrip("-").isdigit() else value
    return options


@contextlib.contextmanager
def _socket(kind: int, timeout_s: float) -> Iterator[Any]:
    import zmq

    sock: Any = zmq.Context.instance().socket(kind)
    ms = max(1, int(timeout_s * 1000))
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, ms)
    sock.setsockopt(zmq.SNDTIMEO, ms)
    try:
        yield sock
    finally:
        sock.close(linger=0)


def _recv(sock: Any, what: str) -> dict[str, Any]:
    import zmq

    try:
        msg: dict[str, Any] = sock.recv_json()
    except zmq.Again as exc:
        raise TimeoutError(f"no {what} within the timeout") from exc
    return msg


# ------------------------------------------------------------------------------ Prefill
def serve_prefill(
    backend: str,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    size: int = DEFAULT_SIZE,
    seed: int = DEFAULT_SEED,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    options: dict[str, Any] | None = None,
    on_ready: Callable[[str], None] | None = None,
) -> CheckResult:
    """Run the Prefill side: serve one Decode check, return Decode's verdict."""
    import zmq

    from rd2h_runtime.transfer import create_backend

    deadline = time.monotonic() + timeout_s
    source = pattern(size, seed)
    digest = hashlib.sha256(source.data).hexdigest()
    with (
        create_backend(backend, role="prefill", host=host, **(options or {})) as engine,
        _socket(zmq.REP, timeout_s) as sock,
    ):
        engine.register([(source.ctypes.data, source.nbytes)])
        if port:
            sock.bind(f"tcp://{host}:{port}")
            bound = port
        else:
            bound = sock.bind_to_random_port(f"tcp://{host}")
        endpoint = f"tcp://{host}:{bound}"
        if on_ready is not None:
            on_ready(endpoint)
        hello = _recv(sock, "hello from Decode")
        if hello.get("op") != "hello" or hello.get("backend") != backend:
            sock.send_json({"op": "error", "reason": f"unexpected hello {hello!r}"})
            return CheckResult(False, f"unexpected hello from Decode: {hello!r}", backend)
        sock.send_json(
            {
                "op": "source",
                "backend": backend,
                "session": engine.session_id,
                "addr": source.ctypes.data,
                "length": source.nbytes,
                "seed": seed,
                "sha256": digest,
            }
        )
        sock.setsockopt(zmq.RCVTIMEO, max(1, int((deadline - time.monotonic()) * 1000)))
        report = _recv(sock, "result from Decode")
        sock.send_json({"op": "bye"})
        # The source must stay registered until Decode has finished reading: only now
        # does the `with` block release it.
        result = report.get("result", {})
        return CheckResult(
            ok=bool(result.get("ok")),
            reason=f"Decode reported: {result.get('reason', report)!s}",
            backend=backend,
            role="prefill",
            bytes_read=int(result.get("bytes_read", 0)),
            seconds=float(result.get("seconds", 0.0)),
            descriptors=int(result.get("descriptors", 0)),
        )


# ------------------------------------------------------------------------------- Decode
def run_decode(
    backend: str,
    *,
    host: str = "127.0.0.1",
    port: int,
    chunk: int = DEFAULT_CHUNK,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    options: dict[str, Any] | None = None,
    local_host: str | None = None,
) -> CheckResult:
    """Run the Decode side against the Prefill at ``host:port``; return the verdict."""
    import zmq

    from rd2h_runtime.transfer import create_backend

    deadline = time.monotonic() + timeout_s

    def left() -> float:
        return max(0.001, deadline - time.monotonic())

    with _socket(zmq.REQ, timeout_s) as sock:
        sock.connect(f"tcp://{host}:{port}")
        sock.send_json({"op": "hello", "backend": backend})
        info = _recv(sock, f"answer from Prefill at {host}:{port}")
        if info.get("op") != "source":
            return CheckResult(False, f"Prefill refused the check: {info!r}", backend, "decode")
        try:
            with create_backend(
                backend, role="decode", host=local_host or host, **(options or {})
            ) as engine:
                result = _decode_checks(engine, backend, info, chunk, left)
        except (ProtocolError, ImportError, OSError) as exc:
            # Still report, so Prefill stops waiting at once.
            result = CheckResult(False, f"Decode: {type(exc).__name__}: {exc}", backend, "decode")
        try:
            sock.send_json({"op": "result", "result": asdict(result)})
            _recv(sock, "goodbye from Prefill")
        except (TimeoutError, zmq.ZMQError) as exc:
            result.details.append(f"could not report to Prefill: {exc}")
        return result


def _decode_checks(
    engine: Any, backend: str, info: dict[str, Any], chunk: int, left: Callable[[], float]
) -> CheckResult:
    session, addr, size = str(info["session"]), int(info["addr"]), int(info["length"])
    expected = pattern(size, int(info["seed"]))
    details: list[str] = []

    def fail(reason: str) -> CheckResult:
        return CheckResult(False, reason, backend, "decode", details=details)

    dest = np.full(size, _SENTINEL, dtype=np.uint8)
    base = dest.ctypes.data
    engine.register([(base, dest.nbytes)])

    # 1. scattered ranges (also sets up the connection before the timed read)
    ranges = scatter_ranges(size)
    src_off = np.array([r[0] for r in ranges], dtype=np.uint64)
    dst_off = np.array([r[1] for r in ranges], dtype=np.uint64)
    lens = np.array([r[2] for r in ranges], dtype=np.uint64)
    try:
        engine.read(session, addr + src_off, base + dst_off, lens, timeout_s=left())
    except TransferError as exc:
        return fail(f"scattered read of {len(ranges)} ranges failed: {exc}")
    touched = np.zeros(size, dtype=bool)
    for s, d, n in ranges:
        if not np.array_equal(dest[d : d + n], expected[s : s + n]):
            first = int(np.flatnonzero(dest[d : d + n] != expected[s : s + n])[0])
            return fail(f"scattered range src+{s} -> dst+{d} differs at byte {first}")
        touched[d : d + n] = True
    if not (dest[~touched] == _SENTINEL).all():
        return fail("scattered read wrote outside its destination ranges")
    details.append(f"scattered read: {len(ranges)} ranges of {ranges[0][2]} bytes verified")

    # 2. the whole buffer, timed, checked against Prefill's SHA-256
    dest.fill(0)
    offs = np.arange(0, size, chunk, dtype=np.uint64)
    lengths = np.minimum(np.uint64(chunk), np.uint64(size) - offs)
    t0 = time.perf_counter()
    try:
        engine.read(session, addr + offs, base + offs, lengths, timeout_s=left())
    except TransferError as exc:
        return fail(f"full read of {size} bytes failed: {exc}")
    seconds = time.perf_counter() - t0
    if hashlib.sha256(dest.data).hexdigest() != info["sha256"]:
        bad = int(np.flatnonzero(dest != expected)[0]) if (dest != expected).any() else -1
        return fail(f"SHA-256 of the {size} bytes read differs from Prefill's (byte {bad})")
    gib = size / seconds / 2**30
    details.append(
        f"full read: {size} bytes in {offs.shape[0]} descriptors of {chunk} bytes, "
        f"{seconds * 1e3:.1f} ms, {gib:.2f} GiB/s, SHA-256 verified"
    )

    # 3. negative cases: each must raise TransferError, and the engine must still work after
    probe = (np.array([addr], np.uint64), np.array([base], np.uint64), np.array([4096], np.uint64))
    negatives = [
        (
            "range past the end of the registered source",
            session,
            np.array([addr + size - 16], np.uint64),
        ),
        ("wrong session", _wrong_session(backend, session), np.array([addr], np.uint64)),
    ]
    for label, bad_session, remote in negatives:
        try:
            engine.read(bad_session, remote, probe[1], probe[2], timeout_s=min(left(), 10.0))
        except TransferError as exc:
            details.append(f"negative case ({label}): TransferError as expected: {exc}")
        except Exception as exc:
            return fail(f"negative case ({label}) raised {type(exc).__name__}, not TransferError")
        else:
            return fail(f"negative case ({label}) did not fail")
        if not engine.quiesce(left()):
            return fail(f"engine still busy after the negative case ({label})")
        try:
            engine.read(session, *probe, timeout_s=left())
        except TransferError as exc:
            return fail(f"read after the negative case ({label}) failed: {exc}")
    return CheckResult(
        True,
        f"{backend}: {size} bytes verified, {gib:.2f} GiB/s, negative cases failed cleanly",
        backend,
        "decode",
        bytes_read=size,
        seconds=seconds,
        descriptors=int(offs.shape[0]),
        details=details,
    )


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
        with _socket(zmq.REQ, timeout_s) as sock:
            sock.connect(endpoint)
            sock.send_json({"op": "hello", "backend": backend})
            info = _recv(sock, f"answer from the {backend} source")
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
                    _recv(sock, "goodbye from the source")
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
