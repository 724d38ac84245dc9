"""The model checker of RD2H: the real endpoints in a simulated world, checked everywhere.

What it is
----------
The protocol core (:mod:`rd2h_protocol`) is sans-IO, so its two endpoints can run inside a
model: a simulated network and memory around real
:class:`~rd2h_protocol.producer.ProducerEndpoint` s and
:class:`~rd2h_protocol.consumer.ConsumerEndpoint` s, with the protocol's invariants
checked after every step. Two drivers explore that model:

* an exhaustive breadth-first search over every interleaving of small configurations,
  with fault budgets (``python -m rd2h_protocol.checker``);
* a hypothesis state machine that drives larger worlds at random (tests).

How to run it
-------------
``python -m rd2h_protocol.checker`` explores every configuration of
:data:`~rd2h_protocol.checker.configs.CONFIGS`: the designed ones completely, their
``NAME+FAULT`` variants up to a number of states
(:data:`~rd2h_protocol.checker.configs.VARIANT_STATES`) (``--config NAME`` for one,
``--max-states N`` to bound every one, ``--list`` to list them, ``--help`` for the rest); it
exits 1 on any unexpected violation, printing a shortest trace to it. ``tools/run-tests.sh``
runs it with the full suite; ``tests/protocol`` runs it bounded.

The modules, in the order they build on each other:

* :mod:`~rd2h_protocol.checker.invariants`: the properties, stated once, and the checks
  of what the endpoints themselves hold;
* :mod:`~rd2h_protocol.checker.model`: what a world is made of: its configuration
  (:class:`~rd2h_protocol.checker.model.WorldConfig`, requests, fault budgets), frames,
  block ids and the memory layout;
* :mod:`~rd2h_protocol.checker.snapshot`: a world as compact, mergeable bytes;
* :mod:`~rd2h_protocol.checker.footprint`: what each action of a world reads and writes,
  and when two actions commute (for the explorer's sleep sets and inherited forms);
* :mod:`~rd2h_protocol.checker.world`: :class:`~rd2h_protocol.checker.world.World`,
  the endpoints wired to a simulated network, memory and runtime, built in layers:
  :mod:`~rd2h_protocol.checker.state` (state, endpoints),
  :mod:`~rd2h_protocol.checker.core` (requests, outputs and their checks),
  :mod:`~rd2h_protocol.checker.network`, :mod:`~rd2h_protocol.checker.memory` (the
  memory model and reads), :mod:`~rd2h_protocol.checker.clock` (timers and time), then
  :mod:`~rd2h_protocol.checker.world` itself (faults, the fair scheduler, the actions);
* :mod:`~rd2h_protocol.checker.canonical`: state fingerprints, and the reductions they
  apply (with the argument why each is sound; symmetry's in
  :mod:`~rd2h_protocol.checker.symmetry`);
* :mod:`~rd2h_protocol.checker.configs`: the explored configurations and their budgets;
* :mod:`~rd2h_protocol.checker.explore`: the search, with its partial-order reduction;
* :mod:`~rd2h_protocol.checker.cli`: ``python -m rd2h_protocol.checker``;
* :mod:`~rd2h_protocol.checker.stateful`: the hypothesis state machine (imports
  hypothesis).
* :mod:`~rd2h_protocol.checker.traces` and :mod:`~rd2h_protocol.checker.replay`: the
  trace files of :mod:`rd2h_runtime.trace` read as plain JSON lines, and their replay
  against fresh endpoints (``rd2h trace check``).

The core never imports this package (``import rd2h_protocol`` loads neither it nor
hypothesis nor transitions; ``tests/protocol/test_package_imports.py`` holds it to
that). The docs generator (:mod:`rd2h_protocol.spec`), the runtime's trace writer (what a
record says: :mod:`~rd2h_protocol.checker.traces`), ``rd2h trace`` and the tests import
it. This ``__init__`` imports nothing: import the module you need.
"""
