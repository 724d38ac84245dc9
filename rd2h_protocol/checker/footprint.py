"""What one action of the model world touches: its footprint, and when two commute.

The explorer's partial-order reduction (sleep sets, see
:mod:`~rd2h_protocol.checker.explore`) needs to know when two actions enabled in the
same state are *independent*: neither disables the other, and taking them in either
order ends in the same state. Its fingerprints need to know which endpoints an action
left alone (their canonical forms are the parent's: see
:func:`~rd2h_protocol.checker.canonical.fingerprint_reusing`). This module answers that
from what each action did when the explorer took it: while :func:`recording` is active,
the world notes every part of the state an action reads or writes (:func:`touch`), and
:func:`conflict` says whether two such footprints may interfere.

The parts of the state, and who touches them
--------------------------------------------
* **An agent** (``("A", "P", p)``: Prefill rank ``p``, its producer, its compute path,
  its incarnation, what the checks remember of its session; ``("A", "D", e)``: Decode
  engine ``e``, every rank's consumer, the cross-rank completion, its reads, its memory,
  the decode-side fields of its requests and what the checks remember of them). Every
  call into an endpoint goes through the world's output handlers
  (``WorldCore._producer_outputs`` / ``_consumer_outputs``), which note the agent; an
  action that reads a producer without calling it (``prefill_abort``'s choice of the
  ranks that hold a request) notes it itself. An agent is read and written as a whole.
* **A connection's queue, one direction** (``src -> dst``): taking its head (a delivery,
  a drop, a lost readiness: ``T``), appending (a send: ``+``), purging both directions
  (a ``Disconnect``: ``X``).
* **A Prefill session's storage**: written by the compute path (``W``), read by a read
  (``R``).
* **The fault budgets** (``B``): every action that spends one reads and writes them.
* **Everything** (``G``): moving time (every deadline compares with the clock), killing
  an endpoint, breaking a connection. Such an action conflicts with every other.

Why disjoint footprints commute
-------------------------------
Each action is a deterministic function of the parts it reads, and it changes only the
parts it writes (the world has no other shared state: the clock, which only ``G``
actions move; the configuration and the block layout, which never change; counters and
labels that the canonical form leaves out). If neither of two actions writes a part the
other reads or writes, each runs the same way in either order, with the same checks and
the same outputs, and the two orders end in the same state. Queues are the one place
where two writers commute: taking the head of a non-empty queue (the head existed when
both were enabled) and appending to its tail touch different frames, and leave the same
queue in either order; two appends, or two takes, do not commute. An action's
enabledness reads only its own footprint's parts (an agent's state, a queue's head, the
budgets, the clock), so an independent action neither enables nor disables it.

One part is read by every action without being noted: the world's cross-rank gathering
(``WorldCore._gather``) asks every engine's completion whether it is idle, and updates
a non-idle one with empty reports. In the model that update is a no-op (the model's
ids are always mapped, so nothing waits unmapped, and no collect timeout is set), so
whether an engine is idle changes nothing another agent's action does; the engine is
noted only where its completion gets reports.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final, TypeAlias

__all__ = ["EVERYTHING", "Footprint", "conflict", "recording", "touch"]

Token: TypeAlias = tuple[object, ...]
Footprint: TypeAlias = frozenset[Token]

#: The token of an action that conflicts with every other.
EVERYTHING: Final[Token] = ("G",)
BUDGETS: Final[Token] = ("B",)

_ACTIVE: list[set[Token]] = []


@contextmanager
def recording() -> Iterator[set[Token]]:
    """Note what the world touches inside the block, in the set it yields."""
    tokens: set[Token] = set()
    _ACTIVE.append(tokens)
    try:
        yield tokens
    finally:
        _ACTIVE.pop()


def touch(token: Token) -> None:
    """Note ``token`` if a :func:`recording` is active (the world calls this)."""
    if _ACTIVE:
        _ACTIVE[-1].add(token)


def agent(side: str, index: int) -> Token:
    """Prefill rank ``index`` (``"P"``) or Decode engine ``index`` (``"D"``)."""
    return ("A", side, index)


def take(src: str, dst: str) -> Token:
    """The head of the queue ``src -> dst`` is delivered or dropped."""
    return ("T", src, dst)


def append(src: str, dst: str) -> Token:
    """A frame joins the end of the queue ``src -> dst``."""
    return ("+", src, dst)


def purge(a: str, b: str) -> Token:
    """Every frame between ``a`` and ``b`` (both ways) is gone."""
    return ("X", *sorted((a, b)))


def storage_read(session: str) -> Token:
    return ("R", session)


def storage_write(session: str) -> Token:
    return ("W", session)


def conflict(a: Footprint, b: Footprint) -> bool:
    """Whether two actions with these footprints may interfere (see the module docstring)."""
    if EVERYTHING in a or EVERYTHING in b:
        return True
    small, large = (a, b) if len(a) <= len(b) else (b, a)
    for token in small:
        kind = token[0]
        # The same agent or budgets; two takes of one head; two appends to one tail; two
        # writes of one storage.
        if kind in ("A", "B", "T", "+", "W") and token in large:
            return True
        if kind == "W" and ("R", token[1]) in large:
            return True
        if kind == "R" and ("W", token[1]) in large:
            return True
        if kind in ("T", "+"):
            if purge(str(token[1]), str(token[2])) in large:
                return True
        elif kind == "X":
            ends = {token[1], token[2]}
            if any(t[0] in ("T", "+", "X") and {t[1], t[2]} == ends for t in large):
                return True
    return False
