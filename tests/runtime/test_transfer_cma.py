"""The cma backend's own checks: who it reads from, what, and what it refuses.

Reads between two real processes, byte for byte, are in test_transfer_remote.py; here a
Prefill-role backend of this very process is the peer (the kernel lets a process read
itself), so each refusal can be set up exactly. Short returns and errno values the kernel
gives only in rare states (a process exiting mid-read, ptrace refused) are produced by a
stand-in for ``process_vm_readv`` that copies less, or fails, as told.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from rd2h_protocol.errors import ConfigError, TransferError
from rd2h_runtime.transfer import create_backend
from rd2h_runtime.transfer.cma_backend import CmaBackend

pytestmark = pytest.mark.timeout(60)

Readv = Callable[[int, int, int, int, int, int], int]


@pytest.fixture
def pair() -> Iterator[tuple[CmaBackend, CmaBackend, np.ndarray, np.ndarray]]:
    src = np.arange(1 << 20, dtype=np.uint32).view(np.uint8)  # 4 MiB, every byte known
    dst = np.zeros(src.nbytes, dtype=np.uint8)
    with (
        create_backend("cma", role="prefill") as prefill,
        create_backend("cma", role="decode") as decode,
    ):
        assert isinstance(prefill, CmaBackend) and isinstance(decode, CmaBackend)
        prefill.register([(src.ctypes.data, src.nbytes)])
        decode.register([(dst.ctypes.data, dst.nbytes)])
        yield prefill, decode, src, dst


def test_reads_descriptors_in_any_order(
    pair: tuple[CmaBackend, CmaBackend, np.ndarray, np.ndarray],
) -> None:
    prefill, decode, src, dst = pair
    block = 4096
    order = np.random.default_rng(7).permutation(src.nbytes // block).astype(np.uint64)
    remote = src.ctypes.data + order * block
    local = dst.ctypes.data + np.arange(order.shape[0], dtype=np.uint64) * block
    lengths = np.full(order.shape, block, dtype=np.uint64)  # 1024 descriptors: one call
    decode.read(prefill.session_id, remote, local, lengths, timeout_s=10)
    assert np.array_equal(dst.reshape(-1, block), src.reshape(-1, block)[order.astype(np.intp)])


def test_session_names_this_boot_the_process_and_its_regions(
    pair: tuple[CmaBackend, CmaBackend, np.ndarray, np.ndarray],
) -> None:
    prefill, _, src, _ = pair
    scheme, boot, pid, start, regions = prefill.session_id.split(":")
    assert scheme == "cma" and len(boot) == 32 and start.isdigit()
    assert int(pid) > 0 and regions == f"{src.ctypes.data:x}+{src.nbytes:x}"


def test_remote_range_outside_the_published_regions_is_refused_before_reading(
    pair: tuple[CmaBackend, CmaBackend, np.ndarray, np.ndarray],
) -> None:
    prefill, decode, src, dst = pair
    with pytest.raises(TransferError, match="outside the regions") as info:
        decode.read(
            prefill.session_id,
            [src.ctypes.data + src.nbytes - 8],
            [dst.ctypes.data],
            [16],
            timeout_s=5,
        )
    assert info.value.backend_code is None
    assert not dst.any()


def test_session_from_another_boot_is_refused(
    pair: tuple[CmaBackend, CmaBackend, np.ndarray, np.ndarray],
) -> None:
    prefill, decode, src, dst = pair
    scheme, _boot, rest = prefill.session_id.split(":", 2)
    other = f"{scheme}:{'0' * 32}:{rest}"
    with pytest.raises(TransferError, match="another host or boot"):
        decode.read(other, [src.ctypes.data], [dst.ctypes.data], [16], timeout_s=5)


def test_session_of_a_process_that_is_gone_is_refused() -> None:
    code = (
        "from rd2h_runtime.transfer import create_backend\n"
        "import numpy as np\n"
        "b = create_backend('cma', role='prefill'); a = np.ones(4096, np.uint8)\n"
        "b.register([(a.ctypes.data, a.nbytes)]); print(b.session_id)\n"
    )
    session = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout.strip()
    addr = int(session.rsplit(":", 1)[1].split("+")[0], 16)
    dst = np.zeros(4096, dtype=np.uint8)
    with create_backend("cma", role="decode") as decode:
        decode.register([(dst.ctypes.data, dst.nbytes)])
        with pytest.raises(TransferError, match="is gone"):
            decode.read(session, [addr], [dst.ctypes.data], [4096], timeout_s=5)


@pytest.fixture
def live_source() -> Iterator[tuple[subprocess.Popen[str], str, int]]:
    """A Prefill process that publishes 4096 bytes of 7s and waits for its stdin to close.
    Yields (the process, its session id, the source address)."""
    code = (
        "import sys\n"
        "from rd2h_runtime.transfer import create_backend\n"
        "import numpy as np\n"
        "b = create_backend('cma', role='prefill'); a = np.full(4096, 7, np.uint8)\n"
        "b.register([(a.ctypes.data, a.nbytes)]); print(b.session_id, flush=True)\n"
        "sys.stdin.read()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        session = proc.stdout.readline().strip()
        yield proc, session, int(session.rsplit(":", 1)[1].split("+")[0], 16)
    finally:
        proc.kill()
        proc.wait(30)


def test_a_peer_that_exits_after_connecting_is_refused(
    live_source: tuple[subprocess.Popen[str], str, int],
) -> None:
    proc, session, addr = live_source
    dst = np.zeros(4096, dtype=np.uint8)
    with create_backend("cma", role="decode") as decode:
        decode.register([(dst.ctypes.data, dst.nbytes)])
        decode.read(session, [addr], [dst.ctypes.data], [4096], timeout_s=5)
        assert (dst == 7).all()
        proc.kill()
        proc.wait(30)
        with pytest.raises(TransferError, match="is gone"):
            decode.read(session, [addr], [dst.ctypes.data], [4096], timeout_s=5)


def test_a_peer_that_exits_during_a_read_fails_that_read(
    live_source: tuple[subprocess.Popen[str], str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    proc, session, addr = live_source
    dst = np.zeros(4096, dtype=np.uint8)
    with create_backend("cma", role="decode") as decode:
        assert isinstance(decode, CmaBackend)
        decode.register([(dst.ctypes.data, dst.nbytes)])
        real: Readv = decode._readv

        def copy_then_peer_exits(
            pid: int, local: int, n: int, remote: int, m: int, flags: int
        ) -> int:
            done = real(pid, local, n, remote, m, flags)
            proc.kill()
            proc.wait(30)
            return done

        monkeypatch.setattr(decode, "_readv", copy_then_peer_exits)
        with pytest.raises(TransferError, match="exited during the read"):
            decode.read(session, [addr], [dst.ctypes.data], [4096], timeout_s=5)


@pytest.mark.parametrize("session", ["cma:nope", "nixl:abc", "cma:a:b:c:d", "cma:x:1:1:zz+1"])
def test_malformed_sessions_are_refused(
    session: str, pair: tuple[CmaBackend, CmaBackend, np.ndarray, np.ndarray]
) -> None:
    _, decode, _, dst = pair
    with pytest.raises(TransferError):
        decode.read(session, [4096], [dst.ctypes.data], [16], timeout_s=5)


def test_too_many_regions_for_a_session_id_are_refused_at_registration() -> None:
    with create_backend("cma", role="prefill") as prefill:
        spaced = [(0x10000 + i * 0x20000, 0x1000) for i in range(400)]
        with pytest.raises(TransferError, match="do not fit a session id"):
            prefill.register(spaced)
        assert prefill.registered == []


# -- copies cut into calls and parts ---------------------------------------------------------


def scattered(
    src: np.ndarray, dst: np.ndarray, count: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``count`` descriptors of odd sizes (1..4099 bytes): sources end to end in a shuffled
    order, destinations end to end in order. Returns (remote, local, lengths)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 4100, count).astype(np.uint64)
    order = rng.permutation(count)
    src_offsets = np.empty(count, dtype=np.uint64)
    src_offsets[order] = np.cumsum(lengths[order]) - lengths[order]
    dst_offsets = np.cumsum(lengths) - lengths
    assert int(lengths.sum()) <= min(src.nbytes, dst.nbytes)
    return src.ctypes.data + src_offsets, dst.ctypes.data + dst_offsets, lengths


def assert_landed(
    src: np.ndarray, dst: np.ndarray, remote: np.ndarray, local: np.ndarray, lengths: np.ndarray
) -> None:
    """Every destination holds its source's bytes, and nothing after the last one moved."""
    for r, lo, n in zip(remote.tolist(), local.tolist(), lengths.tolist(), strict=True):
        s, d = r - src.ctypes.data, lo - dst.ctypes.data
        assert np.array_equal(dst[d : d + n], src[s : s + n]), f"descriptor at dst+{d}"
    assert not dst[int(lengths.sum()) :].any()


