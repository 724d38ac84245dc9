"""SfaRemoteD2HConnector under faults and unequal TP, on real vLLM Schedulers.

* Decode aborts a request while Prefill is between two layers of it: Decode frees the
  blocks only once no read can write them, nothing writes them afterwards, and Prefill
  finishes the request without raising.
* A failed read on Decode: the request is reported in ``failed_recving`` with its main
  AND indexer blocks (one KV-cache group: also through ``get_block_ids_with_load_errors``,
  which vLLM turns into a failed request; two groups: vLLM recomputes it locally).
* Prefill TP 2 -> Decode TP 1: two Prefill worker halves contribute, main KV from member
  0 only, the indexer split between both; every byte lands in Decode's own vLLM cache.

Every cache here is allocated by vLLM itself (tests/vllm/vllm_pd_harness.py); what Decode
holds is checked in its own KV cache, where vLLM's attention reads.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from conftest import VllmConfigFactory
from vllm.v1.request import RequestStatus
from vllm_metaserver_harness import MetaServer
from vllm_pd_harness import (
    INDEXER_BLOCK,
    INDEXER_BYTES,
    MAIN,
    MAIN_BLOCK_BYTES,
    Engine,
    build_engine,
    engines,
    free_port_block,
    make_request,
    run_until,
    status,
)

from rd2h_protocol.errors import TransferError
from rd2h_protocol.rendezvous import Rendezvous, decode_rendezvous, remote_prefill_params
from rd2h_runtime.transfer import TransferBackend
from rd2h_runtime.transfer.base import U64Array
from rd2h_runtime.transfer.loopback import LoopbackBackend
from rd2h_vllm.connector import SfaRemoteD2HConnector
from rd2h_vllm.destinations import DeviceEvents


class FlakyLoopback(LoopbackBackend):
    """In-process memmove that fails every read while :attr:`failing` is set."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.failing = threading.Event()

    def _read(
        self, session: str, remote: U64Array, local: U64Array, lengths: U64Array, deadline: float
    ) -> None:
        if self.failing.is_set():
            raise TransferError("injected read failure", backend_code=-5)
        super()._read(session, remote, local, lengths, deadline)


class LoopbackConnector(SfaRemoteD2HConnector):
    """The real connector on the in-process loopback backend (both roles)."""

    def create_backend(self, role: str) -> TransferBackend:
        self.backend = FlakyLoopback(role=role, host="127.0.0.1")
        return self.backend


def rendezvous_after_post(decode: Engine, server: MetaServer, count: int) -> list[Rendezvous]:
    decode.step()
    run_until([decode], lambda: len(server.script.bodies) >= count, timeout_s=10.0)
    return [decode_rendezvous(b) for b in server.script.bodies]


def test_abort_on_decode_mid_layer_frees_only_when_quiescent(
    make_vllm_config: VllmConfigFactory, server: MetaServer
) -> None:
    decode = build_engine(make_vllm_config, "kv_consumer", kv_port=free_port_block(1))
    prefill = build_engine(make_vllm_config, "kv_producer", max_num_batched_tokens=32)
    with engines(prefill, decode):
        prompt = list(range(96))  # three Prefill steps of 32 tokens
        d_req = decode.add(
            make_request("cmpl-ab-0-00000001", prompt, remote_prefill_params(server.url), 2)
        )
        [rendezvous] = rendezvous_after_post(decode, server, 1)
        dest = decode.block_ids(d_req.request_id)[0]
        free_before = decode.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        snapshot: dict[tuple[str, int], torch.Tensor] = {}

        def abort_between_layers(step: int, rank: int, layer: int) -> None:
            if step != 1 or layer != 0 or snapshot:
                return
            # Prefill published layer 0 of its second chunk; Decode's user goes away.
            decode.scheduler.finish_requests(d_req.request_id, RequestStatus.FINISHED_ABORTED)
            run_until([decode], lambda: d_req.request_id not in decode.scheduler.requests)
            for name in MAIN:
                for block in dest:
                    snapshot[(name, block)] = decode.block(name, block)

        prefill.on_layer = abort_between_layers
        p_req = prefill.add(make_request("cmpl-ab-0-00000002", prompt, rendezvous.to_params(), 1))
        # Prefill keeps computing (and never raises) until its request is over.
        run_until([prefill, decode], lambda: p_req.request_id not in prefill.scheduler.requests)
        assert snapshot, "the abort hook never ran"
        assert p_req.status == RequestStatus.FINISHED_LENGTH_CAPPED  # Prefill's client is served
        # Decode's blocks went back to the pool, and nothing wrote them in its KV cache since.
        assert decode.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() >= free_before
        for (name, block), before in snapshot.items():
            assert torch.equal(decode.block(name, block), before), (name, block)
        d_side, p_side = decode.workers[0].decode, prefill.workers[0].prefill
        assert d_side is not None and d_side.is_idle()
        assert p_side is not None and p_side.is_idle()
        assert p_side.worker.errors == [] and d_side.worker.errors == []
        # Prefill learnt of the abort (v2 ABORT) and reports it as a failure, not a crash.
        failures = [s["failures"] for s in prefill.stats if s.get("failures")]
        assert any("ABORTED" in f for f in failures), failures
        aborts = sum(s.get("aborts_received", 0) for s in prefill.stats)
        assert aborts >= 1


