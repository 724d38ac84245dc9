"""Benchmark: layer throughput through the runtime vs the backend's raw batched read vs memcpy.

Run from the repository root::

    python -m benchmarks.bench_runtime_datapath                    # nixl, 20 and 256 MiB
    python -m benchmarks.bench_runtime_datapath --backend mooncake --layer-mib 20
    python -m benchmarks.bench_runtime_datapath --netns               # across a veth link (root)

One KV layer shaped like a sparse-attention model (K 73728 B, V 8192 B, indexer 16384 B,
LIC8 scale 512 B per block: 98816 B a block) of about ``--layer-mib`` MiB, spread over
``--requests`` requests with shuffled block ids on both sides (as a paged allocator leaves
them), is moved from a Prefill rank in THIS process to a Decode rank in a CHILD process
(``loopback`` cannot cross processes: its Decode runs on a thread here). Three candidates,
each the median of ``--repeats`` samples after one warm-up:

* ``runtime``: the whole layer round trip on real sockets, timed on Prefill:
  ``layer_written`` -> readiness -> Decode endpoint -> planning -> ONE batched read ->
  reply -> the gate reopens (``wait_writable`` returns);
* ``raw``: the same backend's batched read of exactly the descriptors the runtime built
  for that message, called directly in the Decode process;
* ``memcpy``: ``numpy.copyto`` of the layer's bytes within one process.

Where a runtime layer's time goes: ``read`` (inside ``backend.read``, from Decode's
metrics), ``plan`` (plan -> descriptors) and ``rest`` (the control plane: messages both
ways, endpoints, the gate), each the median over the samples.

GB/s = 1e9 bytes/s over the layer's bytes; ``runtime/raw`` is the median of each runtime
sample's speed against the raw sample taken next to it (a loaded machine swings both).
Every byte of the destination is checked against the pattern Prefill wrote. Goal: runtime
>= 70 % of raw on one host.

``--netns`` runs the same across hosts: Prefill in one network namespace (198.18.0.1) and
Decode in another (198.18.0.2), joined by a veth pair (:mod:`rd2h_runtime.testing.netns`,
removed when the run ends, also on an error, Ctrl-C or SIGTERM), each engine kept on that
link (UCX over TCP on the veth: its shared-memory transports would bypass the link). Both
``raw`` and ``runtime`` then cross the link; goal: runtime >= 90 % of raw.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import multiprocessing.connection
import os
import random
import signal
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from rd2h_protocol.consumer import ConsumerConfig
from rd2h_protocol.plan import ReadPlan
from rd2h_protocol.producer import DecodeTarget, ProducerConfig
from rd2h_runtime.decode import DecodeWorker
from rd2h_runtime.planning import Descriptors, build_descriptors
from rd2h_runtime.prefill import PrefillWorker
from rd2h_runtime.testing import netns
from rd2h_runtime.testing.synthetic import DecodeDestinations, PrefillCache, SyntheticModel
from rd2h_runtime.transfer import create_backend

HOST = "127.0.0.1"
MIB = 1 << 20
TIMEOUT_S = 60.0


def layer_model(layer_bytes: int) -> SyntheticModel:
    """A one-layer model whose blocks add up to at least ``layer_bytes``."""
    probe = SyntheticModel(
        num_layers=1,
        main_block_tokens=128,
        indexer_block_tokens=128,
        k_block_len=73728,
        k_scale=1,
        v_block_len=8192,
        v_scale=1,
        indexer_block_len=16384,
        indexer_scale=1,
        scale_block_len=512,
        num_blocks=1,
    )
    per_block = sum(probe.block_bytes(c) for c in probe.components)
    blocks = -(-layer_bytes // per_block)
    return dataclasses.replace(probe, num_blocks=blocks)


def split_ids(ids: list[int], parts: int) -> list[list[int]]:
    size = -(-len(ids) // parts)
    return [ids[i : i + size] for i in range(0, len(ids), size)]


# -- the Decode side (child process, or a thread for loopback) ---------------------------------


def decode_side(
    conn: multiprocessing.connection.Connection,
    backend: str,
    model: SyntheticModel,
    host: str,
    namespace: str | None,
) -> None:
    """Serve one Decode rank: add requests, time raw reads, verify bytes, close."""
    os.environ.setdefault("UCX_MODULES", "^ib")
    if namespace is not None:  # first: before any socket or engine exists
        netns.enter_host(namespace, host)
    dest = DecodeDestinations(model, 1, model.num_blocks)
    plans: list[ReadPlan] = []

    def planner(plan: ReadPlan) -> Descriptors:
        plans.append(plan)
        return build_descriptors(plan)

    worker = DecodeWorker(
        ConsumerConfig(d_rank=0, d_tp=1, layers=dest.layers(0)),
        create_backend(backend, role="decode", host=host),
        host=host,
        regions=dest.regions(0),
        read_timeout_s=TIMEOUT_S,
        planner=planner,
    )
    ids: dict[str, tuple[list[int], list[int]]] = {}
    conn.send(worker.port)
    try:
        while True:
            cmd, arg = conn.recv()
            if cmd == "add":
                for ext, main, idx in arg:
                    ids[ext] = (main, idx)
                    worker.add_request(ext, main, idx)
                conn.send(None)
            elif cmd == "raw":
                # The same backend's batched read of the descriptors of the last message.
                desc = build_descriptors(plans[-1])
                t0 = time.perf_counter()
                worker.backend.read(
                    plans[-1].session,
                    desc.remote_addrs,
                    desc.local_addrs,
                    desc.lengths,
                    timeout_s=TIMEOUT_S,
                )
                conn.send((time.perf_counter() - t0, len(desc), desc.total_bytes))
            elif cmd == "in_read":
                # Seconds the runtime has spent inside backend.read (and planning) so far.
                conn.send((worker.metrics.read_s, worker.metrics.plan_s))
            elif cmd == "verify":
                bad = sum(len(dest.verify(ext, main, idx)) for ext, (main, idx) in ids.items())
                conn.send(bad)
            elif cmd == "close":
                break
    finally:
        worker.close()
    conn.send(None)


class DecodeSide:
    """The Decode rank in a child process (or on a thread for ``loopback``)."""

    def __init__(
        self, backend: str, model: SyntheticModel, host: str, namespace: str | None
    ) -> None:
        self.proc: Any = None
        args = (backend, model, host, namespace)
        if backend == "loopback":
            self.conn, theirs = multiprocessing.Pipe()
            self.proc = threading.Thread(target=decode_side, args=(theirs, *args), daemon=True)
        else:
            ctx = multiprocessing.get_context("spawn")
            self.conn, theirs = ctx.Pipe()
            self.proc = ctx.Process(target=decode_side, args=(theirs, *args))
        self.proc.start()
        self.port: int = self.call_reply()

    def call_reply(self) -> Any:
        if not self.conn.poll(TIMEOUT_S):
            raise TimeoutError("the Decode side did not answer")
        return self.conn.recv()

    def call(self, cmd: str, arg: Any = None) -> Any:
        self.conn.send((cmd, arg))
        return self.call_reply()

    def close(self) -> None:
        try:
            self.call("close")
        finally:
            self.proc.join(TIMEOUT_S)


# -- one layer size ----------------------------------------------------------------------------


def measure_memcpy(nbytes: int, repeats: int) -> list[float]:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    np.copyto(dst, src)  # warm-up: page faults
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        samples.append(time.perf_counter() - t0)
    return samples


def run_size(
    backend: str,
    layer_bytes: int,
    requests: int,
    repeats: int,
    seed: int,
    *,
    hosts: netns.TwoHosts | None = None,
) -> dict[str, Any]:
    """Measure one layer size; with ``hosts``, call it in Prefill's namespace (Decode's
    child enters its own)."""
    prefill_host, decode_host = (hosts.prefill_ip, hosts.decode_ip) if hosts else (HOST, HOST)
    model = layer_model(layer_bytes)
    blocks = model.num_blocks
    rng = random.Random(seed)
    src_ids, dst_ids = list(range(blocks)), list(range(blocks))
    rng.shuffle(src_ids)
    rng.shuffle(dst_ids)
    src_parts, dst_parts = split_ids(src_ids, requests), split_ids(dst_ids, requests)
    names = [f"layer-req-{i}" for i in range(len(src_parts))]
    memcpy = measure_memcpy(blocks * sum(model.block_bytes(c) for c in model.components), repeats)
    decode = DecodeSide(backend, model, decode_host, hosts.decode_ns if hosts else None)
    cache = PrefillCache(model)
    prefill = PrefillWorker(
        ProducerConfig(p_rank=0, p_tp=1, session="", layers=cache.layers(), lease_ms=120_000),
        create_backend(backend, role="prefill", host=prefill_host),
        regions=cache.regions(),
    )
    try:
        decode.call("add", [(n, d, d) for n, d in zip(names, dst_parts, strict=True)])
        target = DecodeTarget(decode_host, decode.port, 1)
        for name, src in zip(names, src_parts, strict=True):
            prefill.add_request(name, target)
            cache.write(0, name, src, 0, src, 0)
        runtime: list[float] = []
        raw: list[float] = []
        in_read: list[float] = []  # of each runtime sample: inside backend.read
        planning: list[float] = []
        read_before, plan_before = decode.call("in_read")
        # Runtime and raw samples alternate, so a noisy neighbour slows both alike, and
        # which of the two goes first alternates too (the one just after the other ran
        # faster over the veth link); the first of each warms up (handshake, connections,
        # page faults).
        for i in range(repeats + 1):
            raw_first = i % 2 == 0 and i > 0
            if raw_first:
                raw_s, descriptors, nbytes = decode.call("raw")
            for name, src in zip(names, src_parts, strict=True):
                prefill.schedule_chunk(name, src, src, 0, 0, i == repeats)
            t0 = time.perf_counter()
            prefill.layer_written(0)
            if not prefill.wait_writable(0, TIMEOUT_S):
                raise TimeoutError("no reply within the timeout")
            elapsed = time.perf_counter() - t0
            read_total, plan_total = decode.call("in_read")
            prefill.end_step()
            if not raw_first:
                raw_s, descriptors, nbytes = decode.call("raw")
            if i:
                runtime.append(elapsed)
                raw.append(raw_s)
                in_read.append(read_total - read_before)
                planning.append(plan_total - plan_before)
            read_before, plan_before = read_total, plan_total
        finished = [prefill.wait_finished(n, TIMEOUT_S) for n in names]
        if not all(f is not None and f.ok for f in finished):
            raise RuntimeError(f"requests did not complete: {finished}")
        bad = decode.call("verify")
        if bad:
            raise RuntimeError(f"{bad} destination blocks hold wrong bytes")
    finally:
        prefill.close()
        decode.close()
    return {
        "nbytes": nbytes,
        "descriptors": descriptors,
        "memcpy": statistics.median(memcpy),
        "raw": statistics.median(raw),
        # Each runtime sample against the raw one beside it (same neighbours' load).
        "paired": statistics.median(w / t for w, t in zip(raw, runtime, strict=True)),
        "runtime": statistics.median(runtime),
        "in_read": statistics.median(in_read),
        "planning": statistics.median(planning),
        "rest": statistics.median(
            r - n - p for r, n, p in zip(runtime, in_read, planning, strict=True)
        ),
    }


def _prefill_side(
    conn: multiprocessing.connection.Connection, hosts: netns.TwoHosts, args: tuple[Any, ...]
) -> None:
    """Child of a ``--netns`` run: enter Prefill's namespace, measure, send the result (or
    the error's text)."""
    try:
        os.environ.setdefault("UCX_MODULES", "^ib")
        netns.enter_host(hosts.prefill_ns, hosts.prefill_ip)
        conn.send(run_size(*args, hosts=hosts))
    except Exception as exc:
        conn.send(f"{type(exc).__name__}: {exc}")


