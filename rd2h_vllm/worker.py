"""The connector's worker halves: Prefill publishes per layer, Decode pulls and completes.

Theory of operation
-------------------
vLLM 0.32's model runner drives a worker-side connector once per engine step, in this
order (vllm/v1/worker/kv_connector_model_runner_mixin.py)::

    bind_connector_metadata(meta)          # before the forward pass
    per attention layer: wait_for_layer_load(name), attention writes the KV,
                         save_kv_layer(name, ...)   (vllm-ascend: on_kv_cache_written)
    start_load_kv(ctx)                     # after the forward (async loads)
    wait_for_save()
    get_transfer_results(finished_req_ids) / get_finished(...)
    get_block_ids_with_load_errors(), get_kv_connector_stats()
    clear_connector_metadata()

Steps without scheduled tokens run the same sequence without the layer calls.

:class:`PrefillSide` (kv_producer) binds one :class:`~rd2h_runtime.prefill.PrefillWorker`.
Each step's :class:`~rd2h_vllm.scheduler.SendSpec` becomes a chunk
(:func:`~rd2h_protocol.topology.chunk_block_range` per KV-cache group) scheduled at
``bind`` time, i.e. before the first layer; ``wait_for_layer_load`` is the slot-reuse
wait (the storage a layer is about to overwrite must no longer be read by any Decode);
``save_kv_layer`` / ``on_kv_cache_written`` publish the layer once its KV is in memory (a
device event recorded on the compute stream; on CPU it is done at once; otherwise a
publisher thread waits for it, keeping every call in order); ``wait_for_save`` ends the
step. A request is reported in ``finished_sending`` once vLLM finished it AND no Decode
read of it can happen any more (the endpoint's ``RequestFinished``, or it never
reached the endpoint). A request vLLM finishes before its final chunk was scheduled
(abort) is aborted toward Decode, and so is a prompt-list child the scheduler found no
usable rendezvous for (:class:`~rd2h_vllm.scheduler.SendAbort`), once a publication has
opened the connection to its Decode (a v1 Decode cannot be told). Prefill never raises
for a failed read of a request (``read_failure_policy="isolate"``); the failure is
counted in the metrics.

:class:`DecodeSide` (kv_consumer) binds one :class:`~rd2h_runtime.decode.DecodeWorker`
whose destinations come from a :class:`~rd2h_vllm.destinations.DestinationProvider`.
Each :class:`~rd2h_vllm.scheduler.LoadSpec` registers the request's destination blocks;
a :class:`~rd2h_vllm.scheduler.LoadFailure` and a request vLLM finished while loading
(``finished_req_ids``) abort it. Every step the rank's newly terminal requests are
gathered over the TP CPU group and fed to
:class:`~rd2h_protocol.completion.CrossRankCompletion` (every rank decides the same, with
rank 0's clock); a request finished on every rank is released in the endpoint and
reported in ``finished_recving`` once no read of it is in flight on this rank (vLLM may
hand its blocks out again right after). A request that failed on any rank is also listed
in ``failed_recving`` and, when the model has one KV-cache group, its main and indexer
blocks in ``get_block_ids_with_load_errors`` (vLLM 0.32 refuses block-level errors with
several groups: there the request-level ``failed_recving`` is the report).

What each half tracks per request changes only by stepping the ``vLLM send`` and ``vLLM
load`` machines declared in :mod:`rd2h_vllm.request_machines`.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeVar

import torch

from rd2h_protocol.completion import CrossRankCompletion, RankReport
from rd2h_protocol.consumer import ConsumerConfig
from rd2h_protocol.errors import (
    ConfigError,
    ErrorCode,
    LocalProtocolError,
    ProtocolError,
    TransferError,
)
from rd2h_protocol.layout import ComponentDest, LayerLayout
from rd2h_protocol.producer import DecodeTarget, ProducerConfig, RequestFinished
from rd2h_protocol.topology import chunk_block_range, layer_number, wire_layer_indices
from rd2h_runtime.control import ControlOptions
from rd2h_runtime.decode import DecodeWorker, Outcome, ReadRecord
from rd2h_runtime.prefill import PrefillWorker
from rd2h_runtime.transfer import TransferBackend
from rd2h_vllm.config import Rd2hConfig
from rd2h_vllm.destinations import (
    DestinationProvider,
    DeviceEvents,
    LayerCaches,
    ScatterEvent,
    match_indexer_caches,
)
from rd2h_vllm.kv_layout import cache_arrays, describe
from rd2h_vllm.metrics import CounterDelta, Rd2hKVConnectorStats
from rd2h_vllm.request_machines import (
    EFFECT_ABORT,
    EFFECT_RELEASE,
    EFFECT_REPORT_LOCAL,
    EFFECT_SCHEDULE,
    L_LOCAL_ADD_FAILED,
    L_LOCAL_ADDED,
    L_LOCAL_COMPLETED,
    L_LOCAL_DUPLICATE,
    L_LOCAL_FAIL,
    L_LOCAL_QUIESCENT,
    LOAD_FINISHED,
    LOAD_NEW,
    LOAD_RELEASE_PENDING,
    LOAD_RELEASED,
    S_LOCAL_BAD_CHUNK,
    S_LOCAL_CHUNK,
    S_LOCAL_CHUNK_AFTER_END,
    S_LOCAL_FINAL_CHUNK,
    S_LOCAL_NOT_REGISTERED,
    S_LOCAL_REGISTERED,
    S_LOCAL_VLLM_FINISHED,
    S_RECV_FINISHED,
    SEND_DONE,
    SEND_NEW,
    SEND_VLLM_FINISHED,
    VLLM_LOAD,
    VLLM_SEND,
)
from rd2h_vllm.scheduler import CacheGroups, LoadSpec, Rd2hConnectorMetadata, SendAbort, SendSpec
from rd2h_vllm.scheduler import DecodeTarget as DecodeEngine

if TYPE_CHECKING:
    from vllm.distributed.parallel_state import GroupCoordinator

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: Version of how we derive layouts from vLLM's KV caches (part of the compat string).
LAYOUT_VERSION: Final = 1


# -- the TP group ----------------------------------------------------------------------------


class TpGroup(Protocol):
    """This worker's tensor-parallel rank and a gather over the TP CPU group."""

    @property
    def rank(self) -> int:
        """This worker's TP rank."""

    @property
    def size(self) -> int:
        """The TP world size."""

    def all_gather(self, obj: _T) -> list[_T]:
        """Every rank's ``obj``, indexed by rank (a collective: every rank calls it)."""