@pytest.mark.parametrize("indexer", ["shared", "group"])
def test_failed_read_reports_main_and_indexer_blocks(
    make_vllm_config: VllmConfigFactory, server: MetaServer, indexer: str
) -> None:
    policy = "fail" if indexer == "shared" else "recompute"
    decode = build_engine(
        make_vllm_config,
        "kv_consumer",
        kv_port=free_port_block(1),
        indexer=indexer,
        worker_cls=LoopbackConnector,
        failure_policy=policy,
    )
    prefill = build_engine(
        make_vllm_config, "kv_producer", indexer=indexer, worker_cls=LoopbackConnector
    )
    with engines(prefill, decode):
        backend = decode.workers[0].backend
        assert isinstance(backend, FlakyLoopback)
        backend.failing.set()
        prompt = list(range(50))
        d_req = decode.add(
            make_request("cmpl-fail-0-00000001", prompt, remote_prefill_params(server.url), 2)
        )
        [rendezvous] = rendezvous_after_post(decode, server, 1)
        ids = decode.block_ids(d_req.request_id)
        main, idx = ids[0], ids[1] if indexer == "group" else ids[0]
        p_req = prefill.add(make_request("cmpl-fail-0-00000002", prompt, rendezvous.to_params(), 1))
        run_until([prefill, decode], lambda: bool(decode.failed_recving))
        assert decode.failed_recving == [{d_req.request_id}]
        assert decode.failed_blocks == [(0, d_req.request_id, main, idx)]
        if indexer == "shared":
            # One KV-cache group: block-level errors too; vLLM fails the request.
            assert decode.load_errors == [set(main) | set(idx)]
            run_until([decode], lambda: d_req.request_id not in decode.scheduler.requests)
            assert d_req.status == RequestStatus.FINISHED_ERROR
        else:
            # Two groups: request-level only (vLLM refuses block ids); recomputed locally.
            assert decode.load_errors == []
            run_until([decode], lambda: status(d_req) == RequestStatus.RUNNING)
            assert d_req.num_computed_tokens == len(prompt)
        # Prefill is told (isolated failure or read_failed) and never raises.
        run_until([prefill, decode], lambda: p_req.request_id not in prefill.scheduler.requests)
        side = prefill.workers[0].prefill
        assert side is not None and side.is_idle() and side.worker.errors == []
        failures = {k for s in decode.stats for k in s.get("failures", {})}
        assert "TRANSFER_FAILED" in failures


