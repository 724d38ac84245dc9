"""The exhaustive explorer (python -m rd2h_protocol.checker): its configurations pass, its
output ends with ``violations=0``, a planted bug is found with a shortest trace, and the endpoint
bugs it found stay fixed (each pinned by a direct test of the endpoint).
"""

from __future__ import annotations

import heapq
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from rd2h_protocol.checker.canonical import fingerprint
from rd2h_protocol.checker.cli import main
from rd2h_protocol.checker.configs import CONFIGS, VARIANT_STATES, max_states_of
from rd2h_protocol.checker.explore import explore
from rd2h_protocol.checker.invariants import INVARIANTS, InvariantViolation
from rd2h_protocol.checker.model import RequestSpec, WorldConfig
from rd2h_protocol.checker.world import World
from rd2h_protocol.completion import CONTRIB_COMPLETE, EFFECT_COMPLETE, ContributorSet
from rd2h_protocol.consumer import (
    ConsumerConfig,
    ConsumerEndpoint,
    Releasable,
    Reply,
    RequestDone,
    RequestFailed,
    StartRead,
)
from rd2h_protocol.consumer.parking import Parking
from rd2h_protocol.errors import ErrorCode, TransferError
from rd2h_protocol.events import Chunk
from rd2h_protocol.machines.declare import TransitionDecl
from rd2h_protocol.machines.producer import (
    EFFECT_REOPEN,
    G_RECV_LAST_REPLY,
    G_RECV_REPLY,
    GATE_OPEN,
    STORAGE_GATE,
)
from rd2h_protocol.producer import DecodeTarget, ProducerEndpoint
from rd2h_protocol.producer import Output as ProducerOutput
from rd2h_protocol.producer.publications import GateEffects
from rd2h_protocol.wire.codec import encode
from rd2h_protocol.wire.layout import (
    ComponentDest,
    DestinationLayout,
    LayerLayout,
    encode_layer_metadata,
)
from rd2h_protocol.wire.messages import (
    ALL_CAPABILITIES,
    MfMeta,
    ReadFailed,
    ReadReadyBatch,
    ReadReq,
)

# -- regressions found by the explorer, pinned on the endpoint itself ---------------------


def _decode_rank(layers: int = 1) -> ConsumerEndpoint:
    """One Decode rank (TP 1) with a v2 Prefill session ``p0`` handshaken."""
    names = [f"layer{i}" for i in range(layers)]
    dests = [
        DestinationLayout(
            (
                ComponentDest(0x9000_0000 + i * 0x10_0000, 64, 16),
                ComponentDest(0xA000_0000 + i * 0x10_0000, 64, 16),
            ),
            ComponentDest(0xB000_0000 + i * 0x10_0000, 16, 16),
            ComponentDest(0xC000_0000 + i * 0x10_0000, 4, 16),
        )
        for i in range(layers)
    ]
    ep = ConsumerEndpoint(
        ConsumerConfig(d_rank=0, d_tp=1, layers=list(zip(names, dests, strict=True)))
    )
    src = LayerLayout(
        base_addrs=[0x1000_0000, 0x2000_0000, 0x3000_0000, 0x4000_0000],
        block_len=[64, 64, 16, 4],
        tensor_group_idx=[0, 0, 1, 1],
        num_blocks=16,
    )
    meta = MfMeta(
        p_session="p0",
        encoded_layer_metadata=encode_layer_metadata(dict.fromkeys(names, src)),
        protocol_version=2,
        capabilities=list(ALL_CAPABILITIES),
    )
    ep.receive(b"p0", encode(meta), 0.0)
    return ep


