"""The core of the model world: the endpoints wired together, and the checks of their outputs.

:class:`WorldCore` is the second layer of :class:`~rd2h_protocol.checker.world.World` (the
layers are listed there), on :class:`~rd2h_protocol.checker.state.WorldState`, which sets
up the state and builds the endpoints. This layer makes the state move: it registers
requests on both sides (the proxy and the Decode engine), runs the Prefill compute path
(a layer is written only when ``can_overwrite`` says so, then published), and executes
every output of an endpoint in order, checking each as it comes: S2 at every
``RequestDone`` and at cross-rank completion, S3 at every ``Releasable``, B1 where a
request finishes (twice, or dropped by the cross-rank rule). :meth:`WorldCore.check`
checks the state invariants after every step. Frames leave through
:meth:`WorldCore.transmit`; the layers above deliver them
(:mod:`~rd2h_protocol.checker.network`), run the reads, checking S1 and S3 at every
block they copy (:mod:`~rd2h_protocol.checker.memory`), and move time, checking S1 at
every lease expiry (:mod:`~rd2h_protocol.checker.clock`).
"""

from __future__ import annotations

from rd2h_protocol.checker import footprint
from rd2h_protocol.checker.invariants import (
    InvariantViolation,
    check_claim_answer,
    check_done_on_rank,
    check_idle,
    check_kept_read_may_start,
    check_kept_settled,
    check_quiescent,
    check_read_may_start,
    check_release,
    check_single_outcome,
    check_storage_gates,
)
from rd2h_protocol.checker.model import (
    CLAIMS,
    COMPONENTS,
    FIRST_PREFILL_BLOCK,
    INDEXER_ID_OFFSET,
    NUM_DECODE_BLOCKS,
    Frame,
    Read,
    Req,
    RequestSpec,
    decode_bases,
    frame_kind,
    prefill_bases,
)
from rd2h_protocol.checker.state import WorldState
from rd2h_protocol.claim import (
    CLAIM_VERSION,
    Claim,
    ClaimAnswer,
    decode_claim,
    decode_claim_answer,
    encode_claim,
)
from rd2h_protocol.completion import RankReport
from rd2h_protocol.consumer import (
    ConsumerEndpoint,
    Releasable,
    Reply,
    RequestDone,
    RequestFailed,
    SendAbort,
    StartRead,
)
from rd2h_protocol.consumer import Output as ConsumerOutput
from rd2h_protocol.events import Chunk, ClaimAnswered
from rd2h_protocol.producer import (
    DecodeTarget,
    Disconnect,
    ProducerEndpoint,
    RequestFinished,
    Send,
)
from rd2h_protocol.producer import Output as ProducerOutput
from rd2h_protocol.topology import group_members
from rd2h_protocol.wire.codec import encode
from rd2h_protocol.wire.messages import Abort, ReadDone, ReadFailed, ReadReadyBatch

__all__ = ["WorldCore"]