@dataclass(frozen=True, slots=True)
class SingleRank:
    """TP size 1, or one rank of a Prefill TP group simulated in one process: only
    Decode gathers, so a rank with ``size`` > 1 refuses to."""

    rank: int = 0
    size: int = 1

    def all_gather(self, obj: _T) -> list[_T]:
        if self.size != 1:
            raise ConfigError(f"SingleRank cannot gather over {self.size} ranks")
        return [obj]


class VllmTpGroup:
    """vLLM's TP group: ``all_gather_object`` over its CPU (gloo) process group."""

    def __init__(self, group: GroupCoordinator) -> None:
        self._group = group

    @property
    def rank(self) -> int:
        return int(self._group.rank_in_group)

    @property
    def size(self) -> int:
        return int(self._group.world_size)

    def all_gather(self, obj: _T) -> list[_T]:
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        torch.distributed.all_gather_object(out, obj, group=self._group.cpu_group)
        return out


def default_tp_group(config: Rd2hConfig) -> TpGroup:
    """vLLM's TP group when it is initialised, else a single rank (TP must be 1)."""
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():  # type: ignore[no-untyped-call]
        group = VllmTpGroup(parallel_state.get_tp_group())
        if group.size != config.tp_size:
            raise ConfigError(
                f"vLLM's TP group has {group.size} ranks but tensor_parallel_size is "
                f"{config.tp_size}"
            )
        return group
    if config.tp_size != 1:
        raise ConfigError(
            f"tensor_parallel_size is {config.tp_size} but vLLM's TP group is not "
            "initialised: the worker side needs it to learn its rank"
        )
    return SingleRank()


# -- KV caches -> layouts ---------------------------------------------------------------------


def _single_array(value: Any, num_blocks: int, what: str) -> ComponentDest:
    arrays = cache_arrays(value, num_blocks, what)
    if len(arrays) != 1:
        raise ConfigError(f"{what}: expected one block array, found {len(arrays)}")
    return arrays[0]


def _device_of(value: Any) -> str:
    tensor = value if isinstance(value, torch.Tensor) else value[0]
    return str(tensor.device.type)


def split_kv_caches(kv_caches: Mapping[str, Any], num_blocks: int) -> list[LayerCaches]:
    """vLLM's ``kv_caches`` as main layers in model order (``layers.N``, then name), each
    with its block arrays read from the tensors (:mod:`rd2h_vllm.kv_layout`).

    Entries whose name contains "indexer" are the sparse-attention indexer (and optional
    LIC8 scale) of the main layer with the same ``layers.N``.
    """
    mains = [name for name in kv_caches if "indexer" not in name]
    if not mains:
        raise ConfigError("register_kv_caches got no main (non-indexer) KV cache")
    mains.sort(key=lambda n: (layer_number(n) if layer_number(n) is not None else -1, n))
    indexers = match_indexer_caches(kv_caches, mains)
    out: list[LayerCaches] = []
    for name in mains:
        main = cache_arrays(kv_caches[name], num_blocks, f"KV cache {name!r}")
        idx, scale = indexers.get(name, (None, None))
        out.append(
            LayerCaches(
                name,
                main,
                None if idx is None else _single_array(idx, num_blocks, f"indexer of {name!r}"),
                None if scale is None else _single_array(scale, num_blocks, f"scale of {name!r}"),
                device=_device_of(kv_caches[name]),
            )
        )
    return out


