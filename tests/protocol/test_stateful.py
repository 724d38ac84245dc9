"""The hypothesis model of the whole protocol (rd2h_protocol.checker.stateful).

``TestProtocol`` runs the state machine with at least 500 examples; the planted-bug tests
prove it fails when the gate opens one reply early or when Decode completes on the first
contributor; the hook test shows a subclass can replace the network and the read executor.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test
from test_explore import plant_early_gate, plant_first_contributor_completes

from rd2h_protocol.checker.invariants import InvariantViolation
from rd2h_protocol.checker.model import Frame
from rd2h_protocol.checker.stateful import ProtocolStateMachine
from rd2h_protocol.checker.world import World
from rd2h_protocol.errors import TransferError
from rd2h_protocol.plan import ReadPlan

# At least 500 runs whatever the profile (CI's "ci" profile is derandomized, so the runs
# are the same every time); 50 steps each, every one followed by the invariant checks and
# each run by a full settle (L1, B1).
RUNS: settings = settings(
    settings.default,
    max_examples=max(500, settings.default.max_examples),
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


class TestProtocol(ProtocolStateMachine.TestCase):  # type: ignore[name-defined,misc]
    settings = RUNS


# A short search for a planted bug: no shrinking (it can take minutes), no example
# database, the same runs every time.
HUNT = settings(
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.generate],
    suppress_health_check=list(HealthCheck),
)


@pytest.mark.parametrize(
    ("plant", "invariant"),
    [(plant_early_gate, "S1"), (plant_first_contributor_completes, "S2")],
)
def test_the_state_machine_catches_a_planted_bug(
    monkeypatch: pytest.MonkeyPatch,
    plant: Callable[[pytest.MonkeyPatch], None],
    invariant: str,
) -> None:
    plant(monkeypatch)
    with pytest.raises(InvariantViolation) as info:
        run_state_machine_as_test(ProtocolStateMachine, settings=HUNT)
    assert info.value.name == invariant


def test_a_lost_unknown_session_reply_leaves_no_layer_unread() -> None:
    """The run hypothesis's random profile found (shrunk): after a Decode restart, the
    UNKNOWN_SESSION reply for one layer is dropped; the Prefill replayed only the layer
    whose reply arrived, and that layer's done completed the request on Decode with the
    other layer unread (S2). Every publication out under the lost session is replayed now."""
    machine = ProtocolStateMachine()
    first = {"arrival": "decode first", "chunks": [2], "engine": 0}
    steps: list[tuple[Callable[..., None], dict[str, object]]] = [
        (machine.kill, {"victim": 1}),
        (machine.new_request, first),
        (machine.decode_abort, {"i": 0}),
        (machine.decode_abort, {"i": 0}),
        (machine.drain, {"i": 0}),
        (machine.run, {"picks": [0]}),
        (machine.kill, {"victim": 4}),
        (machine.new_request, first),
        (machine.run, {"picks": [1]}),
        (machine.new_request, first),
        (machine.run, {"picks": [0, 2, 0]}),
        (machine.run, {"picks": [0]}),
        (machine.duplicate, {"i": 0}),
        (machine.drop, {"i": 0}),
        (machine.drop, {"i": 0}),
    ]
    machine.invariants_hold()
    for step, kwargs in steps:
        step(**kwargs)
        machine.invariants_hold()
    machine.teardown()


class _HookedWorld(World):
    """A world whose network and read executor are replaced, as a runtime test would."""

    frames = 0
    reads = 0

    def transmit(self, frame: Frame) -> None:
        type(self).frames += 1
        super().transmit(frame)

    def execute_read(
        self, engine: int, d_rank: int, plan: ReadPlan, start_by: float | None, layer: int
    ) -> TransferError | None:
        type(self).reads += 1
        return super().execute_read(engine, d_rank, plan, start_by, layer)


class _HookedMachine(ProtocolStateMachine):
    def make_world(self) -> World:
        return _HookedWorld(self.world_config)


def test_subclasses_can_replace_the_network_and_the_read_executor() -> None:
    run_state_machine_as_test(
        _HookedMachine,
        settings=settings(HUNT, max_examples=20, phases=[Phase.generate]),
    )
    assert _HookedWorld.frames > 0 and _HookedWorld.reads > 0


def test_importing_the_protocol_never_imports_hypothesis() -> None:
    code = (
        "import sys, rd2h_protocol, rd2h_protocol.checker.cli, rd2h_protocol.producer, "
        "rd2h_protocol.consumer\n"
        "sys.exit('hypothesis' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], timeout=60, check=False)
    assert proc.returncode == 0
