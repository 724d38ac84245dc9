"""Prefill and Decode engines made of REAL vLLM Schedulers, real rd2h connectors and the
KV caches vLLM itself allocates.

An :class:`Engine` is one vLLM engine reduced to what the connector sees: a real
``Scheduler`` (whose scheduler-side ``SfaRemoteD2HConnector`` vLLM builds from the
kv-transfer config) and one worker-side connector per TP rank, each with its own KV cache
on the CPU. :meth:`Engine.step` is one engine step as vLLM's model runner runs it:
``bind_connector_metadata``, then per layer ``wait_for_layer_load`` / write the KV /
``save_kv_layer`` (Prefill), ``start_load_kv``, ``wait_for_save``,
``get_transfer_results``, ``get_block_ids_with_load_errors``, ``get_kv_connector_stats``,
``clear_connector_metadata``; the TP workers' outputs go through vLLM's
``KVOutputAggregator`` into ``Scheduler.update_from_output``.

The KV caches are vLLM's own (:func:`kv_setup`): the per-layer ``KVCacheSpec`` a model
declares goes through the engine core's sequence (``get_kv_cache_configs`` -- grouping,
page-size unification, ``KVCacheTensor`` placement --, ``generate_scheduler_kv_cache_config``,
``resolve_kv_cache_block_sizes``), and each worker's caches come from
``vllm.v1.worker.utils.allocate_kv_cache`` under ``KVCacheLayout.LBHNC`` (the only layout
vLLM's CPU attention backend supports, so what a CPU server resolves). Main layers are
``FullAttentionSpec`` (a Llama-like layer): one ``[num_blocks, heads, block_size,
head + head_v]`` view per layer, K and V side by side, i.e. ONE block array per layer.

``indexer`` says where the sparse-attention indexer caches (layer names containing
"indexer", declared as DeepSeek V3.2's ``DeepseekV32IndexerCache.get_kv_cache_spec``
does: ``MLAAttentionSpec(num_kv_heads=1, head_size=<bytes>, dtype=uint8,
cache_role=INDEXER)``) end up:

* ``"none"``: no indexer; one KV-cache group.
* ``"shared"``: the indexer declared with the main layers' block size. vLLM puts every
  layer in ONE group (``UniformTypeKVCacheSpecs``, as it does for DeepSeek V3.2): main and
  indexer share block ids, each with its own page size and its own ``KVCacheTensor``.
* ``"group"``: the indexer declared with TWICE the main block size (``INDEXER_BLOCK``).
  Specs of different block sizes are not one type for vLLM, so ``get_kv_cache_groups``
  puts the indexer in a second KV-cache group, with its own block ids and block size
  (the indexer-in-its-own-group form RD2H's protocol supports). vLLM gives several groups
  one page size (``unify_kv_cache_spec_page_size`` grows the smaller page's block size),
  and ``validate_kv_cache_layout`` refuses mixed page sizes in several groups under any
  layer-compact layout (only BLHNC/BLNHC could hold them, and RD2H, moving one layer at a
  time, refuses block-outermost layouts); so this is the only multi-group form vLLM
  produces for RD2H. The indexer's bytes per token are chosen so its page already equals
  the main page (32 x 128 B = 2 x 16 x 32 x 4 B) and its block size stays 32 tokens. As
  for any hybrid model, vLLM overlays the two groups on ONE allocation (both
  ``KVCacheTensor`` start at offset 0): a block id belongs to one group at a time.

What Prefill writes is verifiable: every block of every block array holds
:func:`rd2h_runtime.testing.synthetic.block_pattern` of (external request id, layer, component,
logical block), where the logical block is the block's position in the request's block
list of its KV-cache group. The main component's name includes the Prefill TP rank
(``kv@p1``): each Prefill rank holds different bytes, so Decode rank ``r`` must find the
bytes of the Prefill rank it reads main KV from (its contributor member 0); the indexer
is the same on every Prefill rank (DeepSeek's indexer is replicated over TP), so
contributors may split it. Decode checks the blocks its own scheduler allocated, in its
own vLLM caches (:meth:`Engine.mismatches`): that is where vLLM's attention reads.
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
from vllm.v1.core.kv_cache_utils import (
    generate_scheduler_kv_cache_config,
    get_kv_cache_configs,
    get_request_block_hasher,
    init_none_hash,
    resolve_cache_hit_alignment_tokens,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MLAAttentionSpec,
    SparseCacheRole,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache
from vllm_metaserver_harness import MetaServer

from rd2h_protocol.rendezvous import decode_rendezvous, remote_prefill_params
from rd2h_runtime.control import ControlOptions
from rd2h_runtime.testing.synthetic import block_pattern
from rd2h_vllm.config import CONNECTOR_MODULE, CONNECTOR_NAME
from rd2h_vllm.connector import SfaRemoteD2HConnector
from rd2h_vllm.destinations import VllmCacheDestinations
from rd2h_vllm.worker import SingleRank

BLOCK = 16
INDEXER_BLOCK = 2 * BLOCK  # the indexer's block size in the "group" case
NUM_BLOCKS = 128
NUM_LAYERS = 2
HEADS, HEAD = 2, 16
INDEXER_BYTES = 128  # bytes per token of the indexer cache
#: Bytes of one main block: heads x tokens x (K + V) x float32.
MAIN_BLOCK_BYTES = HEADS * BLOCK * 2 * HEAD * 4
LAYOUT = KVCacheLayout.LBHNC  # vLLM's CPU attention backend supports only this one
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

_hashers: dict[int, Callable[[Request], Any]] = {}


def block_hasher(size: int = BLOCK) -> Callable[[Request], Any]:
    """vLLM's prefix-cache block hasher for ``size``-token hash blocks (one per process)."""
    if not _hashers:
        init_none_hash(sha256)
    if size not in _hashers:
        _hashers[size] = get_request_block_hasher(size, sha256)
    return _hashers[size]