def run_size_across(hosts: netns.TwoHosts, *args: Any) -> dict[str, Any]:
    """:func:`run_size` with Prefill in a child process in its namespace."""
    ctx = multiprocessing.get_context("spawn")
    conn, theirs = ctx.Pipe()
    proc = ctx.Process(target=_prefill_side, args=(theirs, hosts, args))
    proc.start()
    try:
        if not conn.poll(TIMEOUT_S * 4):
            raise TimeoutError("the Prefill side did not answer")
        result = conn.recv()
        proc.join(TIMEOUT_S)
    finally:
        if proc.is_alive():  # an error, Ctrl-C or SIGTERM: leave nothing running there
            proc.kill()  # its Decode child ends when the pipe to it closes
            proc.join(TIMEOUT_S)
    if isinstance(result, str):
        raise RuntimeError(f"the Prefill side failed: {result}")
    return dict(result)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the namespaces' clean-up


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; 1 if runtime/raw falls under ``--min-ratio``, else 0."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--backend", default="nixl", choices=["loopback", "cma", "nixl", "mooncake"])
    ap.add_argument("--layer-mib", type=int, nargs="+", default=[20, 256])
    ap.add_argument("--requests", type=int, default=8, help="requests sharing the layer")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-ratio", type=float, default=0.0)
    ap.add_argument(
        "--netns",
        action="store_true",
        help="Prefill and Decode in two network namespaces joined by a veth pair (root)",
    )
    args = ap.parse_args(argv)
    if args.netns and args.backend not in ("nixl", "mooncake"):
        ap.error("--netns needs a backend that crosses hosts: nixl or mooncake")
    if not args.netns:
        return report(args, None)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        with netns.two_hosts() as hosts:
            return report(args, hosts)
    except netns.NamespacesUnavailable as exc:
        print(f"--netns: {exc}")
        return 2


