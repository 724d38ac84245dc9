"""The Prefill half of the worker-side connector (kv_producer); see :mod:`rd2h_vllm.worker`.

:class:`PrefillSide` follows vLLM's worker hooks and the ``vLLM send`` machine per
request. What it keeps per request and which blocks a step sends are plain data and pure
functions in :mod:`rd2h_vllm.worker.prefill_requests`; the runner that keeps its calls
into the Prefill worker in program order is :mod:`rd2h_vllm.worker.publisher`.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from rd2h_protocol.claim import Claim, ClaimAnswer
from rd2h_protocol.errors import (
    ConfigError,
    ErrorCode,
    LocalProtocolError,
    ProtocolError,
    TransferError,
)
from rd2h_protocol.events import Chunk
from rd2h_protocol.machines import NO_EFFECT, no_effect
from rd2h_protocol.producer import DecodeTarget, ProducerConfig, RequestFinished
from rd2h_protocol.topology import layer_number, wire_layer_indices
from rd2h_runtime.claims import ClaimDoor
from rd2h_runtime.control import ControlError, ControlOptions
from rd2h_runtime.prefill import PrefillWorker
from rd2h_runtime.transfer import TransferBackend
from rd2h_vllm.config import Rd2hConfig
from rd2h_vllm.destinations import (
    DeviceEvents,
    LayerCaches,
)
from rd2h_vllm.metadata import CacheGroups, Rd2hConnectorMetadata, SendSpec
from rd2h_vllm.metrics import CounterDelta, Rd2hKVConnectorStats
from rd2h_vllm.request_machines import (
    EFFECT_ABORT,
    EFFECT_SCHEDULE,
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
    VLLM_SEND,
)
from rd2h_vllm.worker.common import (
    TpGroup,
    prefill_layouts,
)
from rd2h_vllm.worker.prefill_requests import (
    KeptRequest,
    PendingAbort,
    endpoint_target,
    request_chunk,
)
from rd2h_vllm.worker.publisher import Publisher

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Send:
    """One Prefill request as the worker side tracks it."""

    req_id: str
    ext_id: str
    state: str = SEND_NEW  # of VLLM_SEND, changed only by firing _SEND


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
        host: str,
        control_options: ControlOptions | None = None,
    ) -> None:
        self.config = config
        self.groups = groups
        self._events = events
        self._rank = tp.rank
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
        self._pending_aborts: list[PendingAbort] = []
        self._step_active = False
        self._published: set[int] = set()
        self._top = -1
        self._gate_timeout_s = 2 * config.lease_ms / 1000.0 + 10.0
        self._publisher = Publisher()
        # Prefill-first: requests kept for their Decode's claim (the door's thread reads
        # them too: _keep_lock), and this step's to keep once its layers are written.
        self._keep_lock = threading.Lock()
        self._keeps: dict[str, KeptRequest] = {}  # by external id
        self._to_keep: list[KeptRequest] = []
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
                claim_timeout_s=config.claim_timeout_s,
            ),
            backend,
            control_options=control_options,
            on_finished=self._on_finished,
            name=f"rd2h-p{tp.rank}",
            trace_dir=config.trace_dir,
        )
        self.door: ClaimDoor | None = ClaimDoor(
            host, config.base_port + tp.rank, self._on_claim, options=control_options
        )
        try:
            self.door.start()
        except ControlError as exc:
            # Decode-first still works; Prefill-first requests are refused (end_step).
            logger.error(
                "RD2H Prefill TP rank %d: cannot open its claim port: %s; requests sent by a "
                "standard router (Prefill-first) will not be transferred: set kv_port in "
                "--kv-transfer-config to a free port (rank r uses kv_port + r)",
                tp.rank,
                exc,
            )
            self.door = None

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
        return (
            not self._sends
            and not self._pending_aborts
            and not self._keeps
            and self.worker.is_idle()
        )

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
            if send.target is None:
                if send.final:  # computed in this step: kept once its layers are written
                    self._to_keep.append(
                        KeptRequest(
                            send.req_id,
                            send.ext_id,
                            send.main_block_ids,
                            send.indexer_block_ids,
                            send.computed_tokens,
                        )
                    )
                continue
            state = self._sends.get(send.req_id)
            if state is None:
                state = self._register(send)
            if self._ended(state.ext_id):
                event = S_LOCAL_CHUNK_AFTER_END
            else:
                event = S_LOCAL_FINAL_CHUNK if send.final else S_LOCAL_CHUNK
            _SEND.fire(self, state, event, send)
        give_up_at = time.monotonic() + self.config.kv_load_timeout_s
        for child in meta.send_aborts:
            target = endpoint_target(child.target)
            self._pending_aborts.append(PendingAbort(child, target, give_up_at))

    def _register(self, send: SendSpec) -> _Send:
        assert send.target is not None  # a Prefill-first send is kept instead (bind)
        target = endpoint_target(send.target)
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
        _SEND.fire(self, state, S_LOCAL_REGISTERED if registered else S_LOCAL_NOT_REGISTERED)
        self._sends[send.req_id] = state
        if registered:
            self._by_ext[send.ext_id] = send.req_id
        return state

    def _fx_schedule(self, state: _Send, send: SendSpec) -> None:
        """Schedule the chunk ``send`` carries in the endpoint (:data:`VLLM_SEND`'s effect)."""
        try:
            chunk = request_chunk(
                self.groups,
                state.ext_id,
                send.main_block_ids,
                send.indexer_block_ids,
                cached_tokens=send.remote_cached_tokens,
                transferred_tokens=send.transferred_tokens,
                computed_tokens=send.computed_tokens,
                final=send.final,
            )
        except ProtocolError as exc:
            logger.error("request %s: bad chunk: %s", send.req_id, exc)
            self.stats.record_failure(exc.code)
            aborts: list[str] = []
            _SEND.fire(self, state, S_LOCAL_BAD_CHUNK, aborts)  # nothing more goes out for it
            self._abort(aborts)
            return
        ext, final = state.ext_id, send.final
        main, indexer = list(chunk.main_block_ids), list(chunk.indexer_block_ids)
        ms, i_start = chunk.main_start, chunk.indexer_start
        if (main or indexer or final) and send.target is not None:
            # A publication will name the request: it opens the connection to its Decode.
            self._contacted.add(endpoint_target(send.target))

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
        for keep in self._to_keep:
            with self._keep_lock:
                self._keeps[keep.ext_id] = keep
            self._publisher.run(functools.partial(self._keep, keep))
        self._to_keep = []
        if self._pending_aborts:
            self._abort_reachable_children()

    # -- Prefill-first -----------------------------------------------------------------------

    def _keep(self, keep: KeptRequest) -> None:
        """Keep a computed Prefill-first request in the endpoint for its Decode's claim."""
        why = "" if self.door is not None else "this rank's claim port is not open"
        if not why:
            try:
                self.worker.keep_request(keep.ext_id)
            except ProtocolError as exc:
                why = exc.message
                self.stats.record_failure(exc.code)
        with self._keep_lock:
            keep.kept = not why
            keep.refusal = why
            keep.ended = bool(why)
        if why:
            logger.error(
                "request %s (Prefill-first, from a standard router): not kept for its Decode: "
                "%s; the Decode's claim will be refused",
                keep.req_id,
                why,
            )

    def _on_claim(self, claim: Claim) -> ClaimAnswer:
        """A Decode claims a kept request (the door's I/O thread): publish it to that
        Decode now (the layers a step under way has not written yet at its end)."""
        with self._keep_lock:
            keep = self._keeps.get(claim.request_id)
            kept = keep is not None and keep.kept
        if keep is not None and not kept and not keep.refusal:
            # Its step's layers are still being published: let them go first.
            self._publisher.drain(self._gate_timeout_s)
        target = DecodeTarget(claim.host, claim.port, claim.tp_size)
        refusal = keep.refusal if keep is not None else ""
        if keep is not None and not refusal and claim.num_tokens != keep.num_tokens:
            refusal = (
                f"the claim is for a prompt of {claim.num_tokens} tokens, Prefill computed "
                f"{keep.num_tokens} (another tokenizer or prompt?)"
            )
        if refusal:
            return ClaimAnswer(
                request_id=claim.request_id,
                ok=False,
                code=int(ErrorCode.UNKNOWN_REQUEST),
                message=refusal,
            )
        chunk = Chunk(ext_req_id=claim.request_id, main_block_ids=[], final=True)
        if keep is not None:
            try:
                chunk = request_chunk(
                    self.groups,
                    keep.ext_id,
                    keep.main_block_ids,
                    keep.indexer_block_ids,
                    cached_tokens=claim.cached_tokens,
                    transferred_tokens=0,
                    computed_tokens=keep.num_tokens,
                    final=True,
                )
            except ProtocolError as exc:
                return ClaimAnswer(
                    request_id=claim.request_id, ok=False, code=int(exc.code), message=exc.message
                )
        answer = self.worker.claim(claim.request_id, target, chunk)
        if not answer.ok:
            logger.warning(
                "claim of %s by Decode %s:%d refused: %s",
                claim.request_id,
                claim.host,
                claim.port,
                answer.message,
            )
        return ClaimAnswer(
            request_id=claim.request_id,
            ok=answer.ok,
            code=int(answer.code or 0),
            message=answer.message,
        )

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
        waiting: list[PendingAbort] = []
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

    def _abort_child(self, pending: PendingAbort) -> None:
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
        kept_by_req = {k.req_id: k for k in self._keeps.values()}
        for req_id in finished_req_ids:
            keep = kept_by_req.get(req_id)
            if keep is not None:
                keep.vllm_finished = True
            state = self._sends.get(req_id)
            if state is None:
                continue
            # One vLLM finished before its final chunk was scheduled is aborted.
            _SEND.fire(self, state, S_LOCAL_VLLM_FINISHED, aborts)
        self._abort(aborts)
        with self._lock:
            finished, self._finished = self._finished, []
        for f in finished:
            if f.ext_req_id in self._keeps:
                self._kept_finished(self._keeps[f.ext_req_id], f)
                continue
            owner = self._by_ext.get(f.ext_req_id)
            state = self._sends.get(owner) if owner is not None else None
            if state is None:
                continue
            _SEND.fire(self, state, S_RECV_FINISHED)
            if not f.ok:
                self.stats.record_failure(f.code or ErrorCode.UNKNOWN)
                logger.warning("request %s: KV not delivered: %s", owner, f.message)
        done = {r for r, s in self._sends.items() if s.state == SEND_DONE}
        for req_id in done:
            state = self._sends.pop(req_id)
            if self._by_ext.get(state.ext_id) == req_id:  # it was registered
                del self._by_ext[state.ext_id]
        with self._keep_lock:
            over = [k for k in self._keeps.values() if k.ended and k.vllm_finished]
            for keep in over:
                del self._keeps[keep.ext_id]
        done.update(k.req_id for k in over)
        return done

    def _kept_finished(self, keep: KeptRequest, finished: RequestFinished) -> None:
        """The endpoint finished a kept request: read by its Decode, or never claimed."""
        with self._keep_lock:
            keep.ended = True
        if not finished.ok:
            self.stats.record_failure(finished.code or ErrorCode.UNKNOWN)
            logger.warning(
                "request %s (Prefill-first): KV not delivered: %s; its blocks are freed",
                keep.req_id,
                finished.message,
            )

    def _fx_abort(self, state: _Send, aborts: list[str]) -> None:
        """Abort it toward its Decode (:data:`VLLM_SEND`'s effect): with the other ``aborts``
        of the call, in one :meth:`_abort`."""
        aborts.append(state.ext_id)

    def _abort(self, ext_ids: list[str]) -> None:
        """Abort ``ext_ids`` in the endpoint, in order behind what is queued."""
        if ext_ids:
            self._publisher.run(lambda: self.worker.abort(ext_ids))

    def take_stats(self) -> Rd2hKVConnectorStats | None:
        """This interval's stats (endpoint counters included), then reset."""
        self.stats.record_counters(self._counters.take(self.worker.stats))
        return self.stats.take()

    def close(self) -> None:
        """Stop publishing; close the claim door and the worker (and its backend)."""
        if self.door is not None:
            self.door.close()
        self._publisher.drain(5.0)
        self._publisher.close()
        self.worker.close()


# -- the table drives the action: each declared effect bound to its handler ----------------

_SEND: Final = VLLM_SEND.bind(
    {
        NO_EFFECT: no_effect,
        EFFECT_SCHEDULE: PrefillSide._fx_schedule,
        EFFECT_ABORT: PrefillSide._fx_abort,
    }
)