def test_a_failed_load_leaves_the_local_prefix_hit_valid(
    make_vllm_config: VllmConfigFactory, server: MetaServer
) -> None:
    """Decode's own prefix cache already holds the first 3 blocks of a prompt (a running
    request brought them); a second request with that prefix loads only the rest, and its
    load fails: only the blocks it was to write are reported invalid, so vLLM fails that
    request alone and the running request sharing the prefix blocks goes on."""
    decode = build_engine(
        make_vllm_config,
        "kv_consumer",
        kv_port=free_port_block(1),
        indexer="shared",
        worker_cls=LoopbackConnector,
    )
    prefill = build_engine(
        make_vllm_config, "kv_producer", indexer="shared", worker_cls=LoopbackConnector
    )
    with engines(prefill, decode):
        prefix = list(range(48))  # 3 full blocks
        first = decode.add(
            make_request("cmpl-hit-0-00000001", prefix, remote_prefill_params(server.url), 500)
        )
        [rendezvous] = rendezvous_after_post(decode, server, 1)
        prefill.add(make_request("cmpl-hit-0-00000002", prefix, rendezvous.to_params(), 1))
        run_until([prefill, decode], lambda: status(first) == RequestStatus.RUNNING)
        shared = decode.block_ids(first.request_id)[0][:3]
        assert decode.mismatches("cmpl-hit-0", shared, shared) == []
        backend = decode.workers[0].backend
        assert isinstance(backend, FlakyLoopback)
        backend.failing.set()
        longer = prefix + list(range(100, 132))  # the prefix + 2 blocks
        second = decode.add(
            make_request("cmpl-hit-1-00000001", longer, remote_prefill_params(server.url), 2)
        )
        decode.step()
        run_until([decode], lambda: len(server.script.bodies) >= 2)
        rendezvous = decode_rendezvous(server.script.bodies[1])
        assert rendezvous.remote_cached_tokens == 48  # Decode's own prefix hit
        ids = decode.block_ids(second.request_id)[0]
        assert ids[:3] == shared and len(ids) == 5
        prefill.add(make_request("cmpl-hit-1-00000002", longer, rendezvous.to_params(), 1))
        run_until([prefill, decode], lambda: bool(decode.failed_recving))
        assert decode.failed_recving == [{second.request_id}]
        assert decode.failed_blocks == [(0, second.request_id, ids[3:], ids[3:])]
        assert decode.load_errors == [set(ids[3:])]
        run_until([decode], lambda: second.request_id not in decode.scheduler.requests)
        assert second.status == RequestStatus.FINISHED_ERROR
        # The request sharing the prefix blocks still runs on them, untouched.
        assert status(first) == RequestStatus.RUNNING
        assert decode.mismatches("cmpl-hit-0", shared, shared) == []
        run_until([prefill, decode], lambda: not prefill.scheduler.requests)


def test_prefill_tp2_to_decode_tp1(make_vllm_config: VllmConfigFactory, server: MetaServer) -> None:
    decode = build_engine(
        make_vllm_config, "kv_consumer", kv_port=free_port_block(1), indexer="group"
    )
    prefill = build_engine(make_vllm_config, "kv_producer", tp=2, indexer="group")
    with engines(prefill, decode):
        prompt = list(range(70))
        d_req = decode.add(
            make_request("cmpl-tp-0-00000001", prompt, remote_prefill_params(server.url), 2)
        )
        [rendezvous] = rendezvous_after_post(decode, server, 1)
        assert rendezvous.remote_tp_size == 1
        prefill.add(make_request("cmpl-tp-0-00000002", prompt, rendezvous.to_params(), 1))
        run_until([prefill, decode], lambda: status(d_req) == RequestStatus.RUNNING)
        main, idx = decode.block_ids(d_req.request_id)
        assert (len(main), len(idx)) == (5, 3)  # 16- and 32-token blocks
        # Main KV is Prefill rank 0's (member 0); the indexer came from both members.
        assert decode.mismatches("cmpl-tp-0", main, idx, prefill_rank=0) == []
        assert decode.mismatches("cmpl-tp-0", main, prefill_rank=1) != []
        run_until([prefill, decode], lambda: not prefill.scheduler.requests)
        # Both Prefill ranks published; only member 0 read main KV, both read indexer.
        reads = [s["layer_reads"] for s in decode.stats if s.get("layer_reads")]
        total = sum(v[1] for r in reads for v in r.values())
        main_bytes = len(MAIN) * 5 * MAIN_BLOCK_BYTES  # layers x blocks x bytes
        idx_bytes = len(MAIN) * 3 * INDEXER_BLOCK * INDEXER_BYTES  # split between members
        assert total == main_bytes + idx_bytes
        for worker in prefill.workers:
            side = worker.prefill
            assert side is not None and side.is_idle()


