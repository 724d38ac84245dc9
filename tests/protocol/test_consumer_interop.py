"""ConsumerEndpoint against the real ProducerEndpoint, every frame through the codec.

A tiny in-memory network: ``p_tp`` Prefill ranks, ``d_tp`` Decode ranks. Prefill
``Send(conn)`` frames go to the Decode rank behind ``conn`` (peer identity = the Prefill
rank), Decode ``Reply``/``SendAbort`` frames go back on that rank's connection, and
``StartRead`` is executed at once by copying block ids into a model of the destination
memory, so the test can check that every destination block was written exactly once
with the right Prefill block.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import pytest

from rd2h_protocol.completion import CrossRankCompletion, RankReport
from rd2h_protocol.consumer import (
    ConsumerConfig,
    ConsumerEndpoint,
    Releasable,
    Reply,
    RequestDone,
    RequestFailed,
    SendAbort,
    StartRead,
)
from rd2h_protocol.errors import TransferError
from rd2h_protocol.events import Chunk
from rd2h_protocol.producer import (
    Connect,
    DecodeTarget,
    ProducerConfig,
    ProducerEndpoint,
    RequestFinished,
    Send,
)
from rd2h_protocol.wire.codec import encode
from rd2h_protocol.wire.layout import ComponentDest, DestinationLayout, LayerLayout

LAYERS = [f"model.layers.{i}.self_attn" for i in range(3)]
HOST, BASE_PORT = "10.0.0.2", 20050
BLOCKS = 128
K, V, IDX, SCALE = 512, 512, 64, 4


def _src(rank: int) -> LayerLayout:
    base = 0x1_0000_0000 * (rank + 1)
    return LayerLayout(
        base_addrs=[base, base + 0x1000_0000, base + 0x2000_0000, base + 0x3000_0000],
        block_len=[K, V, IDX, SCALE],
        tensor_group_idx=[0, 0, 1, 1],
        num_blocks=BLOCKS,
    )


def _dst() -> DestinationLayout:
    return DestinationLayout(
        (ComponentDest(0xA000_0000, K, BLOCKS), ComponentDest(0xB000_0000, V, BLOCKS)),
        ComponentDest(0xC000_0000, IDX, BLOCKS),
        ComponentDest(0xD000_0000, SCALE, BLOCKS),
    )


class Net:
    """Prefill and Decode endpoints wired together; time only moves when told."""

    def __init__(self, p_tp: int, d_tp: int, protocol: str = "v2", fail_reads: int = 0) -> None:
        self.now = 0.0
        self.d_tp = d_tp
        self.prefill = [
            ProducerEndpoint(
                ProducerConfig(
                    p_rank=r,
                    p_tp=p_tp,
                    session=f"prefill-{r}",
                    layers=[(name, _src(r)) for name in LAYERS],
                    protocol=protocol,  # type: ignore[arg-type]
                    lease_ms=60_000,
                )
            )
            for r in range(p_tp)
        ]
        self.decode = [
            ConsumerEndpoint(
                ConsumerConfig(d_rank=d, d_tp=d_tp, layers=[(name, _dst()) for name in LAYERS])
            )
            for d in range(d_tp)
        ]
        self.conns: dict[tuple[int, int], str] = {}  # (p_rank, d_rank) -> conn
        self.to_decode: deque[tuple[int, int, bytes]] = deque()
        self.to_prefill: deque[tuple[int, str, bytes]] = deque()
        self.reads: deque[tuple[int, StartRead]] = deque()
        self.fail_reads = fail_reads
        # Destination memory model: (d_rank, component, block) -> (p_rank, src block).
        self.main: dict[tuple[str, int], list[tuple[int, int]]] = {}
        self.indexer: dict[tuple[int, str, int], list[tuple[int, int]]] = {}
        self.terminal: list[dict[str, str]] = [{} for _ in range(d_tp)]
        self.releasable: list[set[str]] = [set() for _ in range(d_tp)]
        self.finished: dict[tuple[int, str], RequestFinished] = {}

    # -- plumbing ---------------------------------------------------------------------------

    def from_prefill(self, p_rank: int, outs: list[Any]) -> None:
        for o in outs:
            if isinstance(o, Connect):
                d_rank = o.port - BASE_PORT
                self.conns[(p_rank, d_rank)] = o.conn
            elif isinstance(o, Send):
                d_rank = int(o.conn.rsplit(":", 1)[1]) - BASE_PORT
                self.to_decode.append((p_rank, d_rank, encode(o.msg)))
            elif isinstance(o, RequestFinished):
                self.finished[(p_rank, o.ext_req_id)] = o

    def from_decode(self, d_rank: int, outs: list[Any]) -> None:
        for o in outs:
            if isinstance(o, Reply | SendAbort):
                p_rank = int(o.peer.decode())
                self.to_prefill.append((p_rank, self.conns[(p_rank, d_rank)], encode(o.msg)))
            elif isinstance(o, StartRead):
                self.reads.append((d_rank, o))
            elif isinstance(o, RequestDone):
                self.terminal[d_rank][o.ext_req_id] = "done"
            elif isinstance(o, RequestFailed):
                self.terminal[d_rank][o.ext_req_id] = "failed"
            elif isinstance(o, Releasable):
                self.releasable[d_rank].add(o.ext_req_id)

    def execute(self, d_rank: int, start: StartRead) -> None:
        plan = start.plan
        p_rank = int(plan.session.split("-")[1])
        if self.fail_reads:
            self.fail_reads -= 1
            err = TransferError("injected", -1)
            self.from_decode(d_rank, self.decode[d_rank].read_finished(plan.read_id, err, self.now))
            return
        for r in plan.requests:
            for s, d in zip(r.main_src, r.main_dst, strict=True):
                self.main.setdefault((plan.layer_name, d), []).append((p_rank, s))
            for s, d in zip(r.indexer_src, r.indexer_dst, strict=True):
                key = (d_rank, plan.layer_name, d)
                self.indexer.setdefault(key, []).append((p_rank, s))
        self.from_decode(d_rank, self.decode[d_rank].read_finished(plan.read_id, None, self.now))

    def pump(self) -> None:
        """Deliver everything in flight, in order, until the network is quiet."""
        while self.to_decode or self.to_prefill or self.reads:
            while self.to_decode:
                p_rank, d_rank, frame = self.to_decode.popleft()
                peer = str(p_rank).encode()
                self.from_decode(d_rank, self.decode[d_rank].receive(peer, frame, self.now))
            while self.to_prefill:
                p_rank, conn, frame = self.to_prefill.popleft()
                self.from_prefill(p_rank, self.prefill[p_rank].receive(conn, frame, self.now))
            while self.reads:
                self.execute(*self.reads.popleft())

    # -- driving -----------------------------------------------------------------------------

    def add(self, ext: str, main: list[int], idx: list[int]) -> None:
        for d, dec in enumerate(self.decode):
            self.from_decode(d, dec.add_request(ext, main, idx, self.now))
        target = DecodeTarget(HOST, BASE_PORT, self.d_tp)
        for p, pre in enumerate(self.prefill):
            self.from_prefill(p, pre.add_request(ext, target, self.now))

    def step(self, chunks: dict[str, tuple[list[int], int, bool]]) -> None:
        """One engine step on every Prefill rank: chunks, every layer, end."""
        for p, ep in enumerate(self.prefill):
            for ext, (ids, start, final) in chunks.items():
                self.from_prefill(
                    p,
                    ep.schedule_chunk(
                        Chunk(
                            ext_req_id=ext,
                            main_block_ids=ids,
                            indexer_block_ids=ids,
                            main_start=start,
                            indexer_start=start,
                            final=final,
                        ),
                        0.0,
                    ),
                )
            for layer in range(len(LAYERS)):
                self.pump()
                assert ep.can_overwrite(layer)
                self.from_prefill(p, ep.layer_written(layer, self.now))
            self.pump()
            self.from_prefill(p, ep.end_step(self.now))
        self.pump()
        self.now += 1.0


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 2), (4, 2), (4, 1)])
@pytest.mark.parametrize("protocol", ["v2", "v1"])
def test_chunked_requests_land_exactly_once(p_tp: int, d_tp: int, protocol: str) -> None:
    net = Net(p_tp, d_tp, protocol)
    d_main = {"a": [10, 11, 12, 13, 14, 15], "b": [40, 41, 42, 43, 44]}
    d_idx = {"a": [60, 61, 62, 63, 64, 65], "b": [80, 81, 82, 83, 84]}
    p_ids = {"a": [1, 2, 3, 4, 5, 6], "b": [20, 21, 22, 23, 24]}
    for ext in ("a", "b"):
        net.add(ext, d_main[ext], d_idx[ext])
    net.step({"a": (p_ids["a"][:4], 0, False), "b": (p_ids["b"][:2], 0, False)})
    net.step({"a": (p_ids["a"][4:], 4, True), "b": (p_ids["b"][2:], 2, True)})
    for d in range(d_tp):
        assert net.terminal[d] == {"a": "done", "b": "done"}
        assert net.decode[d].requests() == {"a": "done_on_rank", "b": "done_on_rank"}
        assert net.decode[d].stats.malformed_frames == 0
    assert all(f.ok for f in net.finished.values()) and len(net.finished) == 2 * p_tp
    ratio = p_tp // d_tp
    for layer in LAYERS:
        for ext in ("a", "b"):
            for i, d in enumerate(d_main[ext]):
                # Written once, by member 0 of some group, with the matching Prefill block.
                (writer,) = net.main[(layer, d)]
                assert writer[1] == p_ids[ext][i] and writer[0] % ratio == 0
            for d_rank in range(d_tp):
                for i, d in enumerate(d_idx[ext]):
                    (writer,) = net.indexer[(d_rank, layer, d)]
                    assert writer[1] == p_ids[ext][i] and writer[0] // ratio == d_rank
    # Cross-rank completion over the gathered terminal sets.
    xr = CrossRankCompletion(d_tp)
    reports = [RankReport(done=[e for e, s in t.items() if s == "done"]) for t in net.terminal]
    result = xr.update(reports, lambda e: f"{e}-internal", net.now)
    assert sorted(result.finished) == ["a-internal", "b-internal"] and not result.load_errors
    for d, ep in enumerate(net.decode):
        for ext in ("a", "b"):
            net.from_decode(d, ep.release(ext, net.now))
        assert net.releasable[d] == {"a", "b"} and ep.is_idle()
    assert all(pre.is_idle() for pre in net.prefill)


def test_failed_read_fails_both_sides_and_reports_load_errors() -> None:
    net = Net(2, 2, fail_reads=1)
    net.add("a", [1, 2], [3, 4])
    net.step({"a": ([7, 8], 0, True)})
    states = [t.get("a") for t in net.terminal]
    assert "failed" in states and all(s is not None for s in states)
    assert any(not f.ok for f in net.finished.values())
    xr = CrossRankCompletion(2)
    reports = [
        RankReport(
            done=[e for e, s in t.items() if s == "done"],
            failed=[e for e, s in t.items() if s == "failed"],
        )
        for t in net.terminal
    ]
    result = xr.update(reports, lambda e: e, net.now)
    assert result.finished == ("a",) and result.load_errors == {"a"}


def test_decode_abort_reaches_prefill_and_prefill_abort_reaches_decode() -> None:
    net = Net(1, 1)
    net.add("a", [1, 2], [3, 4])
    net.add("b", [5, 6], [7, 8])
    net.step({"a": ([7], 0, False), "b": ([9], 0, False)})
    net.from_decode(0, net.decode[0].abort(["a"], "client went away", net.now))
    net.pump()
    assert net.finished[(0, "a")].ok is False
    assert net.prefill[0].stats.aborts_received == 1
    net.from_prefill(0, net.prefill[0].abort(["b"], "aborted by Prefill", net.now))
    net.pump()
    assert net.terminal[0] == {"a": "failed", "b": "failed"}
    assert net.decode[0].stats.aborts_received == 1
    assert net.finished[(0, "b")].ok is False