class WorldCore(WorldState):
    """A model world's endpoints at work: requests, outputs and the checks of both.

    See the module docstring. All methods take the world's own clock (``self.now``).
    """

    # -- requests --------------------------------------------------------------------------

    def new_request(self, spec: RequestSpec) -> None:
        """Create a request: Prefill and Decode block ids, nothing registered yet."""
        if spec.ext_id in self.reqs:
            raise ValueError(f"request {spec.ext_id!r} exists")
        total = sum(spec.chunks)
        start = self._next_pblock
        if start + total > FIRST_PREFILL_BLOCK + INDEXER_ID_OFFSET:
            raise ValueError("out of Prefill blocks")
        self._next_pblock += total
        pmain = list(range(start, start + total))
        pidx = [b + INDEXER_ID_OFFSET for b in pmain]
        for j in range(total):
            self._powner[pmain[j]] = (spec.ext_id, j)
            self._powner[pidx[j]] = (spec.ext_id, j)
        dstart = self._next_dblock
        if dstart + 2 * total > NUM_DECODE_BLOCKS:
            raise ValueError("out of Decode blocks")
        self._next_dblock += 2 * total
        # Decode ids in reverse logical order, so a wrong offset cannot go unnoticed.
        dmain = list(range(dstart + total - 1, dstart - 1, -1))
        didx = list(range(dstart + 2 * total - 1, dstart + total - 1, -1))
        self.reqs[spec.ext_id] = Req(spec, pmain, pidx, dmain, didx, self._engine_gens[spec.engine])

    def may_decode_add(self, ext: str) -> bool:
        """Whether Decode may allocate ``ext`` now: a Prefill-first request only once every
        Prefill rank kept it (the router has Prefill's answer, which names where it is)."""
        if ext not in self.cfg.prefill_first:
            return True
        return self.reqs[ext].kept_ranks == self.cfg.p_tp

    def decode_add(self, ext: str) -> None:
        """Decode engine allocates the request's destinations on every rank (and, for a
        Prefill-first request, each rank claims it from the Prefill ranks that serve it)."""
        req = self.reqs[ext]
        req.decode_added = True
        e = req.spec.engine
        for d in range(self.cfg.engines[e]):
            outs = self.consumers[(e, d)].add_request(ext, req.dmain, req.didx, self.now)
            self._consumer_outputs(e, d, outs)
        if ext in self.cfg.prefill_first:
            self._send_claims(ext)
        self._gather()

    def _send_claims(self, ext: str) -> None:
        """Each Decode rank of ``ext``'s engine claims it from every Prefill rank that serves
        it, at the claim port of that rank (whichever incarnation listens there now)."""
        req = self.reqs[ext]
        e = req.spec.engine
        d_tp = self.cfg.engines[e]
        target = self.target(e)
        for d in range(d_tp):
            claim = Claim(
                version=CLAIM_VERSION,
                request_id=ext,
                engine_id=f"decode{e}",
                host=target.host,
                port=target.base_port,
                tp_size=d_tp,
                cached_tokens=0,
                num_tokens=sum(req.spec.chunks),
            )
            for p in group_members(d, self.cfg.p_tp, d_tp):
                # Decode acts on Prefill's answer (the router's second step): it read what
                # every rank's keep wrote.
                footprint.touch(footprint.agent("P", p))
                session = self.ranks[p].session
                self._claims.add((e, d, ext, session))
                self.transmit(
                    Frame(
                        ("D", self.conn_name(e, d) + CLAIMS),
                        ("P", session + CLAIMS),
                        encode_claim(claim),
                        self.now,
                        None,
                        "Claim",
                    )
                )

    def prefill_add(self, ext: str) -> None:
        """The proxy dispatches the request to Prefill: every live rank registers it (a
        Prefill-first request: every live rank starts computing its prompt, for no Decode)."""
        req = self.reqs[ext]
        req.prefill_added = True
        if ext in self.cfg.prefill_first:
            for p, rank in enumerate(self.ranks):
                footprint.touch(footprint.agent("P", p))
                rank.computing[ext] = 0
            return
        for p, prod in enumerate(self.producers):
            self._producer_outputs(p, prod.add_request(ext, self.target(req.spec.engine), self.now))

    def prefill_abort(self, ext: str) -> None:
        """The Prefill scheduler aborts the request on every rank that holds it."""
        for p, prod in enumerate(self.producers):
            footprint.touch(footprint.agent("P", p))  # asked whether it holds ext
            if ext in prod.requests():
                self._producer_outputs(p, prod.abort([ext], "aborted by the model", self.now))
        self._gather()

    def decode_abort(self, ext: str) -> None:
        """Decode aborts the request on every rank (before vLLM finishes it)."""
        req = self.reqs[ext]
        req.decode_aborted = True
        e = req.spec.engine
        for d in range(self.cfg.engines[e]):
            outs = self.consumers[(e, d)].abort([ext], "aborted by the model", self.now)
            self._consumer_outputs(e, d, outs)
        self._gather()

    def release(self, ext: str) -> None:
        """vLLM finishes the request on Decode (after its KV arrived, or a client abort)."""
        req = self.reqs[ext]
        req.released = True
        e = req.spec.engine
        if self._claims:  # its claim answers no longer matter
            self._claims = {c for c in self._claims if c[0] != e or c[2] != ext}
        for d in range(self.cfg.engines[e]):
            outs = self.consumers[(e, d)].release(ext, self.now)
            self._consumer_outputs(e, d, outs)
        self._gather()

    # -- Prefill compute -------------------------------------------------------------------

    def _step_chunks(self, p: int) -> list[tuple[str, int]]:
        """The chunks rank ``p`` schedules if it starts a step now."""
        rank = self.ranks[p]
        out = []
        for ext, state in self.producers[p].requests().items():
            k = rank.chunks.get(ext, 0)
            if state in ("registered", "sending") and k < len(self.reqs[ext].spec.chunks):
                out.append((ext, k))
        for ext, k in rank.computing.items():
            if k < len(self.reqs[ext].spec.chunks):
                out.append((ext, k))
        return out

    def can_write(self, p: int, *, idle: bool | None = None) -> bool:
        """Whether rank ``p`` may write its next layer now: its storage is free and it has
        work (a step under way, chunks to schedule, or ``idle`` steps allowed; default:
        the config's ``idle_steps``)."""
        rank = self.ranks[p]
        idle = self.cfg.idle_steps if idle is None else idle
        if rank.next_layer == 0 and not idle and not self._step_chunks(p):
            return False
        return self.producers[p].can_overwrite(rank.next_layer)

    def write_layer(self, p: int) -> None:
        """Rank ``p`` computes its next layer (starting a step at layer 0), then publishes it."""
        prod, rank = self.producers[p], self.ranks[p]
        layer = rank.next_layer
        if layer == 0:
            for ext, k in self._step_chunks(p):
                if ext in rank.computing:  # Prefill-first: computed for no Decode yet
                    rank.computing[ext] = k + 1
                    continue
                req = self.reqs[ext]
                start = sum(req.spec.chunks[:k])
                end = start + req.spec.chunks[k]
                final = k == len(req.spec.chunks) - 1
                chunk = Chunk(
                    ext_req_id=ext,
                    main_block_ids=req.pmain[start:end],
                    indexer_block_ids=req.pidx[start:end],
                    main_start=start,
                    indexer_start=start,
                    final=final,
                )
                prod.schedule_chunk(chunk, self.now)
                rank.chunks[ext] = k + 1
        self._version += 1
        # The requests whose blocks this rank holds: registered, kept (Prefill-first), or
        # being computed for a Decode that will claim them.
        owners = frozenset(prod.requests())
        if rank.computing or self._kept:
            owners = owners | frozenset(prod.kept()) | frozenset(rank.computing)
        footprint.touch(footprint.storage_write(rank.session))
        for base in prefill_bases(layer % self.cfg.n_storages):
            self.pmem[(rank.session, base)] = (layer, self._version, owners)
        self._producer_outputs(p, prod.layer_written(layer, self.now))
        rank.next_layer += 1
        if rank.next_layer == self.cfg.n_layers:
            rank.next_layer = 0
            self._producer_outputs(p, prod.end_step(self.now))
            self._keep_computed(p)
        self._gather()

    def _keep_computed(self, p: int) -> None:
        """Prefill-first: rank ``p`` keeps every request whose last chunk its step computed."""
        rank, prod = self.ranks[p], self.producers[p]
        for ext, k in sorted(rank.computing.items()):
            req = self.reqs[ext]
            if k == len(req.spec.chunks):
                del rank.computing[ext]
                self._producer_outputs(p, prod.keep_request(ext, self.now))
                self._kept[(rank.session, ext)] = False
                req.kept_ranks += 1

    def claim_delivered(self, p: int, frame: Frame) -> None:
        """Prefill rank ``p``'s runtime got a claim: it hands the endpoint the request's
        blocks (all of them: the model's Decode holds no prefix) and sends the answer back
        to the claiming Decode rank."""
        prod, session = self.producers[p], self.ranks[p].session
        claim = decode_claim(frame.data)
        ext = claim.request_id
        req = self.reqs[ext]
        chunk = Chunk(
            ext_req_id=ext,
            main_block_ids=req.pmain,
            indexer_block_ids=req.pidx,
            main_start=0,
            indexer_start=0,
            final=True,
        )
        before = prod.kept().get(ext)
        target = DecodeTarget(claim.host, claim.port, claim.tp_size)
        outs = prod.claim(ext, target, chunk, self.now)
        for o in outs:
            if isinstance(o, ClaimAnswered):
                check_claim_answer(session, ext, before, o.ok)
                if o.ok:
                    self._kept[(session, ext)] = True
                answer = ClaimAnswer(
                    request_id=o.ext_req_id,
                    ok=o.ok,
                    code=0 if o.code is None else int(o.code),
                    message=o.message,
                )
                self.transmit(
                    Frame(
                        ("P", session + CLAIMS),
                        frame.src,
                        encode_claim(answer),
                        self.now,
                        None,
                        "ClaimAnswer",
                    )
                )
        self._producer_outputs(p, outs)

    def claim_answered(self, e: int, d: int, frame: Frame) -> None:
        """Decode rank ``d`` of engine ``e`` got a claim's answer: a refusal of a claim it
        waits for fails the request on every rank of the engine (as vLLM fails a request
        whose KV cannot load); an answer it does not wait for (a duplicate, one after its
        request ended) is ignored, as the runtime's claim client does."""
        footprint.touch(footprint.agent("D", e))
        answer = decode_claim_answer(frame.data)
        ext = answer.request_id
        key = (e, d, ext, frame.src[1].removesuffix(CLAIMS))
        if key not in self._claims:
            return
        self._claims.discard(key)
        req = self.reqs[ext]
        if answer.ok or not req.decode_added or req.abandoned or req.released or req.finished:
            return
        req.decode_aborted = True
        for rank in range(self.cfg.engines[e]):
            outs = self.consumers[(e, rank)].abort([ext], "claim refused by Prefill", self.now)
            self._consumer_outputs(e, rank, outs)

    # -- the network (sending; delivery is NetworkWorld's) -------------------------------

    def transmit(self, frame: Frame) -> None:
        """Put ``frame`` on the network (override for another transport)."""
        footprint.touch(footprint.append(frame.src[1], frame.dst[1]))
        self.network.append(frame)

    # -- outputs ---------------------------------------------------------------------------

    def _producer_outputs(self, p: int, outs: list[ProducerOutput]) -> None:
        footprint.touch(footprint.agent("P", p))
        session = self.ranks[p].session
        for o in outs:
            if isinstance(o, Send):
                msg = o.msg
                deliver_by = None
                if isinstance(msg, ReadReadyBatch):
                    if msg.lease_ms is not None:  # a peer without the lease: no bound
                        deliver_by = self.now + msg.lease_ms / 2000.0
                elif isinstance(msg, Abort):
                    for ext in msg.ext_ids:
                        self._aborted_to.add((session, o.conn, ext))
                self.transmit(
                    Frame(
                        ("P", session),
                        ("D", o.conn),
                        encode(msg),
                        self.now,
                        deliver_by,
                        frame_kind(msg),
                    )
                )
            elif isinstance(o, Disconnect):
                # A fresh DEALER: nothing of the old connection arrives any more.
                conn = o.conn
                footprint.touch(footprint.purge(session, conn))
                self.network = [f for f in self.network if {f.src[1], f.dst[1]} != {session, conn}]
            elif isinstance(o, RequestFinished):
                key = (session, o.ext_req_id)
                if key in self._prefill_finished:
                    raise InvariantViolation("B1", f"{session} finished {o.ext_req_id} twice")
                self._prefill_finished.add(key)
                if self._kept and self._kept.pop(key, None) is False and o.ok:
                    raise InvariantViolation(
                        "L1", f"{session} finished kept {o.ext_req_id} ok, never claimed"
                    )

    def _consumer_outputs(self, e: int, d: int, outs: list[ConsumerOutput]) -> None:
        footprint.touch(footprint.agent("D", e))
        conn = self.conn_name(e, d)
        for o in outs:
            if isinstance(o, Reply | SendAbort):
                msg = o.msg
                if isinstance(msg, ReadDone | ReadFailed):
                    self._answered(e, d, o.peer, msg)
                session = o.peer.decode()
                if self.session_rank(session) is not None:
                    self.transmit(
                        Frame(
                            ("D", conn),
                            ("P", session),
                            encode(msg),
                            self.now,
                            None,
                            frame_kind(msg),
                        )
                    )
            elif isinstance(o, StartRead):
                layer = self.static.layer_index[o.plan.layer_name]
                self.reads[(e, d, o.plan.read_id)] = Read(o.plan, o.start_by, layer)
            elif isinstance(o, RequestDone):
                self._terminal_report(e, d, o.ext_req_id, "done")
                self._check_done_on_rank(e, d, o.ext_req_id)
                self._reports[e][d][0].append(o.ext_req_id)
            elif isinstance(o, RequestFailed):
                self._terminal_report(e, d, o.ext_req_id, "failed")
                self._reports[e][d][1].append(o.ext_req_id)
            elif isinstance(o, Releasable):
                self._check_releasable(e, d, o.ext_req_id)

    def _answered(self, e: int, d: int, peer: bytes, msg: ReadDone | ReadFailed) -> None:
        """A reply: the done signals of the readiness it answers count if its read succeeded."""
        key = (e, d, peer, reply_key(msg))
        waiting = self._readiness.get(key)
        if not waiting:
            return
        member, done = waiting.pop(0)
        if not waiting:
            del self._readiness[key]
        if isinstance(msg, ReadDone):
            failed = {f.ext_req_id for f in msg.failed or ()}
            for ext in done:
                if ext not in failed:
                    self._delivered.setdefault((e, d, ext), set()).add(member)

    def _terminal_report(self, e: int, d: int, ext: str, what: str) -> None:
        key = (e, d, ext)
        check_single_outcome(self.conn_name(e, d), ext, self._terminal.get(key), what)
        self._terminal[key] = what

    def _check_done_on_rank(self, e: int, d: int, ext: str) -> None:
        """S2 on one rank: every contributor delivered its final layer; the indexer is whole."""
        members = self._delivered.get((e, d, ext), set())
        check_done_on_rank(self.conn_name(e, d), ext, members, self.ratio(e))
        req = self.reqs[ext]
        self._check_data(e, d, req, (2, 3), req.didx)

    def _check_data(
        self, e: int, rank: int, req: Req, comps: tuple[int, ...], ids: list[int]
    ) -> None:
        ext = req.spec.ext_id
        for layer in range(self.cfg.n_layers):
            bases = decode_bases(layer)
            for c in comps:
                for j, blk in enumerate(ids):
                    got = self.dmem.get((e, rank, bases[c], blk))
                    want = (layer, ext, j, COMPONENTS[c])
                    if got != want:
                        raise InvariantViolation(
                            "S2",
                            f"{ext} is done but Decode {COMPONENTS[c]} block {blk} of "
                            f"layer {layer} (rank {rank}) holds {got}, expected {want}",
                        )

    def _check_releasable(self, e: int, d: int, ext: str) -> None:
        writing = [
            rid
            for (re, rd, rid), read in self.reads.items()
            if (re, rd) == (e, d) and any(r.ext_req_id == ext for r in read.plan.requests)
        ]
        check_release(self.conn_name(e, d), ext, writing)
        self._released.add((e, d, ext))

    def _gather(self) -> None:
        """Every rank's terminal reports go through the cross-rank rule (as the worker does)."""
        for e, pending in enumerate(self._reports):
            if (
                not any(done or failed for done, failed in pending)
                and self.completions[e].is_idle()
            ):
                continue
            if any(done or failed for done, failed in pending):
                footprint.touch(footprint.agent("D", e))  # else a no-op: see footprint
            reports = [RankReport(tuple(done), tuple(failed)) for done, failed in pending]
            self._reports[e] = [([], []) for _ in pending]
            result = self.completions[e].update(reports, _identity, self.now)
            for ext in result.finished:
                req = self.reqs[ext]
                req.finished = True
                req.load_error = ext in result.load_errors
                if not req.load_error:
                    for d in range(self.cfg.engines[e]):
                        if self._terminal.get((e, d, ext)) != "done":
                            raise InvariantViolation(
                                "S2", f"{ext} finished without being done on rank {d}"
                            )
                    self._check_data(e, -1, req, (0, 1), req.dmain)
            if result.dropped:
                raise InvariantViolation("B1", f"cross-rank completion dropped {result.dropped}")
            if self.cfg.auto_release:
                for ext in result.finished:
                    if not self.reqs[ext].released:
                        self.release(ext)

    # -- invariants ------------------------------------------------------------------------

    def check(self) -> None:
        """The state invariants, after every step (the event checks ran as outputs came)."""
        for rank, prod in zip(self.ranks, self.producers, strict=True):
            check_storage_gates(rank.session, prod)
        for (e, d, rid), read in self.reads.items():
            if read.start_by is not None and self.now > read.start_by:
                continue  # it can only fail now
            src = self.session_rank(read.plan.session)
            if src is None:
                continue  # it can only fail now
            check_read_may_start(
                self.conn_name(e, d), rid, read.plan.session, self.producers[src], read.layer
            )
            if self.cfg.prefill_first:
                kept = [r.ext_req_id for r in read.plan.requests]
                kept = [x for x in kept if x in self.cfg.prefill_first]
                check_kept_read_may_start(
                    self.conn_name(e, d), rid, read.plan.session, self.producers[src], kept
                )
            for r in read.plan.requests:
                if (e, d, r.ext_req_id) in self._released:
                    raise InvariantViolation("S3", f"read {rid} targets released {r.ext_req_id}")
        for f in self.network:
            if f.deliver_by is not None and not (self.now < f.deliver_by or self.now == f.sent_at):
                raise AssertionError("the model let time pass a readiness's delivery bound")

    def check_quiescent(self) -> None:
        """L1, once everything settled: gates open, every request terminal on both sides."""
        if self.network or self.reads:
            raise InvariantViolation(
                "L1", f"{len(self.network)} frames, {len(self.reads)} reads left"
            )
        if self.cfg.prefill_first:
            check_kept_settled(self._producers_by_session(), self._kept)
        check_quiescent(self._producers_by_session(), self._consumers_by_name())
        for ext, req in self.reqs.items():
            if req.decode_added and not req.abandoned and not req.finished and not req.released:
                raise InvariantViolation("L1", f"{ext} is not finished across Decode ranks")

    def check_idle(self) -> None:
        """B1, after every request ended and was released: no per-request state anywhere."""
        completions = {str(e): comp for e, comp in enumerate(self.completions)}
        check_idle(self._producers_by_session(), self._consumers_by_name(), completions)

    def _producers_by_session(self) -> dict[str, ProducerEndpoint]:
        return {rank.session: prod for rank, prod in zip(self.ranks, self.producers, strict=True)}

    def _consumers_by_name(self) -> dict[str, ConsumerEndpoint]:
        return {self.conn_name(e, d): cons for (e, d), cons in self.consumers.items()}


def reply_key(msg: ReadReadyBatch | ReadDone | ReadFailed) -> int | str:
    """What a reply echoes of its readiness: the seq, or (v1 shapes) the layer."""
    return msg.seq if msg.seq is not None else f"layer {msg.layer_idx}"


def _identity(ext: str) -> str:
    return ext
