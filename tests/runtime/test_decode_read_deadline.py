"""DecodeWorker bounds a batched read's deadline by the readiness's lease (``finish_by``):
past receipt + lease Prefill may reuse the storage, so no read may run on after it."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

from rd2h_protocol.consumer import ConsumerConfig
from rd2h_protocol.layout import ComponentDest, DestinationLayout, LayerLayout
from rd2h_protocol.producer import DecodeTarget, ProducerConfig
from rd2h_runtime.decode import DecodeWorker
from rd2h_runtime.prefill import PrefillWorker
from rd2h_runtime.transfer import TransferBackend
from rd2h_runtime.transfer.base import U64Array

pytestmark = pytest.mark.timeout(60)

HOST = "127.0.0.1"
BLOCKS = 8
_sessions = itertools.count()


class RecordingBackend(TransferBackend):
    """Moves nothing; records when each read was called and the deadline it was given."""

    name: ClassVar[str] = "recording"

    def __init__(self, *, role: str, host: str = HOST, **options: Any) -> None:
        super().__init__(role=role, host=host)
        self._session = f"recording:{next(_sessions)}"
        self.reads: list[tuple[float, float]] = []  # (called at, deadline)

    @property
    def session_id(self) -> str:
        return self._session

    def _register(self, regions: list[tuple[int, int]]) -> None:
        return None

    def _read(
        self, session: str, remote: U64Array, local: U64Array, lengths: U64Array, deadline: float
    ) -> None:
        self.reads.append((time.monotonic(), deadline))

    def _close(self) -> None:
        return None


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[PrefillWorker, DecodeWorker]]:
    protocol, read_timeout_s = request.param
    name = "model.layers.0.self_attn"
    decode = DecodeWorker(
        ConsumerConfig(
            d_rank=0,
            d_tp=1,
            layers=[
                (
                    name,
                    DestinationLayout(
                        main=(
                            ComponentDest(0x5000_0000, 64, BLOCKS),
                            ComponentDest(0x6000_0000, 64, BLOCKS),
                        ),
                        indexer=None,
                        scale=None,
                    ),
                )
            ],
        ),
        RecordingBackend(role="decode"),
        host=HOST,
        read_timeout_s=read_timeout_s,
    )
    prefill = PrefillWorker(
        ProducerConfig(
            p_rank=0,
            p_tp=1,
            session="",
            layers=[
                (
                    name,
                    LayerLayout(
                        base_addrs=[0x1000_0000, 0x2000_0000],
                        block_len=[64, 64],
                        tensor_group_idx=[0, 0],
                        num_blocks=BLOCKS,
                    ),
                )
            ],
            lease_ms=2000,
            protocol=protocol,
        ),
        RecordingBackend(role="prefill"),
    )
    try:
        yield prefill, decode
    finally:
        prefill.close()
        decode.close()


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