# -- vLLM's own KV-cache configuration and allocation ------------------------------------------


def layer_specs(indexer: str = "none") -> dict[str, KVCacheSpec]:
    """The ``KVCacheSpec`` every cache-bearing layer declares, in model order (see the
    module docstring for ``indexer``)."""
    if indexer not in ("none", "shared", "group"):
        raise ValueError(f"indexer must be none, shared or group, got {indexer!r}")
    main = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32
    )
    specs: dict[str, KVCacheSpec] = {}
    for layer in range(NUM_LAYERS):
        specs[MAIN[layer]] = main
        if indexer != "none":
            specs[INDEXER[layer]] = MLAAttentionSpec(  # DeepseekV32IndexerCache's spec
                block_size=BLOCK if indexer == "shared" else INDEXER_BLOCK,
                num_kv_heads=1,
                max_tp_shards=1,
                head_size=INDEXER_BYTES,
                dtype=torch.uint8,
                cache_role=SparseCacheRole.INDEXER,
            )
    return specs


@dataclass(frozen=True)
class KvSetup:
    """What vLLM's engine core resolves for the KV cache before the engine starts."""

    workers: list[KVCacheConfig]  # one per TP rank (what each worker's connector gets)
    scheduler: KVCacheConfig  # what the Scheduler (and its connector) gets
    block_size: int  # the scheduler's block size (LCM of the groups' block sizes)
    hash_block_size: int  # prefix-cache hash granularity (GCD of the groups')


def kv_setup(
    vllm_config: VllmConfig, indexer: str = "none", layout: KVCacheLayout = LAYOUT
) -> KvSetup:
    """vLLM's KV-cache configuration for ``indexer``, one worker per TP rank, resolved as
    the engine core does (vllm/v1/engine/core.py) with ``NUM_BLOCKS`` blocks and
    ``layout`` resolved. Sets the resolved fields on ``vllm_config.cache_config``."""
    cache = vllm_config.cache_config
    cache.kv_cache_layout = layout.name
    cache.num_gpu_blocks_override = NUM_BLOCKS
    tp = vllm_config.parallel_config.tensor_parallel_size
    specs = layer_specs(indexer)
    workers = get_kv_cache_configs(vllm_config, [specs] * tp, [1 << 30] * tp)
    for config in workers:
        config.kv_cache_layout = layout.name
    scheduler = generate_scheduler_kv_cache_config(workers)
    cache.num_gpu_blocks = scheduler.num_blocks
    cache.block_size = min(g.kv_cache_spec.block_size for g in scheduler.kv_cache_groups)
    block_size, hash_block_size = resolve_kv_cache_block_sizes(scheduler, vllm_config)
    alignment = resolve_cache_hit_alignment_tokens(
        scheduler, vllm_config, block_size, hash_block_size
    )
    for config in (*workers, scheduler):
        config.hash_block_size = hash_block_size
        config.cache_hit_alignment_tokens = alignment
    return KvSetup(workers, scheduler, block_size, hash_block_size)


