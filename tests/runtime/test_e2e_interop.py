"""v1 interop on real sockets: our Prefill in v1 mode against our Decode, a v1-shaped
Prefill (raw DEALERs sending msgpack tuples like tests/protocol/fixtures) against our
Decode, and our Prefill against a minimal v1-shaped Decode (raw ROUTER + msgpack).
Bytes move through the loopback backend and are checked one by one."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq

from rd2h_protocol.producer import DecodeTarget
from rd2h_protocol.topology import indexer_share
from rd2h_runtime.testing.engines import (
    HOST,
    DecodeEngine,
    DecodeSpec,
    PrefillEngine,
    PrefillSpec,
)
from rd2h_runtime.testing.synthetic import (
    BlockAllocator,
    DecodeDestinations,
    PrefillCache,
    RequestSpec,
    SyntheticModel,
)
from rd2h_runtime.transfer import create_backend
from tests.runtime.e2e_harness import (
    Relay,
    assert_clean,
    wait_until,
)

pytestmark = pytest.mark.timeout(60)

MODEL = SyntheticModel(num_layers=4)
WAIT_S = 10.0


def packb(obj: object) -> bytes:
    data: bytes = msgpack.packb(obj, use_bin_type=True)
    return data


def unpackb(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False)


def v1_inner(cache: PrefillCache) -> bytes:
    """The MF_META inner blob exactly as v1 builds it: six keys per layer, plain msgpack."""
    return packb(
        {
            name: {
                "base_addrs": list(layout.base_addrs),
                "block_len": list(layout.block_len),
                "block_size_scale": list(layout.scales),
                "tensor_group_idx": list(layout.tensor_group_idx),
                "main_tensor_count": 2,
                "has_indexer": True,
            }
            for name, layout in cache.layers()
        }
    )


REQS = [RequestSpec("v1-a", 120), RequestSpec("v1-b", 300), RequestSpec("v1-c", 7)]


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def test_our_prefill_in_v1_mode_against_our_decode() -> None:
    decode = DecodeEngine(DecodeSpec(MODEL))
    relay = Relay(decode.base_port, lambda direction, payload: [0.0])
    prefill = PrefillEngine(PrefillSpec(MODEL, protocol="v1"))
    try:
        decode.add(REQS)
        prefill.add(REQS, DecodeTarget(HOST, relay.port, 1))
        assert prefill.run() == []
        ids = [r.ext_id for r in REQS]
        results = decode.wait(ids, WAIT_S)
        assert all(r.ok and r.mismatches == () for r in results.values()), results
        assert all(
            f is not None and f[0].ok for fs in prefill.wait(ids, WAIT_S).values() for f in fs
        )
        up, down = relay.frames("up"), relay.frames("down")
        # The v1 wire: a 3-field MF_META answered by the raw ACK frame, 7-field readiness,
        # 2-field read_done; nothing of v2 either way.
        assert up[0][0] == b"mf_meta" and len(up[0]) == 3
        assert down[0] == ("raw", b"ACK")
        readiness = [f for f in up if f[0] == b"read_ready_batch"]
        assert len(readiness) == MODEL.num_layers and all(len(f) == 7 for f in readiness)
        replies = down[1:]
        assert sorted(replies) == [(b"read_done", i) for i in range(MODEL.num_layers)]
        assert decode.release(ids)
        assert_clean(decode.state())
        assert_clean(prefill.state())
    finally:
        prefill.close()
        relay.close()
        decode.close()


def test_v1_prefill_ranks_against_our_decode(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    # Two v1 Prefill ranks feed one Decode rank (tp_ratio 2): member 0 sends the main KV
    # and half of the indexer, member 1 the other half. Raw msgpack frames, v1 shapes only.
    ratio = 2
    decode = DecodeEngine(DecodeSpec(MODEL))
    caches = [PrefillCache(MODEL) for _ in range(ratio)]
    backends = [create_backend("loopback", role="prefill") for _ in range(ratio)]
    dealers: list[zmq.Socket[bytes]] = []
    try:
        decode.add(REQS)
        alloc = BlockAllocator(MODEL.num_blocks, 11)
        phys = {r.ext_id: [alloc.allocate(n) for n in MODEL.blocks_for(r.tokens)] for r in REQS}
        for cache, backend in zip(caches, backends, strict=True):
            backend.register(cache.regions())
            for layer in range(MODEL.num_layers):
                for ext, (main, idx) in phys.items():
                    cache.write(layer, ext, main, 0, idx, 0)
        for member in range(ratio):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, int(WAIT_S * 1000))
            sock.connect(f"tcp://{HOST}:{decode.base_port}")
            dealers.append(sock)
            sock.send(packb((b"mf_meta", backends[member].session_id, v1_inner(caches[member]))))
            assert sock.recv_multipart() == [b"", b"ACK"]
        last = MODEL.num_layers - 1
        for layer in range(MODEL.num_layers):
            for member, sock in enumerate(dealers):
                entries = [(ext, main, idx, 0, 0) for ext, (main, idx) in phys.items()]
                done = list(phys) if layer == last else []
                name = MODEL.layer_name(layer)
                sock.send(packb((b"read_ready_batch", layer, name, entries, done, member, ratio)))
        for sock in dealers:
            replies = [unpackb(sock.recv_multipart()[-1]) for _ in range(MODEL.num_layers)]
            assert sorted(map(tuple, replies)) == [
                (b"read_done", i) for i in range(MODEL.num_layers)
            ]
        ids = list(phys)
        results = decode.wait(ids, WAIT_S)
        assert all(r.ok and r.mismatches == () for r in results.values()), results
        assert decode.release(ids)
        assert_clean(decode.state())
    finally:
        for sock in dealers:
            sock.close(0)
        for backend in backends:
            backend.close()
        decode.close()


class V1Decode:
    """A minimal v1-shaped Decode: a raw ROUTER that speaks msgpack tuples, reads with the
    reference rule (one descriptor per block, member 0 main, indexer split by member) and
    answers raw b"ACK" and 2-field read_done, as the existing implementation does."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], model: SyntheticModel) -> None:
        self.model = model
        self.dest = DecodeDestinations(model, 1)
        self.backend = create_backend("loopback", role="decode")
        self.backend.register(self.dest.regions(0))
        self.alloc = BlockAllocator(256, 5)
        self.ids: dict[str, tuple[list[int], list[int]]] = {}
        self.frames: list[tuple[Any, ...]] = []
        self.done: dict[str, set[int]] = {}
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.port = self.router.bind_to_random_port(f"tcp://{HOST}")
        self._sessions: dict[bytes, tuple[str, dict[str, Any]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def add(self, reqs: list[RequestSpec]) -> None:
        for r in reqs:
            self.ids[r.ext_id] = tuple(  # type: ignore[assignment]
                self.alloc.allocate(n) for n in self.model.blocks_for(r.tokens)
            )
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            ident, payload = self.router.recv_multipart()
            msg = tuple(unpackb(payload))
            self.frames.append(msg)
            if msg[0] == b"mf_meta":
                self._sessions[ident] = (msg[1], unpackb(msg[2]))
                self.router.send_multipart([ident, b"", b"ACK"])
            elif msg[0] == b"read_ready_batch":
                self._read(ident, msg)
                self.router.send_multipart([ident, b"", packb((b"read_done", msg[1]))])

    def _read(self, ident: bytes, msg: tuple[Any, ...]) -> None:
        session, layers = self._sessions[ident]
        layer_idx, name, entries, done, member, ratio = msg[1:7]
        src = layers[name]
        remote: list[int] = []
        local: list[int] = []
        lengths: list[int] = []
        for ext, main_ids, idx_ids, main_start, idx_start in entries:
            d_main, d_idx = self.ids[ext]
            groups = [(0, main_ids, d_main[main_start:]), (1, main_ids, d_main[main_start:])]
            s, e = indexer_share(len(idx_ids), member, ratio, idx_start)
            for t in (2, 3):
                groups.append((t, idx_ids[s:e], d_idx[idx_start + s :]))
            for tensor, pids, dids in groups:
                if tensor < 2 and member:
                    continue
                comp = ("k", "v", "indexer", "scale")[tensor]
                size = src["block_len"][tensor] * src["block_size_scale"][tensor]
                dst = self.dest.component(0, layer_idx, comp)
                for pid, did in zip(pids, dids, strict=False):
                    remote.append(src["base_addrs"][tensor] + pid * size)
                    local.append(dst.base + did * size)
                    lengths.append(size)
        self.backend.read(session, remote, local, lengths, timeout_s=5.0)
        for ext in done:
            self.done.setdefault(ext, set()).add(member)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        self.router.close(0)
        self.backend.close()


def test_our_prefill_against_a_v1_decode(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    v1 = V1Decode(ctx, MODEL)
    prefill = PrefillEngine(PrefillSpec(MODEL))  # v2 by default: must fall back to v1
    try:
        v1.add(REQS)
        prefill.add(REQS, DecodeTarget(HOST, v1.port, 1))
        assert prefill.run() == []
        ids = [r.ext_id for r in REQS]
        finished = prefill.wait(ids, WAIT_S)
        assert all(f is not None and f[0].ok for fs in finished.values() for f in fs), finished
        # v2 MF_META (a v1 Decode reads fields 1 and 2 only), then v1 readiness: no seq/lease.
        meta = v1.frames[0]
        assert meta[0] == b"mf_meta" and meta[3] == 2
        readiness = [f for f in v1.frames if f[0] == b"read_ready_batch"]
        assert len(readiness) == MODEL.num_layers and all(len(f) == 7 for f in readiness)
        assert v1.done == {ext: {0} for ext in ids}
        for ext in ids:
            assert v1.dest.verify(ext, *v1.ids[ext]) == []
        assert wait_until(lambda: all(prefill.state()["idle"]), WAIT_S)
        assert_clean(prefill.state())
    finally:
        prefill.close()
        v1.close()
