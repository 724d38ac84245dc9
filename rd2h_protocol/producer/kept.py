"""The kept request machine's effects: the Prefill-first flow.

A standard router (vllm-router, llm-d, vLLM's example proxy) sends Prefill the prompt
first, with no Decode named. Prefill computes it, keeps its blocks and answers where its
KV is (:mod:`rd2h_protocol.claim`); the router then sends the request to a Decode, which
*claims* it from this rank. :meth:`_KeptRequests.keep_request` holds the request for the
claim window; :meth:`_KeptRequests.claim` registers a Prefill request toward the claiming
Decode and publishes every layer at once, detached from the compute step (the KV was
written in earlier steps and its blocks are still held), after which the request ends as
any other: once every publication naming it has ended. A claim window that runs out
finishes the request unread (:class:`RequestFinished` with ``LEASE_EXPIRED``), so its
blocks are freed even when no Decode ever comes.

Keeping needs storage that nothing overwrites meanwhile: a Prefill whose layers share
storage (a reuse ring, such as AscendStore's layerwise buffers) reuses it in the very next
step, so it refuses to keep a request.
"""

from __future__ import annotations

import heapq

from rd2h_protocol.errors import ErrorCode, LocalProtocolError, TopologyError
from rd2h_protocol.events import Chunk, ClaimAnswered, RequestFinished
from rd2h_protocol.machines.producer import (
    CONN_READY_V1,
    K_RECV_CLAIM,
    K_RECV_CLAIM_UNUSABLE,
    K_TIMER_CLAIM_EXPIRED,
    PREFILL_REQUEST,
    R_LOCAL_CLAIMED,
    R_SEND_DONE,
)
from rd2h_protocol.machines.producer_inputs import ClaimAt, ReqChunk
from rd2h_protocol.producer.config import DecodeTarget, Output
from rd2h_protocol.producer.leases import _Leases
from rd2h_protocol.producer.records import _Conn, _Kept, _Pub, _Request
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


