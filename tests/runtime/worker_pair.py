"""A Prefill and a Decode worker over real ZMQ sockets on 127.0.0.1, sharing one
cache-bearing layer of two 64-byte components (K and V): the smallest real pair, for tests
of the workers' behaviour around the endpoints (the backends are the caller's)."""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator
from typing import Any, ClassVar

from rd2h_protocol.consumer import ConsumerConfig
from rd2h_protocol.producer import ProducerConfig
from rd2h_protocol.wire.layout import ComponentDest, DestinationLayout, LayerLayout
from rd2h_runtime.control import ControlOptions
from rd2h_runtime.decode import DecodeWorker
from rd2h_runtime.prefill import PrefillWorker
from rd2h_runtime.transfer import TransferBackend
from rd2h_runtime.transfer.base import U64Array

HOST = "127.0.0.1"
LAYER = "model.layers.0.self_attn"
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


def decode_worker(
    backend: TransferBackend, blocks: int, *, consumer: dict[str, Any] | None = None, **kw: Any
) -> DecodeWorker:
    """A Decode worker for :data:`LAYER` (``consumer``: ConsumerConfig fields; ``kw``:
    DecodeWorker arguments)."""
    dest = DestinationLayout(
        main=(ComponentDest(0x5000_0000, 64, blocks), ComponentDest(0x6000_0000, 64, blocks)),
        indexer=None,
        scale=None,
    )
    config = ConsumerConfig(d_rank=0, d_tp=1, layers=[(LAYER, dest)], **(consumer or {}))
    return DecodeWorker(config, backend, host=HOST, **kw)


def prefill_worker(
    backend: TransferBackend,
    blocks: int,
    control_options: ControlOptions | None = None,
    **producer: Any,
) -> PrefillWorker:
    """A Prefill worker for :data:`LAYER` (``producer``: ProducerConfig fields)."""
    source = LayerLayout(
        base_addrs=[0x1000_0000, 0x2000_0000],
        block_len=[64, 64],
        tensor_group_idx=[0, 0],
        num_blocks=blocks,
    )
    config = ProducerConfig(p_rank=0, p_tp=1, session="", layers=[(LAYER, source)], **producer)
    return PrefillWorker(config, backend, control_options=control_options)


@contextlib.contextmanager
def closing(*workers: PrefillWorker | DecodeWorker) -> Iterator[None]:
    """Close ``workers`` (in order) when the block ends."""
    try:
        yield
    finally:
        for w in workers:
            w.close()