def layout_summary(layers: Sequence[LayerCaches]) -> str:
    """One line for the start-up log: layer count and the first layer's block arrays."""
    first = layers[0]
    parts = [f"{len(layers)} layers", f"main {describe(first.main)}"]
    if first.indexer is not None:
        parts.append(f"indexer {first.indexer.block_bytes} B/block")
    if first.scale is not None:
        parts.append(f"scale {first.scale.block_bytes} B/block")
    parts.append(f"{first.main[0].num_blocks} blocks on {first.device}")
    return ", ".join(parts)


def compat_string(
    *, model_type: str, kv_dtype: str, block_sizes: Sequence[int], num_layers: int
) -> str:
    """What both sides must agree on before any byte moves (the v2 handshake's ``compat``):
    how layouts are derived, the model family, the KV dtype, the KV-cache groups' block
    sizes and the number of cache-bearing layers. Built from configuration both sides
    have (not from tensors: a Decode with a destination provider may hold no main KV)."""
    return (
        f"rd2h-layout-{LAYOUT_VERSION};model={model_type};kv_dtype={kv_dtype};"
        f"block_sizes={','.join(map(str, block_sizes))};layers={num_layers}"
    )


def prefill_layouts(
    layers: Sequence[LayerCaches], groups: CacheGroups, num_blocks: int
) -> list[tuple[str, LayerLayout]]:
    """The MF_META layouts of Prefill's KV caches (base addresses, bytes per block)."""
    idx_group = groups.indexer if groups.indexer is not None else groups.main
    out: list[tuple[str, LayerLayout]] = []
    for layer in layers:
        arrays = layer.arrays()
        extra = len(arrays) - len(layer.main)
        out.append(
            (
                layer.name,
                LayerLayout(
                    base_addrs=[a.base for a in arrays],
                    block_len=[a.block_bytes for a in arrays],
                    tensor_group_idx=[groups.main] * len(layer.main) + [idx_group] * extra,
                    main_tensor_count=len(layer.main),
                    num_blocks=num_blocks,
                ),
            )
        )
    return out


# -- Prefill ---------------------------------------------------------------------------------


def _endpoint_target(engine: DecodeEngine) -> DecodeTarget:
    """The producer endpoint's view of a Decode engine (host, base port, TP size)."""
    return DecodeTarget(engine.host, engine.base_port, engine.tp_size)


@dataclass(frozen=True, slots=True)
class _PendingAbort:
    """A prompt-list child to abort toward its Decode once a publication reached it."""

    child: SendAbort
    target: DecodeTarget
    give_up_at: float  # Decode's load timeout has failed the child by then


@dataclass(slots=True)
class _Send:
    """One Prefill request as the worker side tracks it."""

    req_id: str
    ext_id: str
    state: str = SEND_NEW  # of VLLM_SEND, changed only by step()

    def step(self, event: str) -> str:
        """Step :data:`VLLM_SEND`; return the effect."""
        effect, self.state = VLLM_SEND.step(self.state, event)
        return effect


class _Publisher:
    """Runs the compute path's calls into the Prefill worker in order.

    A call runs inline when nothing is queued; a layer whose device event is not done yet
    is queued behind it on a thread that waits for the event, and every later call queues
    behind it too, so the endpoint sees chunks, layers and step ends in program order.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending = 0
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.errors: list[BaseException] = []

    def run(self, fn: Callable[[], None], event: ScatterEvent | None = None) -> None:
        with self._cond:
            inline = self._pending == 0 and (event is None or event.query())
            if not inline:
                self._pending += 1
        if inline:
            fn()
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="rd2h-publisher", daemon=True)
            self._thread.start()

        def job() -> None:
            if event is not None:
                event.synchronize()
            fn()

        self._queue.put(job)

    def drain(self, timeout: float) -> bool:
        """Wait until every queued call ran; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                job()
            except Exception as exc:  # never kill the thread that orders publications
                logger.exception("RD2H publisher: a queued call raised")
                self.errors.append(exc)
            finally:
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(10.0)