def build_scheduler(vllm_config: VllmConfig, setup: KvSetup) -> Scheduler:
    """A real vLLM Scheduler on ``setup``'s KV-cache configuration and block sizes."""
    return Scheduler(
        vllm_config,
        setup.scheduler,
        StructuredOutputManager(vllm_config),
        block_size=setup.block_size,
        hash_block_size=setup.hash_block_size,
        log_stats=True,
    )


def allocate(kv_cache_config: KVCacheConfig) -> dict[str, torch.Tensor]:
    """One worker's KV caches, allocated by vLLM itself (what ``register_kv_caches`` gets)
    in the layout the configuration was resolved with."""
    layout = KVCacheLayout[kv_cache_config.kv_cache_layout or LAYOUT.name]
    return allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout, None)


def block_bytes(cache: torch.Tensor, block: int) -> torch.Tensor:
    """The bytes of vLLM block ``block`` of one layer's cache view, as a flat uint8 view.

    Under ``LAYOUT`` (LBHNC) a block of a ``[B, H, N, C]`` view is one contiguous page.
    """
    page = cache[block]
    assert page.is_contiguous(), f"block {block} of {tuple(cache.shape)} is not one page"
    return page.reshape(-1).view(torch.uint8)


def main_component(prefill_rank: int) -> str:
    """The pattern component of the main KV written by Prefill TP rank ``prefill_rank``."""
    return f"kv@p{prefill_rank}"


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
    indexer: str  # "none", "group" or "shared" (see the module docstring)
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

    @property
    def indexer_group(self) -> int:
        """The KV-cache group holding the indexer layers."""
        return 1 if self.indexer == "group" else 0

    @property
    def indexer_block(self) -> int:
        """Tokens per indexer block."""
        return INDEXER_BLOCK if self.indexer == "group" else BLOCK

    def _write(self, out: SchedulerOutput, rank: int, layer: int, *, indexer: bool) -> None:
        """Prefill: write every block the step's tokens touch, in this rank's own cache."""
        if self.role != "kv_producer":
            return
        for req_id, count in out.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            ext = req_id[:-9]
            start = req.num_computed_tokens - count  # schedule() advanced it already
            ids = self.block_ids(req_id)
            if indexer:
                size, group_ids = self.indexer_block, ids[self.indexer_group]
                cache, component = self.caches[rank][INDEXER[layer]], "indexer"
            else:
                size, group_ids = BLOCK, ids[0]
                cache, component = self.caches[rank][MAIN[layer]], main_component(rank)
            for j in range(start // size, (start + count - 1) // size + 1):
                dest = block_bytes(cache, group_ids[j])
                pat = block_pattern(ext, layer, component, [j], dest.numel())
                dest.copy_(torch.from_numpy(pat[0]))

    # -- Decode checks ---------------------------------------------------------------------

    def destinations(self, rank: int = 0) -> VllmCacheDestinations:
        """Decode rank ``rank``'s destinations: its own vLLM KV cache, in place."""
        dest = self.rd2h(rank).destinations
        assert isinstance(dest, VllmCacheDestinations)
        assert dest.main_shared is False
        for name in MAIN:
            [main] = dest.main(name)
            assert main.base == self.caches[rank][name].data_ptr()
        return dest

    def block(self, name: str, block: int, rank: int = 0) -> torch.Tensor:
        """A copy of the bytes of ``block`` of layer ``name`` in rank ``rank``'s cache."""
        return block_bytes(self.caches[rank][name], block).clone()

    def mismatches(
        self,
        ext: str,
        main_ids: Sequence[int],
        indexer_ids: Sequence[int] = (),
        rank: int = 0,
        prefill_rank: int | None = None,
    ) -> list[str]:
        """Blocks of ``ext`` in Decode rank ``rank``'s own vLLM caches, at its destination
        ids, whose bytes differ from what Prefill wrote. The main KV is expected from
        Prefill rank ``prefill_rank``; the default, the same rank number, is the rank
        Decode reads main KV from when the TP sizes are equal, and member 0 (rank 0) of
        the contributors when two Prefill ranks feed Decode rank 0."""
        self.destinations(rank)  # the caches checked are the connector's destinations
        source = rank if prefill_rank is None else prefill_rank
        bad: list[str] = []
        for layer, name in enumerate(MAIN):
            for j, block in enumerate(main_ids):
                have = block_bytes(self.caches[rank][name], block)
                want = block_pattern(ext, layer, main_component(source), [j], have.numel())
                if not torch.equal(have, torch.from_numpy(want[0])):
                    bad.append(f"{name}/kv/block {j}")
            for j, block in enumerate(indexer_ids):
                have = block_bytes(self.caches[rank][INDEXER[layer]], block)
                want = block_pattern(ext, layer, "indexer", [j], have.numel())
                if not torch.equal(have, torch.from_numpy(want[0])):
                    bad.append(f"{INDEXER[layer]}/block {j}")
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
    map_caches: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
) -> Engine:
    """A Prefill (``kv_producer``) or Decode (``kv_consumer``) engine with ``tp`` workers.

    ``wrap`` turns RD2H's kv-transfer entry into the engine's whole kv-transfer config
    (a multi-connector holding it); ``worker_cls`` then builds that connector's workers.
    ``map_caches`` turns each worker's vLLM allocation into the caches it registers and
    writes (e.g. layers sharing one buffer, as a layerwise store's reuse ring does).
    """
    transfer = rd2h_entry(role, kv_port, backend, extra)
    if wrap is not None:
        transfer = wrap(transfer)
    transfer["kv_load_failure_policy"] = failure_policy
    config = make_vllm_config(
        transfer, tp=tp, attach_after=False, max_num_batched_tokens=max_num_batched_tokens
    )
    setup = kv_setup(config, indexer)
    scheduler = build_scheduler(config, setup)
    workers: list[Any] = []
    caches: list[dict[str, torch.Tensor]] = []
    gather = ThreadGather(tp) if threaded else None
    try:
        for rank in range(tp):
            worker = worker_cls(config, KVConnectorRole.WORKER, setup.workers[rank])
            ours = rd2h_of(worker)
            ours.control_options = FAST_CONTROL
            ours.bind_tp_group(
                gather.member(rank) if gather is not None else SingleRank(rank=rank, size=tp)
            )
            cache = allocate(setup.workers[rank])
            if map_caches is not None:
                cache = map_caches(cache)
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


