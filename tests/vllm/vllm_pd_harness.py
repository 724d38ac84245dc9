"""Prefill and Decode engines made of REAL vLLM Schedulers and real rd2h connectors.

An :class:`Engine` is one vLLM engine reduced to what the connector sees: a real
``Scheduler`` (whose scheduler-side ``SfaRemoteD2HConnector`` vLLM builds from the
kv-transfer config) and one worker-side connector per TP rank, each with its own KV-cache
tensors on the CPU. :meth:`Engine.step` is one engine step as vLLM's model runner runs it:
``bind_connector_metadata``, then per layer ``wait_for_layer_load`` / write the KV /
``save_kv_layer`` (Prefill), ``start_load_kv``, ``wait_for_save``,
``get_transfer_results``, ``get_block_ids_with_load_errors``, ``get_kv_connector_stats``,
``clear_connector_metadata``; the TP workers' outputs go through vLLM's
``KVOutputAggregator`` into ``Scheduler.update_from_output``.

What Prefill writes is verifiable: every block of every layer and component holds
:func:`rd2h_runtime.synthetic.block_pattern` of (external request id, layer, component,
logical block), where the logical block is the block's position in the request's block
list of its KV-cache group. Decode checks its destination blocks against the same
function (:meth:`Engine.mismatches`).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from rd2h_runtime.control import ControlOptions
from rd2h_runtime.synthetic import block_pattern
from rd2h_vllm.config import CONNECTOR_MODULE, CONNECTOR_NAME
from rd2h_vllm.connector import SfaRemoteD2HConnector
from rd2h_vllm.destinations import HostPoolDestinations
from rd2h_vllm.worker import SingleRank

BLOCK = 16
NUM_BLOCKS = 64
NUM_LAYERS = 2
HEADS, HEAD = 2, 16
INDEXER_BYTES = 8  # bytes per token of the indexer cache
MAIN = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
INDEXER = [f"model.layers.{i}.self_attn.indexer.k_cache" for i in range(NUM_LAYERS)]

#: Quick control sockets (heartbeats and polls), for tests.
FAST_CONTROL = ControlOptions(
    heartbeat_ivl_s=0.5, heartbeat_timeout_s=2.0, heartbeat_ttl_s=4.0, idle_poll_s=0.05
)
#: Quick metaserver client options.
FAST_METASERVER: dict[str, Any] = {
    "metaserver_timeout_s": 2.0,
    "metaserver_max_attempts": 2,
    "metaserver_backoff_s": 0.01,
    "metaserver_backoff_max_s": 0.01,
    "metaserver_deadline_s": 5.0,
    "advertise_host": "127.0.0.1",
}

_hasher: Callable[[Request], Any] | None = None


def block_hasher() -> Callable[[Request], Any]:
    """vLLM's prefix-cache block hasher (initialised once per process)."""
    global _hasher
    if _hasher is None:
        init_none_hash(sha256)
        _hasher = get_request_block_hasher(BLOCK, sha256)
    return _hasher


def free_port_block(count: int, host: str = "127.0.0.1") -> int:
    """A base port with ``count`` consecutive ports free on ``host`` right now."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind((host, 0))
            base = int(probe.getsockname()[1])
        if base + count > 65535:
            continue
        held: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                held.append(s)
                s.bind((host, port))
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
        return base
    raise OSError(f"no {count} consecutive free ports on {host}")


def make_request(
    req_id: str, prompt: Sequence[int], params: Mapping[str, Any] | None, max_tokens: int
) -> Request:
    extra = {"kv_transfer_params": dict(params)} if params is not None else None
    return Request(
        req_id,
        list(prompt),
        SamplingParams(max_tokens=max_tokens, extra_args=extra),
        None,
        block_hasher=block_hasher(),
    )


def kv_cache_config(indexer: str) -> KVCacheConfig:
    """The main layers' group; indexers in a second group ("group") or in the main group
    ("shared"), or none ("none")."""
    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32
    )
    main = list(MAIN) + (list(INDEXER) if indexer == "shared" else [])
    groups = [KVCacheGroupSpec(layer_names=main, kv_cache_spec=spec)]
    if indexer == "group":
        groups.append(KVCacheGroupSpec(layer_names=list(INDEXER), kv_cache_spec=spec))
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)


def kv_caches(indexer: str) -> dict[str, torch.Tensor]:
    """One rank's KV caches: ``[2, blocks, block, heads, head]`` per main layer (K, V),
    ``[blocks, block, INDEXER_BYTES]`` uint8 per indexer."""
    caches = {
        name: torch.zeros((2, NUM_BLOCKS, BLOCK, HEADS, HEAD), dtype=torch.float32) for name in MAIN
    }
    if indexer != "none":
        for name in INDEXER:
            caches[name] = torch.zeros((NUM_BLOCKS, BLOCK, INDEXER_BYTES), dtype=torch.uint8)
    return caches


class ThreadGather:
    """A TP group of ``size`` ranks running in threads of one process (tests).

    ``all_gather`` is a real collective: every rank blocks until all have entered it.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._barrier = threading.Barrier(size)
        self._slots: list[Any] = [None] * size

    def member(self, rank: int) -> _Member:
        return _Member(self, rank)

    def gather(self, rank: int, obj: Any) -> list[Any]:
        self._slots[rank] = obj
        self._barrier.wait(timeout=20)
        out = list(self._slots)
        self._barrier.wait(timeout=20)  # nobody overwrites a slot before all have read
        return out