def report(args: argparse.Namespace, hosts: netns.TwoHosts | None) -> int:
    """Measure every size and print the table; 1 if runtime/raw is under ``--min-ratio``."""
    where = (
        f"Prefill in namespace {hosts.prefill_ns} ({hosts.prefill_ip}), Decode in "
        f"{hosts.decode_ns} ({hosts.decode_ip}), a veth pair between them, UCX over TCP"
        if hosts
        else "Prefill here, Decode in a "
        + ("thread" if args.backend == "loopback" else "child process")
    )
    print(
        f"one layer through the runtime ({args.backend}, {where}), "
        f"{args.requests} requests, shuffled blocks, median of {args.repeats}; GB/s = 1e9 B/s"
    )
    print(
        f"{'layer MiB':>9} {'descs':>6} {'memcpy':>8} {'raw':>8} {'runtime':>8}"
        f" {'runtime/raw':>12} {'runtime/memcpy':>15}   runtime ms = read + plan + rest"
    )
    ok = True
    for mib in args.layer_mib:
        sized = (args.backend, mib * MIB, args.requests, args.repeats, args.seed)
        r = run_size_across(hosts, *sized) if hosts else run_size(*sized)
        gbs = {k: r["nbytes"] / r[k] / 1e9 for k in ("memcpy", "raw", "runtime")}
        ratio = r["paired"]
        print(
            f"{r['nbytes'] / MIB:>9.1f} {r['descriptors']:>6} {gbs['memcpy']:>8.2f} "
            f"{gbs['raw']:>8.2f} {gbs['runtime']:>8.2f} {ratio:>11.0%} "
            f"{gbs['runtime'] / gbs['memcpy']:>14.0%}   {r['runtime'] * 1e3:.1f} = "
            f"{r['in_read'] * 1e3:.1f} + {r['planning'] * 1e3:.2f} + {r['rest'] * 1e3:.2f}"
        )
        ok = ok and ratio >= args.min_ratio
    print(f"goal: runtime >= {'90% of raw across hosts' if hosts else '70% of raw'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