def test_prefill_abort_mid_prompt_fails_the_decode_load(
    make_vllm_config: VllmConfigFactory, server: MetaServer
) -> None:
    decode = build_engine(
        make_vllm_config, "kv_consumer", kv_port=free_port_block(1), failure_policy="recompute"
    )
    prefill = build_engine(make_vllm_config, "kv_producer", max_num_batched_tokens=32)
    with engines(prefill, decode):
        prompt = list(range(96))
        d_req = decode.add(
            make_request("cmpl-pa-0-00000001", prompt, remote_prefill_params(server.url), 2)
        )
        [rendezvous] = rendezvous_after_post(decode, server, 1)
        p_req = prefill.add(make_request("cmpl-pa-0-00000002", prompt, rendezvous.to_params(), 1))
        prefill.step()  # the first chunk is published
        prefill.scheduler.finish_requests(p_req.request_id, RequestStatus.FINISHED_ABORTED)
        # Published: Prefill keeps the blocks until no Decode read of them can happen.
        assert p_req.request_id in prefill.scheduler.requests
        run_until([prefill, decode], lambda: bool(decode.failed_recving))
        assert decode.failed_recving == [{d_req.request_id}]
        run_until([prefill, decode], lambda: p_req.request_id not in prefill.scheduler.requests)
        run_until([decode], lambda: status(d_req) == RequestStatus.RUNNING)
        assert d_req.num_computed_tokens == len(prompt)  # recomputed on Decode
        assert sum(s.get("aborts_received", 0) for s in decode.stats) >= 1
        side = prefill.workers[0].prefill
        assert side is not None and side.is_idle()


class SlowEvent:
    """A device event that completes 20 ms after it is recorded (an async scatter)."""

    def __init__(self) -> None:
        self.at = 0.0

    def record(self) -> None:
        self.at = time.monotonic() + 0.02

    def query(self) -> bool:
        return time.monotonic() >= self.at

    def synchronize(self) -> None:
        time.sleep(max(0.0, self.at - time.monotonic()))


