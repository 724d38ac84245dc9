"""SfaRemoteD2HConnector end to end: real vLLM Schedulers on both sides, real transfers.

Decode gets a request with ``do_remote_prefill`` and the metaserver URL, posts its
rendezvous; the test plays the proxy (the posted JSON becomes the Prefill request's
``kv_transfer_params``); Prefill computes the prompt layer by layer through the worker
half of the connector over CPU tensors, Decode pulls each layer with NIXL (UCX, in
process) into the blocks its own scheduler allocated in its own vLLM KV cache (allocated
by vLLM), and the Decode request becomes runnable.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest
from conftest import VllmConfigFactory
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging
from vllm.v1.request import RequestStatus
from vllm_metaserver_harness import MetaServer
from vllm_pd_harness import (
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

from rd2h_protocol.rendezvous import BATCH_PARAMS_KEY, decode_rendezvous, remote_prefill_params


@pytest.fixture
def pd(make_vllm_config: VllmConfigFactory) -> Iterator[tuple[Engine, Engine]]:
    decode = build_engine(make_vllm_config, "kv_consumer", kv_port=free_port_block(1))
    try:
        prefill = build_engine(make_vllm_config, "kv_producer")
    except BaseException:
        decode.close()
        raise
    yield prefill, decode
    prefill.close()
    decode.close()


def wait_posts(server: MetaServer, count: int, timeout_s: float = 10.0) -> list[bytes]:
    deadline = time.monotonic() + timeout_s
    while len(server.script.bodies) < count:
        assert time.monotonic() < deadline, "rendezvous not posted in time"
        time.sleep(0.01)
    return list(server.script.bodies)


def test_kv_arrives_byte_exact_and_decode_runs(
    pd: tuple[Engine, Engine], server: MetaServer
) -> None:
    prefill, decode = pd
    prompt = list(range(40))  # 2 full blocks + a partial one
    d_req = decode.add(
        make_request("cmpl-e2e-0-0000abcd", prompt, remote_prefill_params(server.url), 4)
    )
    decode.step()
    assert status(d_req) == RequestStatus.WAITING_FOR_REMOTE_KVS
    [body] = wait_posts(server, 1)
    rendezvous = decode_rendezvous(body)
    assert (rendezvous.remote_host, rendezvous.remote_port) == ("127.0.0.1", decode.kv_port)
    p_req = prefill.add(make_request("cmpl-e2e-0-00001234", prompt, rendezvous.to_params(), 1))
    dest_ids = decode.block_ids(d_req.request_id)[0]
    run_until([prefill, decode], lambda: status(d_req) == RequestStatus.RUNNING)
    assert decode.mismatches("cmpl-e2e-0", dest_ids) == []
    assert d_req.num_computed_tokens == len(prompt)  # the prompt's KV came from Prefill
    # Prefill frees its blocks only after every read; Decode then generates.
    run_until([prefill, decode], lambda: p_req.request_id not in prefill.scheduler.requests)
    run_until([decode], lambda: len(d_req.output_token_ids) >= 2)
    assert prefill.workers[0].prefill is not None and prefill.workers[0].prefill.is_idle()
    assert decode.workers[0].decode is not None and decode.workers[0].decode.is_idle()
    assert prefill.connector.scheduler is not None and prefill.connector.scheduler.is_idle()
    # Metrics through vLLM's aggregation: Decode's reads per layer, Prefill's publications.
    reads = [s["layer_reads"] for s in decode.stats if s.get("layer_reads")]
    layers = {name for r in reads for name in r}
    assert layers == {"model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"}
    total = sum(v[1] for r in reads for v in r.values())
    assert total == len(MAIN) * 3 * MAIN_BLOCK_BYTES  # layers x blocks x bytes per block
    events = [s["protocol_events"] for s in prefill.stats if s.get("protocol_events")]
    assert sum(e.get("publications", 0) for e in events) == 2
    # vLLM's front-end log line, rebuilt by the connector class vLLM resolves from config.
    ktc = decode.vllm_config.kv_transfer_config
    assert ktc is not None
    log = KVConnectorLogging(ktc)
    for data in decode.stats:
        log.observe(data)
    lines: list[str] = []
    log.log(log_fn=lambda fmt, *args: lines.append(fmt % args))  # type: ignore[no-untyped-call]
    reads_total = sum(v[0] for r in reads for v in r.values())
    assert reads_total == 2  # one batched read per layer
    assert f"RD2H reads={reads_total}" in lines[0]
    assert f"RD2H read MB={round(total / 2**20, 3)}" in lines[0]


def test_chunked_prefill_sends_each_chunk(
    make_vllm_config: VllmConfigFactory, server: MetaServer
) -> None:
    decode = build_engine(make_vllm_config, "kv_consumer", kv_port=free_port_block(1))
    prefill = build_engine(make_vllm_config, "kv_producer", max_num_batched_tokens=32)
    try:
        prompt = list(range(100, 190))  # 90 tokens: chunks of 32, 32, 26
        d_req = decode.add(
            make_request("cmpl-chunk-0-00000001", prompt, remote_prefill_params(server.url), 2)
        )
        decode.step()
        rendezvous = decode_rendezvous(wait_posts(server, 1)[0])
        p_req = prefill.add(
            make_request("cmpl-chunk-0-00000002", prompt, rendezvous.to_params(), 1)
        )
        chunks: list[int] = []
        while status(d_req) != RequestStatus.RUNNING:
            result = prefill.step()
            if p_req.request_id in result.out.num_scheduled_tokens:
                chunks.append(result.out.num_scheduled_tokens[p_req.request_id])
            decode.step()
            assert len(chunks) < 50
        assert chunks == [32, 32, 26]
        assert decode.mismatches("cmpl-chunk-0", decode.block_ids(d_req.request_id)[0]) == []
        run_until([prefill, decode], lambda: not prefill.scheduler.requests)
    finally:
        prefill.close()
        decode.close()


def test_prompt_list_children_share_one_prefill_dispatch(
    pd: tuple[Engine, Engine], server: MetaServer
) -> None:
    prefill, decode = pd
    prompts = [list(range(20)), list(range(30, 65)), list(range(70, 73))]
    children = [
        decode.add(
            make_request(f"cmpl-list-{i}-0000000{i}", p, remote_prefill_params(server.url), 2)
        )
        for i, p in enumerate(prompts)
    ]
    decode.step()
    posted = {r.request_id: r for r in map(decode_rendezvous, wait_posts(server, 3))}
    assert set(posted) == {"cmpl-list-0", "cmpl-list-1", "cmpl-list-2"}
    # The proxy dispatches the original list once: child 0's params plus the batch map.
    params = {
        **posted["cmpl-list-0"].to_params(),
        BATCH_PARAMS_KEY: {ext: r.to_params() for ext, r in posted.items()},
    }
    for i, p in enumerate(prompts):
        prefill.add(make_request(f"cmpl-list-{i}-1000000{i}", p, params, 1))
    run_until([prefill, decode], lambda: all(status(c) == RequestStatus.RUNNING for c in children))
    for i, child in enumerate(children):
        ids = decode.block_ids(child.request_id)[0]
        assert decode.mismatches(f"cmpl-list-{i}", ids) == [], i
    run_until([prefill, decode], lambda: not prefill.scheduler.requests)


#: Decode's load timeout when a child must fail on Prefill's ABORT: ample for the other
#: children's loads, many times what an ABORT takes.
ABORT_TEST_LOAD_TIMEOUT_S = 10.0


@pytest.mark.parametrize(
    ("missing", "token_budget"),
    [
        pytest.param(1, 1024, id="siblings-published-in-the-same-step"),
        # 32 tokens a step: child 0 (20 tokens) and 12 of child 1's 35 in step 1, less
        # than a block of child 1, so nothing is published to Decode before step 2.
        pytest.param(0, 32, id="abort-waits-for-a-later-publication"),
    ],
)
def test_prompt_list_child_without_a_batch_entry_fails_on_decode_at_once(
    make_vllm_config: VllmConfigFactory,
    server: MetaServer,
    caplog: pytest.LogCaptureFixture,
    missing: int,
    token_budget: int,
) -> None:
    """The batch map lacks one child's entry: Prefill aborts that child toward the Decode
    of the list's top-level rendezvous, on the connection its siblings' first publication
    opens (this is the first traffic between the two engines), and Decode fails it on the
    ABORT, long before its load timeout; the siblings load byte-exact."""
    decode = build_engine(
        make_vllm_config,
        "kv_consumer",
        kv_port=free_port_block(1),
        extra={"kv_load_timeout_s": ABORT_TEST_LOAD_TIMEOUT_S},
    )
    prefill = build_engine(make_vllm_config, "kv_producer", max_num_batched_tokens=token_budget)
    with engines(prefill, decode), caplog.at_level(logging.WARNING, logger="rd2h_vllm"):
        prompts = [list(range(20)), list(range(30, 65)), list(range(70, 73))]
        children = [
            decode.add(
                make_request(f"cmpl-gap-{i}-0000000{i}", p, remote_prefill_params(server.url), 2)
            )
            for i, p in enumerate(prompts)
        ]
        decode.step()
        posted = {r.request_id: r for r in map(decode_rendezvous, wait_posts(server, 3))}
        params = {
            **posted["cmpl-gap-0"].to_params(),
            BATCH_PARAMS_KEY: {
                ext: r.to_params() for ext, r in posted.items() if ext != f"cmpl-gap-{missing}"
            },
        }
        start = time.monotonic()
        p_reqs = [
            prefill.add(make_request(f"cmpl-gap-{i}-1000000{i}", p, params, 1))
            for i, p in enumerate(prompts)
        ]
        run_until([prefill, decode], lambda: bool(decode.failed_recving))
        failed_after_s = time.monotonic() - start
        assert decode.failed_recving == [{children[missing].request_id}]
        assert failed_after_s < ABORT_TEST_LOAD_TIMEOUT_S / 4, failed_after_s
        # Failed by Prefill's ABORT (code ABORTED), not by the load timeout (TIMEOUT).
        assert sum(s.get("aborts_received", 0) for s in decode.stats) == 1
        d_failures = [s["failures"] for s in decode.stats if s.get("failures")]
        assert d_failures == [{"ABORTED": 1}]
        assert "KV not received on TP rank 0: aborted by Prefill" in caplog.text
        assert (
            f"request {p_reqs[missing].request_id}: prompt-list child cmpl-gap-{missing} has "
            "no usable rendezvous" in caplog.text
        )
        # One KV-cache group: the blocks are load errors and vLLM fails the request.
        run_until([decode], lambda: children[missing].request_id not in decode.scheduler.requests)
        assert children[missing].status == RequestStatus.FINISHED_ERROR
        siblings = [(i, child) for i, child in enumerate(children) if i != missing]
        run_until(
            [prefill, decode],
            lambda: all(status(c) == RequestStatus.RUNNING for _, c in siblings),
        )
        for i, child in siblings:
            ids = decode.block_ids(child.request_id)[0]
            assert decode.mismatches(f"cmpl-gap-{i}", ids) == [], i
        run_until([prefill, decode], lambda: not prefill.scheduler.requests)
        p_failures = [s["failures"] for s in prefill.stats if s.get("failures")]
        assert p_failures == [{"MALFORMED": 1}]  # the missing entry, counted once
        side = prefill.workers[0].prefill
        assert side is not None and side.is_idle() and side.worker.errors == []
        assert prefill.connector.scheduler is not None and prefill.connector.scheduler.is_idle()


@pytest.mark.parametrize("indexer", ["shared", "group"])
def test_main_and_indexer_arrive_in_decodes_vllm_cache(
    make_vllm_config: VllmConfigFactory, server: MetaServer, indexer: str
) -> None:
    """Both forms vLLM gives a model with an indexer, over NIXL: one KV-cache group (main
    and indexer share block ids) and two groups aliasing one allocation."""
    decode = build_engine(
        make_vllm_config, "kv_consumer", kv_port=free_port_block(1), indexer=indexer
    )
    prefill = build_engine(make_vllm_config, "kv_producer", indexer=indexer)
    with engines(prefill, decode):
        prompt = list(range(200, 270))  # 70 tokens
        d_req = decode.add(
            make_request("cmpl-idx-0-00000001", prompt, remote_prefill_params(server.url), 2)
        )
        decode.step()
        rendezvous = decode_rendezvous(wait_posts(server, 1)[0])
        prefill.add(make_request("cmpl-idx-0-00000002", prompt, rendezvous.to_params(), 1))
        run_until([prefill, decode], lambda: status(d_req) == RequestStatus.RUNNING)
        ids = decode.block_ids(d_req.request_id)
        main, idx = ids[0], ids[decode.indexer_group]
        assert len(idx) == (5 if indexer == "shared" else 3)
        assert decode.mismatches("cmpl-idx-0", main, idx) == []
        run_until([prefill, decode], lambda: not prefill.scheduler.requests)
        reads = [s["layer_reads"] for s in decode.stats if s.get("layer_reads")]
        total = sum(v[1] for r in reads for v in r.values())
        idx_block = decode.indexer_block * INDEXER_BYTES
        assert total == len(MAIN) * (len(main) * MAIN_BLOCK_BYTES + len(idx) * idx_block)
