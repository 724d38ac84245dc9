"""Decode TP 2: two Decode worker halves in threads share one host pool and one decision.

Each Decode rank pulls a disjoint share of the main KV into the TP-shared pool (a file
both ranks map) and a full copy of the indexer into its own memory; the cross-rank
completion is gathered over a real collective (threads meeting at a barrier), so the
request becomes runnable only when both ranks are done, and a read that fails on ONE
rank fails the request on both.
"""

from __future__ import annotations

import torch
from conftest import VllmConfigFactory
from test_vllm_connector_faults import FlakyLoopback, LoopbackConnector
from vllm.v1.request import RequestStatus
from vllm_metaserver_harness import MetaServer
from vllm_pd_harness import (
    MAIN,
    build_engine,
    engines,
    free_port_block,
    make_request,
    run_until,
    status,
)

from rd2h_protocol.rendezvous import decode_rendezvous, remote_prefill_params


def test_decode_tp2_shares_the_pool_and_completes_on_both_ranks(
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
        pools = [decode.destinations(rank) for rank in range(2)]
        assert pools[0].shared_path is not None and pools[0].shared_path == pools[1].shared_path
        prompt = list(range(75))  # 5 blocks: the main share splits 3 / 2 over the ranks
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
        for rank in range(2):
            # Main through either rank's mapping of the one pool; each rank's own indexer.
            assert decode.mismatches("cmpl-dtp-0", main, idx, rank=rank) == [], rank
        run_until([prefill, decode], lambda: not prefill.scheduler.requests)
        for worker in decode.workers:
            assert worker.decode is not None and worker.decode.is_idle()
        # Each rank read only its share of the main KV: together exactly once.
        reads = [s["layer_reads"] for s in decode.stats if s.get("layer_reads")]
        total = sum(v[1] for r in reads for v in r.values())
        assert total == 2 * 2 * 5 * 2048 + 2 * (2 * 5 * 128)  # main once, indexer per rank


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
        d_req = decode.add(
            make_request("cmpl-dtf-0-00000001", prompt, remote_prefill_params(server.url), 2)
        )
        decode.step()
        run_until([decode], lambda: bool(server.script.bodies))
        params = decode_rendezvous(server.script.bodies[0]).to_params()
        prefill.add(make_request("cmpl-dtf-0-00000002", prompt, params, 1))
        run_until([prefill, decode], lambda: bool(decode.failed_recving))
        assert decode.failed_recving == [{d_req.request_id}]
        main = decode.block_ids(d_req.request_id)[0]
        # Both ranks report the failure with the request's blocks, in the same step.
        assert sorted(r for r, *_ in decode.failed_blocks) == [0, 1]
        assert all(m == main for _, _, m, _ in decode.failed_blocks)
        run_until([decode], lambda: status(d_req) == RequestStatus.RUNNING)
        assert d_req.num_computed_tokens == len(prompt)  # recomputed locally
        run_until([prefill, decode], lambda: not prefill.scheduler.requests)
        # Rank 0's share did land, rank 1's did not: the pool alone cannot be trusted.
        pool = decode.destinations(0)
        untouched = [b for b in main if not torch.any(pool.tensor(MAIN[0], "k")[b] != 0).item()]
        assert 0 < len(untouched) < len(main)
