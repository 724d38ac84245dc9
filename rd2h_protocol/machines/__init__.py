"""The state machines, declared once as data; the tables drive the endpoints' actions.

* :mod:`~rd2h_protocol.machines.declare`: the declaration form (:class:`MachineSpec`, in the
  ``transitions`` package's declarative shape plus an effect per transition and the guards
  its conditions name), :meth:`MachineSpec.bind` (each effect to exactly one handler,
  checked at import) and :class:`BoundMachine` (``apply``: look up, set the state, run the
  handler with the input's one typed context; ``apply_batch`` for a batched input: the same
  for a run of records at once; ``fire``, untyped, for the runtime's small machines);
* :mod:`~rd2h_protocol.machines.producer`: the Prefill side's tables (storage-slot gate,
  layer publication, Prefill request, connection handshake) and their guards;
* :mod:`~rd2h_protocol.machines.consumer`: the Decode side's (request, readiness, session)
  and their guards; the completion machines live with their rule in
  :mod:`rd2h_protocol.completion`.

The endpoints bind these tables to their handlers; bindings of other layers (the runtime's
connection health, the proxy's request phase, the vLLM worker's request tracking) declare
their own machines with the names exported here. specs/machines.md is generated from them.
"""

from rd2h_protocol.machines.declare import (
    NO_EFFECT,
    BoundMachine,
    Guard,
    Input,
    MachineSpec,
    TransitionDecl,
    check_guards,
    no_effect,
    stay,
)

__all__ = [
    "NO_EFFECT",
    "BoundMachine",
    "Guard",
    "Input",
    "MachineSpec",
    "TransitionDecl",
    "check_guards",
    "no_effect",
    "stay",
]
