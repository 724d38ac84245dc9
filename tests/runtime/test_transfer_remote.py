"""NIXL, Mooncake and cma backends between two real processes, verifying every byte.

The Prefill source runs in a child process (``transfer_source`` in conftest.py); this
process is Decode and reads with its own backend.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from rd2h_protocol.errors import ConfigError, TransferError
from rd2h_runtime.testing.check_read import SourceInfo
from rd2h_runtime.testing.check_read_sides import pattern
from rd2h_runtime.transfer import TransferBackend, create_backend
from rd2h_runtime.transfer.mooncake_backend import MAX_BATCH_SLICES

SOURCE_BYTES = 64 << 20
BACKENDS = ["nixl", "mooncake", "cma"]

pytestmark = pytest.mark.timeout(60)


@functools.lru_cache(maxsize=2)
def expected_bytes(size: int, seed: int) -> np.ndarray:
    return pattern(size, seed)


@pytest.fixture(params=BACKENDS)
def source(
    request: pytest.FixtureRequest, transfer_source: Callable[[str, int], SourceInfo]
) -> SourceInfo:
    return transfer_source(request.param, SOURCE_BYTES)


@pytest.fixture
def reader(source: SourceInfo) -> Iterator[tuple[TransferBackend, np.ndarray]]:
    """A Decode backend of the source's kind with a registered, zeroed destination."""
    dest = np.zeros(source.length, dtype=np.uint8)
    with create_backend(source.backend, role="decode") as backend:
        backend.register([(dest.ctypes.data, dest.nbytes)])
        yield backend, dest


def test_reads_every_byte_of_the_source(
    source: SourceInfo, reader: tuple[TransferBackend, np.ndarray]
) -> None:
    backend, dest = reader
    chunk = 64 << 10
    offs = np.arange(0, source.length, chunk, dtype=np.uint64)
    lengths = np.full(offs.shape, chunk, dtype=np.uint64)
    backend.read(source.session, source.addr + offs, dest.ctypes.data + offs, lengths, timeout_s=30)
    assert np.array_equal(dest, expected_bytes(source.length, source.seed))


def test_batch_larger_than_the_engine_limit_is_read_whole(
    source: SourceInfo, reader: tuple[TransferBackend, np.ndarray]
) -> None:
    # Mooncake's TCP lane refuses ~4096 slices in one batch; the backend splits. NIXL takes
    # the batch as one request. Either way every descriptor must land.
    backend, dest = reader
    count, size, stride = 2 * MAX_BATCH_SLICES + 17, 1000, 3001
    src_off = np.arange(count, dtype=np.uint64) * stride + 7  # non-contiguous, odd offsets
    dst_off = np.arange(count, dtype=np.uint64)[::-1] * size  # packed, reversed order
    lengths = np.full(count, size, dtype=np.uint64)
    backend.read(
        source.session, source.addr + src_off, dest.ctypes.data + dst_off, lengths, timeout_s=30
    )
    expected = expected_bytes(source.length, source.seed)
    got = dest[: count * size].reshape(count, size)[::-1]
    idx = src_off.astype(np.int64)[:, None] + np.arange(size)
    assert np.array_equal(got, expected[idx])


def test_remote_range_outside_registered_memory_fails_cleanly(
    source: SourceInfo, reader: tuple[TransferBackend, np.ndarray]
) -> None:
    backend, dest = reader
    with pytest.raises(TransferError) as info:
        backend.read(
            source.session, [source.addr + source.length - 16], [dest.ctypes.data], [4096],
            timeout_s=10,
        )  # fmt: skip
    if source.backend == "cma":  # refused by our check of the published regions
        assert info.value.backend_code is None
        assert "outside the regions" in info.value.message
    else:  # refused by the engine
        assert info.value.backend_code is not None and info.value.backend_code < 0
    # The engine is still usable afterwards.
    backend.read(source.session, [source.addr + 5], [dest.ctypes.data], [4096], timeout_s=10)
    assert np.array_equal(dest[:4096], expected_bytes(source.length, source.seed)[5:4101])


@pytest.mark.parametrize("which", ["malformed", "no such peer"])
def test_bad_session_fails_cleanly(
    source: SourceInfo, reader: tuple[TransferBackend, np.ndarray], which: str
) -> None:
    backend, dest = reader
    if source.backend == "nixl":
        from rd2h_runtime.transfer.nixl_backend import encode_session

        bad = "nixl1:%%%" if which == "malformed" else encode_session(b"junk metadata")
    else:
        bad = "127.0.0.1:notaport" if which == "malformed" else "127.0.0.1:1"
    with pytest.raises(TransferError):
        backend.read(bad, [source.addr], [dest.ctypes.data], [4096], timeout_s=10)
    backend.read(source.session, [source.addr], [dest.ctypes.data], [4096], timeout_s=10)
    assert np.array_equal(dest[:4096], expected_bytes(source.length, source.seed)[:4096])


def test_connect_ahead_of_the_first_read(
    source: SourceInfo, reader: tuple[TransferBackend, np.ndarray]
) -> None:
    # connect() gets a first read's connection set-up out of its timeout; it is idempotent,
    # moves no byte, and a peer it cannot reach fails it cleanly.
    backend, dest = reader
    backend.connect(source.session, timeout_s=30)
    backend.connect(source.session, timeout_s=30)
    assert not dest.any()
    backend.read(source.session, [source.addr + 3], [dest.ctypes.data], [4096], timeout_s=10)
    assert np.array_equal(dest[:4096], expected_bytes(source.length, source.seed)[3:4099])
    if source.backend == "nixl":
        from rd2h_runtime.transfer.nixl_backend import encode_session

        with pytest.raises(TransferError):
            backend.connect(encode_session(b"junk metadata"), timeout_s=10)


