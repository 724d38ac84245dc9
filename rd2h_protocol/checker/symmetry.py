"""Symmetry reduction: the renamings of interchangeable requests, and why they are sound.

:func:`~rd2h_protocol.checker.canonical.fingerprint` with ``symmetry`` takes the least
hash of a world's canonical form under every renaming :func:`renamings` lists. This
module holds those renamings and the argument for the reduction; it is apart from
:mod:`~rd2h_protocol.checker.canonical` because the renamings depend on the
configuration alone (worked out once per exploration, not per state) and the argument
is about the model, not about how a canonical form is written.

Requests of the same engine with the same chunks (and both or neither allocated late on
Decode) are interchangeable: the model treats them alike (the endpoints and the world use
request ids as names only; they compare block ids only with bounds that every id of the
model meets and look at a request's own ids only for contiguity, and the ids of every
request are laid out alike: ascending on Prefill, descending on Decode), so a state ``s``
and the state ``pi(s)`` in which such requests swap names (and block ``j`` of one becomes block
``j`` of the other) have the same futures up to that renaming, and ``pi(s)`` breaks an
invariant iff ``s`` does (the invariants name no particular request; the initial state
registers them in order, which the canonical form already disregards as dict order).
Exploring one state per orbit therefore reaches a state that breaks an invariant iff the
full exploration does. The fingerprint is the least hash of the canonical forms under
every permutation of each class
(:func:`~rd2h_protocol.checker.canonical.fingerprint`): equal fingerprints mean forms that
are equal up to a renaming, i.e. the same orbit. For the renaming to reach every
occurrence, the canonical form writes structs, readiness frames and the packed entries
of a parked readiness as data (not as encoded bytes), every text that could embed an id
is already left out of it, and block ids live in ranges of their own
(``FIRST_PREFILL_BLOCK``...) above every other number a state holds (seqs and uids grow
by a few per step; the explorer asserts its depth stays far below), so an int is renamed
only if it is a block id. The cost is one canonical form per permutation (two for two
requests).

It is off by default (``--symmetry`` turns it on; ``--compare-reduction`` measures both
ways in one run) because on these configurations it does not pay: the requests travel
together in the same batches, whose lists keep registration order (r0 before r1), so the
mirror of a reachable state is rarely itself reachable, and the merge happens only where a
fault treats the requests differently before they share a batch: few states merge, and
each state costs a canonical form per permutation (``--compare-reduction symmetry``
prints both for a configuration). Sorting the requests inside a batch in the canonical
form would merge more, but would need the endpoints to be provably insensitive to that
order, which they are not written to be.
"""

from __future__ import annotations

import itertools

from rd2h_protocol.checker.world import World

__all__ = ["renamings"]


def renamings(world: World) -> list[dict[object, object]]:
    """Every permutation of the interchangeable requests (same engine, same chunks, both
    allocated late on Decode or neither) as a renaming of their ids and of their block ids
    (block ``j`` of a request to block ``j`` of its image); the identity first, as ``{}``."""
    cfg = world.cfg
    classes: dict[tuple[object, ...], list[str]] = {}
    for spec in cfg.requests:
        key = (
            spec.engine,
            spec.chunks,
            spec.ext_id in cfg.late_decode,
            spec.ext_id in cfg.prefill_first,
        )
        classes.setdefault(key, []).append(spec.ext_id)
    groups = [ids for ids in classes.values() if len(ids) > 1]
    renamings: list[dict[object, object]] = []
    for images in itertools.product(*(itertools.permutations(ids) for ids in groups)):
        renaming: dict[object, object] = {}
        for ids, image in zip(groups, images, strict=True):
            for src, dst in zip(ids, image, strict=True):
                if src != dst:
                    a, b = world.reqs[src], world.reqs[dst]
                    renaming[src] = dst
                    for blocks, to in ((a.pmain, b.pmain), (a.pidx, b.pidx)):
                        renaming.update(zip(blocks, to, strict=True))
                    for blocks, to in ((a.dmain, b.dmain), (a.didx, b.didx)):
                        renaming.update(zip(blocks, to, strict=True))
        renamings.append(renaming)
    return renamings