def iovecs(address: int, count: int) -> np.ndarray:
    """View the ``count`` (base, length) pairs of an iovec array at ``address``."""
    pairs = (ctypes.c_uint64 * (2 * count)).from_address(address)
    return np.ctypeslib.as_array(pairs).reshape(count, 2)


@dataclass(frozen=True)
class Source:
    """A registered 12 MiB random source, a destination, and ``decode(threads)``, which
    makes a Decode backend (closed after the test) to read one into the other."""

    session: str
    src: np.ndarray
    dst: np.ndarray
    decode: Callable[[int], CmaBackend]


@pytest.fixture
def source() -> Iterator[Source]:
    src = np.random.default_rng(3).integers(0, 256, 12 << 20, dtype=np.uint8)
    dst = np.zeros(src.nbytes, dtype=np.uint8)
    made: list[CmaBackend] = []

    def decode(threads: int) -> CmaBackend:
        backend = create_backend("cma", role="decode", threads=threads)
        assert isinstance(backend, CmaBackend)
        backend.register([(dst.ctypes.data, dst.nbytes)])
        made.append(backend)
        return backend

    with create_backend("cma", role="prefill") as prefill:
        prefill.register([(src.ctypes.data, src.nbytes)])
        try:
            yield Source(prefill.session_id, src, dst, decode)
        finally:
            for backend in made:
                backend.close()