class PrefillSide:
    """The Prefill (kv_producer) worker half (see the module docstring)."""

    def __init__(
        self,
        config: Rd2hConfig,
        groups: CacheGroups,
        layers: Sequence[LayerCaches],
        num_blocks: int,
        *,
        tp: TpGroup,
        backend: TransferBackend,
        events: DeviceEvents,
        compat: str,
        control_options: ControlOptions | None = None,
    ) -> None:
        self.config = config
        self.groups = groups
        self._events = events
        self._layers = [layer.name for layer in layers]
        self._index = {name: i for i, name in enumerate(self._layers)}
        # Layer numbers (the N of ``layers.N``, else the position: what a readiness
        # carries), by which a layerwise store names a layer and an indexer cache finds
        # its main layer.
        self._by_number = {n: i for i, n in enumerate(wire_layer_indices(self._layers))}
        self.stats = Rd2hKVConnectorStats()
        self._counters = CounterDelta()
        self._lock = threading.Lock()
        self._finished: list[RequestFinished] = []  # from the worker's threads
        self._sends: dict[str, _Send] = {}
        self._by_ext: dict[str, str] = {}
        # Decode engines a publication has gone to (their connection's handshake began),
        # and prompt-list children still waiting for one to abort toward theirs.
        self._contacted: set[DecodeTarget] = set()
        self._pending_aborts: list[_PendingAbort] = []
        self._step_active = False
        self._published: set[int] = set()
        self._top = -1
        self._gate_timeout_s = 2 * config.lease_ms / 1000.0 + 10.0
        self._publisher = _Publisher()
        self.worker = PrefillWorker(
            ProducerConfig(
                p_rank=tp.rank,
                p_tp=config.tp_size,
                session="",
                layers=prefill_layouts(layers, groups, num_blocks),
                lease_ms=config.lease_ms,
                read_failure_policy=config.read_failure_policy,
                protocol=config.protocol,
                compat=compat,
                handshake_timeout_s=config.handshake_timeout_s,
                silent_peer_timeout_s=config.silent_peer_timeout_s,
            ),
            backend,
            control_options=control_options,
            on_finished=self._on_finished,
            name=f"rd2h-p{tp.rank}",
            trace_dir=config.trace_dir,
        )

    # -- introspection ---------------------------------------------------------------------

    @property
    def layer_names(self) -> list[str]:
        """Main layers in wire order."""
        return list(self._layers)

    def sending(self) -> dict[str, bool]:
        """``{req_id: vLLM finished it}`` of every request still tracked."""
        return {r: s.state in SEND_VLLM_FINISHED for r, s in self._sends.items()}

    def is_idle(self) -> bool:
        """Nothing tracked here nor in the endpoint."""
        return not self._sends and not self._pending_aborts and self.worker.is_idle()

    def published(self) -> frozenset[int]:
        """Wire indices of the layers published so far in the current step."""
        return frozenset(self._published)

    def layer_index(self, layer_name: str) -> int | None:
        """The wire index of a main layer, or of the main layer an indexer belongs to."""
        idx = self._index.get(layer_name)
        if idx is None and "indexer" in layer_name:
            number = layer_number(layer_name)
            idx = self._by_number.get(number) if number is not None else None
        return idx

    def storage_layer(self, layer: str | int) -> int:
        """The position (in wire order) of the main layer whose storage ``layer`` names: a
        main or indexer layer name, or a layer NUMBER (the N of ``layers.N``, as
        :func:`~rd2h_protocol.topology.wire_layer_index` gives it), never a position.

        Raises :class:`~rd2h_protocol.errors.ConfigError` for a layer this Prefill holds no
        KV cache of: a store that names another model's layers must not pass unguarded.
        """
        idx = self._by_number.get(layer) if isinstance(layer, int) else self.layer_index(layer)
        if idx is None:
            numbers = sorted(self._by_number)
            raise ConfigError(
                f"layer {layer!r} has no KV cache on this Prefill: expected a layer name "
                f"such as {self._layers[0]!r} or a layer number in {numbers}; the store and "
                "RD2H must be configured for the same model"
            )
        return idx

    # -- the step ----------------------------------------------------------------------------

    def bind(self, meta: Rd2hConnectorMetadata) -> None:
        """Schedule this step's chunks (before the forward pass's first layer); take the
        prompt-list children to abort (see :meth:`end_step`)."""
        self._published.clear()
        self._top = -1
        for send in meta.sends:
            state = self._sends.get(send.req_id)
            if state is None:
                state = self._register(send)
            if self._ended(state.ext_id):
                event = S_LOCAL_CHUNK_AFTER_END
            else:
                event = S_LOCAL_FINAL_CHUNK if send.final else S_LOCAL_CHUNK
            if state.step(event) == EFFECT_SCHEDULE:
                self._schedule(state, send)
        give_up_at = time.monotonic() + self.config.kv_load_timeout_s
        for child in meta.send_aborts:
            target = _endpoint_target(child.target)
            self._pending_aborts.append(_PendingAbort(child, target, give_up_at))

    def _register(self, send: SendSpec) -> _Send:
        target = _endpoint_target(send.target)
        registered = True
        try:
            if send.ext_id in self._by_ext:
                raise LocalProtocolError(
                    f"external id {send.ext_id!r} is already in flight for request "
                    f"{self._by_ext[send.ext_id]!r}"
                )
            self.worker.add_request(send.ext_id, target)
        except ProtocolError as exc:
            # Prefill still computes the request; Decode fails it on its own deadline.
            logger.error("request %s: not published: %s", send.req_id, exc)
            self.stats.record_failure(exc.code)
            registered = False
        state = _Send(send.req_id, send.ext_id)
        state.step(S_LOCAL_REGISTERED if registered else S_LOCAL_NOT_REGISTERED)
        self._sends[send.req_id] = state
        if registered:
            self._by_ext[send.ext_id] = send.req_id
        return state

    def _schedule(self, state: _Send, send: SendSpec) -> None:
        groups = self.groups
        try:
            ms, me = chunk_block_range(
                remote_cached_tokens=send.remote_cached_tokens,
                transferred_tokens=send.transferred_tokens,
                computed_tokens=send.computed_tokens,
                block_size=groups.block_sizes[groups.main],
                allocated_blocks=len(send.main_block_ids),
                final=send.final,
            )
            indexer: list[int] = []
            i_start = 0
            if send.indexer_block_ids is not None and groups.indexer is not None:
                i_start, i_end = chunk_block_range(
                    remote_cached_tokens=send.remote_cached_tokens,
                    transferred_tokens=send.transferred_tokens,
                    computed_tokens=send.computed_tokens,
                    block_size=groups.block_sizes[groups.indexer],
                    allocated_blocks=len(send.indexer_block_ids),
                    final=send.final,
                )
                indexer = send.indexer_block_ids[i_start:i_end]
            elif send.indexer_block_ids is not None:
                # One group holds main and indexer: the same ids, the same range.
                indexer, i_start = send.indexer_block_ids[ms:me], ms
        except ProtocolError as exc:
            logger.error("request %s: bad chunk: %s", send.req_id, exc)
            self.stats.record_failure(exc.code)
            if state.step(S_LOCAL_BAD_CHUNK) == EFFECT_ABORT:  # nothing more goes out for it
                self._publisher.run(lambda: self.worker.abort([state.ext_id]))
            return
        main = send.main_block_ids[ms:me]
        ext, final = state.ext_id, send.final
        if main or indexer or final:
            # A publication will name the request: it opens the connection to its Decode.
            self._contacted.add(_endpoint_target(send.target))

        def schedule() -> None:
            try:
                self.worker.schedule_chunk(ext, main, indexer, ms, i_start, final)
            except LocalProtocolError:
                # The endpoint may have finished the request meanwhile (an ABORT from
                # Decode, a failure): then there is nothing left to publish for it.
                if ext in self.worker.requests():
                    raise
                logger.debug("request %s ended before its chunk was scheduled", ext)

        self._publisher.run(schedule)
        self._step_active = True

    def wait_writable(self, idx: int) -> None:
        """Block until the storage main layer ``idx`` (a position in wire order) writes is
        no longer read by Decode; safe from any thread (a store's transfer thread calls
        it too)."""
        layer_name = self._layers[idx]
        # Publications still queued have not closed their gates yet: let them first.
        if not self._publisher.drain(self._gate_timeout_s):
            raise TransferError(f"{layer_name}: earlier layers were not published in time")
        if self.worker.can_overwrite(idx):
            return
        start = time.monotonic()
        ok = self.worker.wait_writable(idx, self._gate_timeout_s)
        self.stats.record_gate_wait(time.monotonic() - start)
        if not ok:
            raise TransferError(
                f"{layer_name}: its storage is still being read after "
                f"{self._gate_timeout_s:.0f} s; refusing to overwrite it",
                code=ErrorCode.TIMEOUT,
            )

    def layer_written(self, layer_name: str) -> None:
        """The layer's KV is written (scatter issued): publish it once this step."""
        if not self._step_active:
            return
        idx = self.layer_index(layer_name)
        if idx is None or layer_name != self._layers[idx]:
            return  # indexers are published with their main layer
        if idx in self._published or idx <= self._top:
            return  # save_kv_layer and on_kv_cache_written both fire for one layer
        self._published.add(idx)
        self._top = idx
        event = self._events.record()
        self._publisher.run(lambda: self._publish(idx), event)

    def _publish(self, idx: int) -> None:
        if not self.worker.can_overwrite(idx):
            # The compute path wrote into storage still being read (no layer-entry wait):
            # publishing would be a lie; the step ends with this layer missing instead.
            logger.error("layer %s written without waiting for its storage", self._layers[idx])
            self.stats.record_failure(ErrorCode.STEP_INCOMPLETE)
            return
        self.worker.layer_written(idx)

    def end_step(self) -> None:
        """The step's forward pass is over; then abort the prompt-list children whose
        Decode a publication has reached."""
        if self._step_active:
            self._step_active = False
            self._publisher.run(self.worker.end_step)
        if self._pending_aborts:
            self._abort_reachable_children()

    def _abort_reachable_children(self) -> None:
        """Abort pending prompt-list children toward Decode engines a publication reached.

        The endpoint can tell a Decode only over a connection whose handshake has begun
        (a publication begins it; an ABORT toward a connection never used is dropped), so a
        child waits until a publication went to its Decode engine: in practice a sibling's,
        in the same step. Queued behind this step's publications, its ABORT goes out on the
        connection they opened (held until the handshake ends). A child that no publication
        reaches within the load timeout is dropped: its Decode has failed it by then.
        """
        now = time.monotonic()
        waiting: list[_PendingAbort] = []
        for pending in self._pending_aborts:
            if pending.target in self._contacted:
                self._publisher.run(functools.partial(self._abort_child, pending))
            elif now < pending.give_up_at:
                waiting.append(pending)
            else:
                logger.warning(
                    "request %s: prompt-list child %s was never aborted toward Decode %s:%d "
                    "(nothing was published to it); Decode fails it on its load timeout",
                    pending.child.req_id,
                    pending.child.ext_id,
                    pending.target.host,
                    pending.target.base_port,
                )
        self._pending_aborts = waiting

    def _abort_child(self, pending: _PendingAbort) -> None:
        """Register the child with the endpoint and abort it at once: a v2 Decode fails it
        on the ABORT; a v1 Decode has no ABORT message and fails it on its load timeout."""
        child, target = pending.child, pending.target
        logger.warning(
            "request %s: prompt-list child %s has no usable rendezvous (%s); aborting it "
            "toward Decode %s:%d (a v1 Decode cannot be told and fails it on its load timeout)",
            child.req_id,
            child.ext_id,
            child.message,
            target.host,
            target.base_port,
        )
        try:
            self.worker.add_request(child.ext_id, target)
        except ProtocolError as exc:
            # E.g. its external id is in flight for another request: that one must not be
            # aborted, so this child fails on Decode's load timeout.
            logger.error("request %s: child %s not aborted: %s", child.req_id, child.ext_id, exc)
            self.stats.record_failure(exc.code)
            return
        self.worker.abort([child.ext_id])

    # -- completion --------------------------------------------------------------------------

    def _on_finished(self, finished: RequestFinished) -> None:
        with self._lock:
            self._finished.append(finished)

    def _ended(self, ext_id: str) -> bool:
        """Whether the endpoint already finished ``ext_id`` (not collected yet)."""
        with self._lock:
            return any(f.ext_req_id == ext_id for f in self._finished)

    def get_finished(self, finished_req_ids: Iterable[str]) -> set[str]:
        """Requests whose blocks vLLM may free now (``finished_sending``)."""
        aborts: list[str] = []
        for req_id in finished_req_ids:
            state = self._sends.get(req_id)
            if state is None:
                continue
            if state.step(S_LOCAL_VLLM_FINISHED) == EFFECT_ABORT:
                aborts.append(state.ext_id)  # finished before its prompt was: aborted
        if aborts:
            self._publisher.run(lambda: self.worker.abort(aborts))
        with self._lock:
            finished, self._finished = self._finished, []
        for f in finished:
            owner = self._by_ext.get(f.ext_req_id)
            state = self._sends.get(owner) if owner is not None else None
            if state is None:
                continue
            state.step(S_RECV_FINISHED)
            if not f.ok:
                self.stats.record_failure(f.code or ErrorCode.UNKNOWN)
                logger.warning("request %s: KV not delivered: %s", owner, f.message)
        done = {r for r, s in self._sends.items() if s.state == SEND_DONE}
        for req_id in done:
            state = self._sends.pop(req_id)
            if self._by_ext.get(state.ext_id) == req_id:  # it was registered
                del self._by_ext[state.ext_id]
        return done

    def take_stats(self) -> Rd2hKVConnectorStats | None:
        """This interval's stats (endpoint counters included), then reset."""
        self.stats.record_counters(self._counters.take(self.worker.stats))
        return self.stats.take()

    def close(self) -> None:
        """Stop publishing; close the worker (and its backend)."""
        self._publisher.drain(5.0)
        self._publisher.close()
        self.worker.close()