def test_layers_published_after_their_device_event_in_order(
    make_vllm_config: VllmConfigFactory, server: MetaServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    import rd2h_vllm.connector as connector_module

    monkeypatch.setattr(
        connector_module, "device_events", lambda device: DeviceEvents("cuda", SlowEvent)
    )
    decode = build_engine(make_vllm_config, "kv_consumer", kv_port=free_port_block(1))
    prefill = build_engine(make_vllm_config, "kv_producer", max_num_batched_tokens=32)
    with engines(prefill, decode):
        prompt = list(range(80))
        d_req = decode.add(
            make_request("cmpl-ev-0-00000001", prompt, remote_prefill_params(server.url), 2)
        )
        [rendezvous] = rendezvous_after_post(decode, server, 1)
        prefill.add(make_request("cmpl-ev-0-00000002", prompt, rendezvous.to_params(), 1))
        run_until([prefill, decode], lambda: status(d_req) == RequestStatus.RUNNING)
        assert decode.mismatches("cmpl-ev-0", decode.block_ids(d_req.request_id)[0]) == []
        side = prefill.workers[0].prefill
        assert side is not None
        assert side._publisher._thread is not None  # the events really were waited for
        assert side._publisher.errors == []
        run_until([prefill, decode], lambda: not prefill.scheduler.requests)


class Fp8Connector(SfaRemoteD2HConnector):
    """A Decode configured with another KV dtype than its Prefill."""

    def _kv_dtype(self) -> str:
        return "fp8"


def test_incompatible_peers_are_refused_before_any_byte_moves(
    make_vllm_config: VllmConfigFactory, server: MetaServer
) -> None:
    decode = build_engine(
        make_vllm_config,
        "kv_consumer",
        kv_port=free_port_block(1),
        worker_cls=Fp8Connector,
        failure_policy="recompute",
        extra={"kv_load_timeout_s": 3.0},
    )
    prefill = build_engine(make_vllm_config, "kv_producer")
    with engines(prefill, decode):
        prompt = list(range(40))
        d_req = decode.add(
            make_request("cmpl-cx-0-00000001", prompt, remote_prefill_params(server.url), 2)
        )
        [rendezvous] = rendezvous_after_post(decode, server, 1)
        p_req = prefill.add(make_request("cmpl-cx-0-00000002", prompt, rendezvous.to_params(), 1))
        run_until([prefill, decode], lambda: bool(decode.failed_recving), timeout_s=15.0)
        assert decode.failed_recving == [{d_req.request_id}]
        for block in decode.block_ids(d_req.request_id)[0]:  # never written
            assert not torch.any(decode.block(MAIN[0], block) != 0).item()
        run_until([prefill, decode], lambda: p_req.request_id not in prefill.scheduler.requests)
        failures = {k for s in prefill.stats for k in s.get("failures", {})}
        assert failures, "Prefill recorded no failure"
        side = decode.rd2h().decode
        assert side is not None and side.worker.stats.refused_handshakes >= 1


def test_a_second_load_under_a_live_external_id_fails_alone(
    make_vllm_config: VllmConfigFactory, server: MetaServer
) -> None:
    decode = build_engine(
        make_vllm_config, "kv_consumer", kv_port=free_port_block(1), failure_policy="recompute"
    )
    prefill = build_engine(make_vllm_config, "kv_producer")
    with engines(prefill, decode):
        prompt = list(range(40))
        params = remote_prefill_params(server.url)
        first = decode.add(make_request("cmpl-dup-0-00000001", prompt, params, 2))
        second = decode.add(make_request("cmpl-dup-0-00000002", prompt[::-1], params, 2))
        # The second load fails at once; a request that ends cancels its pending POST, so
        # its rendezvous may never be sent: wait for the first one only.
        rendezvous = rendezvous_after_post(decode, server, 1)[0]
        run_until([decode], lambda: bool(decode.failed_recving))
        assert decode.failed_recving == [{second.request_id}]
        prefill.add(make_request("cmpl-dup-0-10000000", prompt, rendezvous.to_params(), 1))
        run_until([prefill, decode], lambda: status(first) == RequestStatus.RUNNING)
        assert decode.mismatches("cmpl-dup-0", decode.block_ids(first.request_id)[0]) == []
        run_until([prefill, decode], lambda: not prefill.scheduler.requests)


def test_decode_gone_mid_prompt_prefill_recovers_after_the_lease(
    make_vllm_config: VllmConfigFactory, server: MetaServer
) -> None:
    decode = build_engine(make_vllm_config, "kv_consumer", kv_port=free_port_block(1))
    prefill = build_engine(
        make_vllm_config,
        "kv_producer",
        max_num_batched_tokens=32,
        extra={"lease_ms": 1000, "handshake_timeout_s": 1.0},
    )
    with engines(prefill, decode):
        prompt = list(range(96))
        decode.add(
            make_request("cmpl-gone-0-00000001", prompt, remote_prefill_params(server.url), 2)
        )
        [rendezvous] = rendezvous_after_post(decode, server, 1)

        def kill_decode(step: int, rank: int, layer: int) -> None:
            if step == 1 and layer == 0:
                for worker in decode.workers:  # the Decode process dies mid-prompt
                    worker.shutdown()

        prefill.on_layer = kill_decode
        p_req = prefill.add(make_request("cmpl-gone-0-00000002", prompt, rendezvous.to_params(), 1))
        start = time.monotonic()
        run_until([prefill], lambda: p_req.request_id not in prefill.scheduler.requests)
        # The gates held by the dead peer reopened once the lease ran out, no sooner
        # than the reply could have come, and Prefill's compute path never raised.
        assert time.monotonic() - start < 10.0
        assert p_req.status == RequestStatus.FINISHED_LENGTH_CAPPED
        side = prefill.workers[0].prefill
        assert side is not None and side.is_idle() and side.worker.errors == []
        failures = {k for s in prefill.stats for k in s.get("failures", {})}
        assert failures & {"LEASE_EXPIRED", "CONNECTION_LOST", "TIMEOUT"}, failures