def test_local_range_outside_registered_memory_never_reaches_the_engine(
    source: SourceInfo, reader: tuple[TransferBackend, np.ndarray]
) -> None:
    backend, _dest = reader
    unregistered = np.zeros(4096, dtype=np.uint8)
    with pytest.raises(TransferError, match="outside the registered regions") as info:
        backend.read(source.session, [source.addr], [unregistered.ctypes.data], [4096], timeout_s=5)
    assert info.value.backend_code is None
    assert not unregistered.any()


def test_read_is_bounded_by_its_timeout(
    source: SourceInfo, reader: tuple[TransferBackend, np.ndarray]
) -> None:
    backend, dest = reader
    # Warm the connection up so the timed read is all data movement.
    backend.read(source.session, [source.addr], [dest.ctypes.data], [4096], timeout_s=10)
    t0 = time.monotonic()
    # On a loaded machine the millisecond may be gone before the read starts: that is
    # refused too, with its own message.
    with pytest.raises(TransferError, match=r"timed out|already elapsed"):
        # 64 MiB in one millisecond would need 64 GB/s: this read cannot finish in time.
        backend.read(
            source.session, [source.addr], [dest.ctypes.data], [source.length], timeout_s=0.001
        )
    assert time.monotonic() - t0 < 1.0
    assert backend.quiesce(30.0)
    dest[:] = 0
    backend.read(source.session, [source.addr], [dest.ctypes.data], [source.length], timeout_s=30)
    assert np.array_equal(dest, expected_bytes(source.length, source.seed))


def test_mooncake_batches_are_split_at_the_limit(
    transfer_source: Callable[[str, int], SourceInfo],
) -> None:
    source = transfer_source("mooncake", SOURCE_BYTES)
    dest = np.zeros(1 << 20, dtype=np.uint8)
    with create_backend("mooncake", role="decode", max_batch_slices=1000) as backend:
        backend.register([(dest.ctypes.data, dest.nbytes)])
        calls: list[int] = []
        engine = backend._engine  # type: ignore[attr-defined]

        class Counting:
            def batch_transfer_sync_read(self, session: str, *lists: list[int]) -> int:
                calls.append(len(lists[0]))
                result: int = engine.batch_transfer_sync_read(session, *lists)
                return result

        backend._engine = Counting()  # type: ignore[attr-defined]
        count = 2500
        offs = np.arange(count, dtype=np.uint64) * 256
        backend.read(
            source.session, source.addr + offs, dest.ctypes.data + offs,
            np.full(count, 256, np.uint64), timeout_s=30,
        )  # fmt: skip
        backend._engine = engine  # type: ignore[attr-defined]
    assert calls == [1000, 1000, 500] and len(calls) == math.ceil(count / 1000)
    assert np.array_equal(
        dest[: count * 256], expected_bytes(source.length, source.seed)[: count * 256]
    )


@pytest.mark.parametrize("value", [0, MAX_BATCH_SLICES + 1])
def test_mooncake_batch_limit_option_is_checked(value: int) -> None:
    with pytest.raises(ConfigError, match="max_batch_slices"):
        create_backend("mooncake", role="decode", max_batch_slices=value)


def test_mooncake_session_is_host_and_rpc_port() -> None:
    with create_backend("mooncake", role="prefill") as backend:
        host, port = backend.session_id.rsplit(":", 1)
        assert host == "127.0.0.1" and 0 < int(port) < 65536


def test_nixl_session_carries_the_registered_memory() -> None:
    from rd2h_runtime.transfer.nixl_backend import decode_session

    buf = np.zeros(1 << 16, dtype=np.uint8)
    with create_backend("nixl", role="prefill") as backend:
        before = backend.session_id
        backend.register([(buf.ctypes.data, buf.nbytes)])
        after = backend.session_id
        assert before != after  # the metadata now lists the region
        assert len(decode_session(after)) > len(decode_session(before))
    with pytest.raises(TransferError, match="not a NIXL session"):
        decode_session("127.0.0.1:5000")
    with pytest.raises(TransferError, match="malformed"):
        decode_session("nixl1:AAAA")


def test_nixl_progress_thread_sleeps_and_loopback_hosts_stay_on_lo() -> None:
    """An idle NIXL agent must not spin a core, and a loopback-bound backend keeps UCX on
    the loopback device (else UCX's TCP leaves through the external interface)."""
    import os
    import subprocess
    import sys

    probe = (
        "import os, time\n"
        "os.environ.pop('UCX_NET_DEVICES', None)\n"
        "from rd2h_runtime.transfer import create_backend\n"
        "be = create_backend('nixl', role='decode', host='127.0.0.1')\n"
        "print(os.environ['UCX_NET_DEVICES'])\n"
        "t = time.process_time(); time.sleep(1.0); print(time.process_time() - t)\n"
        "be.close()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "UCX_NET_DEVICES"}
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, env=env
    )
    lines = proc.stdout.split()
    assert proc.returncode == 0, proc.stderr
    assert lines[0] == "lo"
    assert float(lines[1]) < 0.5  # NIXL's own default spins ~0.7 core
