"""The connector worker's vLLM send / load machines: their tables, and the worker halves
firing them (a Prefill and a Decode half in this process, on the loopback backend)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import torch

from rd2h_protocol.errors import ErrorCode, LocalProtocolError
from rd2h_runtime.control import ControlOptions
from rd2h_runtime.transfer import create_backend
from rd2h_vllm.config import Rd2hConfig, parse_config
from rd2h_vllm.destinations import VllmCacheDestinations, device_events
from rd2h_vllm.metadata import (
    CacheGroups,
    DecodeTarget,
    LoadFailure,
    LoadSpec,
    Rd2hConnectorMetadata,
    SendSpec,
)
from rd2h_vllm.request_machines import (
    L_LOCAL_ADD_FAILED,
    L_LOCAL_ADDED,
    L_LOCAL_COMPLETED,
    L_LOCAL_FAIL,
    L_LOCAL_QUIESCENT,
    LOAD_FAILED_LOCALLY,
    LOAD_NEW,
    LOAD_RELEASED,
    S_LOCAL_BAD_CHUNK,
    S_LOCAL_CHUNK,
    S_LOCAL_FINAL_CHUNK,
    S_LOCAL_REGISTERED,
    S_LOCAL_VLLM_FINISHED,
    S_RECV_FINISHED,
    SEND_DONE,
    SEND_FINISHING,
    SEND_NEW,
    SEND_PUBLISHED,
    SEND_PUBLISHING,
    VLLM_LOAD,
    VLLM_MACHINES,
    VLLM_SEND,
)
from rd2h_vllm.worker import DecodeSide, PrefillSide, SingleRank, split_kv_caches
from rd2h_vllm.worker import decode as decode_mod
from rd2h_vllm.worker import prefill as prefill_mod
from tests.machine_checks import record, table_tests
from tests.vllm.vllm_pd_harness import free_port_block

pytestmark = pytest.mark.timeout(60)

NUM_BLOCKS = 8
BLOCK_SIZE = 16
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
GROUPS = CacheGroups(main=0, indexer=None, block_sizes=(BLOCK_SIZE,))
CONTROL = ControlOptions(reconnect_grace_s=1.0)
WAIT_S = 10.0


test_table_agrees_with_machine_on_every_pair, test_declarations_are_well_formed = table_tests(
    VLLM_MACHINES
)


def test_a_second_finish_from_vllm_is_refused() -> None:
    with pytest.raises(LocalProtocolError, match="vLLM send: input LOCAL_VLLM_FINISHED"):
        VLLM_SEND.step(SEND_FINISHING, S_LOCAL_VLLM_FINISHED)
    with pytest.raises(LocalProtocolError, match="vLLM load: input LOCAL_COMPLETED"):
        VLLM_LOAD.step(LOAD_RELEASED, L_LOCAL_COMPLETED)


# -- the worker halves ----------------------------------------------------------------------


def _config(role: str, port: int) -> Rd2hConfig:
    return parse_config(
        {
            "kv_connector": "SfaRemoteD2HConnector",
            "kv_role": role,
            "kv_port": port,
            "kv_connector_extra_config": {"transfer_backend": "nixl", "lease_ms": 2000},
        }
    )


def _caches(fill: float) -> dict[str, Any]:
    return {
        name: torch.full((NUM_BLOCKS, BLOCK_SIZE, 8), fill + i, dtype=torch.float32)
        for i, name in enumerate(LAYERS)
    }


@pytest.fixture
def halves() -> Iterator[tuple[PrefillSide, DecodeSide, dict[str, Any], dict[str, Any]]]:
    port = free_port_block(1)
    p_caches, d_caches = _caches(1.0), _caches(0.0)
    decode = DecodeSide(
        _config("kv_consumer", port),
        GROUPS,
        VllmCacheDestinations(split_kv_caches(d_caches, NUM_BLOCKS), NUM_BLOCKS),
        tp=SingleRank(),
        backend=create_backend("loopback", role="decode"),
        host="127.0.0.1",
        port=port,
        compat="test",
        report_block_errors=True,
        control_options=CONTROL,
    )
    try:
        prefill = PrefillSide(
            _config("kv_producer", port),
            GROUPS,
            split_kv_caches(p_caches, NUM_BLOCKS),
            NUM_BLOCKS,
            tp=SingleRank(),
            backend=create_backend("loopback", role="prefill"),
            events=device_events("cpu"),
            compat="test",
            host="127.0.0.1",
            control_options=CONTROL,
        )
        try:
            yield prefill, decode, p_caches, d_caches
        finally:
            prefill.close()
    finally:
        decode.close()


def _port(decode: DecodeSide) -> int:
    assert decode.config.base_port is not None
    return decode.config.base_port


def _publish(prefill: PrefillSide) -> None:
    """One forward pass: every layer written once its storage is free."""
    for idx, name in enumerate(LAYERS):
        prefill.wait_writable(idx)
        prefill.layer_written(name)
    prefill.end_step()


def _send(req: str, blocks: list[int], port: int, *, final: bool) -> SendSpec:
    tokens = len(blocks) * BLOCK_SIZE
    return SendSpec(
        req_id=req,
        ext_id=f"ext-{req}",
        target=DecodeTarget(engine_id="d", host="127.0.0.1", base_port=port, tp_size=1),
        remote_cached_tokens=0,
        transferred_tokens=0,
        computed_tokens=tokens,
        main_block_ids=blocks,
        indexer_block_ids=None,
        final=final,
    )


def _load(req: str, blocks: list[int]) -> LoadSpec:
    return LoadSpec(
        req_id=req,
        ext_id=f"ext-{req}",
        main_block_ids=blocks,
        indexer_block_ids=None,
        local_tokens=0,
        num_tokens=len(blocks) * BLOCK_SIZE,
    )


def _until(what: str, fn: Any, *args: Any) -> Any:
    """Call ``fn(*args)`` until it returns something truthy; return that."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        out = fn(*args)
        if out:
            return out
        time.sleep(0.02)
    raise AssertionError(f"{what} not reached within {WAIT_S} s")