# -- Decode ----------------------------------------------------------------------------------


@dataclass(slots=True)
class _Load:
    """One Decode request as the worker side tracks it."""

    spec: LoadSpec
    state: str = LOAD_NEW  # of VLLM_LOAD, changed only by step()
    failed: bool = False  # the completion rule's verdict: it failed on some rank

    def step(self, event: str) -> str:
        """Step :data:`VLLM_LOAD`; return the effect."""
        effect, self.state = VLLM_LOAD.step(self.state, event)
        return effect


class DecodeSide:
    """The Decode (kv_consumer) worker half (see the module docstring)."""

    def __init__(
        self,
        config: Rd2hConfig,
        groups: CacheGroups,
        destinations: DestinationProvider,
        *,
        tp: TpGroup,
        backend: TransferBackend,
        host: str,
        port: int,
        compat: str,
        report_block_errors: bool,
        control_options: ControlOptions | None = None,
    ) -> None:
        self.config = config
        self.groups = groups
        self.destinations = destinations
        self._tp = tp
        self._report_blocks = report_block_errors
        self.stats = Rd2hKVConnectorStats()
        self._counters = CounterDelta()
        self._lock = threading.Lock()
        self._outcomes: list[Outcome] = []
        self._reads: list[ReadRecord] = []
        self._loads: dict[str, _Load] = {}
        self._by_ext: dict[str, str] = {}
        self._error_blocks: set[int] = set()
        #: Loads reported failed by the last get_finished: req_id -> (main, indexer) ids.
        self.last_failed: dict[str, tuple[list[int], list[int]]] = {}
        self.completion = CrossRankCompletion(tp.size)
        # A read must end well within half the Prefill lease (see DecodeWorker).
        read_timeout_s = max(0.1, min(10.0, 0.4 * config.lease_ms / 1000.0))
        self.worker = DecodeWorker(
            ConsumerConfig(
                d_rank=tp.rank,
                d_tp=config.tp_size,
                layers=destinations.layouts(),
                compat=compat,
                kv_load_timeout_s=config.kv_load_timeout_s,
                max_read_retries=config.max_read_retries,
                main_shared=destinations.main_shared,
            ),
            backend,
            host=host,
            port=port,
            control_options=control_options,
            read_timeout_s=read_timeout_s,
            on_outcome=self._on_outcome,
            on_read=self._on_read,
            trace_dir=config.trace_dir,
        )

    # -- introspection ---------------------------------------------------------------------

    def loading(self) -> dict[str, bool]:
        """``{req_id: finished on every rank}`` of every load still tracked."""
        return {r: load.state in LOAD_FINISHED for r, load in self._loads.items()}

    def is_idle(self) -> bool:
        """Nothing tracked here, in the completion rule or in the endpoint."""
        return not self._loads and self.completion.is_idle() and self.worker.is_idle()

    # -- the step ----------------------------------------------------------------------------

    def bind(self, meta: Rd2hConnectorMetadata) -> None:
        """Register new destinations; abort loads whose rendezvous failed."""
        now = time.monotonic()
        for spec in meta.loads:
            if spec.req_id not in self._loads:
                self._add(spec, now)
        for failure in meta.load_failures:
            load = self._loads.get(failure.req_id)
            if load is not None:
                self._fail(load, failure.message)

    def _add(self, spec: LoadSpec, now: float) -> None:
        indexer = spec.indexer_block_ids if spec.indexer_block_ids is not None else []
        load = _Load(spec)
        self._loads[spec.req_id] = load
        if spec.ext_id in self._by_ext:
            # Two live loads under one external id: Prefill could not tell them apart.
            # Every rank sees the same metadata, so each fails this one on its own (the
            # cross-rank rule, keyed by external id, would confuse it with the other).
            other = self._by_ext[spec.ext_id]
            logger.error(
                "request %s: external id %r is already loading for request %s",
                spec.req_id,
                spec.ext_id,
                other,
            )
            self.stats.record_failure(ErrorCode.UNKNOWN_REQUEST)
            load.failed = True
            load.step(L_LOCAL_DUPLICATE)
            return
        self._by_ext[spec.ext_id] = spec.req_id
        try:
            self.worker.add_request(spec.ext_id, spec.main_block_ids, indexer)
        except ProtocolError as exc:
            if load.step(L_LOCAL_ADD_FAILED) == EFFECT_REPORT_LOCAL:
                with self._lock:
                    self._outcomes.append(Outcome(spec.ext_id, False, exc.code, exc.message))
            return
        load.step(L_LOCAL_ADDED)

    def _fail(self, load: _Load, message: str) -> None:
        """A rendezvous failure, or vLLM finished it: abort it if it still loads."""
        if load.step(L_LOCAL_FAIL) == EFFECT_ABORT:
            self.worker.abort([load.spec.ext_id], message)

    def _on_outcome(self, outcome: Outcome) -> None:
        with self._lock:
            self._outcomes.append(outcome)

    def _on_read(self, record: ReadRecord) -> None:
        with self._lock:
            self._reads.append(record)

    def get_finished(self, finished_req_ids: Iterable[str]) -> tuple[set[str], set[str]]:
        """``(finished_recving, failed_recving)`` of this step (a TP collective)."""
        for req_id in finished_req_ids:
            load = self._loads.get(req_id)
            if load is not None:
                # vLLM finished (aborted) it, maybe while it was loading.
                self._fail(load, "aborted by vLLM while loading")
        with self._lock:
            outcomes, self._outcomes = self._outcomes, []
        done = [o.ext_req_id for o in outcomes if o.ok]
        failed = [o.ext_req_id for o in outcomes if not o.ok]
        for o in outcomes:
            if not o.ok:
                self.stats.record_failure(o.code or ErrorCode.UNKNOWN)
                logger.warning(
                    "request %s: KV not received on TP rank %d: %s (%s)",
                    self._by_ext.get(o.ext_req_id, o.ext_req_id),
                    self._tp.rank,
                    o.message,
                    (o.code or ErrorCode.UNKNOWN).name,
                )
        gathered = self._tp.all_gather((RankReport(done=done, failed=failed), time.monotonic()))
        result = self.completion.update(
            [report for report, _ in gathered], self._by_ext.get, gathered[0][1]
        )
        for ext in result.dropped:
            logger.warning("request %s: completion given up (no id mapping)", ext)
        for req_id in result.finished:
            load = self._loads.get(req_id)
            if load is None:
                continue
            load.failed = req_id in result.load_errors
            if load.step(L_LOCAL_COMPLETED) == EFFECT_RELEASE and self.worker.release(
                load.spec.ext_id
            ):
                load.step(L_LOCAL_QUIESCENT)
        recving: set[str] = set()
        failed_recving: set[str] = set()
        self.last_failed = {}
        for req_id, load in list(self._loads.items()):
            if load.state == LOAD_RELEASE_PENDING:
                if not self.worker.wait_releasable(load.spec.ext_id, 0.0):
                    continue  # a read may still write its blocks
                load.step(L_LOCAL_QUIESCENT)
            if load.state != LOAD_RELEASED:
                continue
            recving.add(req_id)
            del self._loads[req_id]
            if self._by_ext.get(load.spec.ext_id) == req_id:
                del self._by_ext[load.spec.ext_id]
            if load.failed:
                failed_recving.add(req_id)
                main, indexer = self._loaded_blocks(load.spec)
                self.last_failed[req_id] = (main, indexer)
                logger.warning(
                    "request %s: KV load failed; the %d blocks it was to load are reported "
                    "invalid (vLLM recomputes them with kv_load_failure_policy=recompute, "
                    "else fails the request); none enters the prefix cache",
                    req_id,
                    len(main) + len(indexer),
                )
                if self._report_blocks:
                    self._error_blocks.update(main)
                    self._error_blocks.update(indexer)
        return recving, failed_recving

    def _loaded_blocks(self, spec: LoadSpec) -> tuple[list[int], list[int]]:
        """The main and indexer blocks a load was to write: those past the request's
        local prefix hit (whole blocks, valid and possibly shared with other requests)."""
        sizes, groups = self.groups.block_sizes, self.groups
        main = list(spec.main_block_ids[spec.local_tokens // sizes[groups.main] :])
        if spec.indexer_block_ids is None:
            return main, []
        idx_size = sizes[groups.indexer if groups.indexer is not None else groups.main]
        return main, list(spec.indexer_block_ids[spec.local_tokens // idx_size :])

    def take_load_errors(self) -> set[int]:
        """Blocks of failed loads reported this step (single KV-cache group only)."""
        blocks, self._error_blocks = self._error_blocks, set()
        return blocks

    def take_stats(self) -> Rd2hKVConnectorStats | None:
        """This interval's stats (reads per layer, endpoint counters), then reset."""
        with self._lock:
            reads, self._reads = self._reads, []
        for r in reads:
            if r.error is None:
                self.stats.record_read(r.layer_name, r.nbytes, r.descriptors, r.seconds)
        self.stats.record_counters(self._counters.take(self.worker.stats))
        return self.stats.take()

    def close(self) -> None:
        """Close the worker (and its backend)."""
        self.worker.close()


__all__ = [
    "LAYOUT_VERSION",
    "DecodeSide",
    "PrefillSide",
    "SingleRank",
    "TpGroup",
    "VllmTpGroup",
    "compat_string",
    "default_tp_group",
    "layout_summary",
    "prefill_layouts",
    "split_kv_caches",
]