class _KeptRequests(_Leases):
    """Effects of :data:`~rd2h_protocol.machines.producer.KEPT_REQUEST`, and its inputs."""

    def _can_keep(self) -> str | None:
        """Why this endpoint cannot keep a request, or None."""
        if self._v1_only:
            return NOT_KEPT_V1
        storages = {slots[0] for slots in self._layer_slots}
        if len(storages) < len(self._layer_slots):
            return NOT_KEPT_SHARED_STORAGE
        return None

    def keep_request(self, ext_req_id: str, now: float) -> list[Output]:
        """Keep a computed request for the Decode that will claim it (Prefill-first).

        Its blocks must stay untouched until :class:`RequestFinished` names it: after a
        claim's reads, or unread when ``claim_timeout_s`` passes with no claim. Raises
        :class:`LocalProtocolError` for an id kept or registered already, or when this
        Prefill cannot keep a request (v1 only, or storage shared between layers: the
        message names the Decode-first proxy instead).
        """
        why = self._can_keep()
        if why is not None:
            raise LocalProtocolError(f"request {ext_req_id!r} cannot be kept: {why}")
        if ext_req_id in self._kept or ext_req_id in self._requests:
            raise LocalProtocolError(f"request {ext_req_id!r} is already kept or registered")
        uid = self._uid()
        deadline = now + self.config.claim_timeout_s
        kept = _Kept(ext_req_id, uid, deadline)
        self._kept[ext_req_id] = kept
        self._kept_timers[uid] = kept
        heapq.heappush(self._timers, (deadline, uid))
        self.stats.kept += 1
        return []

    def claim(
        self, ext_req_id: str, target: DecodeTarget, chunk: Chunk, now: float
    ) -> list[Output]:
        """Decode ``target`` claims kept request ``ext_req_id``: publish ``chunk`` to it.

        ``chunk`` holds the request's blocks that Decode does not hold yet (its prefix
        hit left out), ``final``. Peer input: never raises; the answer is a
        :class:`ClaimAnswered` among the outputs (refused for an id not kept here, one
        claimed already, or a Decode whose topology this Prefill cannot serve).
        """
        out: list[Output] = []
        kept = self._kept.get(ext_req_id)
        if kept is None:
            self.stats.claims_refused += 1
            out.append(
                ClaimAnswered(
                    ext_req_id,
                    False,
                    ErrorCode.UNKNOWN_REQUEST,
                    f"request {ext_req_id!r} is not kept on Prefill rank {self.config.p_rank}: "
                    "never computed here, delivered already, or its claim window "
                    f"({self.config.claim_timeout_s:g} s) ran out",
                )
            )
            return out
        conn: _Conn | None = None
        problem = ""
        try:
            conn = self._conn_for(target)
        except TopologyError as exc:
            problem = exc.message
        if conn is not None and conn.state == CONN_READY_V1:
            problem = f"Decode {conn.name} speaks protocol v1, which has no Prefill-first flow"
        if problem:
            self._KEPT.apply(
                self, kept, K_RECV_CLAIM_UNUSABLE, ClaimAt(None, chunk, problem, now, out)
            )
        else:
            self._KEPT.apply(self, kept, K_RECV_CLAIM, ClaimAt(conn, chunk, "", now, out))
        return out

    # The kept machine's claim effects: (kept, ctx: ClaimAt).

    def _fx_publish_kept(self, kept: _Kept, ctx: ClaimAt) -> None:
        """Claimed: register the request toward its Decode, publish every layer at once."""
        conn, chunk, now, out = ctx.conn, ctx.chunk, ctx.now, ctx.out
        assert conn is not None  # RECV_CLAIM: a usable claim names its connection
        del self._kept_timers[kept.uid]
        kept.claimed_by = conn.name
        self.stats.claimed += 1
        req = _Request(kept.ext_id, conn, PREFILL_REQUEST.initial)
        self._requests[kept.ext_id] = req
        main, indexer = list(chunk.main_block_ids), list(chunk.indexer_block_ids)
        self._REQUEST.apply(self, req, R_LOCAL_CLAIMED, ReqChunk(chunk, main, indexer))
        out.append(ClaimAnswered(kept.ext_id, True, None, ""))
        deadline = now + self._lease_s
        read_reqs = [req.chunk] if req.chunk is not None else []
        pubs: list[_Pub] = []
        for layer_idx, slots in enumerate(self._layer_slots):
            done: list[str] = []
            if layer_idx == self._last_layer:
                done.append(req.ext_id)
                self._REQUEST.apply(self, req, R_SEND_DONE, None)
            pubs.append(self._publish(layer_idx, slots, read_reqs, done, [req], deadline))
        req.chunk = None
        for pub in pubs:
            self._conn_publish(pub, now, out)

    def _fx_refuse_claim(self, kept: _Kept, ctx: ClaimAt) -> None:
        """A claim this Prefill does not publish: say why."""
        problem, out = ctx.problem, ctx.out
        self.stats.claims_refused += 1
        if not problem:
            problem = (
                f"request {kept.ext_id!r} was claimed already by Decode {kept.claimed_by}; "
                "its KV is published once"
            )
        out.append(ClaimAnswered(kept.ext_id, False, ErrorCode.UNKNOWN_REQUEST, problem))

    def _fx_schedule_claimed(self, req: _Request, ctx: ReqChunk) -> None:
        """The claimed request's blocks, published by the claim itself (no compute step)."""
        main, indexer = ctx.main, ctx.indexer
        if main or indexer:
            chunk = ctx.chunk
            req.chunk = ReadReq(req.ext_id, main, indexer, chunk.main_start, chunk.indexer_start)

    def _claim_expired(self, uid: int, out: list[Output]) -> bool:
        """The claim window of a kept request ran out (False: ``uid`` is not one)."""
        kept = self._kept_timers.pop(uid, None)
        if kept is None:
            return False
        self._KEPT.apply(self, kept, K_TIMER_CLAIM_EXPIRED, out)
        return True

    def _fx_release_unclaimed(self, kept: _Kept, out: list[Output]) -> None:
        """No Decode claimed it in time: it ends unread, its blocks may be freed."""
        del self._kept[kept.ext_id]
        self.stats.unclaimed += 1
        out.append(
            RequestFinished(
                kept.ext_id,
                False,
                ErrorCode.LEASE_EXPIRED,
                f"no Decode claimed it within {self.config.claim_timeout_s:g} s "
                "(Prefill-first: the router's Decode step never came)",
            )
        )

    def kept(self) -> dict[str, str]:
        """``{ext_id: kept-request state}`` of every request kept or claimed, not finished."""
        return {ext_id: kept.state for ext_id, kept in self._kept.items()}
