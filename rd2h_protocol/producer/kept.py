"""The kept request machine's effects: the Prefill-first flow.

A standard router (vllm-router, llm-d, vLLM's example proxy) sends Prefill the prompt
first, with no Decode named. Prefill computes it, keeps its blocks and answers where its
KV is (:mod:`rd2h_protocol.claim`); the router then sends the request to a Decode, which
*claims* it from this rank. :meth:`KeptEffects.keep_request` holds the request for the
claim window; :meth:`KeptEffects.claim` registers a Prefill request toward the claiming
Decode and publishes its layers detached from the compute step (the KV was written in
earlier steps and its blocks are still held): at once, except that the layers a step
under way has not written yet wait for that step's end, so that no gate closes between
the step's wait for a layer's storage and its write. The request then ends as any other:
once every publication naming it has ended. A claim window that runs out
finishes the request unread (:class:`RequestFinished` with ``LEASE_EXPIRED``), so its
blocks are freed even when no Decode ever comes.

Keeping needs storage that nothing overwrites meanwhile: a Prefill whose layers share
storage (a reuse ring, such as AscendStore's layerwise buffers) reuses it in the very next
step, so it refuses to keep a request.
"""

from __future__ import annotations

import heapq
from typing import ClassVar

from rd2h_protocol.errors import ErrorCode, LocalProtocolError, TopologyError
from rd2h_protocol.events import Chunk, ClaimAnswered, RequestFinished
from rd2h_protocol.machines.declare import NO_EFFECT, BoundMachine, no_effect
from rd2h_protocol.machines.producer import (
    CONN_READY_V1,
    EFFECT_PUBLISH_KEPT,
    EFFECT_REFUSE_CLAIM,
    EFFECT_RELEASE_UNCLAIMED,
    K_RECV_CLAIM,
    K_RECV_CLAIM_UNUSABLE,
    K_TIMER_CLAIM_EXPIRED,
    KEPT_REQUEST,
    PREFILL_REQUEST,
    R_LOCAL_CLAIMED,
    R_SEND_DONE,
    REQ_PUBLISHING,
)
from rd2h_protocol.machines.producer_inputs import ClaimAt, ReqChunk
from rd2h_protocol.producer.config import DecodeTarget
from rd2h_protocol.producer.records import Conn, Kept, Pub, Request
from rd2h_protocol.producer.state import Effects
from rd2h_protocol.wire.messages import ReadReq

#: What a Prefill that cannot keep a request says (and where to go instead).
NOT_KEPT_SHARED_STORAGE = (
    "this Prefill's layers share storage buffers that the next step reuses (a layerwise "
    "store such as AscendStore), so it cannot keep a request's KV for a Decode that comes "
    "later: the Prefill-first flow of a standard router is not possible here; run rd2h's "
    "Decode-first proxy (rd2h proxy) in front of it instead"
)
NOT_KEPT_V1 = (
    "this Prefill speaks protocol v1 only (protocol='v1'), and v1 has no Prefill-first "
    "flow: run rd2h's Decode-first proxy (rd2h proxy) in front of it, or protocol v2"
)


