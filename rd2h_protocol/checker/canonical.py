"""State fingerprints: a canonical form of a world, and the reductions it applies.

Canonical form
--------------
Two states reached along different paths are often the same state written differently:
dicts filled in another order, read ids handed out in another order, a lazy timer heap
laid out differently, counters, and every time shifted by the same amount. The
fingerprint is the hash of a canonical form that leaves those out: dicts and sets sorted,
read ids and uid counters dropped (they are labels), derived caches and configuration
skipped, times measured from now, and references between an endpoint's own records
written as the name or id they stand for (which also breaks the cycles).

Each of those is left out because nothing that happens next depends on it: the
endpoints and the world never observe the order of a dict or a set, use read ids and
uids as labels only, never act on the skipped attributes (:data:`_SKIP`: configuration,
derived caches, counters, texts; the entries say why), and compare times only with each
other. The comments in :func:`_canon_world` argue the same for what the world remembers
(the history of requests that ended, Decode's memory of replies no one can ask for any
more). Equal canonical forms therefore mean states with the same futures.

The fingerprint is Python's 64-bit hash of the canonical form: stable within one
process, and over a million states the chance that two different states collide is
about 1e-7 (:func:`fingerprint`).

Shortcuts that build the same form: an int, a string, bytes, a bool or None is its own
form (:data:`_AS_IS`), so the hot loops keep such a value as it is instead of calling
:func:`_canon`, which would return it unchanged (while a renaming is applied they call
it for every value, since it renames); the form of a reply or an ABORT and the seq of a
readiness are decoded once per distinct frame payload (:data:`_REPLY_FORMS`,
:data:`_SEQS`: a payload's bytes decide its message, and a form cached without a
renaming is the one :func:`_reply_form` writes then); the live publications are read
from the producer's table instead of its ``publications()`` views (the same conn and seq
of every one); the explorer hands a child the forms of the endpoints the action leading
to it did not touch, from its parent (:func:`fingerprint_reusing`: an endpoint's form is
a function of the endpoint and the clock, and an action that touches neither keeps both;
tested by building every such fingerprint again from scratch). Each builds a form equal
to the one built without it, so the states, transitions and depths of every exploration
are unchanged (checked on the 13 designed configurations and on bounded variants, before
and after).

Symmetry reduction
------------------
Requests that the model treats alike may swap names (and block ids): with ``symmetry``,
:func:`fingerprint` takes the least hash of the canonical forms under every such
renaming. The renamings and the argument that the reduction keeps every violation are
in :mod:`~rd2h_protocol.checker.symmetry`. For a renaming to reach every occurrence, the
canonical form writes structs, readiness frames and the packed entries of a parked
readiness as data while one is applied (``_STRUCTS_AS_DATA``, ``_RENAME``).

Duplicates made on delivery
---------------------------
A ``dup`` of the explorer delivers a frame and queues a copy behind everything its
connection holds at that instant (:meth:`~rd2h_protocol.checker.network.NetworkWorld.
deliver_duplicated`; ``WorldConfig.duplicate_on_delivery``), instead of queueing the copy
at any instant while the original waits (:meth:`~rd2h_protocol.checker.network.
NetworkWorld.duplicate`, which the hypothesis state machine keeps). Why nothing is lost
but what is named below: a copy made early changes nothing any endpoint sees until a
frame of that connection is delivered (frames of one connection arrive in order, the
copy waits behind its original, carries no delivery bound since readiness is never
duplicated, and a kill or a break that purges the connection purges both), so making
it is independent of every action but a send on the same connection, the delivery,
drop or purge of its original, and the budget it spends. An early copy can therefore
be moved later, past every other action, up to the next send on its connection or the
delivery of its original. When no frame joins the connection in between, that is the
delivery itself: the reduced ``dup`` reaches the same state. What it leaves unexplored:
a copy that overtakes a frame sent on its connection after the original was sent and
before the original arrived (the copy then arrives between those two frames); the copy
of a reply or an ABORT always arrives after every frame sent before its original was
delivered. ``--compare-reduction duplicates`` prints the states and CPU time with and
without it for a configuration.

Partial-order reduction
-----------------------
The explorer applies sleep sets (see :mod:`~rd2h_protocol.checker.explore`): they skip
transitions that end in a state reached already through the other order of two
independent actions, and keep every state. Persistent (ample, stubborn) sets, which
would also leave states out, are not applied, because their condition (no action
outside the set, on any path, may depend on one inside it before the set runs) fails
almost everywhere in this model:

* every endpoint is reactive: any two of its inputs depend on each other, and any
  other agent may send it a frame on an empty connection (Prefill's compute path, its
  timers and Decode's replies all send), so a set made of one endpoint's actions is
  persistent only while no other agent can send to it;
* moving time depends on every action (each deadline compares with the clock), and is
  enabled in many states;
* a kill or a break left in a budget is enabled in every state and depends on every
  action.

Classifying every pair of enabled actions over the first states of ``tp2-d2`` (each
pair taken in both orders, classified by its footprints, see
:mod:`~rd2h_protocol.checker.footprint`) bears this out: besides the independent pairs
(which sleep sets already use) there are pairs where one disables the other (a delivery
and a loss of the same frame, two timers), pairs with time or a fault that hits
everything, pairs that commute although their footprints overlap (mostly a delivery to a
Prefill rank and that rank's next write, which read and write the same producer), and
pairs that do not commute.
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Callable
from typing import Any, Final, TypeAlias

import msgspec

from rd2h_protocol.checker.model import CLAIM_KINDS, Frame
from rd2h_protocol.checker.snapshot import connection_of, share
from rd2h_protocol.checker.symmetry import renamings
from rd2h_protocol.checker.world import World
from rd2h_protocol.claim import decode_claim, decode_claim_answer
from rd2h_protocol.consumer import ConsumerEndpoint
from rd2h_protocol.plan import ReadPlan
from rd2h_protocol.producer import ProducerEndpoint
from rd2h_protocol.wire.codec import decode
from rd2h_protocol.wire.layout import DestinationLayout, LayerLayout
from rd2h_protocol.wire.messages import Abort, ReadDone, ReadFailed, ReadReadyBatch
from rd2h_protocol.wire.readiness import PACKED_ENTRIES_DECODER as _UNPACK_DECODER

__all__ = ["Endpoint", "EndpointForms", "fingerprint", "fingerprint_reusing", "read_form"]

_Canon: TypeAlias = object

# Attributes left out of the canonical form, by class (module.qualname): configuration,
# derived caches, counters and labels that never change what happens next.
_SKIP: Final[dict[str, frozenset[str]]] = {
    "rd2h_protocol.checker.world.World": frozenset(
        {
            "cfg",
            "static",
            "_powner",
            "_version",
            "_next_pblock",
            "_next_dblock",
            "reads",
            "pmem",
            "network",
            "dmem",
            "ranks",
            "_terminal",
            "_delivered",
            "_prefill_finished",
            "_aborted_to",
        }
    ),
    # (an endpoint's form is its state's, see _canon_producer; out is empty between inputs)
    "rd2h_protocol.producer.state.ProducerState": frozenset(
        {
            "config",
            "stats",
            "layer_names",
            "layer_slots",
            "last_layer",
            "lease_s",
            "v1_only",
            "meta",
            "next_uid",
            "timers",
            "out",
        }
    ),
    "rd2h_protocol.consumer.state.ConsumerState": frozenset(
        {
            "config",
            "stats",
            "layers",
            "caps",
            "main_limit",
            "indexer_limit",
            "next_read_id",
            "next_park_id",
            "out",
            "aborts",
            "reads",
            "entry_cache",
            # What sessions hold in bytes acts only beyond the session budgets (MiBs),
            # which the model's few small sessions never approach.
            "session_bytes",
            "session_bytes_by_origin",
            "origin_sessions",
        }
    ),
    # history only tells a stale reply from a duplicate one (a counter); next_seq is a label.
    "rd2h_protocol.producer.records.Conn": frozenset({"history", "next_seq", "refusal"}),
    "rd2h_protocol.producer.records.Pub": frozenset({"sent_at"}),  # for latency metrics only
    # Failure texts are reported, never acted on.
    "rd2h_protocol.producer.records.Request": frozenset({"message"}),
    "rd2h_protocol.consumer.records.RequestRecord": frozenset({"fail_message"}),
    "rd2h_protocol.consumer.records.ParkedAbort": frozenset({"reason"}),
    # The reply memory is written by _canon_world, only where it can still be asked.
    "rd2h_protocol.consumer.records.SessionRecord": frozenset(
        {"validated", "remembered", "remembered_bytes", "held", "layout_bytes"}
    ),
    # A request's spec and block ids never change; its key says which request it is.
    "rd2h_protocol.checker.model.Req": frozenset({"spec", "pmain", "pidx", "dmain", "didx"}),
    "rd2h_protocol.completion.ContributorSet": frozenset({"duplicates"}),
    "rd2h_protocol.completion.CrossRankCompletion": frozenset(
        {"stats", "world_size", "max_unmapped", "unmapped_timeout_s", "collect_timeout_s"}
    ),
}
# Attributes that hold references to records kept elsewhere: written as their key.
_REFS: Final[dict[str, dict[str, str]]] = {
    "rd2h_protocol.producer.records.Pub": {"conn": "name", "requests": "ext_id"},
    "rd2h_protocol.producer.records.Request": {"conn": "name"},
    "rd2h_protocol.consumer.records.ReadinessRecord": {"accepted": "ext_id", "in_plan": "ext_id"},
}
# Attributes that hold structs packed as msgpack bytes, with their decoder: written as the
# decoded data while structs are written as data (a renaming must reach the ids inside),
# else as the bytes (they decide the data).
_PACKED: Final[dict[str, dict[str, msgspec.msgpack.Decoder[Any]]]] = {
    "rd2h_protocol.consumer.records.ReadinessRecord": {"packed": _UNPACK_DECODER},
}
_ATOMIC: Final[frozenset[type]] = frozenset({str, int, bytes, bool, type(None)})
# Types whose values are their own canonical form: the atomic ones, or none while a
# renaming is applied (then every value goes through _canon, which renames). The hot
# loops below test it inline instead of calling _canon for each int and string.
_AS_IS: frozenset[type] = _ATOMIC
_NOW: list[float] = [0.0]  # the instant times are measured from, while canonicalising
# The renaming of request ids and block ids applied while canonicalising (symmetry), and
# whether structs are written as data (so that renaming reaches inside them) or as bytes.
_RENAME: dict[object, object] = {}
_STRUCTS_AS_DATA: list[bool] = [False]
_HANDLERS: dict[type, Callable[[Any], _Canon]] = {}
_SHARED_FORMS: dict[int, _Canon] = {}  # forms of shared immutable objects (layouts), by id


def _canon(obj: object) -> _Canon:
    """The canonical form of ``obj``: plain, hashable, free of order and labels."""
    t = type(obj)
    if t in _ATOMIC:
        return _RENAME.get(obj, obj) if _RENAME else obj
    if t is float:
        # Behaviour depends on differences of times only: measure them from now.
        return obj - _NOW[0]  # type: ignore[operator]
    # The common containers inline (this runs a few hundred times per state).
    if t is tuple or t is list:
        return tuple([x if type(x) in _AS_IS else _canon(x) for x in obj]) if obj else ()  # type: ignore[attr-defined]
    if t is dict:
        return _canon_map(obj) if obj else _EMPTY_MAP
    if t is set or t is frozenset:
        return _canon_set(obj) if obj else _EMPTY_SET
    handler = _HANDLERS.get(t)
    if handler is None:
        handler = _HANDLERS[t] = _handler_for(t)
    return handler(obj)


_EMPTY_MAP: Final = ("{}", ())
_EMPTY_SET: Final = ("set", ())


def _sorted(items: list[_Canon]) -> tuple[_Canon, ...]:
    try:
        return tuple(sorted(items))  # type: ignore[type-var]
    except TypeError:
        return tuple(sorted(items, key=repr))


def _canon_seq(obj: Any) -> _Canon:
    return tuple([x if type(x) in _AS_IS else _canon(x) for x in obj])


def _canon_map(obj: Any) -> _Canon:
    return (
        "{}",
        _sorted(
            [
                (
                    k if type(k) in _AS_IS else _canon(k),
                    v if type(v) in _AS_IS else _canon(v),
                )
                for k, v in obj.items()
            ]
        ),
    )


def _canon_set(obj: Any) -> _Canon:
    return ("set", _sorted([x if type(x) in _AS_IS else _canon(x) for x in obj]))


def _canon_struct(obj: Any) -> _Canon:
    if _STRUCTS_AS_DATA[0]:
        return _canon(msgspec.to_builtins(obj, builtin_types=(bytes,)))
    return msgspec.msgpack.encode(obj)


def _canon_shared_struct(obj: Any) -> _Canon:
    # Layouts are shared between snapshots (see DISPATCH) and never change.
    form = _SHARED_FORMS.get(id(obj))
    if form is None:
        share(("form", id(obj)), obj)  # keep it alive: its id stays its own
        form = _SHARED_FORMS[id(obj)] = msgspec.msgpack.encode(obj)
    return form


def _canon_plan(plan: Any) -> _Canon:
    # read_id is a label; the components follow from the layer.
    return ("plan", plan.session, plan.layer_name, _canon(plan.requests))


def _canon_world(world: Any) -> _Canon:
    state = _canon_vars(world)
    reads = _sorted([((e, d), _canon(r)) for (e, d, _), r in world.reads.items()])
    # Write versions are for the traces only: what a block holds is (layer, owners).
    pmem = _sorted([(k, (v[0], _canon(v[2]))) for k, v in world.pmem.items()])
    network = tuple([_canon_frame(f) for f in sorted(world.network, key=connection_of)])
    # What the checks remember about a request matters only while it lives: once Decode
    # released (or abandoned) it and every Prefill rank finished it, its history is moot.
    live_decode = {x for x, r in world.reqs.items() if not r.released and not r.abandoned}
    live_prefill = {x for prod in world.producers for x in prod.requests()}
    dblocks = {
        (r.spec.engine, b) for x in live_decode for r in (world.reqs[x],) for b in r.dmain + r.didx
    }
    memory = _sorted(
        [_canon(item) for item in world.dmem.items() if (item[0][0], item[0][3]) in dblocks]
    )
    records = tuple(
        _sorted([_canon(item) for item in table.items() if item[0][2] in live_decode])
        for table in (world._terminal, world._delivered)
    )
    aborted = _sorted([_canon(k) for k in world._aborted_to if k[2] in live_prefill])
    # Decode's reply memory (seq -> reply) matters only for a seq that can still reach it:
    # one Prefill still holds (and may resend) or one in flight. Prefill never resends an
    # ended publication and never reuses a seq, and the model stays far below the memory's
    # bounds, so what Decode remembers of any other seq changes nothing that follows.
    # (Every live publication, as publications() would list it, without building views.)
    askable = {
        (prod.config.session, pub.conn.name, pub.seq)
        for prod in world.producers
        for pub in prod.state.pubs.values()
    }
    for f in world.network:
        if f.kind == "ReadReadyBatch":
            askable.add((f.src[1], f.dst[1], _readiness_seq(f.data)))
    remembered = _sorted(
        [
            (conn, name, seq, _canon(reply))
            for (e, d), cons in world.consumers.items()
            for conn in (World.conn_name(e, d),)
            for name, session in cons.state.sessions.items()
            for seq, reply in session.remembered.items()
            if (name, conn, seq) in askable
        ]
    )
    ranks = tuple(
        (
            rank.session,
            rank.next_layer,
            _sorted([_canon(c) for c in rank.chunks.items() if c[0] in live]),
            _canon(rank.computing),  # Prefill-first prompts under way
        )
        for rank, prod in zip(world.ranks, world.producers, strict=True)
        for live in (prod.requests(),)
    )
    return (state, reads, pmem, network, memory, records, aborted, ranks, remembered)


def _canon_frame(frame: Frame) -> _Canon:
    """A frame as what its receiver acts on: texts (reasons, error messages) and the send
    time of frames without a delivery bound change nothing."""
    head = (frame.src, frame.dst)
    if frame.kind in CLAIM_KINDS:
        return (head, *_claim_form(frame))
    if frame.kind in _REPLY_KINDS:
        if _RENAME:  # a renaming reaches inside: nothing cached
            return (head, *_reply_form(frame))
        form = _REPLY_FORMS.get(frame.data)
        if form is None:
            form = _REPLY_FORMS[frame.data] = _reply_form(frame)
        return (head, *form)
    deliver_by = None if frame.deliver_by is None else frame.deliver_by - _NOW[0]
    if frame.kind == "ReadReadyBatch" and _STRUCTS_AS_DATA[0]:
        return (head, _canon_struct(decode(frame.data)), deliver_by)
    return (head, frame.data, deliver_by)


_REPLY_KINDS: Final = frozenset({"Abort", "ReadFailed", "ReadDone"})
# The form of a reply or an ABORT (after its head) and the seq of a readiness, by the
# frame's bytes: decoded once each, as the model sends few distinct ones (a frame's bytes
# decide its message; the forms are written without a renaming).
_REPLY_FORMS: dict[bytes, tuple[_Canon, ...]] = {}
_SEQS: dict[bytes, int | None] = {}


def _reply_form(frame: Frame) -> tuple[_Canon, ...]:
    if frame.kind == "Abort":
        msg = decode(frame.data)
        assert isinstance(msg, Abort)
        return ("abort", _canon(msg.ext_ids))
    if frame.kind == "ReadFailed":
        failed = decode(frame.data)
        assert isinstance(failed, ReadFailed)
        return ("failed", failed.layer_idx, failed.seq, failed.code)
    done = decode(frame.data)
    assert isinstance(done, ReadDone)
    isolated = _canon([(f.ext_req_id, f.code) for f in done.failed or ()])
    return ("done", done.layer_idx, done.seq, isolated)


def _claim_form(frame: Frame) -> tuple[_Canon, ...]:
    """A claim as what Prefill acts on (the request it names; the rest is the same in
    every claim of that request: its Decode, its prompt length), an answer as what Decode
    acts on (the request, accepted or not; its text is reported, never acted on)."""
    if frame.kind == "Claim":
        return ("claim", _canon(decode_claim(frame.data).request_id))
    answer = decode_claim_answer(frame.data)
    return ("claim answer", _canon(answer.request_id), answer.ok)


def _readiness_seq(data: bytes) -> int | None:
    if data not in _SEQS:
        msg = decode(data)
        assert isinstance(msg, ReadReadyBatch)
        _SEQS[data] = msg.seq
    return _SEQS[data]


# The forms of endpoints known already (inherited from the state a child was made from),
# and those built by the fingerprint under way: by id of the endpoint object.
_KNOWN_FORMS: dict[int, _Canon] = {}
_BUILT_FORMS: dict[int, _Canon] = {}


def _canon_producer(prod: Any) -> _Canon:
    form = _KNOWN_FORMS.get(id(prod))
    if form is None:
        state = prod.state
        live = set(state.pubs) | set(state.handshakes) | set(state.kept_timers)
        # The timer heap is lazy: only its live entries matter, in deadline order.
        timers = tuple(sorted((t - _NOW[0], uid) for t, uid in state.timers if uid in live))
        form = (_canon_vars(state), timers)
    _BUILT_FORMS[id(prod)] = form
    return form


def _canon_consumer(cons: Any) -> _Canon:
    form = _KNOWN_FORMS.get(id(cons))
    if form is None:
        state = cons.state  # (the endpoint's parts hold nothing but references to it)
        form = (_canon_vars(state), _sorted([_canon(rd) for rd in state.reads.values()]))
    _BUILT_FORMS[id(cons)] = form
    return form


_VAR_NAMES: dict[type, tuple[frozenset[str], tuple[str, ...]]] = {}


def _canon_vars(obj: object) -> tuple[_Canon, ...]:
    own = vars(obj)
    cls = type(obj)
    cached = _VAR_NAMES.get(cls)
    keys = own.keys()
    if cached is None or cached[0] != keys:
        skip = _skip_of(cls)
        cached = _VAR_NAMES[cls] = (frozenset(keys), tuple(a for a in sorted(own) if a not in skip))
    return tuple([v if type(v) in _AS_IS else _canon(v) for v in map(own.__getitem__, cached[1])])


def _skip_of(cls: type) -> frozenset[str]:
    for klass in cls.__mro__:
        skip = _SKIP.get(f"{klass.__module__}.{klass.__qualname__}")
        if skip is not None:
            return skip
    return frozenset()


def _handler_for(t: type) -> Callable[[Any], _Canon]:
    """Build (once per type) the function that canonicalises values of type ``t``."""
    if issubclass(t, World):
        return _canon_world
    if issubclass(t, ProducerEndpoint):
        return _canon_producer
    if issubclass(t, ConsumerEndpoint):
        return _canon_consumer
    if issubclass(t, tuple | list | deque):  # NamedTuples too
        return _canon_seq
    if issubclass(t, dict):
        return _canon_map
    if issubclass(t, set | frozenset):
        return _canon_set
    if issubclass(t, int):  # IntEnum
        return int
    if t in (LayerLayout, DestinationLayout):
        return _canon_shared_struct
    if issubclass(t, msgspec.Struct):
        return _canon_struct
    if t is ReadPlan:
        return _canon_plan
    name = f"{t.__module__}.{t.__qualname__}"
    refs = _REFS.get(name, {})
    slots: list[str] = []
    for klass in reversed(t.__mro__):
        declared = klass.__dict__.get("__slots__", ())
        slots.extend([declared] if isinstance(declared, str) else declared)
    if not slots:
        return lambda obj: (t.__qualname__, _canon_vars(obj))
    skip = _skip_of(t)
    attrs = [a for a in dict.fromkeys(slots) if a not in skip and a != "__weakref__"]
    plain = [a for a in attrs if a not in refs]
    referring = [(a, refs[a]) for a in attrs if a in refs]
    qualname = t.__qualname__

    get_plain = operator.attrgetter(*plain) if len(plain) > 1 else None
    packed = [(1 + plain.index(a), a, d) for a, d in _PACKED.get(name, {}).items() if a in plain]

    def handler(obj: Any) -> _Canon:
        fields: list[_Canon] = [qualname]
        if get_plain is not None:
            fields.extend([v if type(v) in _AS_IS else _canon(v) for v in get_plain(obj)])
        elif plain:
            fields.append(_canon(getattr(obj, plain[0])))
        if packed and _STRUCTS_AS_DATA[0]:
            for at, attr, decoder in packed:
                raw = getattr(obj, attr)
                if raw is not None:
                    fields[at] = _canon(decoder.decode(raw))
        for attr, key in referring:
            value = getattr(obj, attr)
            if isinstance(value, list | tuple):
                fields.append(tuple([_canon(getattr(v, key)) for v in value]))
            else:
                fields.append(_canon(getattr(value, key)))
        return tuple(fields)

    return handler


def fingerprint(world: World, *, symmetry: bool = False) -> int:
    """A hash of ``world``'s canonical form: equal for states that behave the same, up to
    a permutation of interchangeable requests (``symmetry``; see the module docstring):
    the least hash of the forms under every such permutation.

    Python's hash of the form (64 bits): within one process it is stable, and over a
    million states the chance that two different states collide is about 1e-7.
    """
    _NOW[0] = world.now
    _BUILT_FORMS.clear()  # ids of this world's endpoints only
    static = world.static
    if static.renamings is None:
        static.renamings = renamings(world)
    if not symmetry or len(static.renamings) == 1:
        return hash(_canon(world))
    assert not _KNOWN_FORMS, "inherited forms are written without a renaming"
    global _AS_IS
    _STRUCTS_AS_DATA[0] = True
    _AS_IS = frozenset()
    try:
        best = None
        for renaming in static.renamings:
            _RENAME.update(renaming)
            h = hash(_canon(world))
            _RENAME.clear()
            best = h if best is None else min(best, h)
    finally:
        _RENAME.clear()
        _STRUCTS_AS_DATA[0] = False
        _AS_IS = _ATOMIC
    assert best is not None
    return best


#: An endpoint of a world: ``("P", p, 0)`` for Prefill rank ``p``, ``("D", e, d)`` for
#: rank ``d`` of Decode engine ``e``.
Endpoint: TypeAlias = tuple[str, int, int]
EndpointForms: TypeAlias = dict[Endpoint, _Canon]


def fingerprint_reusing(world: World, inherited: EndpointForms) -> tuple[int, EndpointForms]:
    """:func:`fingerprint` (without symmetry) of ``world``, taking the canonical forms of
    the endpoints in ``inherited`` as given instead of building them; with the forms of
    all its endpoints, for its own children to inherit.

    The explorer passes a child the forms of its parent's endpoints that the action
    leading to it did not touch (see :mod:`~rd2h_protocol.checker.footprint`): an
    endpoint's form is a function of the endpoint alone and of the clock (its times are
    measured from now), and an action that moves the clock touches every endpoint.
    """
    endpoints: dict[Endpoint, object] = {
        ("P", p, 0): prod for p, prod in enumerate(world.producers)
    }
    endpoints.update((("D", e, d), cons) for (e, d), cons in world.consumers.items())
    for key, form in inherited.items():
        _KNOWN_FORMS[id(endpoints[key])] = form
    try:
        h = fingerprint(world)
        return h, {key: _BUILT_FORMS[id(obj)] for key, obj in endpoints.items()}
    finally:
        _KNOWN_FORMS.clear()
        _BUILT_FORMS.clear()


def read_form(world: World, key: tuple[int, int, int]) -> _Canon:
    """Read ``key`` of ``world`` by what it is, not by its read id (a label): its rank
    and the canonical form of its plan, deadline and layer (as :func:`fingerprint` writes
    it), equal in every state that the fingerprint merges."""
    _NOW[0] = world.now
    return (key[:2], _canon(world.reads[key]))
