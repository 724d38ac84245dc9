"""Serving one readiness: from the checks to the one read plan of the message.

The layer and layout checks, parking, each request's share and the one
:class:`~rd2h_protocol.plan.ReadPlan` per message: steps 1 to 5 of the theory of
operation in :mod:`rd2h_protocol.consumer`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from rd2h_protocol.completion import ContributorSet
from rd2h_protocol.consumer.held import VALIDATED_BYTES
from rd2h_protocol.consumer.records import ReadinessRecord, RequestRecord, SessionRecord
from rd2h_protocol.consumer.replies import clip
from rd2h_protocol.consumer.state import ConsumerState
from rd2h_protocol.errors import ErrorCode, LayoutMismatch, ProtocolError, RemoteProtocolError
from rd2h_protocol.machines.consumer import (
    M_LOCAL_NOTHING_TO_READ,
    M_LOCAL_PARK,
    M_LOCAL_START_READ,
    R_LOCAL_FAIL,
    R_RECV_READINESS,
)
from rd2h_protocol.machines.consumer_inputs import RdPark, ReqEnd, ReqReadiness
from rd2h_protocol.plan import ComponentAddrs, ReadPlan, RequestRead
from rd2h_protocol.topology import indexer_share, main_share
from rd2h_protocol.wire.layout import (
    LayerLayout,
    check_destination_range,
    check_source_blocks,
    validate_layer,
)
from rd2h_protocol.wire.messages import FailedRequest, ReadReq
from rd2h_protocol.wire.readiness import message_ids, unique_ids

if TYPE_CHECKING:
    from rd2h_protocol.consumer.held import SessionBudgets
    from rd2h_protocol.consumer.parking import Parking
    from rd2h_protocol.consumer.reads import ReadinessEffects
    from rd2h_protocol.consumer.replies import Replies
    from rd2h_protocol.consumer.requests import RequestEffects


def _explain(mismatch: LayoutMismatch, tp_ratio: int) -> str:
    """A layout mismatch's message, with the likely cause when block sizes differ by
    exactly the TP ratio: the KV heads are split over the Prefill ranks."""
    prefill, decode = mismatch.prefill, mismatch.decode
    if (
        tp_ratio > 1
        and isinstance(prefill, int)
        and isinstance(decode, int)
        and prefill * tp_ratio == decode
    ):
        return (
            f"{mismatch.message} (each of the {tp_ratio} Prefill TP ranks per Decode rank "
            "holds a share of the KV heads; RD2H needs the whole KV on every Prefill rank, "
            "as with MLA, or equal Prefill and Decode TP)"
        )
    return mismatch.message


def _check_source(layer: str, component: str, ids: Sequence[int], num_blocks: int | None) -> None:
    """Prefill block ids must lie in ``[0, num_blocks)`` when the layout says ``num_blocks``."""
    if num_blocks is not None and ids and max(ids) >= num_blocks:  # max(): no per-id Python
        check_source_blocks(layer, component, ids, num_blocks)


def _part(ids: Sequence[int], start: int, end: int) -> Sequence[int]:
    """``ids[start:end]``, without a copy when that is all of ``ids``."""
    return ids if start == 0 and end == len(ids) else ids[start:end]


class ShareRule(NamedTuple):
    """What :meth:`Serving._share` decides once per readiness, not per request: with the
    entry and the request, all a share depends on (the layer's name is only quoted)."""

    whole: bool  # every share is its whole entry: one Decode rank (or main not shared), ratio 1
    num_blocks: int | None  # the bound to check Prefill ids against; None: proven or unbounded
    has_indexer: bool  # the layer has indexer components: the indexer ids are read too
    member: int  # the readiness's group_member_idx
    tp_ratio: int


class Serving:
    """From a readiness the session admitted to its read (or its refusal): a collaborator
    of the session and readiness machines' effects, and the request machine's for its
    RECV_READINESS effects."""

    __slots__ = ("budgets", "parking", "readiness", "replies", "request", "state")

    budgets: SessionBudgets
    parking: Parking
    readiness: ReadinessEffects
    replies: Replies
    request: RequestEffects

    def __init__(self, state: ConsumerState) -> None:
        self.state = state

    def serve(
        self, rd: ReadinessRecord, session: SessionRecord, now: float, *, allow_park: bool
    ) -> None:
        """Serve one readiness (received, or leaving the park) of ``session``, ready (the
        session machine's rows see to it: ``RECV_READINESS``, ``LOCAL_UNPARKED``)."""
        msg = rd.msg
        state = self.state
        rd.caps = session.caps
        local_name = msg.layer_name
        known = state.by_name.get(local_name)
        if known is None:
            self.replies.refuse(
                rd,
                now,
                ErrorCode.UNKNOWN_LAYER,
                f"layer {local_name!r} (layer_idx {msg.layer_idx}) is not one of Decode's "
                f"{len(state.layers)} cache-bearing layers",
            )
            return
        expected, dst = known
        if msg.layer_idx != expected:
            self.replies.refuse(
                rd,
                now,
                ErrorCode.LAYOUT_MISMATCH,
                f"layer_idx {msg.layer_idx} disagrees with layer name {local_name!r}, "
                f"which is layer {expected}",
            )
            return
        src = session.layers.get(msg.layer_name)
        if src is None:
            self.replies.refuse(
                rd,
                now,
                ErrorCode.UNKNOWN_LAYER,
                f"layer {msg.layer_name!r} is not in the session's MF_META layout",
            )
            return
        key = (msg.layer_idx, msg.layer_name)
        comps = session.validated.get(key)
        if comps is None:
            try:
                comps = validate_layer(msg.layer_name, src, dst)
            except LayoutMismatch as exc:
                comps = exc
            session.validated[key] = comps
            self.budgets.account_layout(session, session.layout_bytes + VALIDATED_BYTES)
            self.budgets.enforce_session_budgets(session)
        if isinstance(comps, LayoutMismatch):
            self.replies.refuse(rd, now, ErrorCode.LAYOUT_MISMATCH, _explain(comps, msg.tp_ratio))
            return
        if allow_park:
            # (set.difference looks each id up in the dict; retired, an OrderedDict, it
            # would iterate whole, so the few ids left are looked up there one by one)
            named = set(message_ids(msg))
            retired = state.retired
            missing = [ext for ext in named.difference(state.requests) if ext not in retired]
            if missing:
                parking = self.parking
                packed = parking.prepare_park(rd, missing)
                rd.deadline = now + state.config.park_timeout_s
                if rd.start_by is not None:
                    rd.deadline = min(rd.deadline, rd.start_by)
                if parking.park_has_room(rd):
                    readiness = self.readiness
                    readiness.TABLE.apply(readiness, rd, M_LOCAL_PARK, RdPark(packed, missing))
                    return
                rd.names, rd.left = (), 0
                if len(missing) == len(named):
                    # Not one request Decode knows: each would fail alone, UNKNOWN_REQUEST,
                    # so the readiness fails whole, without a failure record per request
                    # (what made a flood of such frames dear to handle).
                    self.replies.refuse(
                        rd,
                        now,
                        ErrorCode.UNKNOWN_REQUEST,
                        f"none of its {len(named)} requests is known here and the park is full",
                        fail_known=False,
                    )
                    return
        if rd.start_by is not None and now > rd.start_by:
            state.stats.expired_leases += 1
            self.replies.refuse(
                rd,
                now,
                ErrorCode.LEASE_EXPIRED,
                f"less than half of the {msg.lease_ms} ms lease was left to start the read",
            )
            return
        main, indexer = comps
        self._plan(rd, session, src, local_name, main, indexer, now)

    def _plan(
        self,
        rd: ReadinessRecord,
        session: SessionRecord,
        src: LayerLayout,
        local_name: str,
        main: tuple[ComponentAddrs, ...],
        indexer: tuple[ComponentAddrs, ...],
        now: float,
    ) -> None:
        msg = rd.msg
        named = [rr.ext_req_id for rr in msg.read_reqs]
        entry_of = dict(zip(named, msg.read_reqs, strict=True))
        # Only entries can name a request twice (done ids are deduplicated and skip those
        # the entries name); such a request is handled once, where it first stands.
        twice: set[str] = set()
        if len(entry_of) < len(named):
            twice = {ext for ext, n in Counter(named).items() if n > 1}
            named = list(entry_of)
        ids = named + [ext for ext in unique_ids(msg.done_ext_ids) if ext not in entry_of]
        reads: list[RequestRead] = []
        state = self.state
        kept = state.entry_cache.get(rd.session)
        shares = kept.shares if kept is not None and kept.entries is msg.read_reqs else None
        rule = self._share_rule(rd, src, indexer)
        ctx = ReqReadiness(rd, entry_of, twice, rule, shares, now, reads)
        found = list(map(state.requests.get, ids))
        request = self.request
        table = request.TABLE
        if None in found:
            # An unknown request is isolated where it stands, between the runs around it.
            run: list[RequestRecord] = []
            for ext, req in zip(ids, found, strict=True):
                if req is not None:
                    run.append(req)
                    continue
                table.apply_batch(request, run, R_RECV_READINESS, ctx)
                run = []
                self.isolate(rd, ext, ErrorCode.UNKNOWN_REQUEST, "unknown request")
            table.apply_batch(request, run, R_RECV_READINESS, ctx)
        else:
            table.apply_batch(request, found, R_RECV_READINESS, ctx)
        if not reads:
            readiness = self.readiness
            readiness.TABLE.apply(readiness, rd, M_LOCAL_NOTHING_TO_READ, None)
            readiness.count_done(rd, now)
            return
        read_id = state.next_read_id
        state.next_read_id += 1
        rd.plan = ReadPlan(read_id, session.name, local_name, main, indexer, tuple(reads))
        rd.retries_left = state.config.max_read_retries
        for req in rd.in_plan:
            req.in_flight += 1
        state.reads[read_id] = rd
        state.stats.reads_started += 1
        readiness = self.readiness
        readiness.TABLE.apply(readiness, rd, M_LOCAL_START_READ, None)

    def _share_rule(
        self, rd: ReadinessRecord, src: LayerLayout, indexer: tuple[ComponentAddrs, ...]
    ) -> ShareRule:
        """How every entry of this readiness is shared: whole (one Decode rank and one
        contributor, the usual shape: no split per request), and whether Prefill's ids
        still need checking against ``num_blocks`` (not when the bounded decode proved
        every id of the message below it)."""
        msg, cfg = rd.msg, self.state.config
        num_blocks = src.num_blocks
        if num_blocks is not None and rd.ids_below is not None and rd.ids_below <= num_blocks:
            num_blocks = None  # every Prefill id of the message is below it: checked already
        whole = (cfg.d_tp == 1 or not cfg.main_shared) and msg.tp_ratio == 1
        return ShareRule(whole, num_blocks, bool(indexer), msg.group_member_idx, msg.tp_ratio)

    def _share(self, req: RequestRecord, rr: ReadReq, rule: ShareRule, layer: str) -> RequestRead:
        """This rank's blocks of one readiness entry, mapped to the request's own ids
        (``layer``: the layer's name, for the errors).

        No id is copied when the share is the whole entry: the plan holds the message's
        own lists and the request's own (immutable) destination ids.
        """
        cfg = self.state.config
        whole, num_blocks, has_indexer, member, tp_ratio = rule
        main_ids = rr.main_block_ids
        n = len(main_ids)
        if whole:
            start, end = 0, n
        elif cfg.main_shared:
            start, end = main_share(n, cfg.d_rank, cfg.d_tp, rr.main_start_block, member)
        else:
            start, end = main_share(n, 0, 1, rr.main_start_block, member)
        main_src: Sequence[int] = ()
        main_dst: Sequence[int] = ()
        if member == 0:
            base = rr.main_start_block
            if base < 0 or base + n > len(req.main_ids):  # (the check, inlined: it raises)
                check_destination_range(req.ext_id, "main", base, n, len(req.main_ids))
            main_src = main_ids if whole else _part(main_ids, start, end)
            main_dst = req.main_ids[base + start : base + end]
            if num_blocks is not None:
                _check_source(layer, "main", main_src, num_blocks)
        idx_src: Sequence[int] = ()
        idx_dst: Sequence[int] = ()
        if has_indexer:
            idx_ids = rr.indexer_ids
            n = len(idx_ids)
            base = rr.indexer_start_block
            if base < 0 or base + n > len(req.indexer_ids):
                check_destination_range(req.ext_id, "indexer", base, n, len(req.indexer_ids))
            if whole:
                start, end = 0, n
            else:
                start, end = indexer_share(n, member, tp_ratio, base)
            idx_src = idx_ids if whole else _part(idx_ids, start, end)
            idx_dst = req.indexer_ids[base + start : base + end]
            if num_blocks is not None:
                _check_source(layer, "indexer", idx_src, num_blocks)
        return RequestRead(req.ext_id, main_src, main_dst, idx_src, idx_dst)

    def isolate(self, rd: ReadinessRecord, ext: str, code: ErrorCode, text: str) -> None:
        self.state.stats.isolated_requests += 1
        rd.isolated.append(FailedRequest(ext, int(code), clip(text)))

    # The request machine's RECV_READINESS effects (a batched input, see
    # RequestEffects.fx_accept), ``reqs`` a run of the readiness's requests in one state.

    def isolate_run(
        self, reqs: Sequence[RequestRecord], rd: ReadinessRecord, code: ErrorCode, text: str
    ) -> None:
        """The requests stopped waiting: leave them out of the read, report each alone."""
        for req in reqs:
            self.isolate(rd, req.ext_id, code, text)

    def accept(self, reqs: Sequence[RequestRecord], ctx: ReqReadiness) -> None:
        """Take the readiness for each request: its entry (``entry_of``; none for a done id
        alone) must be sound (named once, the same ``tp_ratio``, a destination range that
        fits, source ids within the layout), else the request is isolated and fails
        (``LOCAL_FAIL``) where it stands. A share with blocks joins ``reads``, in order.

        ``shares``: those of the session's kept entries (when the message carries them),
        each reused while it stands for the same entry, request and rule (then its checks
        passed on these very inputs), else worked out and kept.
        """
        rd, entry_of, twice, rule, shares = ctx.rd, ctx.entry_of, ctx.twice, ctx.rule, ctx.shares
        now, reads = ctx.now, ctx.reads
        ratio, layer = rule.tp_ratio, rd.msg.layer_name
        accepted: list[RequestRecord] = []
        for req in reqs:
            ext = req.ext_id
            entry = entry_of.get(ext)
            try:
                if ext in twice:
                    raise RemoteProtocolError("the request appears more than once in the message")
                if req.contributors is not None:
                    req.contributors.check_ratio(ratio)
                kept = None if shares is None else shares.get(ext)
                if entry is None:
                    read = None
                elif kept is not None and kept[:3] == (entry, req, rule):
                    read = kept[3]
                else:
                    read = self._share(req, entry, rule, layer)
                    if shares is not None:
                        shares[ext] = (entry, req, rule, read)
            except ProtocolError as exc:
                self.isolate(rd, ext, exc.code, exc.message)
                self.request.apply(req, R_LOCAL_FAIL, ReqEnd(now, exc.code, exc.message))
                continue
            accepted.append(req)
            if read is not None and (read.main_src or read.indexer_src):
                reads.append(read)
                rd.in_plan.append(req)
        self.request.touch(accepted, now)
        for req in accepted:
            req.sessions.add(rd.session)
            if req.contributors is None:
                req.contributors = ContributorSet(ratio)
        rd.accepted += accepted