@dataclass(frozen=True)
class _Member:
    group: ThreadGather
    rank: int

    @property
    def size(self) -> int:
        return self.group.size

    def all_gather(self, obj: Any) -> list[Any]:
        return self.group.gather(self.rank, obj)


def rd2h_of(connector: object) -> SfaRemoteD2HConnector:
    """``connector`` itself, or the RD2H child of a multi-connector."""
    if isinstance(connector, SfaRemoteD2HConnector):
        return connector
    children = getattr(connector, "sub_connectors", [])
    [ours] = [c for c in children if isinstance(c, SfaRemoteD2HConnector)]
    return ours


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a contiguous block, as a flat uint8 view."""
    return t.reshape(-1).view(torch.uint8)


@dataclass
class StepResult:
    """What one engine step produced."""

    out: SchedulerOutput
    engine_outputs: dict[int, EngineCoreOutputs]
    kv_output: KVConnectorOutput | None


@dataclass
class Engine:
    """One vLLM engine (see the module docstring)."""

    role: str
    scheduler: Scheduler
    workers: list[Any]  # SfaRemoteD2HConnector, or a multi-connector holding one
    caches: list[dict[str, torch.Tensor]]
    indexer: str  # "none", "group" or "shared" (see kv_cache_config)
    vllm_config: VllmConfig
    aggregator: KVOutputAggregator
    #: Called between layers of a Prefill step: (step number, rank, layer index).
    on_layer: Callable[[int, int, int], None] | None = None
    #: Call ``on_kv_cache_written`` after each main layer's write, before save_kv_layer.
    cache_written_hook: bool = False
    #: Run the TP workers of a step in parallel threads (needed for Decode TP > 1).
    threaded: bool = False
    steps: int = 0
    load_errors: list[set[int]] = field(default_factory=list)
    failed_recving: list[set[str]] = field(default_factory=list)
    stats: list[dict[str, Any]] = field(default_factory=list)
    #: Decode: loads each worker reported failed, as (rank, req_id, main ids, indexer ids).
    failed_blocks: list[tuple[int, str, list[int], list[int]]] = field(default_factory=list)

    @property
    def kv_port(self) -> int:
        ktc = self.vllm_config.kv_transfer_config
        assert ktc is not None and ktc.kv_port is not None
        return int(ktc.kv_port)

    @property
    def connector(self) -> SfaRemoteD2HConnector:
        """The scheduler-side RD2H connector vLLM built (inside a multi-connector too)."""
        return rd2h_of(self.scheduler.connector)

    def rd2h(self, rank: int = 0) -> SfaRemoteD2HConnector:
        """Worker ``rank``'s RD2H connector."""
        return rd2h_of(self.workers[rank])

    def add(self, req: Request) -> Request:
        self.scheduler.add_request(req)
        return req

    def block_ids(self, req_id: str) -> tuple[list[int], ...]:
        return self.scheduler.kv_cache_manager.get_block_ids(req_id)

    # -- the step -------------------------------------------------------------------------

    def step(self) -> StepResult:
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        assert meta is not None
        if self.threaded:
            # Each TP rank in its own thread, as in vLLM: the Decode completion gather is
            # a collective every rank enters.
            with ThreadPoolExecutor(len(self.workers)) as pool:
                futures = [
                    pool.submit(self._run_worker, rank, worker, out)
                    for rank, worker in enumerate(self.workers)
                ]
                outputs: list[ModelRunnerOutput | None] = [f.result(30) for f in futures]
        else:
            outputs = [
                self._run_worker(rank, worker, out) for rank, worker in enumerate(self.workers)
            ]
        merged = self.aggregator.aggregate(outputs)
        assert merged is not None
        kv_output = merged.kv_connector_output
        if kv_output is not None:
            if kv_output.invalid_block_ids:
                self.load_errors.append(set(kv_output.invalid_block_ids))
            if kv_output.failed_recving:
                self.failed_recving.append(set(kv_output.failed_recving))
        engine_outputs = self.scheduler.update_from_output(out, merged)
        for eco in engine_outputs.values():
            if eco.scheduler_stats is not None and eco.scheduler_stats.kv_connector_stats:
                self.stats.append(eco.scheduler_stats.kv_connector_stats)
        self.steps += 1
        return StepResult(out, engine_outputs, kv_output)

    def _run_worker(self, rank: int, worker: Any, out: SchedulerOutput) -> ModelRunnerOutput:
        """One TP worker's share of the step, as vLLM's model runner calls the connector."""
        meta = out.kv_connector_metadata
        assert meta is not None
        worker.bind_connector_metadata(meta)
        if out.total_num_scheduled_tokens > 0:
            for layer, name in enumerate(MAIN):
                if self.indexer != "none":
                    worker.wait_for_layer_load(INDEXER[layer])
                    self._write(out, rank, layer, indexer=True)
                    worker.save_kv_layer(INDEXER[layer], self.caches[rank][INDEXER[layer]], None)
                worker.wait_for_layer_load(name)
                self._write(out, rank, layer, indexer=False)
                if self.cache_written_hook:
                    worker.on_kv_cache_written(name)  # vllm-ascend's earlier hook
                worker.save_kv_layer(name, self.caches[rank][name], None)
                if self.on_layer is not None:
                    self.on_layer(self.steps, rank, layer)
        worker.start_load_kv(None)
        worker.wait_for_save()
        results = worker.get_transfer_results(out.finished_req_ids)
        side = rd2h_of(worker).decode
        if side is not None:
            for req_id, (main, idx) in side.last_failed.items():
                self.failed_blocks.append((rank, req_id, main, idx))
        kv_out = KVConnectorOutput(
            finished_sending=results.finished_sending or None,
            finished_recving=results.finished_recving or None,
            failed_recving=results.failed_recving,
            invalid_block_ids=worker.get_block_ids_with_load_errors(),
            kv_connector_stats=worker.get_kv_connector_stats(),
        )
        worker.clear_connector_metadata()
        return self._model_output(out, kv_out)

    def _model_output(self, out: SchedulerOutput, kv_out: KVConnectorOutput) -> ModelRunnerOutput:
        req_ids = list(out.num_scheduled_tokens)
        sampled = [[] if self.scheduler.requests[r].is_prefill_chunk else [7] for r in req_ids]
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_out,
        )

    def _write(self, out: SchedulerOutput, rank: int, layer: int, *, indexer: bool) -> None:
        """Prefill: write every block the step's tokens touch, in this rank's cache."""
        if self.role != "kv_producer":
            return
        for req_id, count in out.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            ext = req_id[:-9]
            start = req.num_computed_tokens - count  # schedule() advanced it already
            first, last = start // BLOCK, (start + count - 1) // BLOCK
            ids = self.block_ids(req_id)
            if indexer:
                group_ids = ids[1] if self.indexer == "group" else ids[0]
                cache = self.caches[rank][INDEXER[layer]]
                for j in range(first, last + 1):
                    pat = block_pattern(ext, layer, "indexer", [j], BLOCK * INDEXER_BYTES)
                    _bytes(cache[group_ids[j]]).copy_(torch.from_numpy(pat[0]))
                continue
            cache = self.caches[rank][MAIN[layer]]
            for j in range(first, last + 1):
                for kv, comp in enumerate(("k", "v")):
                    nbytes = BLOCK * HEADS * HEAD * 4
                    pat = block_pattern(ext, layer, comp, [j], nbytes)
                    _bytes(cache[kv][ids[0][j]]).copy_(torch.from_numpy(pat[0]))

    # -- Decode checks ---------------------------------------------------------------------

    def destinations(self, rank: int = 0) -> HostPoolDestinations:
        dest = self.rd2h(rank).destinations
        assert isinstance(dest, HostPoolDestinations)
        return dest

    def mismatches(
        self, ext: str, main_ids: Sequence[int], indexer_ids: Sequence[int] = (), rank: int = 0
    ) -> list[str]:
        """Destination blocks of ``ext`` whose bytes differ from what Prefill wrote."""
        dest = self.destinations(rank)
        bad: list[str] = []
        for layer, name in enumerate(MAIN):
            for comp in ("k", "v"):
                tensor = dest.tensor(name, comp)
                for j, block in enumerate(main_ids):
                    want = torch.from_numpy(
                        block_pattern(ext, layer, comp, [j], tensor.shape[1])[0]
                    )
                    if not torch.equal(tensor[block], want):
                        bad.append(f"{name}/{comp}/block {j}")
            if indexer_ids:
                tensor = dest.tensor(name, "indexer")
                for j, block in enumerate(indexer_ids):
                    want = torch.from_numpy(
                        block_pattern(ext, layer, "indexer", [j], tensor.shape[1])[0]
                    )
                    if not torch.equal(tensor[block], want):
                        bad.append(f"{name}/indexer/block {j}")
        return bad

    def close(self) -> None:
        for worker in self.workers:
            with contextlib.suppress(Exception):
                worker.shutdown()
        self.scheduler.shutdown()


