"""Reuse the RD2H endpoints over another transport: asyncio queues and memmove.

The two sans-IO endpoints of :mod:`rd2h_protocol` know nothing about sockets, threads or
clocks. This example binds them to a transport of its own, with no ``rd2h_runtime``, and
uses only names exported from :mod:`rd2h_protocol` (the public API):

* control frames are bytes (``rd2h_protocol.encode`` / the endpoints decode them) carried
  by one asyncio queue per endpoint; the Prefill side names its Decode connection
  ``"decode:20000"``, the Decode side names its Prefill peer by the bytes ``b"prefill-0"``;
* KV memory is plain ``bytearray`` s whose real addresses go into the MF_META layout, and
  a read plan is executed with ``ctypes.memmove`` between those addresses, as a transfer
  engine would (off the event loop, in a worker thread);
* time is ``asyncio``'s loop clock, handed to every call as ``now``; each side sleeps until
  its endpoint's ``get_timer()`` or its next frame, whichever comes first.

One Prefill rank computes a request in two chunks over four layers that share two
storages (a reuse ring: layer ``L`` writes storage ``L % 2``), so the compute path must wait
for ``can_overwrite`` before each layer; one Decode rank pulls every layer into its own
destinations, in an order of blocks different from Prefill's. At the end every
destination byte is compared with what Prefill wrote.

Run it: ``python examples/custom_transport.py`` (prints ``verified``, exit status 0).
"""

from __future__ import annotations

import asyncio
import ctypes
import sys
from dataclasses import dataclass, field

from rd2h_protocol import (
    Chunk,
    ComponentDest,
    ConsumerConfig,
    ConsumerEndpoint,
    DecodeTarget,
    DestinationLayout,
    GateOpened,
    LayerLayout,
    ProducerConfig,
    ProducerEndpoint,
    ReadPlan,
    Releasable,
    Reply,
    RequestDone,
    RequestFailed,
    RequestFinished,
    Send,
    SendAbort,
    StartRead,
    TransferError,
    encode,
)

N_LAYERS = 4
N_STORAGES = 2  # a reuse ring: layer L lives in storage L % 2
BLOCKS = 16  # blocks per tensor, on both sides
BLOCK_BYTES = (256, 256, 64, 8)  # K, V, indexer, LIC8 scale
CHUNKS = ((0, 5), (5, 9))  # logical blocks [start, end) of each chunk of the request
PREFILL_IDS = [3, 4, 5, 6, 7, 8, 9, 10, 11]  # the request's Prefill blocks, logical order
DECODE_IDS = [14, 2, 9, 0, 11, 5, 7, 12, 1]  # where Decode wants them, logical order
REQUEST = "req-1"
PREFILL = "prefill-0"
# The Prefill endpoint names a Decode rank "host:port" (base port + rank); here it is only
# the key of the Decode side's queue.
DECODE_HOST, DECODE_PORT = "decode", 20000
DECODE = f"{DECODE_HOST}:{DECODE_PORT}"


class Memory:
    """Tensors as bytearrays with real addresses (what a transfer engine registers)."""

    def __init__(self) -> None:
        self._keep: list[bytearray] = []

    def tensor(self, size: int) -> tuple[bytearray, int]:
        buf = bytearray(size)
        self._keep.append(buf)
        return buf, ctypes.addressof((ctypes.c_char * size).from_buffer(buf))


def pattern(layer: int, component: int, logical: int, size: int) -> bytes:
    """What Prefill's compute writes for one block: unique per layer, tensor and block."""
    return bytes((layer * 31 + component * 7 + logical * 3 + i) % 251 for i in range(size))


@dataclass
class Prefill:
    """One Prefill rank: its endpoint, its KV storage and its inbox."""

    memory: Memory
    inbox: asyncio.Queue[tuple[str, bytes]] = field(default_factory=asyncio.Queue)
    storages: list[list[tuple[bytearray, int]]] = field(default_factory=list)
    gate_opened: asyncio.Event = field(default_factory=asyncio.Event)
    gate_waits: int = 0
    finished: asyncio.Future[RequestFinished] | None = None

    def __post_init__(self) -> None:
        self.storages = [
            [self.memory.tensor(BLOCKS * size) for size in BLOCK_BYTES] for _ in range(N_STORAGES)
        ]
        layers = []
        for layer in range(N_LAYERS):
            tensors = self.storages[layer % N_STORAGES]
            layers.append(
                (
                    f"model.layers.{layer}.self_attn",
                    LayerLayout(
                        base_addrs=[addr for _, addr in tensors],
                        block_len=list(BLOCK_BYTES),
                        tensor_group_idx=[0, 0, 1, 1],
                        num_blocks=BLOCKS,
                    ),
                )
            )
        self.endpoint = ProducerEndpoint(
            ProducerConfig(p_rank=0, p_tp=1, session=PREFILL, layers=layers, lease_ms=5000)
        )

    def compute(self, layer: int, start: int, end: int) -> None:
        """The model writes layer ``layer`` of the chunk's blocks into its storage."""
        for component, (buf, _) in enumerate(self.storages[layer % N_STORAGES]):
            size = BLOCK_BYTES[component]
            for logical in range(start, end):
                block = PREFILL_IDS[logical]
                buf[block * size : (block + 1) * size] = pattern(layer, component, logical, size)


