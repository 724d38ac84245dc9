"""The in-process loopback backend: copies, checks on both sides, lifecycle."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rd2h_protocol.errors import TransferError
from rd2h_runtime.transfer import TransferBackend, create_backend

SIZE = 1 << 16
rng = np.random.default_rng(7)
SOURCE = rng.integers(0, 256, SIZE, dtype=np.uint8)


@pytest.fixture
def pair() -> Iterator[tuple[TransferBackend, TransferBackend, np.ndarray]]:
    dest = np.zeros(SIZE, dtype=np.uint8)
    with (
        create_backend("loopback", role="prefill") as prefill,
        create_backend("loopback", role="decode") as decode,
    ):
        prefill.register([(SOURCE.ctypes.data, SOURCE.nbytes)])
        decode.register([(dest.ctypes.data, dest.nbytes)])
        yield prefill, decode, dest


@given(
    st.lists(
        st.tuples(st.integers(0, SIZE - 1), st.integers(0, SIZE - 1), st.integers(0, 512)),
        max_size=20,
    )
)
def test_reads_land_where_asked(descs: list[tuple[int, int, int]]) -> None:
    dest = np.zeros(SIZE, dtype=np.uint8)
    with (
        create_backend("loopback", role="prefill") as prefill,
        create_backend("loopback", role="decode") as decode,
    ):
        prefill.register([(SOURCE.ctypes.data, SOURCE.nbytes)])
        decode.register([(dest.ctypes.data, dest.nbytes)])
        # clip so every range fits; zero-length ones are allowed and skipped
        items = [(s, d, min(n, SIZE - s, SIZE - d)) for s, d, n in descs]
        expected = np.zeros(SIZE, dtype=np.uint8)
        for s, d, n in items:
            expected[d : d + n] = SOURCE[s : s + n]
        decode.read(
            prefill.session_id,
            np.array([SOURCE.ctypes.data + s for s, _, _ in items], dtype=np.uint64),
            [dest.ctypes.data + d for _, d, _ in items],  # lists are accepted too
            [n for _, _, n in items],
            timeout_s=5,
        )
    assert np.array_equal(dest, expected)


def test_empty_batch_is_a_no_op(pair: tuple[TransferBackend, TransferBackend, np.ndarray]) -> None:
    prefill, decode, dest = pair
    decode.read(prefill.session_id, [], [], [], timeout_s=1)
    assert not dest.any()


def test_remote_range_outside_the_peer_registration_fails(
    pair: tuple[TransferBackend, TransferBackend, np.ndarray],
) -> None:
    prefill, decode, dest = pair
    with pytest.raises(TransferError, match="outside the regions registered by loopback"):
        decode.read(
            prefill.session_id, [SOURCE.ctypes.data + SIZE - 1], [dest.ctypes.data], [2],
            timeout_s=1,
        )  # fmt: skip
    assert not dest.any()  # nothing moved, not even the valid descriptors


def test_local_range_outside_our_registration_fails(
    pair: tuple[TransferBackend, TransferBackend, np.ndarray],
) -> None:
    prefill, decode, dest = pair
    with pytest.raises(TransferError, match=r"local range .* outside the registered regions"):
        decode.read(
            prefill.session_id,
            [SOURCE.ctypes.data, SOURCE.ctypes.data],
            [dest.ctypes.data, dest.ctypes.data + SIZE],
            [8, 8],
            timeout_s=1,
        )
    assert not dest.any()


def test_unknown_and_closed_sessions_fail(
    pair: tuple[TransferBackend, TransferBackend, np.ndarray],
) -> None:
    prefill, decode, dest = pair
    args = ([SOURCE.ctypes.data], [dest.ctypes.data], [8])
    with pytest.raises(TransferError, match="not a live backend"):
        decode.read("loopback:1:999999", *args, timeout_s=1)
    session = prefill.session_id
    prefill.close()
    with pytest.raises(TransferError, match="not a live backend"):
        decode.read(session, *args, timeout_s=1)


def test_mismatched_lengths_and_bad_session_type_fail(
    pair: tuple[TransferBackend, TransferBackend, np.ndarray],
) -> None:
    prefill, decode, dest = pair
    with pytest.raises(TransferError, match="equal length"):
        decode.read(prefill.session_id, [SOURCE.ctypes.data], [dest.ctypes.data], [], timeout_s=1)
    with pytest.raises(TransferError, match="non-empty str"):
        decode.read("", [SOURCE.ctypes.data], [dest.ctypes.data], [8], timeout_s=1)


def test_expired_deadline_reads_nothing(
    pair: tuple[TransferBackend, TransferBackend, np.ndarray],
) -> None:
    prefill, decode, dest = pair
    with pytest.raises(TransferError, match="already elapsed") as info:
        decode.read(prefill.session_id, [SOURCE.ctypes.data], [dest.ctypes.data], [8], timeout_s=0)
    assert info.value.transient and not dest.any()


def test_deadline_is_checked_between_descriptors(
    pair: tuple[TransferBackend, TransferBackend, np.ndarray],
) -> None:
    prefill, decode, dest = pair
    count = 200_000  # 13 GB of copies: far more than fits in 0.1 s
    remote = np.full(count, SOURCE.ctypes.data, dtype=np.uint64)
    local = np.full(count, dest.ctypes.data, dtype=np.uint64)
    with pytest.raises(TransferError, match="timed out after"):
        decode.read(
            prefill.session_id, remote, local, np.full(count, SIZE, np.uint64), timeout_s=0.1
        )


def test_close_is_idempotent_and_reads_after_close_fail() -> None:
    backend = create_backend("loopback", role="decode")
    assert "open" in repr(backend)
    backend.close()
    backend.close()
    assert backend.closed and "closed" in repr(backend)
    with pytest.raises(TransferError, match="closed"):
        backend.read("loopback:0:0", [1], [1], [1], timeout_s=1)
    with pytest.raises(TransferError, match="closed"):
        backend.register([(1, 1)])


def test_register_reports_merged_regions() -> None:
    a = np.zeros(100, dtype=np.uint8)
    with create_backend("loopback", role="prefill") as backend:
        backend.register([(a.ctypes.data, 50), (a.ctypes.data + 50, 50)])
        assert backend.registered == [(a.ctypes.data, 100)]
        assert backend.quiesce(0)  # synchronous copies: always quiescent