Halves = tuple[PrefillSide, DecodeSide, dict[str, Any], dict[str, Any]]


def test_a_request_moves_and_both_halves_fire_their_machines(
    halves: Halves, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefill, decode, p_caches, d_caches = halves
    sends = record(monkeypatch, prefill_mod, "_SEND")
    loads = record(monkeypatch, decode_mod, "_LOAD")
    src, dst = [1, 2], [5, 6]
    # Decode learns the destinations, then Prefill computes and publishes every layer.
    decode.bind(Rd2hConnectorMetadata(loads=[_load("a", dst)]))
    prefill.bind(Rd2hConnectorMetadata(sends=[_send("a", src, _port(decode), final=True)]))
    _publish(prefill)
    assert _until("Decode finished", lambda: decode.get_finished([])[0]) == {"a"}
    for name in LAYERS:
        assert torch.equal(d_caches[name][dst], p_caches[name][src])
    # vLLM finishes it on Prefill; it is reported once Decode's reply has come too.
    sending = prefill.get_finished(["a"]) or _until("Prefill finished", prefill.get_finished, [])
    assert sending == {"a"} and prefill.is_idle() and decode.is_idle()
    assert sends.inputs()[:2] == [S_LOCAL_REGISTERED, S_LOCAL_FINAL_CHUNK]
    # The reply and vLLM's finish come in either order; both end it.
    assert sorted(sends.inputs()[2:]) == sorted([S_LOCAL_VLLM_FINISHED, S_RECV_FINISHED])
    assert VLLM_SEND.step(*sends.steps[-1])[1] == SEND_DONE
    assert loads.inputs() == [L_LOCAL_ADDED, L_LOCAL_COMPLETED, L_LOCAL_QUIESCENT]


def test_a_failed_load_and_an_early_finish_abort(
    halves: Halves, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefill, decode, _, _ = halves
    sends = record(monkeypatch, prefill_mod, "_SEND")
    loads = record(monkeypatch, decode_mod, "_LOAD")
    # Decode: the rendezvous failed after the load was registered: aborted in the endpoint.
    decode.bind(Rd2hConnectorMetadata(loads=[_load("b", [3])]))
    failure = LoadFailure(req_id="b", ext_id="ext-b", code=int(ErrorCode.ABORTED), message="x")
    decode.bind(Rd2hConnectorMetadata(load_failures=[failure]))
    assert _until("Decode failed", lambda: decode.get_finished([])[0]) == {"b"}
    assert "b" in decode.last_failed
    assert loads.inputs() == [L_LOCAL_ADDED, L_LOCAL_FAIL, L_LOCAL_COMPLETED, L_LOCAL_QUIESCENT]
    # Prefill: vLLM finishes a request before its final chunk: it is aborted, then reported.
    prefill.bind(Rd2hConnectorMetadata(sends=[_send("c", [1], _port(decode), final=False)]))
    _publish(prefill)
    sending = prefill.get_finished(["c"]) or _until("Prefill aborted", prefill.get_finished, [])
    assert sending == {"c"} and prefill.is_idle()
    assert sends.steps[:3] == [
        (SEND_NEW, S_LOCAL_REGISTERED),
        (SEND_PUBLISHING, S_LOCAL_CHUNK),
        (SEND_PUBLISHING, S_LOCAL_VLLM_FINISHED),  # -> finishing, effect abort
    ]
    assert sends.steps[3:] == [(SEND_FINISHING, S_RECV_FINISHED)]


def test_a_refused_load_and_a_bad_chunk_fire_their_handlers(
    halves: Halves, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefill, decode, _, _ = halves
    sends = record(monkeypatch, prefill_mod, "_SEND")
    loads = record(monkeypatch, decode_mod, "_LOAD")
    # report_local: the endpoint refuses a block past the cache; the failure is reported
    # like an endpoint outcome and the load is released (failed) without a release.
    decode.bind(Rd2hConnectorMetadata(loads=[_load("e", [NUM_BLOCKS])]))
    assert decode.get_finished([]) == ({"e"}, {"e"})
    assert loads.steps == [(LOAD_NEW, L_LOCAL_ADD_FAILED), (LOAD_FAILED_LOCALLY, L_LOCAL_COMPLETED)]
    # abort: a chunk whose block range is impossible; nothing more goes out for it.
    bad = msgspec.structs.replace(_send("h", [1], _port(decode), final=False), computed_tokens=-1)
    prefill.bind(Rd2hConnectorMetadata(sends=[bad]))
    sending = prefill.get_finished(["h"]) or _until("Prefill aborted", prefill.get_finished, [])
    assert sending == {"h"} and prefill.is_idle()
    assert sends.steps == [
        (SEND_NEW, S_LOCAL_REGISTERED),
        (SEND_PUBLISHING, S_LOCAL_CHUNK),  # -> schedule, which finds the chunk bad
        (SEND_PUBLISHING, S_LOCAL_BAD_CHUNK),  # -> published, abort
        (SEND_PUBLISHED, S_LOCAL_VLLM_FINISHED),
        (SEND_FINISHING, S_RECV_FINISHED),
    ]
