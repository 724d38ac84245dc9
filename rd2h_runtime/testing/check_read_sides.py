"""The two sides of the read check (``rd2h check-read``), each of which runs alone on its
host: Prefill's source (:func:`serve_prefill`) and Decode's reads and checks
(:func:`run_decode`), with what both compute on their own (the pattern, the scattered
ranges), the verdict they agree on, and their REQ/REP control exchange.

Apart from :mod:`rd2h_runtime.testing.check_read`, which runs them: the driver that
starts both here (threads or child processes), the test source for tests and benchmarks,
and the command line.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from rd2h_protocol.errors import ConfigError, ProtocolError, TransferError

__all__ = [
    "DEFAULT_CHUNK",
    "DEFAULT_SEED",
    "DEFAULT_SIZE",
    "DEFAULT_TIMEOUT_S",
    "SCATTER_RANGES",
    "CheckResult",
    "control_socket",
    "pattern",
    "recv_json",
    "run_decode",
    "scatter_ranges",
    "serve_prefill",
]

DEFAULT_SIZE: Final = 64 << 20
DEFAULT_CHUNK: Final = 1 << 20
DEFAULT_TIMEOUT_S: Final = 60.0
DEFAULT_SEED: Final = 20250607
SCATTER_RANGES: Final = 8
_SENTINEL: Final = 0xA5

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


@contextlib.contextmanager
def control_socket(kind: int, timeout_s: float) -> Iterator[Any]:
    """A ZMQ socket of ``kind`` whose sends and receives give up after ``timeout_s``."""
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


def recv_json(sock: Any, what: str) -> dict[str, Any]:
    """The next JSON message on ``sock``; :class:`TimeoutError` (naming ``what``) if none."""
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
        control_socket(zmq.REP, timeout_s) as sock,
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
        hello = recv_json(sock, "hello from Decode")
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
        report = recv_json(sock, "result from Decode")
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

    with control_socket(zmq.REQ, timeout_s) as sock:
        sock.connect(f"tcp://{host}:{port}")
        sock.send_json({"op": "hello", "backend": backend})
        info = recv_json(sock, f"answer from Prefill at {host}:{port}")
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
            recv_json(sock, "goodbye from Prefill")
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