EngineFactory = Callable[..., Engine]


def build_engine(
    make_vllm_config: Callable[..., VllmConfig],
    role: str,
    *,
    tp: int = 1,
    kv_port: int = 20050,
    indexer: str = "none",
    max_num_batched_tokens: int = 1024,
    failure_policy: str = "fail",
    worker_cls: Callable[..., Any] = SfaRemoteD2HConnector,
    extra: Mapping[str, Any] | None = None,
    backend: str = "nixl",
    wrap: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    threaded: bool = False,
) -> Engine:
    """A Prefill (``kv_producer``) or Decode (``kv_consumer``) engine with ``tp`` workers.

    ``wrap`` turns RD2H's kv-transfer entry into the engine's whole kv-transfer config
    (a multi-connector holding it); ``worker_cls`` then builds that connector's workers.
    """
    transfer = rd2h_entry(role, kv_port, backend, extra)
    if wrap is not None:
        transfer = wrap(transfer)
    transfer["kv_load_failure_policy"] = failure_policy
    config = make_vllm_config(
        transfer, tp=tp, attach_after=False, max_num_batched_tokens=max_num_batched_tokens
    )
    config.cache_config.num_gpu_blocks = NUM_BLOCKS
    kcc = kv_cache_config(indexer)
    scheduler = Scheduler(
        config, kcc, StructuredOutputManager(config), block_size=BLOCK, log_stats=True
    )
    workers: list[Any] = []
    caches: list[dict[str, torch.Tensor]] = []
    gather = ThreadGather(tp) if threaded else None
    try:
        for rank in range(tp):
            worker = worker_cls(config, KVConnectorRole.WORKER, kcc)
            ours = rd2h_of(worker)
            ours.control_options = FAST_CONTROL
            ours.bind_tp_group(
                gather.member(rank) if gather is not None else SingleRank(rank=rank, size=tp)
            )
            cache = kv_caches(indexer)
            worker.register_kv_caches(cache)
            workers.append(worker)
            caches.append(cache)
    except BaseException:
        for worker in workers:
            worker.shutdown()
        scheduler.shutdown()
        raise
    return Engine(
        role,
        scheduler,
        workers,
        caches,
        indexer,
        config,
        KVOutputAggregator(tp),
        threaded=threaded,
    )


def rd2h_entry(
    role: str, kv_port: int, backend: str = "nixl", extra: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """RD2H's own kv-transfer entry (the deployment guide's shape)."""
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": role,
        "kv_port": kv_port,
        "kv_connector_extra_config": {
            "transfer_backend": backend,
            **FAST_METASERVER,
            **(extra or {}),
        },
    }


def run_until(engines: Sequence[Engine], done: Callable[[], bool], timeout_s: float = 20.0) -> int:
    """Step every engine in turn until ``done()``; returns the rounds run."""
    deadline = time.monotonic() + timeout_s
    rounds = 0
    while not done():
        assert time.monotonic() < deadline, f"not done after {rounds} rounds"
        for engine in engines:
            engine.step()
        rounds += 1
        time.sleep(0.002)
    return rounds


def status(req: Request) -> RequestStatus:
    """The request's status, read afresh."""
    return req.status


@contextlib.contextmanager
def engines(*made: Engine) -> Iterator[tuple[Engine, ...]]:
    """Close every engine at the end, whatever happened."""
    try:
        yield made
    finally:
        for engine in made:
            engine.close()
