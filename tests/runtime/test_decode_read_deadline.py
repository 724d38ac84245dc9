"""DecodeWorker bounds a batched read's deadline by the readiness's lease (``finish_by``):
past receipt + lease Prefill may reuse the storage, so no read may run on after it."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from worker_pair import HOST, RecordingBackend, closing, decode_worker, prefill_worker

from rd2h_protocol.producer import DecodeTarget
from rd2h_runtime.decode import DecodeWorker
from rd2h_runtime.prefill import PrefillWorker

pytestmark = pytest.mark.timeout(60)

BLOCKS = 8


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[PrefillWorker, DecodeWorker]]:
    protocol, read_timeout_s = request.param
    decode = decode_worker(RecordingBackend(role="decode"), BLOCKS, read_timeout_s=read_timeout_s)
    prefill = prefill_worker(
        RecordingBackend(role="prefill"), BLOCKS, lease_ms=2000, protocol=protocol
    )
    with closing(prefill, decode):
        yield prefill, decode


def one_read(prefill: PrefillWorker, decode: DecodeWorker) -> tuple[float, float, float, float]:
    """Publish one layer of one request; (before, after, read called at, read deadline)."""
    decode.add_request("r1", [3, 4], [])
    prefill.add_request("r1", DecodeTarget(HOST, decode.port, 1))
    prefill.schedule_chunk("r1", [1, 2], [], 0, 0, True)
    before = time.monotonic()
    prefill.layer_written(0)
    assert prefill.wait_writable(0, 10.0)
    after = time.monotonic()
    prefill.end_step()
    backend = decode.backend
    assert isinstance(backend, RecordingBackend)
    [(called, deadline)] = backend.reads
    return before, after, called, deadline


@pytest.mark.parametrize("pair", [("v2", 60.0)], indirect=True)
def test_read_deadline_is_capped_by_receipt_plus_lease(
    pair: tuple[PrefillWorker, DecodeWorker],
) -> None:
    before, after, _, deadline = one_read(*pair)
    # finish_by = receipt + lease_ms, receipt within [before, after]; read_timeout_s is
    # 60 s. Prefill sends what is left of its 2 s lease (its clock started a little before
    # layer_written), so lease_ms is at most 2000.
    assert before + 1.5 <= deadline <= after + 2.0


@pytest.mark.parametrize("pair", [("v2", 0.5)], indirect=True)
def test_a_shorter_read_timeout_still_wins(pair: tuple[PrefillWorker, DecodeWorker]) -> None:
    _, _, called, deadline = one_read(*pair)
    assert called <= deadline <= called + 0.5


@pytest.mark.parametrize("pair", [("v1", 60.0)], indirect=True)
def test_a_v1_peer_without_lease_gets_the_read_timeout(
    pair: tuple[PrefillWorker, DecodeWorker],
) -> None:
    _, after, called, deadline = one_read(*pair)
    assert called + 59.0 <= deadline <= after + 60.0