def _consumer_with_read_in_flight() -> tuple[ConsumerEndpoint, StartRead]:
    """One Decode rank, two requests, one leased readiness read in flight for both."""
    ep = _decode_rank()
    ep.add_request("r0", [0], [0], 0.0)
    ep.add_request("r1", [1], [1], 0.0)
    batch = ReadReadyBatch(
        layer_idx=0,
        layer_name="layer0",
        read_reqs=[ReadReq("r0", [0], [0]), ReadReq("r1", [1], [1])],
        seq=0,
        lease_ms=1000,
    )
    outs = ep.receive(b"p0", encode(batch), 0.0)
    (start,) = [o for o in outs if isinstance(o, StartRead)]
    return ep, start


def test_failed_retry_skips_a_request_released_meanwhile() -> None:
    """Found by the explorer (config "faults" with a read failure): a request aborted and
    released while its read was in flight is released for good when a transient failure
    retries the read without it; the retried read then failing must not step the released
    request again (the table refused LOCAL_FAIL in ``released`` and read_finished raised)."""
    ep, start = _consumer_with_read_in_flight()
    ep.abort(["r0"], "client abort", 0.0)
    assert ep.release("r0", 0.0) == []  # its read is in flight: held
    outs = ep.read_finished(start.plan.read_id, TransferError("flaky", transient=True), 0.1)
    assert Releasable("r0") in outs  # the retry leaves it out: quiescent now
    (retry,) = [o for o in outs if isinstance(o, StartRead)]
    assert [r.ext_req_id for r in retry.plan.requests] == ["r1"]
    late = TransferError("could not start in time")
    late.code = ErrorCode.LEASE_EXPIRED
    outs = ep.read_finished(retry.plan.read_id, late, 1.0)
    failed = [o.ext_req_id for o in outs if isinstance(o, RequestFailed)]
    assert failed == ["r1"]
    (reply,) = [o.msg for o in outs if isinstance(o, Reply)]
    assert isinstance(reply, ReadFailed) and reply.code == ErrorCode.LEASE_EXPIRED
    assert ep.requests() == {"r1": "failed"}


def test_no_done_while_a_parked_readiness_still_names_the_request() -> None:
    """Found by the state machine: layer 0 names r0 and r1, which this rank does not know
    yet, so it is parked; layer 1 (the last) names r0 alone, is read at once and carries
    r0's done signal. r0 must not be done before its parked layer 0 is read: Decode would
    schedule it with layer 0 missing (the parked readiness, served later, would find r0
    done and isolate it)."""
    ep = _decode_rank(layers=2)
    ep.add_request("r0", [0], [0], 0.0)
    first = ReadReadyBatch(
        layer_idx=0,
        layer_name="layer0",
        read_reqs=[ReadReq("r0", [3], [3]), ReadReq("r1", [4], [4])],
        seq=0,
        lease_ms=1000,
    )
    assert ep.receive(b"p0", encode(first), 0.0) == []  # parked: r1 is unknown
    last = ReadReadyBatch(
        layer_idx=1,
        layer_name="layer1",
        read_reqs=[ReadReq("r0", [3], [3])],
        done_ext_ids=["r0"],
        seq=1,
        lease_ms=1000,
    )
    (start,) = [o for o in ep.receive(b"p0", encode(last), 0.0) if isinstance(o, StartRead)]
    outs = ep.read_finished(start.plan.read_id, None, 0.0)
    assert not [o for o in outs if isinstance(o, RequestDone)]
    assert ep.requests() == {"r0": "receiving"}
    # r1 arrives: layer 0 is served, read, and only now is r0 done.
    outs = ep.add_request("r1", [1], [1], 0.1)
    (start,) = [o for o in outs if isinstance(o, StartRead)]
    outs = ep.read_finished(start.plan.read_id, None, 0.1)
    assert [o.ext_req_id for o in outs if isinstance(o, RequestDone)] == ["r0"]


# -- the explorer --------------------------------------------------------------------------


#: States per configuration the test explores: bounded by work, not wall-clock seconds
#: (a loaded 2-core machine must not fail it). The complete exploration of every
#: configuration is its own step in tools/run-tests.sh.
TEST_STATES = 500


