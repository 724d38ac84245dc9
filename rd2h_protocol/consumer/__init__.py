"""The Decode side of the protocol: one sans-IO endpoint per Decode TP rank.

Theory of operation
-------------------
:class:`ConsumerEndpoint` owns nothing but state. The runtime feeds it what happened --
a frame from a Prefill peer (:meth:`~ConsumerEndpoint.receive`), a request whose
destination blocks vLLM allocated (:meth:`~ConsumerEndpoint.add_request`), the end of a
data read (:meth:`~ConsumerEndpoint.read_finished`), an abort or a release from vLLM, the
passing of time (:meth:`~ConsumerEndpoint.handle_timer`) -- always with ``now``
(monotonic seconds), and executes the outputs it gets back, in order: :class:`Reply` and
:class:`SendAbort` go on the wire, :class:`StartRead` goes to a read worker,
:class:`RequestDone` / :class:`RequestFailed` feed the cross-rank completion
(:mod:`rd2h_protocol.completion`), :class:`Releasable` lets vLLM free the blocks.
Nothing here raises for peer input: bad frames and messages are counted in
:attr:`~ConsumerEndpoint.stats` and answered when they can be identified.

Serving one readiness (reference §2, departures 1, 4, 6, 11):

1. The peer must be bound to a session by MF_META (else ``UNKNOWN_SESSION``; a refused
   session gets its refusal code). The layer is identified by NAME (reference §5):
   ``layer_name`` must be one of this rank's layers and of the session's layout, and
   ``layer_idx`` must be the index v1 peers derive from that name
   (:func:`~rd2h_protocol.topology.wire_layer_index`, else ``LAYOUT_MISMATCH`` naming
   both); the layout must match the destination
   (:func:`~rd2h_protocol.wire.layout.validate_layer`). A failure here
   fails the WHOLE layer, ``read_failed``, before any byte moves (never a partial write),
   and every known request the message names fails with it.
2. Requests this rank does not know yet (the rendezvous outran the worker) park the
   message, bounded in count and time; requests retired recently (released, aborted) are
   not waited for.
3. The lease (v2): a read is never STARTED once less than half of ``lease_ms`` is left
   since the message arrived; the message is refused ``LEASE_EXPIRED`` instead.
4. Per request: unknown (after parking), no longer waiting, inconsistent ``tp_ratio``,
   destination range that does not fit, or Prefill block ids outside the layout's
   ``num_blocks``: the request is *isolated* -- left out of the read, failed on this rank,
   and (v2 with the ``isolate`` capability) listed in the reply's ``failed``. Every other
   request contributes its share: the main blocks only from ``group_member_idx`` 0,
   split over the Decode TP ranks with :func:`~rd2h_protocol.topology.main_share` when
   the ranks share one main pool (``main_shared``), else all of them on every rank (each
   rank's own KV cache, e.g. vLLM's); the
   indexer (and its scale) split over the contributors with
   :func:`~rd2h_protocol.topology.indexer_share`. The request machine takes the message
   in runs of requests in one state (``RECV_READINESS`` is a batched input), and the
   shares of a session's kept entries are worked out once per engine step (see
   ``KeptEntries``): the other layers look them up.
5. ONE :class:`~rd2h_protocol.plan.ReadPlan` per message (``StartRead``), or, when this
   rank has nothing to read, ``read_done`` at once. A whole-entry share is not copied:
   the plan holds the message's own ids (tuples decoded once per engine step, as every
   layer carries the same entries; see :mod:`rd2h_protocol.wire.readiness`) and the request's own
   destination ids (a tuple, or a range when contiguous), so the runtime can plan the
   later layers of a step with no per-id work. When the read ends, the reply goes out;
   done signals count (contributor completion) only after a successful read; a failed
   read fails every request of the message. A transient failure is retried
   (``max_read_retries``) while the lease still leaves its margin.

Toward a v1 peer: isolation still applies (the other requests are read), and the reply
is the plain ``read_done`` -- v1 has no per-request failure field, and its Prefill raises
on ``read_failed`` and so fails every request of its batch. The isolated requests fail on
Decode, which owns their completion, so nothing depends on the v1 Prefill learning of
them. ``read_failed`` is kept for what fails the whole layer.

Reading order
-------------
The endpoint is one state record and the parts that act on it, by composition (no part
inherits from another, and none holds state: :mod:`.state` declares all of it). Each
machine has one effects object, the owner its bound table's handlers run on; the
collaborators they share do one concern each. A part reaches the others through the
references :class:`ConsumerEndpoint` wires when it builds them:

* :mod:`.config` -- :class:`ConsumerConfig` and :class:`ConsumerStats`;
* :mod:`.records` -- the per-session, per-request and per-readiness records;
* :mod:`.state` -- :class:`~.state.ConsumerState`, everything the endpoint holds (its
  ``out`` collects the outputs of the input being handled);
* :mod:`.held` -- :class:`~.held.SessionBudgets`: what sessions hold, and its budgets;
* :mod:`.parking` -- :class:`~.parking.Parking`: readiness and ABORTs that wait for
  requests not known yet;
* :mod:`.requests` -- :class:`~.requests.RequestEffects`: the request machine's effects
  (done, failed, released);
* :mod:`.replies` -- :class:`~.replies.Replies`: read_done / read_failed, and the memory
  of recent replies;
* :mod:`.reads` -- :class:`~.reads.ReadinessEffects`: the readiness machine's effects
  and a batched read's outcomes (done signals, retry, failure);
* :mod:`.serving` -- :class:`~.serving.Serving`: serving one readiness: checks, parking,
  shares, the read plan;
* :mod:`.sessions` -- :class:`~.sessions.SessionEffects`: the session machine's effects:
  handshake, ABORT, admission;
* :mod:`.endpoint` -- :class:`ConsumerEndpoint`: the public inputs and views; each input
  hands out (and clears) the outputs the parts collected in ``state.out``.

A frame from Prefill goes through one decoder call and one dispatch:
:meth:`~ConsumerEndpoint.receive` hands it to
:func:`~rd2h_protocol.wire.readiness.read_frame` with what the session holds (its block id
bound, its kept entries), and acts on the value it gets back alone: a ``Readiness`` goes to
the session table (``RECV_READINESS``), an ``Unreadable`` gets its failure reply (or is
dropped), any other message goes to its handler.
"""

from rd2h_protocol.consumer.config import ConsumerConfig, ConsumerStats, Output
from rd2h_protocol.consumer.endpoint import ConsumerEndpoint
from rd2h_protocol.events import Releasable, Reply, RequestDone, RequestFailed, SendAbort, StartRead
from rd2h_protocol.machines.consumer import CONSUMER_MACHINES

__all__ = [
    "CONSUMER_MACHINES",
    "ConsumerConfig",
    "ConsumerEndpoint",
    "ConsumerStats",
    "Output",
    "Releasable",
    "Reply",
    "RequestDone",
    "RequestFailed",
    "SendAbort",
    "StartRead",
]