def wrap_in(
    cls: type[Any], *children: dict[str, Any], **store_extra: Any
) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A ``build_engine`` wrap: the multi-connector ``cls`` holding ``children`` (each with
    ``store_extra`` as its ``kv_connector_extra_config``) then RD2H."""

    def wrap(rd2h: dict[str, Any]) -> dict[str, Any]:
        entries = [{**c, "kv_connector_extra_config": dict(store_extra)} for c in children]
        return {
            "kv_connector": cls.__name__,
            "kv_connector_module_path": cls.__module__,
            "kv_role": rd2h["kv_role"],
            "kv_connector_extra_config": {"connectors": [*entries, rd2h]},
        }

    return wrap


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


def start_remote_prefill(
    prefill: Engine, decode: Engine, server: MetaServer, ext: str, prompt: list[int]
) -> Request:
    """Decode takes ``{ext}-00000001`` with its prompt prefilled remotely and posts the
    rendezvous; Prefill gets ``{ext}-00000002`` with those params. Returns Decode's request."""
    d_req = decode.add(
        make_request(f"{ext}-00000001", prompt, remote_prefill_params(server.url), 2)
    )
    decode.step()
    run_until([decode], lambda: bool(server.script.bodies))
    params = decode_rendezvous(server.script.bodies[0]).to_params()
    prefill.add(make_request(f"{ext}-00000002", prompt, params, 1))
    return d_req


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
