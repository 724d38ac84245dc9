"""The cma backend's own checks: who it reads from, what, and what it refuses.

Reads between two real processes, byte for byte, are in test_transfer_remote.py; here a
Prefill-role backend of this very process is the peer (the kernel lets a process read
itself), so each refusal can be set up exactly.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest

from rd2h_protocol.errors import TransferError
from rd2h_runtime.transfer import create_backend
from rd2h_runtime.transfer.cma_backend import CmaBackend

pytestmark = pytest.mark.timeout(60)


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
