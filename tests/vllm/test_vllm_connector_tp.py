"""Decode TP 2: two Decode worker halves in threads, each with its own vLLM KV cache, and
one decision.

Every Decode TP rank holds its own KV cache (allocated by vLLM), so each rank pulls ALL
the main blocks of the request from its Prefill peer (the Prefill rank of the same number)
and a full copy of the indexer, into the blocks Decode's scheduler allocated; the
cross-rank completion is gathered over a real collective (threads meeting at a barrier),
so the request becomes runnable only when both ranks are done, and a read that fails on
ONE rank fails the request on both (that rank's cache was never written).
"""

from __future__ import annotations

import torch
from conftest import VllmConfigFactory
from test_vllm_connector_faults import FlakyLoopback, LoopbackConnector
from vllm.v1.request import RequestStatus
from vllm_metaserver_harness import MetaServer
from vllm_pd_harness import (
    INDEXER_BLOCK,
    INDEXER_BYTES,
    MAIN,
    MAIN_BLOCK_BYTES,
    build_engine,
    engines,
    free_port_block,
    make_request,
    run_until,
    start_remote_prefill,
    status,
)

from rd2h_protocol.rendezvous import decode_rendezvous, remote_prefill_params


def test_decode_tp2_each_rank_fills_its_own_cache_and_completes_on_both_ranks(
    make_vllm_config: VllmConfigFactory, server: MetaServer
) -> None:
    decode = build_engine(
        make_vllm_config,
        "kv_consumer",
        tp=2,
        kv_port=free_port_block(2),
        indexer="group",
        threaded=True,
    )
    prefill = build_engine(make_vllm_config, "kv_producer", tp=2, indexer="group")
    with engines(prefill, decode):
        # Each rank's destinations are its own cache: two disjoint allocations.
        bases = {decode.destinations(rank).main(MAIN[0])[0].base for rank in range(2)}
        assert len(bases) == 2
        prompt = list(range(75))  # 5 main blocks, 3 indexer blocks
        d_req = decode.add(
            make_request("cmpl-dtp-0-00000001", prompt, remote_prefill_params(server.url), 2)
        )
        decode.step()
        run_until([decode], lambda: bool(server.script.bodies))
        rendezvous = decode_rendezvous(server.script.bodies[0])
        assert rendezvous.remote_tp_size == 2
        prefill.add(make_request("cmpl-dtp-0-00000002", prompt, rendezvous.to_params(), 1))
        run_until([prefill, decode], lambda: status(d_req) == RequestStatus.RUNNING)
        main, idx = decode.block_ids(d_req.request_id)
        assert (len(main), len(idx)) == (5, 3)
        for rank in range(2):
            # Rank r's cache holds Prefill rank r's main KV and the whole indexer.
            assert decode.mismatches("cmpl-dtp-0", main, idx, rank=rank) == [], rank
        assert decode.mismatches("cmpl-dtp-0", main, rank=1, prefill_rank=0) != []
        run_until([prefill, decode], lambda: not prefill.scheduler.requests)
        for worker in decode.workers:
            assert worker.decode is not None and worker.decode.is_idle()
        # Each rank read all of the main KV and all of the indexer, once.
        reads = [s["layer_reads"] for s in decode.stats if s.get("layer_reads")]
        total = sum(v[1] for r in reads for v in r.values())
        per_rank = len(MAIN) * (5 * MAIN_BLOCK_BYTES + 3 * INDEXER_BLOCK * INDEXER_BYTES)
        assert total == 2 * per_rank


def test_a_read_failing_on_one_decode_rank_fails_the_request_on_both(
    make_vllm_config: VllmConfigFactory, server: MetaServer
) -> None:
    decode = build_engine(
        make_vllm_config,
        "kv_consumer",
        tp=2,
        kv_port=free_port_block(2),
        worker_cls=LoopbackConnector,
        failure_policy="recompute",
        threaded=True,
    )
    prefill = build_engine(make_vllm_config, "kv_producer", tp=2, worker_cls=LoopbackConnector)
    with engines(prefill, decode):
        backend = decode.rd2h(1).backend  # type: ignore[attr-defined]
        assert isinstance(backend, FlakyLoopback)
        backend.failing.set()
        prompt = list(range(64))
        d_req = start_remote_prefill(prefill, decode, server, "cmpl-dtf-0", prompt)
        run_until([prefill, decode], lambda: bool(decode.failed_recving))
        assert decode.failed_recving == [{d_req.request_id}]
        main = decode.block_ids(d_req.request_id)[0]
        # Both ranks report the failure with the request's blocks, in the same step.
        assert sorted(r for r, *_ in decode.failed_blocks) == [0, 1]
        assert all(m == main for _, _, m, _ in decode.failed_blocks)
        run_until([decode], lambda: status(d_req) == RequestStatus.RUNNING)
        assert d_req.num_computed_tokens == len(prompt)  # recomputed locally
        run_until([prefill, decode], lambda: not prefill.scheduler.requests)
        # Rank 0's cache got its layer 0, rank 1's got nothing: either alone would mislead.
        assert not [bad for bad in decode.mismatches("cmpl-dtf-0", main, rank=0) if MAIN[0] in bad]
        for name in MAIN:
            for block in main:
                assert not torch.any(decode.block(name, block, rank=1) != 0).item()
