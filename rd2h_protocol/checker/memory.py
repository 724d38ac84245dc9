"""The memory model of the model world: reads run against what each storage holds.

Every Prefill storage tensor holds what the last write put there (``(layer, version,
owners)``); a read copies, per block, ``(layer, request, logical block, component)``
into the Decode destination it names (the K/V pool shared by the ranks of an engine, the
rank-local indexer and scale). A read is executed atomically when the runtime runs it,
and refused with ``LEASE_EXPIRED`` past its ``start_by`` (as the runtime must). So a
read after reuse is not only forbidden by a state check but *detected*: Decode got the
data of another layer, or of a freed request.

:class:`MemoryWorld` is a layer of :class:`~rd2h_protocol.checker.world.World`;
:meth:`MemoryWorld.execute_read` is the executor of read plans a subclass may replace
with a real backend.
"""

from __future__ import annotations

from collections.abc import Sequence

from rd2h_protocol.checker import footprint
from rd2h_protocol.checker.invariants import InvariantViolation
from rd2h_protocol.checker.model import GARBAGE, Req, Value
from rd2h_protocol.checker.network import NetworkWorld
from rd2h_protocol.errors import ErrorCode, TransferError
from rd2h_protocol.plan import ComponentAddrs, ReadPlan

__all__ = ["MemoryWorld"]


class MemoryWorld(NetworkWorld):
    """The memory layer of :class:`~rd2h_protocol.checker.world.World`."""

    # -- reads -----------------------------------------------------------------------------

    def finish_read(self, key: tuple[int, int, int], outcome: str = "ok") -> None:
        """The runtime runs read ``key`` (``ok``, ``fail`` or ``transient``) and reports it."""
        read = self.reads.pop(key)
        e, d, read_id = key
        error: TransferError | None
        if outcome == "ok":
            footprint.touch(footprint.storage_read(read.plan.session))
            error = self.execute_read(e, d, read.plan, read.start_by, read.layer)
        else:
            error = TransferError(
                f"the model failed read {read_id}", 7, transient=outcome != "fail"
            )
            self._scribble(e, d, read.plan)
        outs = self.consumers[(e, d)].read_finished(read_id, error, self.now)
        self._consumer_outputs(e, d, outs)
        self._gather()

    def execute_read(
        self, engine: int, d_rank: int, plan: ReadPlan, start_by: float | None, layer: int
    ) -> TransferError | None:
        """Run ``plan`` against the memory model; return the error to report, if any.

        Refuses to start past ``start_by`` (``LEASE_EXPIRED``), fails against a Prefill
        session that died, and otherwise copies every block, checking each value it reads
        (S1: the right layer of a live request) and where it lands (S3, DATA). Override to
        move real bytes with a real backend.
        """
        if start_by is not None and self.now > start_by:
            err = TransferError("the read could not start before its lease margin ran out")
            err.code = ErrorCode.LEASE_EXPIRED
            return err
        if self.session_rank(plan.session) is None:
            return TransferError(f"Prefill session {plan.session} is gone", 3)
        for rr in plan.requests:
            req = self.reqs[rr.ext_req_id]
            for comp in plan.main:
                self._copy(engine, d_rank, -1, comp, (rr.main_src, rr.main_dst), req, layer, plan)
            for comp in plan.indexer:
                pair = (rr.indexer_src, rr.indexer_dst)
                self._copy(engine, d_rank, d_rank, comp, pair, req, layer, plan)
        return None

    def _copy(
        self,
        engine: int,
        d_rank: int,
        mem_rank: int,
        comp: ComponentAddrs,
        blocks: tuple[Sequence[int], Sequence[int]],
        req: Req,
        layer: int,
        plan: ReadPlan,
    ) -> None:
        """Copy one component's blocks; ``mem_rank`` -1 is the engine's shared K/V pool."""
        ext = req.spec.ext_id
        src, dst = blocks
        dest_ids = req.dmain if mem_rank < 0 else req.didx
        if (engine, d_rank, ext) in self._released:
            raise InvariantViolation(
                "S3",
                f"read {plan.read_id} writes {ext}'s blocks after Decode rank {d_rank} "
                "released them",
            )
        stored = self.pmem.get((plan.session, comp.src_base))
        for s, blk in zip(src, dst, strict=True):
            if stored is None:
                raise InvariantViolation("S1", f"read {plan.read_id} reads storage never written")
            w_layer, version, owners = stored
            owner, j = self._powner.get(s, ("?", -1))
            value: Value = (w_layer, owner if owner in owners else None, j, comp.name)
            expected: Value = (
                layer,
                ext,
                dest_ids.index(blk) if blk in dest_ids else -2,
                comp.name,
            )
            if value[:2] != expected[:2]:
                raise InvariantViolation(
                    "S1",
                    f"read {plan.read_id} of layer {layer} for {ext} from {plan.session} got "
                    f"layer {w_layer} (write {version}) of "
                    f"{'a freed request' if value[1] is None else value[1]}: read after reuse",
                )
            if value != expected:
                raise InvariantViolation(
                    "DATA",
                    f"read {plan.read_id}: Prefill block {s} ({value}) lands in "
                    f"Decode block {blk} ({expected})",
                )
            self.dmem[(engine, mem_rank, comp.dst_base, blk)] = value

    def _scribble(self, engine: int, d_rank: int, plan: ReadPlan) -> None:
        """A failed read may have written part of its destinations: garbage in the first."""
        for rr in plan.requests:
            for comps, dst, rank in (
                (plan.main, rr.main_dst, -1),
                (plan.indexer, rr.indexer_dst, d_rank),
            ):
                if dst and comps:
                    if (engine, d_rank, rr.ext_req_id) in self._released:
                        raise InvariantViolation(
                            "S3", f"a failed read wrote {rr.ext_req_id}'s released blocks"
                        )
                    self.dmem[(engine, rank, comps[0].dst_base, dst[0])] = GARBAGE