def destination(parts: list[ComponentDest]) -> DestinationLayout:
    """K, V and indexer (BLOCK_BYTES's order) as one layer's destination."""
    k, v, indexer, *scale = parts
    return DestinationLayout((k, v), indexer, scale[0] if scale else None)


@dataclass
class Decode:
    """One Decode rank: its endpoint, its destinations and its inbox."""

    memory: Memory
    inbox: asyncio.Queue[tuple[bytes, bytes]] = field(default_factory=asyncio.Queue)
    dests: list[list[tuple[bytearray, int]]] = field(default_factory=list)
    done: asyncio.Future[str] | None = None
    reads: set[asyncio.Task[None]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.dests = [
            [self.memory.tensor(BLOCKS * size) for size in BLOCK_BYTES] for _ in range(N_LAYERS)
        ]
        layers = [
            (
                f"model.layers.{layer}.self_attn",
                destination(
                    [
                        ComponentDest(addr, size, BLOCKS)
                        for (_, addr), size in zip(tensors, BLOCK_BYTES, strict=True)
                    ]
                ),
            )
            for layer, tensors in enumerate(self.dests)
        ]
        self.endpoint = ConsumerEndpoint(ConsumerConfig(d_rank=0, d_tp=1, layers=layers))


def execute(plan: ReadPlan) -> None:
    """The transfer engine: one memmove per block of every component of every request."""
    for request in plan.requests:
        pairs = (
            (plan.main, request.main_src, request.main_dst),
            (plan.indexer, request.indexer_src, request.indexer_dst),
        )
        for components, src_ids, dst_ids in pairs:
            for comp in components:
                for src, dst in zip(src_ids, dst_ids, strict=True):
                    ctypes.memmove(
                        comp.dst_base + dst * comp.block_bytes,
                        comp.src_base + src * comp.block_bytes,
                        comp.block_bytes,
                    )


def wait_for_timer(timer: float | None, now: float) -> float:
    """How long a loop may wait for a frame: until the endpoint's next deadline, and at
    most a tenth of a second so that it notices when the example stops."""
    return 0.1 if timer is None else min(0.1, max(0.0, timer - now))


async def run_prefill(p: Prefill, d: Decode, stop: asyncio.Event) -> None:
    """Prefill's loop: frames from Decode, timers; outputs go on Decode's queue."""
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        timeout = wait_for_timer(p.endpoint.get_timer(), loop.time())
        try:
            conn, frame = await asyncio.wait_for(p.inbox.get(), timeout)
            outs = p.endpoint.receive(conn, frame, loop.time())
        except asyncio.TimeoutError:
            outs = p.endpoint.handle_timer(loop.time())
        handle_prefill_outputs(p, d, outs)


def handle_prefill_outputs(p: Prefill, d: Decode, outs: list[object]) -> None:
    for out in outs:
        if isinstance(out, Send):  # Connect needs nothing: the queue is always there
            d.inbox.put_nowait((PREFILL.encode(), encode(out.msg)))
        elif isinstance(out, GateOpened):
            p.gate_opened.set()
        elif isinstance(out, RequestFinished) and p.finished is not None:
            p.finished.set_result(out)


async def prefill_compute(p: Prefill, d: Decode) -> None:
    """The compute path: chunk by chunk, layer by layer, waiting for the storage gate."""
    loop = asyncio.get_running_loop()
    ep = p.endpoint
    ep.add_request(REQUEST, DecodeTarget(DECODE_HOST, DECODE_PORT, 1), loop.time())
    for k, (start, end) in enumerate(CHUNKS):
        final = k == len(CHUNKS) - 1
        ids = PREFILL_IDS[start:end]
        chunk = Chunk(
            ext_req_id=REQUEST,
            main_block_ids=ids,
            indexer_block_ids=ids,
            main_start=start,
            indexer_start=start,
            final=final,
        )
        ep.schedule_chunk(chunk, loop.time())
        for layer in range(N_LAYERS):
            while not ep.can_overwrite(layer):  # Decode may still read the previous owner
                p.gate_waits += 1
                p.gate_opened.clear()
                await p.gate_opened.wait()
            p.compute(layer, start, end)
            handle_prefill_outputs(p, d, list(ep.layer_written(layer, loop.time())))
        handle_prefill_outputs(p, d, list(ep.end_step(loop.time())))


async def run_decode(p: Prefill, d: Decode, stop: asyncio.Event) -> None:
    """Decode's loop: frames from Prefill, timers; reads run in a worker thread."""
    loop = asyncio.get_running_loop()
    ep = d.endpoint
    while not stop.is_set():
        timeout = wait_for_timer(ep.get_timer(), loop.time())
        try:
            peer, frame = await asyncio.wait_for(d.inbox.get(), timeout)
            outs = ep.receive(peer, frame, loop.time())
        except asyncio.TimeoutError:
            outs = ep.handle_timer(loop.time())
        await handle_decode_outputs(p, d, list(outs))


async def handle_decode_outputs(p: Prefill, d: Decode, outs: list[object]) -> None:
    for out in outs:
        if isinstance(out, Reply | SendAbort):
            p.inbox.put_nowait((DECODE, encode(out.msg)))
        elif isinstance(out, StartRead):
            # The read runs beside the loop, which keeps answering frames meanwhile.
            task = asyncio.create_task(read(p, d, out))
            d.reads.add(task)
            task.add_done_callback(d.reads.discard)
        elif isinstance(out, RequestDone) and d.done is not None:
            d.done.set_result(out.ext_req_id)
        elif isinstance(out, RequestFailed) and d.done is not None:
            d.done.set_exception(RuntimeError(f"{out.ext_req_id} failed: {out.message}"))
        elif isinstance(out, Releasable):
            print(f"decode: {out.ext_req_id} released, its blocks are free")


async def read(p: Prefill, d: Decode, start: StartRead) -> None:
    """Run one read plan in a worker thread and report its end to the endpoint."""
    loop = asyncio.get_running_loop()
    error: TransferError | None = None
    if not start.may_start(loop.time()):  # half its lease is gone: it must not start
        error = start.not_started(loop.time())
    else:
        await asyncio.to_thread(execute, start.plan)
    outs = d.endpoint.read_finished(start.plan.read_id, error, loop.time())
    await handle_decode_outputs(p, d, list(outs))


def verify(d: Decode) -> int:
    """Compare every destination block with what Prefill's compute wrote."""
    checked = 0
    for layer, tensors in enumerate(d.dests):
        for component, (buf, _) in enumerate(tensors):
            size = BLOCK_BYTES[component]
            for logical, block in enumerate(DECODE_IDS):
                got = bytes(buf[block * size : (block + 1) * size])
                if got != pattern(layer, component, logical, size):
                    raise SystemExit(f"layer {layer} tensor {component} block {logical}: wrong")
                checked += size
    return checked


async def main() -> int:
    loop = asyncio.get_running_loop()
    memory = Memory()
    p, d = Prefill(memory), Decode(memory)
    p.finished, d.done = loop.create_future(), loop.create_future()
    d.endpoint.add_request(REQUEST, DECODE_IDS, DECODE_IDS, loop.time())
    stop = asyncio.Event()
    loops = [
        asyncio.create_task(run_prefill(p, d, stop)),
        asyncio.create_task(run_decode(p, d, stop)),
    ]
    await asyncio.wait_for(prefill_compute(p, d), 10)
    print(f"decode: {await asyncio.wait_for(d.done, 10)} done on every layer")
    finished = await asyncio.wait_for(p.finished, 10)
    print(f"prefill: {finished.ext_req_id} finished, ok={finished.ok}")
    await handle_decode_outputs(p, d, list(d.endpoint.release(REQUEST, loop.time())))
    stop.set()
    await asyncio.gather(*loops)
    checked = verify(d)
    assert p.endpoint.is_idle() and d.endpoint.is_idle(), "per-request state left behind"
    assert "rd2h_runtime" not in sys.modules, "the example must not need rd2h_runtime"
    print(f"prefill: the compute path waited {p.gate_waits} times for a storage to be read")
    print(f"verified {checked} bytes in {N_LAYERS} layers, {len(DECODE_IDS)} blocks each")
    return 0 if finished.ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
