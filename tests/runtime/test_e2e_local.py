"""Both engines in this process on the loopback backend: deterministic checks of what the
byte patterns alone cannot show between processes -- the chunk boundaries of a chunked
prefill and the proof that a reuse-ring buffer is overwritten only after its gate opened."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from rd2h_runtime.testing.engines import (
    DecodeEngine,
    DecodeSpec,
    PrefillEngine,
    PrefillSpec,
)
from rd2h_runtime.testing.synthetic import (
    ChunkStep,
    RequestSpec,
    SyntheticModel,
    block_pattern,
    chunk_steps,
)
from tests.runtime.e2e_harness import (
    assert_clean,
    wait_until,
)

pytestmark = pytest.mark.timeout(60)

RING = SyntheticModel(num_layers=8, num_buffers=3)


class Pair:
    """A Prefill and a Decode engine in this process, closed at the end."""

    def __init__(self, prefill: PrefillSpec, decode: DecodeSpec) -> None:
        self.decode = DecodeEngine(decode)
        try:
            self.prefill = PrefillEngine(prefill)
        except BaseException:
            self.decode.close()
            raise

    def add(self, reqs: list[RequestSpec]) -> list[str]:
        self.decode.add(reqs)
        self.prefill.add(reqs, self.decode.target())
        return [r.ext_id for r in reqs]

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()


@pytest.fixture
def pairs() -> Iterator[list[Pair]]:
    made: list[Pair] = []
    yield made
    for p in made:
        p.close()


def test_chunked_prefill_moves_each_chunk_once_with_the_partial_block_last(
    pairs: list[Pair],
) -> None:
    model = SyntheticModel(num_layers=3)
    steps = chunk_steps(model, 150, 64)
    # 150 tokens in chunks of 64: main blocks of 16 tokens, indexer blocks of 64. Non-final
    # chunks send only full blocks; the final one the rest, partial blocks included.
    assert steps == [
        ChunkStep((0, 4), (0, 1), False),
        ChunkStep((4, 8), (1, 2), False),
        ChunkStep((8, 10), (2, 3), True),
    ]
    pair = Pair(PrefillSpec(model), DecodeSpec(model))
    pairs.append(pair)
    [ext] = pair.add([RequestSpec("chunky", 150, chunk_tokens=64)])
    rank = pair.prefill.ranks[0]
    main, idx = pair.decode.ids[ext]
    for n, step in enumerate(steps, start=1):
        rank.driver.run_step()
        assert wait_until(lambda: not rank.worker.publications(), 5.0)
        (_, main_end), (_, idx_end) = step.main, step.indexer
        # Everything sent so far is in place; nothing of a later chunk was written.
        assert pair.decode.dest.verify(ext, main[:main_end], idx[:idx_end]) == []
        assert pair.decode.dest.untouched(main[main_end:], idx[idx_end:])
        assert rank.driver.steps_run == n
    [res] = pair.decode.wait([ext], 5.0).values()
    assert res.ok and res.mismatches == ()
    [(finished, _)] = pair.prefill.wait([ext], 5.0)[ext]  # type: ignore[misc]
    assert finished.ok
    assert pair.decode.release([ext])
    assert_clean(pair.decode.state())
    assert_clean(pair.prefill.state())


def ring_requests() -> list[RequestSpec]:
    return [RequestSpec(f"ring-{i}", 100 + 50 * i) for i in range(3)]


def test_reuse_ring_buffer_is_overwritten_only_after_its_gate_opened(pairs: list[Pair]) -> None:
    # Decode reads slowly, so any overwrite that did not wait for the gate would land
    # before the read: the byte check would see the newer layer's data.
    pair = Pair(PrefillSpec(RING), DecodeSpec(RING, read_delay_s=0.03))
    pairs.append(pair)
    ids = pair.add(ring_requests())
    assert pair.prefill.run() == []
    results = pair.decode.wait(ids, 10.0)
    assert all(r.ok and r.mismatches == () for r in results.values()), results
    metrics = pair.prefill.state()["metrics"][0]
    # Layers 3..7 reuse a buffer whose previous layer was still being read: the compute
    # path really waited on those gates, and then wrote as soon as they opened. Decode
    # reads the layers queued behind a slow read in one batch, which opens their gates
    # together, so some of those layers find their buffer free (3 or 4 of 5 waited here).
    assert metrics["gate_waits"] >= 2, metrics
    assert all(f is not None and f[0].ok for fs in pair.prefill.wait(ids, 5.0).values() for f in fs)
    assert pair.decode.release(ids)
    assert_clean(pair.decode.state())
    assert_clean(pair.prefill.state())


def test_overwriting_before_the_gate_opens_is_caught_by_the_byte_check(pairs: list[Pair]) -> None:
    # The same run with a broken compute path that writes first and waits after: Decode
    # must read the NEWER layer's data from the shared buffer, which proves the check above
    # would see a premature overwrite.
    pair = Pair(PrefillSpec(RING, write_before_wait=True), DecodeSpec(RING, read_delay_s=0.03))
    pairs.append(pair)
    ids = pair.add(ring_requests())
    assert pair.prefill.run() == []
    results = pair.decode.wait(ids, 10.0)
    mismatches = [m for r in results.values() for m in r.mismatches]
    assert mismatches, "a buffer overwritten under a read went unnoticed"
    dest = pair.decode.dest
    for m in mismatches:
        # Only layers with a later occupant of their buffer can be overwritten...
        assert m.layer + 3 < RING.num_layers, m
        main, idx = pair.decode.ids[m.request]
        ids_of = main if m.component in ("k", "v") else idx
        arr = (
            dest.main[(m.layer, m.component)]
            if m.rank < 0
            else dest.local[(m.rank, m.layer, m.component)]
        )
        got = arr[ids_of[m.logical_block]]
        # ...and what Decode got is exactly a later layer of the same buffer.
        later = [
            layer
            for layer in range(m.layer + 3, RING.num_layers, 3)
            if np.array_equal(
                got,
                block_pattern(
                    m.request, layer, m.component, [m.logical_block], RING.block_bytes(m.component)
                )[0],
            )
        ]
        assert later, m
    assert pair.decode.release(ids)
