"""A Decode read that timed out while its engine call runs on (an engine that cannot cancel
one, as mooncake's) keeps its request's blocks held until that call ended: a late write
must never land in blocks vLLM got back (S3)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
from worker_pair import HOST, closing, decode_worker, prefill_worker

from rd2h_protocol.producer import DecodeTarget
from rd2h_runtime.decode import DecodeWorker
from rd2h_runtime.prefill import PrefillWorker
from rd2h_runtime.transfer import TransferBackend
from rd2h_runtime.transfer.base import BlockingCallRunner, U64Array

pytestmark = pytest.mark.timeout(60)

BLOCKS = 8


class StuckBackend(TransferBackend):
    """Each read's engine call blocks until ``unstick`` is set, past any deadline."""

    name: ClassVar[str] = "stuck"
    _count = 0

    def __init__(self, *, role: str, host: str = HOST, **options: Any) -> None:
        super().__init__(role=role, host=host)
        StuckBackend._count += 1
        self._session = f"stuck:{StuckBackend._count}"
        self.unstick = threading.Event()
        self.call_ended_at: float | None = None
        self._runner = BlockingCallRunner(self.name)

    @property
    def session_id(self) -> str:
        return self._session

    def _register(self, regions: list[tuple[int, int]]) -> None:
        return None

    def _read(
        self, session: str, remote: U64Array, local: U64Array, lengths: U64Array, deadline: float
    ) -> None:
        def call() -> None:
            self.unstick.wait(30.0)
            self.call_ended_at = time.monotonic()

        self._runner.run(call, deadline, "read")

    def quiesce(self, timeout_s: float) -> bool:
        return self._runner.wait_idle(timeout_s)

    def _close(self) -> None:
        self.unstick.set()


@pytest.fixture
def pair() -> Iterator[tuple[PrefillWorker, DecodeWorker]]:
    decode = decode_worker(
        StuckBackend(role="decode"),
        BLOCKS,
        consumer={"kv_load_timeout_s": 0.5},
        read_timeout_s=0.3,
    )
    prefill = prefill_worker(StuckBackend(role="prefill"), BLOCKS, lease_ms=20_000)
    with closing(prefill, decode):
        yield prefill, decode


def test_blocks_of_a_read_whose_engine_call_outlived_it_stay_held(
    pair: tuple[PrefillWorker, DecodeWorker],
) -> None:
    prefill, decode = pair
    backend = decode.backend
    assert isinstance(backend, StuckBackend)
    decode.add_request("r1", [3, 4], [])
    prefill.add_request("r1", DecodeTarget(HOST, decode.port, 1))
    prefill.schedule_chunk("r1", [1, 2], [], 0, 0, True)
    prefill.layer_written(0)
    prefill.end_step()
    # The read times out (0.3 s) and the load timeout (0.5 s) fails the request, but the
    # engine call still runs: vLLM may not have those blocks back.
    outcome = decode.wait_finished("r1", 10.0)
    assert outcome is not None and not outcome.ok
    assert not decode.release("r1")
    assert not decode.wait_releasable("r1", 1.5)
    assert backend.call_ended_at is None
    # The call ends: the read is reported and the blocks go back.
    backend.unstick.set()
    assert decode.wait_releasable("r1", 10.0)
    assert backend.call_ended_at is not None
    assert decode.metrics.reads_outlived == 1