@pytest.mark.parametrize("threads", [1, 3])
def test_odd_descriptors_beyond_iov_max_land_byte_for_byte(threads: int, source: Source) -> None:
    src, dst = source.src, source.dst
    remote, local, lengths = scattered(src, dst, 4000, seed=threads)  # ~8 MiB, 4 calls+
    source.decode(threads).read(source.session, remote, local, lengths, timeout_s=30)
    assert_landed(src, dst, remote, local, lengths)


def test_one_descriptor_is_cut_between_threads(
    source: Source,
) -> None:
    src, dst = source.src, source.dst
    n = (9 << 20) + 3  # four parts, each cut inside the one descriptor
    remote, local, lengths = [src.ctypes.data + 5], [dst.ctypes.data], [n]
    source.decode(4).read(source.session, remote, local, lengths, timeout_s=30)
    assert np.array_equal(dst[:n], src[5 : 5 + n]) and not dst[n:].any()


@pytest.mark.parametrize("threads", [1, 2])
def test_short_returns_are_continued_from_where_they_stopped(
    threads: int,
    source: Source,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    src, dst = source.src, source.dst
    backend = source.decode(threads)
    real: Readv = backend._readv
    calls: list[int] = []

    def half_of_the_first(pid: int, local: int, n: int, remote: int, m: int, flags: int) -> int:
        """Copy only the first half (rounded up) of the first iovec: a short return."""
        calls.append(n)
        one = np.array([iovecs(local, n)[0], iovecs(remote, m)[0]], dtype=np.uint64)
        one[:, 1] = (one[:, 1] + 1) // 2
        return real(pid, one[0].ctypes.data, 1, one[1].ctypes.data, 1, flags)

    monkeypatch.setattr(backend, "_readv", half_of_the_first)
    remote, local, lengths = scattered(src, dst, 1500, seed=11)
    backend.read(source.session, remote, local, lengths, timeout_s=30)
    assert_landed(src, dst, remote, local, lengths)
    assert max(calls) > 1 and len(calls) > 2 * lengths.shape[0]


@pytest.mark.parametrize(
    ("code", "says"),
    [
        (errno.EPERM, "not allowed to read process"),
        (errno.ESRCH, "is gone"),
        (errno.EFAULT, "not mapped any more"),
    ],
)
def test_kernel_errors_say_what_to_do(
    code: int,
    says: str,
    source: Source,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    src, dst = source.src, source.dst
    backend = source.decode(1)

    def refuse(pid: int, local: int, n: int, remote: int, m: int, flags: int) -> int:
        ctypes.set_errno(code)
        return -1

    monkeypatch.setattr(backend, "_readv", refuse)
    with pytest.raises(TransferError, match=says) as info:
        backend.read(source.session, [src.ctypes.data], [dst.ctypes.data], [64], timeout_s=5)
    assert info.value.backend_code == code and "descriptor 0" in str(info.value)


PAGE = mmap.PAGESIZE
_PROT_NONE = 0


@pytest.fixture
def source_with_a_hole() -> Iterator[tuple[CmaBackend, int, int]]:
    """A registered 8 MiB source whose page at 6 MiB may not be read (PROT_NONE).
    Yields (prefill backend, source address, offset of that page)."""
    size, hole = 8 << 20, 6 << 20
    area = mmap.mmap(-1, size)
    area.write(bytes(range(256)) * (size // 256))
    addr = ctypes.addressof(ctypes.c_char.from_buffer(area))
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mprotect(ctypes.c_void_p(addr + hole), PAGE, _PROT_NONE) == 0
    try:
        with create_backend("cma", role="prefill") as prefill:
            assert isinstance(prefill, CmaBackend)
            prefill.register([(addr, size)])
            yield prefill, addr, hole
    finally:
        libc.mprotect(ctypes.c_void_p(addr + hole), PAGE, mmap.PROT_READ | mmap.PROT_WRITE)
        area.close()


@pytest.mark.parametrize("threads", [1, 2])
def test_memory_that_cannot_be_read_fails_at_its_descriptor(
    threads: int, source_with_a_hole: tuple[CmaBackend, int, int]
) -> None:
    """The kernel returns short at the hole; the continued call fails there. With two
    threads the hole lies in the pool's part: its error reaches the caller."""
    prefill, addr, hole = source_with_a_hole
    dst = np.zeros(8 << 20, dtype=np.uint8)
    offsets = np.arange(0, dst.nbytes, 1 << 20, dtype=np.uint64)
    lengths = np.full(offsets.shape, 1 << 20, dtype=np.uint64)
    with create_backend("cma", role="decode", threads=threads) as decode:
        decode.register([(dst.ctypes.data, dst.nbytes)])
        with pytest.raises(TransferError, match="not mapped any more") as info:
            decode.read(
                prefill.session_id, addr + offsets, dst.ctypes.data + offsets, lengths,
                timeout_s=10,
            )  # fmt: skip
    assert info.value.backend_code == errno.EFAULT
    assert f"descriptor {hole >> 20} " in str(info.value)
    assert np.array_equal(dst[:PAGE], np.arange(PAGE, dtype=np.uint8))


def test_a_read_past_its_deadline_stops_with_every_part_ended(
    source: Source,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    src, dst = source.src, source.dst
    backend = source.decode(2)
    real: Readv = backend._readv
    running = []

    def slow(pid: int, local: int, n: int, remote: int, m: int, flags: int) -> int:
        running.append(1)
        time.sleep(0.02)
        one = np.array([iovecs(local, n)[0], iovecs(remote, m)[0]], dtype=np.uint64)
        one[:, 1] = np.minimum(one[:, 1], 4096)
        done = real(pid, one[0].ctypes.data, 1, one[1].ctypes.data, 1, flags)
        running.pop()
        return done

    monkeypatch.setattr(backend, "_readv", slow)
    with pytest.raises(TransferError, match="timed out") as info:
        backend.read(source.session, [src.ctypes.data], [dst.ctypes.data], [8 << 20], timeout_s=0.2)
    assert info.value.transient and not running


# -- the pool's setting and lifetime ---------------------------------------------------------


@pytest.mark.parametrize("threads", [0, -1, "2", True, 1.5])
def test_threads_must_be_a_positive_integer(threads: object) -> None:
    with pytest.raises(ConfigError, match="threads must be an integer >= 1"):
        create_backend("cma", role="decode", threads=threads)


def copy_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("rd2h-cma-copy")}


def test_close_ends_the_copy_threads(
    source: Source,
) -> None:
    src, dst = source.src, source.dst
    before = copy_threads()
    backend = source.decode(3)
    for _ in range(3):  # the same threads serve every read
        backend.read(
            source.session, [src.ctypes.data], [dst.ctypes.data], [src.nbytes], timeout_s=30
        )
    started = copy_threads() - before
    assert len(started) == 2 and np.array_equal(dst, src)
    backend.close()
    assert not any(t.is_alive() for t in started)


def test_backends_with_pools_read_at_once(
    source: Source,
) -> None:
    """Two Decode backends of one process, two threads each, read halves concurrently."""
    src, dst = source.src, source.dst
    half = src.nbytes // 2
    errors: list[BaseException] = []

    def read_half(backend: CmaBackend, offset: int) -> None:
        try:
            for _ in range(5):
                backend.read(
                    source.session, [src.ctypes.data + offset], [dst.ctypes.data + offset],
                    [half], timeout_s=30,
                )  # fmt: skip
        except BaseException as exc:  # reported below
            errors.append(exc)

    readers = [
        threading.Thread(target=read_half, args=(source.decode(2), offset)) for offset in (0, half)
    ]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join(30)
    assert not errors and np.array_equal(dst, src)
