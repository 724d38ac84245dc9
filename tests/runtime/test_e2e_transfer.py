"""Real bytes between processes: nixl and mooncake, equal and unequal TP, chunked prefill,
a reuse ring, and one Prefill serving two Decode engines. Every destination byte is
checked against what Prefill wrote; every engine must end idle and healthy."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import pytest

from rd2h_runtime.testing.child_engines import EngineProcess, engine_process
from rd2h_runtime.testing.engines import DecodeSpec, PrefillSpec
from rd2h_runtime.testing.synthetic import RequestSpec, SyntheticModel
from tests.runtime.e2e_harness import (
    assert_clean,
)

pytestmark = pytest.mark.timeout(90)

# 8 layers over 3 physical Prefill buffers, K/V + indexer + LIC8 scale, main blocks of 16
# tokens and indexer blocks of 64.
RING = SyntheticModel(num_layers=8, num_buffers=3)
FLAT = SyntheticModel(num_layers=4)


def requests(prefix: str) -> list[RequestSpec]:
    return [
        RequestSpec(f"{prefix}-whole", 200),  # one chunk, partial last blocks
        RequestSpec(f"{prefix}-chunked", 150, chunk_tokens=64),  # 3 chunks, partial final
        RequestSpec(f"{prefix}-tiny", 5),  # less than one block of either group
        RequestSpec(f"{prefix}-aligned", 256),  # whole blocks only
    ]


def run_transfer(
    prefill: PrefillSpec, decodes: Sequence[DecodeSpec], timeout: float = 60.0
) -> None:
    """Run one Prefill engine against the Decode engines, each with its own requests."""
    with contextlib.ExitStack() as stack:
        dprocs: list[EngineProcess] = [
            stack.enter_context(engine_process("decode", spec)) for spec in decodes
        ]
        pproc = stack.enter_context(engine_process("prefill", prefill))
        batches = [requests(f"e{i}") for i in range(len(decodes))]
        for dproc, batch in zip(dprocs, batches, strict=True):
            dproc.call("add", batch)
            pproc.call("add", batch, dproc.target())
        assert pproc.call("run", timeout, timeout=timeout + 5) == []
        for dproc, batch in zip(dprocs, batches, strict=True):
            ids = [r.ext_id for r in batch]
            done = pproc.call("wait", ids, 10.0)
            for ext, per_rank in done.items():
                assert all(f is not None and f[0].ok for f in per_rank), (ext, per_rank)
            results = dproc.call("wait", ids, 10.0)
            for ext, res in results.items():
                assert res.ok, (ext, res)
                assert res.mismatches == (), res.mismatches
            assert dproc.call("release", ids)
            assert_clean(dproc.call("state"))
        assert_clean(pproc.call("state"))


@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_equal_tp_with_reuse_ring_and_chunks(backend: str) -> None:
    run_transfer(PrefillSpec(RING, backend=backend), [DecodeSpec(RING, backend=backend)])


@pytest.mark.parametrize(("backend", "p_tp", "d_tp"), [("nixl", 4, 2), ("mooncake", 4, 1)])
def test_unequal_tp(backend: str, p_tp: int, d_tp: int) -> None:
    run_transfer(
        PrefillSpec(FLAT, p_tp=p_tp, backend=backend),
        [DecodeSpec(FLAT, d_tp=d_tp, backend=backend)],
    )


def test_one_prefill_serves_two_decode_engines() -> None:
    # Prefill TP 2 toward one engine of TP 2 (ratio 1) and one of TP 1 (ratio 2): each
    # endpoint gets the contributor identity of its own TP size.
    run_transfer(
        PrefillSpec(FLAT, p_tp=2, backend="nixl"),
        [DecodeSpec(FLAT, d_tp=2, backend="nixl"), DecodeSpec(FLAT, d_tp=1, backend="nixl")],
    )