class KeptEffects(Effects):
    """Effects of :data:`~rd2h_protocol.machines.producer.KEPT_REQUEST`, and its inputs."""

    __slots__ = ()

    TABLE: ClassVar[BoundMachine]

    def can_keep(self) -> str | None:
        """Why this endpoint cannot keep a request, or None."""
        state = self.state
        if state.v1_only:
            return NOT_KEPT_V1
        storages = {slots[0] for slots in state.layer_slots}
        if len(storages) < len(state.layer_slots):
            return NOT_KEPT_SHARED_STORAGE
        return None

    def keep_request(self, ext_req_id: str, now: float) -> None:
        """What :meth:`~.endpoint.ProducerEndpoint.keep_request` says."""
        why = self.can_keep()
        if why is not None:
            raise LocalProtocolError(f"request {ext_req_id!r} cannot be kept: {why}")
        state = self.state
        if ext_req_id in state.kept or ext_req_id in state.requests:
            raise LocalProtocolError(f"request {ext_req_id!r} is already kept or registered")
        uid = state.uid()
        deadline = now + state.config.claim_timeout_s
        kept = Kept(ext_req_id, uid, deadline)
        state.kept[ext_req_id] = kept
        state.kept_timers[uid] = kept
        heapq.heappush(state.timers, (deadline, uid))
        state.stats.kept += 1

    def claim(self, ext_req_id: str, target: DecodeTarget, chunk: Chunk, now: float) -> None:
        """What :meth:`~.endpoint.ProducerEndpoint.claim` says (the answer among the
        outputs)."""
        state = self.state
        config = state.config
        kept = state.kept.get(ext_req_id)
        if kept is None:
            state.stats.claims_refused += 1
            state.out.append(
                ClaimAnswered(
                    ext_req_id,
                    False,
                    ErrorCode.UNKNOWN_REQUEST,
                    f"request {ext_req_id!r} is not kept on Prefill rank {config.p_rank}: "
                    "never computed here, delivered already, or its claim window "
                    f"({config.claim_timeout_s:g} s) ran out",
                )
            )
            return
        conn: Conn | None = None
        problem = ""
        try:
            conn = self.conn_fx.conn_for(target)
        except TopologyError as exc:
            problem = exc.message
        if conn is not None and conn.state == CONN_READY_V1:
            problem = f"Decode {conn.name} speaks protocol v1, which has no Prefill-first flow"
        if problem:
            self.TABLE.apply(self, kept, K_RECV_CLAIM_UNUSABLE, ClaimAt(None, chunk, problem, now))
        else:
            self.TABLE.apply(self, kept, K_RECV_CLAIM, ClaimAt(conn, chunk, "", now))

    # The kept machine's claim effects: (kept, ctx: ClaimAt).

    def _fx_publish_kept(self, kept: Kept, ctx: ClaimAt) -> None:
        """Claimed: register the request toward its Decode, publish its layers. A step
        that scheduled chunks may be between waiting for a layer's storage and writing
        it: publishing that layer now would close its gates under the write, so the
        layers the step has not written yet wait for its end (:meth:`publish_waiting`)."""
        conn, chunk, now = ctx.conn, ctx.chunk, ctx.now
        assert conn is not None  # RECV_CLAIM: a usable claim names its connection
        state = self.state
        del state.kept_timers[kept.uid]
        kept.claimed_by = conn.name
        state.stats.claimed += 1
        req = Request(kept.ext_id, conn, PREFILL_REQUEST.initial)
        state.requests[kept.ext_id] = req
        main, indexer = list(chunk.main_block_ids), list(chunk.indexer_block_ids)
        req_fx = self.req_fx
        req_fx.TABLE.apply(req_fx, req, R_LOCAL_CLAIMED, ReqChunk(chunk, main, indexer))
        state.out.append(ClaimAnswered(kept.ext_id, True, None, ""))
        read_reqs = [req.chunk] if req.chunk is not None else []
        req.chunk = None
        n_layers = len(state.layer_slots)
        step_open = bool(state.step) or state.step_layers > 0
        first_waiting = state.step_top + 1 if step_open else n_layers
        self._publish_claimed(req, read_reqs, range(first_waiting), now)
        if first_waiting < n_layers:
            state.claims_waiting[req.ext_id] = (first_waiting, read_reqs)

    def publish_waiting(self, now: float) -> None:
        """The step ended: publish the layers claims left for it (those still wanted)."""
        state = self.state
        waiting, state.claims_waiting = state.claims_waiting, {}
        n_layers = len(state.layer_slots)
        for ext_id, (first, read_reqs) in waiting.items():
            req = state.requests.get(ext_id)
            if req is not None and req.state in REQ_PUBLISHING:
                self._publish_claimed(req, read_reqs, range(first, n_layers), now)

    def _publish_claimed(
        self, req: Request, read_reqs: list[ReadReq], layers: range, now: float
    ) -> None:
        state = self.state
        deadline = now + state.lease_s
        req_fx, publish = self.req_fx, self.pub_fx.publish
        pubs: list[Pub] = []
        for layer_idx in layers:
            done: list[str] = []
            if layer_idx == state.last_layer:
                done.append(req.ext_id)
                req_fx.TABLE.apply(req_fx, req, R_SEND_DONE, None)
            pubs.append(
                publish(layer_idx, state.layer_slots[layer_idx], read_reqs, done, [req], deadline)
            )
        conn_fx = self.conn_fx
        for pub in pubs:
            conn_fx.publish(pub, now)

    def _fx_refuse_claim(self, kept: Kept, ctx: ClaimAt) -> None:
        """A claim this Prefill does not publish: say why."""
        problem = ctx.problem
        self.state.stats.claims_refused += 1
        if not problem:
            problem = (
                f"request {kept.ext_id!r} was claimed already by Decode {kept.claimed_by}; "
                "its KV is published once"
            )
        self.state.out.append(ClaimAnswered(kept.ext_id, False, ErrorCode.UNKNOWN_REQUEST, problem))

    def claim_expired(self, uid: int) -> bool:
        """The claim window of a kept request ran out (False: ``uid`` is not one)."""
        kept = self.state.kept_timers.pop(uid, None)
        if kept is None:
            return False
        self.TABLE.apply(self, kept, K_TIMER_CLAIM_EXPIRED, None)
        return True

    def _fx_release_unclaimed(self, kept: Kept, _ctx: None) -> None:
        """No Decode claimed it in time: it ends unread, its blocks may be freed."""
        state = self.state
        del state.kept[kept.ext_id]
        state.stats.unclaimed += 1
        state.out.append(
            RequestFinished(
                kept.ext_id,
                False,
                ErrorCode.LEASE_EXPIRED,
                f"no Decode claimed it within {state.config.claim_timeout_s:g} s "
                "(Prefill-first: the router's Decode step never came)",
            )
        )


KeptEffects.TABLE = KEPT_REQUEST.bind(
    {
        NO_EFFECT: no_effect,
        EFFECT_PUBLISH_KEPT: KeptEffects._fx_publish_kept,
        EFFECT_REFUSE_CLAIM: KeptEffects._fx_refuse_claim,
        EFFECT_RELEASE_UNCLAIMED: KeptEffects._fx_release_unclaimed,
    }
)