# The bound is the number of states; the timeout only guards against a hang on a machine
# that other jobs load.
@pytest.mark.timeout(900)
def test_command_explores_every_configuration_without_violation() -> None:
    """What CI's exploration step runs, bounded by a number of states per configuration."""
    proc = subprocess.run(
        [sys.executable, "-m", "rd2h_protocol.checker", "--max-states", str(TEST_STATES)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    lines = proc.stdout.strip().splitlines()
    for name in CONFIGS:
        (line,) = [x for x in lines if x.startswith(f"{name}: ")]
        assert "distinct states" in line and "VIOLATION" not in line, line
        states = int(line.split(": ")[1].split()[0])
        # Complete below the bound, or stopped exactly at it: never stopped early.
        assert (", complete," in line and states > 100) or states >= TEST_STATES, line
    assert "violations=0" in lines[-1], proc.stdout + proc.stderr


def test_every_fault_of_the_issue_is_explored_in_every_designed_configuration() -> None:
    """Issue 10: duplicates, kills and aborts in every configuration, tp2-d2 included (each
    in the configuration itself or in its ``+fault`` variant)."""
    designed = [name for name in CONFIGS if "+" not in name]
    assert "tp2-d2" in designed
    for name in designed:
        for fault in ("dup", "kill", "abort"):
            own = dict(CONFIGS[name].budgets).get(fault, 0)
            variant = CONFIGS.get(f"{name}+{fault}")
            assert own >= 1 or (variant is not None and dict(variant.budgets)[fault] == 1)
            assert variant is None or variant.expect == CONFIGS[name].expect


def test_only_the_variants_are_bounded_by_default() -> None:
    assert max_states_of("tp2-d2+kill") == VARIANT_STATES < max_states_of("tp2-d2")


def test_every_configuration_spends_a_lose_budget() -> None:
    # A readiness lost on a live connection is explored everywhere (issue: S2 hole).
    assert all(dict(cfg.budgets).get("lose", 0) >= 1 for cfg in CONFIGS.values())


def test_list_option_names_every_configuration(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in CONFIGS)


# -- planted bugs: the explorer must catch them with a shortest trace ----------------------


def plant_early_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted bug: a storage gate reopens on a reply while other publications against the
    storage are still outstanding (one reply early with two Decode engines)."""
    decls: list[TransitionDecl] = []
    for decl in STORAGE_GATE.transitions:
        if decl["trigger"] == G_RECV_REPLY:
            decls.append({**decl, "dest": GATE_OPEN, "effect": EFFECT_REOPEN})
        else:
            decls.append(decl)
    decls.append({"trigger": G_RECV_REPLY, "source": GATE_OPEN, "dest": GATE_OPEN})
    decls.append({"trigger": G_RECV_LAST_REPLY, "source": GATE_OPEN, "dest": GATE_OPEN})
    planted = replace(STORAGE_GATE, transitions=tuple(decls))
    # The gates' effects object fires the table its class binds: bind the planted one.
    monkeypatch.setattr(GateEffects, "TABLE", planted.bind(GateEffects.TABLE.handlers))


def plant_first_contributor_completes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted bug: Decode completes a request on the first contributor's done signal,
    whatever the tp_ratio (as if every Prefill rank carried the whole indexer)."""

    def report(self: ContributorSet, member: int) -> str:
        self._members.add(member)
        self.state = CONTRIB_COMPLETE
        return EFFECT_COMPLETE

    monkeypatch.setattr(ContributorSet, "report", report)


def unfix_parked_completion(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bug the state machine found, put back: a parked readiness does not hold up the
    completion of the requests it names."""
    monkeypatch.setattr(Parking, "named_by_parked", lambda self, ext: False)


def plant_claim_window_never_armed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted bug (Prefill-first): a kept request's claim window is never armed, so a
    request whose Decode never comes is kept for good."""
    keep = ProducerEndpoint.keep_request

    def keep_request(self: ProducerEndpoint, ext_req_id: str, now: float) -> list[ProducerOutput]:
        out = keep(self, ext_req_id, now)
        state = self.state
        uid = state.kept[ext_req_id].uid
        state.timers = [entry for entry in state.timers if entry[1] != uid]
        heapq.heapify(state.timers)
        return out

    monkeypatch.setattr(ProducerEndpoint, "keep_request", keep_request)


def plant_second_claim_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted bug (Prefill-first): a claim of a request claimed already is accepted again
    (its KV published a second time, to whoever claims it)."""
    claim = ProducerEndpoint.claim

    def claim_again(
        self: ProducerEndpoint, ext_req_id: str, target: DecodeTarget, chunk: Chunk, now: float
    ) -> list[ProducerOutput]:
        kept = self.state.kept.get(ext_req_id)
        if kept is not None and kept.state == "claimed":
            kept.state = "waiting"
            self.state.kept_timers[kept.uid] = kept
        return claim(self, ext_req_id, target, chunk, now)

    monkeypatch.setattr(ProducerEndpoint, "claim", claim_again)


@pytest.mark.parametrize("symmetry", [True, False], ids=["symmetry", "no-symmetry"])
@pytest.mark.parametrize(
    ("plant", "config", "invariant"),
    [
        (plant_early_gate, "two-engines", "S1"),
        (plant_first_contributor_completes, "tp2-d1", "S2"),
        (unfix_parked_completion, "parking", "S2"),
        (plant_claim_window_never_armed, "prefill-first", "L1"),
        (plant_second_claim_accepted, "prefill-first+dup", "S1"),
    ],
)
def test_explorer_catches_a_planted_bug_with_a_shortest_trace(
    monkeypatch: pytest.MonkeyPatch,
    plant: Callable[[pytest.MonkeyPatch], None],
    config: str,
    invariant: str,
    symmetry: bool,
) -> None:
    plant(monkeypatch)
    # No warm-up request: the bug must show in the explored interleavings themselves.
    result = explore(config, replace(CONFIGS[config], warmup=False), symmetry=symmetry)
    assert result.violation is not None and result.violation.name == invariant
    # Breadth first: every shorter interleaving was explored without a violation.
    assert len(result.trace) == result.depth + 1
    assert 3 <= len(result.trace) <= 15, result.trace


# -- Prefill-first -------------------------------------------------------------------------


# Complete explorations of 9,792 and 8,024 states (~25 s of CPU for both): the default run
# bounds these two variants low to fit its budget (configs._VARIANT_BOUNDS), so the suite
# proves them here. The timeout only guards against a hang on a loaded machine.
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["prefill-first+dup", "prefill-first+abort"])
def test_prefill_first_variants_are_explored_completely_without_violation(name: str) -> None:
    result = explore(name, CONFIGS[name])
    assert result.complete and result.passed and not result.found, result.trace
    assert max_states_of(name) < result.states


def test_prefill_first_is_explored_completely_by_default() -> None:
    result = explore("prefill-first", CONFIGS["prefill-first"])
    assert result.complete and result.passed and not result.found, result.trace
    assert result.states <= max_states_of("prefill-first")


# -- expected violations -------------------------------------------------------------------


# Bounded by its states (10,863, ~8 s of CPU); the timeout only guards against a hang on a
# loaded machine, where the default 120 s was once reached.
@pytest.mark.timeout(600)
def test_reopen_breaks_s1_and_nothing_else() -> None:
    result = explore("reopen", CONFIGS["reopen"])
    assert result.complete and result.passed
    assert set(result.found) == {"S1"} and result.violation is None
    violation, trace = result.found["S1"]
    assert "without an ABORT" in violation.detail or "may still start read" in violation.detail
    assert any("time passes" in step for step in trace), trace  # the lease ran out


def test_an_expected_violation_not_found_fails_the_configuration() -> None:
    result = explore("reopen", replace(CONFIGS["reopen"], expect=("S1", "S3")))
    assert result.complete and result.missing == ["S3"] and not result.passed


def test_an_unexpected_violation_stops_the_exploration() -> None:
    result = explore("reopen", replace(CONFIGS["reopen"], expect=()))
    assert result.violation is not None and result.violation.name == "S1"
    assert not result.passed and len(result.trace) == result.depth + 1


def test_every_expected_violation_is_stated_by_the_invariants() -> None:
    """A configuration may expect a break only where rd2h_protocol.checker.invariants says the
    invariant does not hold (and so specs/invariants.md lists it)."""
    stated = {inv.name for inv in INVARIANTS if inv.does_not_hold}
    for name, cfg in CONFIGS.items():
        assert set(cfg.expect) <= stated, name


# -- the symmetry reduction ----------------------------------------------------------------


def test_fingerprint_merges_states_that_differ_by_swapping_two_requests() -> None:
    cfg = replace(
        SMALL,
        p_tp=2,
        upfront=True,
        requests=(RequestSpec("r0", 0, (2,)), RequestSpec("r1", 0, (2,))),
    )
    first, second = World(cfg), World(cfg)
    first.decode_abort("r0")
    second.decode_abort("r1")
    assert fingerprint(first, symmetry=True) == fingerprint(second, symmetry=True)
    assert fingerprint(first) != fingerprint(second)
    both = World(cfg)
    both.decode_abort("r0")
    both.decode_abort("r1")
    assert fingerprint(both, symmetry=True) != fingerprint(first, symmetry=True)


def test_requests_that_differ_are_not_interchangeable() -> None:
    cfg = replace(
        SMALL, upfront=True, requests=(RequestSpec("r0", 0, (2,)), RequestSpec("r1", 0, (1,)))
    )
    first, second = World(cfg), World(cfg)
    first.decode_abort("r0")
    second.decode_abort("r1")
    assert fingerprint(first, symmetry=True) != fingerprint(second, symmetry=True)


@pytest.mark.parametrize("reduction", ["symmetry", "sleep-sets", "inherited-forms"])
def test_compare_reduction_prints_the_ratios(
    reduction: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--config", "reopen", "--compare-reduction", reduction, "--max-states", "2000"]
    assert main([*args, "--jobs", "1"]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if f"{reduction} reduction" in x]
    assert "states x" in line and "transitions x" in line and "CPU time x" in line


def test_command_exits_1_and_prints_the_trace_of_a_planted_bug() -> None:
    code = (
        "import sys, pytest\n"
        "from test_explore import plant_early_gate\n"
        "from rd2h_protocol.checker.cli import main\n"
        "with pytest.MonkeyPatch.context() as mp:\n"
        "    plant_early_gate(mp)\n"
        "    sys.exit(main(['--config', 'two-engines']))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=Path(__file__).parent,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout
    assert "VIOLATION S1" in out
    assert "  1. " in out  # the numbered trace
    assert "violations=1" in out.strip().splitlines()[-1]


# -- the world's own checks ----------------------------------------------------------------

SMALL = WorldConfig(p_tp=1, engines=(1,), n_layers=2, n_storages=1)


def test_a_read_after_reuse_is_detected_by_the_memory_model() -> None:
    """Even with a gate that let it happen, a read of reused storage gets caught by what
    the read copies (the layer written last), not only by the state check."""
    world = World(SMALL)
    world.new_request(RequestSpec("r", 0, (2,)))
    world.decode_add("r")
    world.prefill_add("r")
    world.write_layer(0)
    while not world.reads:
        world.deliver(world.deliverable()[0])
    # A compute path that ignored the gate writes layer 1 into the same storage.
    for key, (_, version, owners) in list(world.pmem.items()):
        world.pmem[key] = (1, version + 1, owners)
    with pytest.raises(InvariantViolation, match="read after reuse") as info:
        world.finish_read(next(iter(world.reads)))
    assert info.value.name == "S1"


def test_settle_reaches_quiescence_and_leaves_nothing_behind() -> None:
    world = World(replace(SMALL, engines=(1, 1), p_tp=1))
    for i, chunks in enumerate([(2, 3), (1,), (3, 1, 2)]):
        world.new_request(RequestSpec(f"r{i}", i % 2, chunks))
    world.settle()
    world.check_quiescent()
    assert all(r.finished and not r.load_error for r in world.reqs.values())
    world.release_all()
    world.settle()
    world.check_idle()


def test_a_request_stuck_on_decode_breaks_liveness() -> None:
    world = World(SMALL)
    world.new_request(RequestSpec("r", 0, (2,)))
    world.decode_add("r")
    world.reqs["r"].prefill_added = True  # as if dispatched, but no Prefill rank has it
    with pytest.raises(InvariantViolation) as info:
        world.check_quiescent()
    assert info.value.name == "L1"
    world.settle()  # Decode gives up on it after its load timeout
    world.check_quiescent()
    assert world.reqs["r"].load_error


def test_fingerprint_ignores_a_shift_of_time_and_counters() -> None:
    early, late = World(SMALL), World(SMALL)
    late.advance(3.0)
    for world in (early, late):
        world.new_request(RequestSpec("r", 0, (2,)))
        world.decode_add("r")
    assert late.now == 3.0
    assert fingerprint(early) == fingerprint(late)
    early.prefill_add("r")
    assert fingerprint(early) != fingerprint(late)


def test_budget_option_adds_faults(capsys: pytest.CaptureFixture[str]) -> None:
    def states() -> int:
        first = capsys.readouterr().out.splitlines()[0]
        return int(first.split(": ")[1].split()[0])

    assert main(["--config", "handshake", "--budget", "kill=0", "--budget", "abort=0"]) == 0
    plain = states()
    assert main(["--config", "handshake"]) == 0
    assert states() > plain


def test_budget_option_refuses_an_unknown_fault() -> None:
    with pytest.raises(SystemExit):
        main(["--config", "faults", "--budget", "teleport=1"])


# -- duplicates made on delivery -----------------------------------------------------------


def _world_with_an_ack_in_flight(cfg: WorldConfig = SMALL) -> tuple[World, int]:
    """A Prefill rank and a Decode rank, the Decode's answer to the handshake in flight."""
    world = World(cfg)
    world.new_request(RequestSpec("r", 0, (2,)))
    world.decode_add("r")
    world.prefill_add("r")
    world.write_layer(0)  # the first readiness opens the connection: MF_META goes out
    world.deliver(world.deliverable()[0])
    (ack,) = [i for i in world.droppable() if world.network[i].kind == "Ack"]
    return world, ack


def test_a_duplicate_on_delivery_delivers_and_queues_a_copy_behind_its_connection() -> None:
    world, ack = _world_with_an_ack_in_flight()
    frame = world.network[ack]
    world.deliver_duplicated(ack)
    same_connection = [f for f in world.network if (f.src, f.dst) == (frame.src, frame.dst)]
    assert same_connection[-1] == frame and world.network.count(frame) == 1
    assert set(world.producers[0].connections().values()) == {"ready_v2"}  # ACK delivered


@pytest.mark.parametrize("on_delivery", [True, False])
def test_the_dup_action_follows_the_configured_duplicate(on_delivery: bool) -> None:
    cfg = replace(SMALL, duplicate_on_delivery=on_delivery, budgets=(("dup", 1),))
    world, ack = _world_with_an_ack_in_flight(cfg)
    frame = world.network[ack]
    world.apply(("dup", ack))
    # On delivery: one copy left; otherwise the original and its copy both wait.
    assert world.network.count(frame) == (1 if on_delivery else 2)
