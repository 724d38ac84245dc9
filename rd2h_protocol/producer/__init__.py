"""The Prefill side of RD2H as a sans-IO endpoint.

Theory of operation
-------------------
One :class:`ProducerEndpoint` serves one Prefill TP rank. The runtime feeds it events
(a request arrived, a chunk was scheduled, a layer's KV is written, a frame arrived, a
deadline passed) together with ``now`` (monotonic seconds) and executes the outputs it
returns, in order: :class:`Connect` a DEALER, :class:`Send` a message, report a
:class:`RequestFinished`, wake the compute path on :class:`GateOpened`. Nothing here
reads a clock, opens a socket or sleeps.

The rules that change state are the tables in :mod:`rd2h_protocol.machines.producer`
(storage-slot gates, layer publications, requests, connection handshakes); this module
resolves their guards and performs their effects. The two properties it protects:

* buffer reuse (S1): the runtime asks :meth:`ProducerEndpoint.can_overwrite` before a
  layer's storage is written; it is True only while every publication against that
  storage has ended (a terminal reply, a local release, or an expired lease whose ABORT
  went out first -- emitted as a :class:`Send` before the :class:`GateOpened`).
  :meth:`ProducerEndpoint.layer_written` refuses to publish into a storage that is not
  open;
* bounded state (B1): a request is forgotten the moment it is finished, and it is
  finished only when no publication that named it is outstanding (or still readable by
  a peer that could not be told: such a publication keeps only its gates, see below).

Peers that cannot be told (S1 toward v1)
----------------------------------------
A v1 Decode (or a v2 one without the ``abort`` capability, or any peer under
``protocol="v1"``) cannot receive an ABORT, so an expired lease alone proves nothing: it
may still be reading. With ``v1_lease_expiry="hold"`` (the default) such a publication is
*held*: its requests are reported failed (``LEASE_EXPIRED``) at once, but its storage
gates stay closed until that connection replies to it, or until the runtime declares
the endpoint dead with :meth:`ProducerEndpoint.connection_lost`. The same holds for a v2
peer whose ABORT has to wait for a handshake in progress (after UNKNOWN_SESSION): the
gates reopen only once the ABORT has been emitted. ``v1_lease_expiry="reopen"`` keeps
v1's behaviour (reopen at expiry, untold) and is UNSAFE: the compute path may overwrite
storage a Decode is still reading.

Dead peers
----------
:meth:`ProducerEndpoint.connection_lost` is for the runtime's heartbeat. Publications
out on that connection fail their requests at once (``CONNECTION_LOST``; an ABORT goes
out best effort to a v2 peer, which may come back), but their gates reopen only when the
lease has ALSO run out (or a reply comes). A heartbeat proves that the peer process is
gone or cut off, not that no read it started is still moving bytes, and for a v1 peer
nothing else ever will; the lease (30 s by default, against reads of milliseconds that
v1 starts on receipt) is what bounds such a read. Residual risk, accepted: a Decode cut
off on the control network only, whose data path still works, and that starts a read
more than a lease after the readiness arrived. A reply that such a peer sends after
that (v1 replies carry no seq) may also be matched to a newer publication of the same
layer on that connection.

Step protocol, per engine step: ``schedule_chunk`` for every request with blocks in the
step, then ``layer_written`` for each cache-bearing layer (each at most once), then
``end_step``. Replies, aborts and timers may arrive at any time.

The modules, read top-down
--------------------------
:mod:`.config`        what the caller gives and reads: :class:`ProducerConfig`,
                      :class:`DecodeTarget`, :class:`ProducerStats`, :class:`PublicationView`
:mod:`.records`       one record per machine instance: storage gate, connection, request,
                      publication, kept request
:mod:`.state`         :class:`~.state.ProducerState`, the one record they all share, and
                      the base of the effects objects
:mod:`.requests`      the request machine's effects object
:mod:`.handshakes`    the connection machine's effects object: handshakes, refusals, ABORTs
:mod:`.publications`  the publication and storage-gate machines' effects objects: readiness
                      out, replies matched, publications ended
:mod:`.leases`        (publication effects) leases that run out: ABORT then reopen, or hold
:mod:`.dead_peers`    (publication effects) dead, silent and resumed connections
:mod:`.kept`          the kept request machine's effects object (Prefill-first)
:mod:`.endpoint`      :class:`ProducerEndpoint`: the public inputs and views

Composition, not inheritance: :class:`ProducerEndpoint` holds the state
(``endpoint.state``) and one effects object per machine over it; each effects object
binds its machine's table to its own handlers (``TABLE``) and reaches the other machines
only through their effects objects and tables. Outputs are appended to ``state.out``;
each input method of the endpoint hands back that list and starts a new one.
"""

from __future__ import annotations

from rd2h_protocol.events import (
    ClaimAnswered,
    Connect,
    Disconnect,
    GateOpened,
    LayerReplied,
    RequestFinished,
    Send,
)
from rd2h_protocol.machines.producer import PRODUCER_MACHINES
from rd2h_protocol.producer.config import (
    DecodeTarget,
    Output,
    ProducerConfig,
    ProducerStats,
    ProtocolChoice,
    PublicationView,
    ReadFailurePolicy,
    V1LeaseExpiry,
)
from rd2h_protocol.producer.endpoint import ProducerEndpoint

__all__ = [
    "PRODUCER_MACHINES",
    "ClaimAnswered",
    "Connect",
    "DecodeTarget",
    "Disconnect",
    "GateOpened",
    "LayerReplied",
    "Output",
    "ProducerConfig",
    "ProducerEndpoint",
    "ProducerStats",
    "ProtocolChoice",
    "PublicationView",
    "ReadFailurePolicy",
    "RequestFinished",
    "Send",
    "V1LeaseExpiry",
]
