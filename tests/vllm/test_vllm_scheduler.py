"""rd2h_vllm.scheduler driven by a REAL vLLM Scheduler (both roles), with real rendezvous posts.

The connector is the real ``SfaRemoteD2HConnector`` (selected through
``kv_connector_module_path``, as a deployment may), whose scheduler half is
:class:`rd2h_vllm.scheduler.SchedulerSide`; worker outputs are built by hand as vLLM's
model runner would report them (tests/vllm/test_vllm_connector_e2e.py drives the real
worker half).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
import torch
from conftest import VllmConfigFactory
from example_proxy_harness import ExampleProxy
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm_metaserver_harness import MetaServer
from vllm_pd_harness import BLOCK, INDEXER_BLOCK, MAIN, build_scheduler, kv_setup

from rd2h_protocol.errors import ConfigError, ErrorCode
from rd2h_protocol.rendezvous import (
    BATCH_PARAMS_KEY,
    METASERVER_IDEMPOTENT_KEY,
    Rendezvous,
    decode_rendezvous,
    remote_prefill_params,
)
from rd2h_vllm.config import CONNECTOR_MODULE, CONNECTOR_NAME
from rd2h_vllm.connector import SfaRemoteD2HConnector
from rd2h_vllm.metadata import CacheGroups, LoadSpec, Rd2hConnectorMetadata, SendSpec
from rd2h_vllm.scheduler import SchedulerSide

LAYERS = list(MAIN)
#: A quick metaserver client: failures show up within a test's patience.
FAST: dict[str, Any] = {
    "metaserver_timeout_s": 2.0,
    "metaserver_max_attempts": 2,
    "metaserver_backoff_s": 0.01,
    "metaserver_backoff_max_s": 0.01,
    "metaserver_deadline_s": 5.0,
    "advertise_host": "127.0.0.1",
}
KV_PORT = 20050


def kv_transfer(role: str, **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": role,
        "kv_port": KV_PORT,
        "kv_connector_extra_config": {"transfer_backend": "nixl", **FAST, **extra},
    }


@pytest.fixture(scope="module")
def block_hasher() -> Callable[[Request], Any]:
    init_none_hash(sha256)
    return get_request_block_hasher(BLOCK, sha256)


SchedulerFactory = Callable[..., Scheduler]


@pytest.fixture
def make_scheduler(make_vllm_config: VllmConfigFactory) -> Iterator[SchedulerFactory]:
    made: list[Scheduler] = []

    def make(
        role: str,
        *,
        tp: int = 1,
        max_num_batched_tokens: int = 1024,
        failure_policy: str = "fail",
    ) -> Scheduler:
        transfer = {**kv_transfer(role), "kv_load_failure_policy": failure_policy}
        config = make_vllm_config(
            transfer, tp=tp, attach_after=False, max_num_batched_tokens=max_num_batched_tokens
        )
        setup = kv_setup(config)  # vLLM's own KV-cache configuration of the model
        assert setup.scheduler.kv_cache_groups[0].layer_names == LAYERS
        scheduler = build_scheduler(config, setup)
        made.append(scheduler)
        return scheduler

    yield make
    for scheduler in made:
        scheduler.shutdown()  # closes the connector's metaserver client


def request(
    req_id: str,
    prompt: list[int],
    params: Mapping[str, Any] | None,
    hasher: Callable[[Request], Any],
    max_tokens: int = 3,
) -> Request:
    extra = {"kv_transfer_params": dict(params)} if params is not None else None
    return Request(
        req_id,
        prompt,
        SamplingParams(max_tokens=max_tokens, extra_args=extra),
        None,
        block_hasher=hasher,
    )


def status(req: Request) -> RequestStatus:
    """The request's status, read afresh (it changes under the scheduler's calls)."""
    return req.status


def meta(out: SchedulerOutput) -> Rd2hConnectorMetadata:
    assert isinstance(out.kv_connector_metadata, Rd2hConnectorMetadata)
    return out.kv_connector_metadata


def worker_output(
    scheduler: Scheduler,
    out: SchedulerOutput,
    *,
    finished_recving: set[str] | None = None,
    finished_sending: set[str] | None = None,
    invalid_block_ids: set[int] | None = None,
) -> ModelRunnerOutput:
    """What the model runner returns for ``out``: a token for every request past its
    prompt, nothing for a prefill chunk, plus the connector's report."""
    req_ids = list(out.num_scheduled_tokens)
    sampled = [[] if scheduler.requests[r].is_prefill_chunk else [7] for r in req_ids]
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        kv_connector_output=KVConnectorOutput(
            finished_recving=finished_recving,
            finished_sending=finished_sending,
            invalid_block_ids=invalid_block_ids or set(),
        ),
    )


def step(
    scheduler: Scheduler, **report: Any
) -> tuple[SchedulerOutput, dict[int, EngineCoreOutputs]]:
    out = scheduler.schedule()
    return out, scheduler.update_from_output(out, worker_output(scheduler, out, **report))


def wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def side(scheduler: Scheduler) -> SchedulerSide:
    connector = scheduler.connector
    assert isinstance(connector, SfaRemoteD2HConnector)
    assert connector.scheduler is not None
    return connector.scheduler


# -- Decode ------------------------------------------------------------------------------


def test_decode_reports_the_prompt_as_async_and_posts_after_allocation(
    make_scheduler: SchedulerFactory,
    server: MetaServer,
    block_hasher: Callable[[Request], Any],
) -> None:
    scheduler = make_scheduler("kv_consumer")
    req = request(
        "cmpl-abc-0-0123abcd", list(range(40)), remote_prefill_params(server.url), block_hasher
    )
    scheduler.add_request(req)
    out = scheduler.schedule()
    assert status(req) == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert out.num_scheduled_tokens == {}  # nothing runs until the KV arrived
    [load] = meta(out).loads
    blocks = scheduler.kv_cache_manager.get_block_ids(req.request_id)[0]
    assert load == LoadSpec(
        req_id=req.request_id,
        ext_id="cmpl-abc-0",
        main_block_ids=blocks,
        indexer_block_ids=None,
        local_tokens=0,
        num_tokens=40,
    )
    assert len(blocks) == 3  # ceil(40 / 16)
    assert req.kv_transfer_params is not None
    assert req.kv_transfer_params["do_remote_prefill"] is False  # cleared after allocation
    wait_for(lambda: len(server.script.bodies) == 1)
    assert decode_rendezvous(server.script.bodies[0]) == Rendezvous(
        request_id="cmpl-abc-0",
        remote_engine_id=side(scheduler).config.engine_id,
        remote_host="127.0.0.1",
        remote_port=KV_PORT,
        remote_tp_size=1,
        remote_cached_tokens=0,
    )
    # Blocks stay while loading, even if the request is asked about again.
    assert side(scheduler).loading().keys() == {req.request_id}

    # Every worker reported the load finished: the request becomes runnable.
    scheduler.update_from_output(
        out, worker_output(scheduler, out, finished_recving={req.request_id})
    )
    assert side(scheduler).loading() == {}
    out2, _ = step(scheduler)
    assert status(req) == RequestStatus.RUNNING
    assert out2.num_scheduled_tokens == {req.request_id: 1}  # only the last prompt token
    assert req.num_computed_tokens == 40
    assert meta(out2).is_empty()
    assert list(req.output_token_ids) == [7]
    wait_for(lambda: not side(scheduler).posting())  # the answer reaches the poster's thread
    assert side(scheduler).is_idle()


def test_decode_local_prefix_hit_is_posted_as_cached_tokens(
    make_scheduler: SchedulerFactory,
    server: MetaServer,
    block_hasher: Callable[[Request], Any],
) -> None:
    scheduler = make_scheduler("kv_consumer")
    first = request(
        "cmpl-a-0-00000001", list(range(40)), remote_prefill_params(server.url), block_hasher
    )
    scheduler.add_request(first)
    out, _ = step(scheduler)
    scheduler.update_from_output(
        out, worker_output(scheduler, out, finished_recving={first.request_id})
    )
    step(scheduler)  # first runs; its 2 full prompt blocks are now in the prefix cache
    second = request(
        "cmpl-b-0-00000002", [*range(40), 1, 2, 3], remote_prefill_params(server.url), block_hasher
    )
    scheduler.add_request(second)
    out = scheduler.schedule()
    [load] = meta(out).loads
    assert (load.local_tokens, load.num_tokens) == (32, 11)
    first_blocks = scheduler.kv_cache_manager.get_block_ids(first.request_id)[0]
    assert load.main_block_ids[:2] == first_blocks[:2]  # shared cached blocks, full list
    assert len(load.main_block_ids) == 3
    # Both posts are in flight at once (the first is not awaited), each on its own pooled
    # connection: they may reach the server in either order, so match them by request id.
    wait_for(lambda: len(server.script.bodies) == 2)
    posted = {rv.request_id: rv for rv in map(decode_rendezvous, server.script.bodies)}
    assert posted.keys() == {"cmpl-a-0", "cmpl-b-0"}
    assert posted["cmpl-a-0"].remote_cached_tokens == 0
    assert posted["cmpl-b-0"].remote_cached_tokens == 32


def test_decode_refused_rendezvous_becomes_a_load_failure(
    make_scheduler: SchedulerFactory,
    server: MetaServer,
    block_hasher: Callable[[Request], Any],
) -> None:
    server.script.replies = [404]
    scheduler = make_scheduler("kv_consumer", failure_policy="recompute")
    req = request(
        "cmpl-x-0-0000000f", list(range(40)), remote_prefill_params(server.url), block_hasher
    )
    scheduler.add_request(req)
    out, _ = step(scheduler)
    wait_for(lambda: bool(side(scheduler)._failures))
    out, engine_outputs = step(scheduler)
    [failure] = meta(out).load_failures
    assert failure.req_id == req.request_id and failure.ext_id == "cmpl-x-0"
    assert failure.code == ErrorCode.UNKNOWN_REQUEST and "HTTP 404" in failure.message
    # The scheduler-side stats reach vLLM's SchedulerStats.
    [stats] = [eco.scheduler_stats for eco in engine_outputs.values() if eco.scheduler_stats]
    assert stats.kv_connector_stats is not None
    assert stats.kv_connector_stats["failures"] == {"UNKNOWN_REQUEST": 1}
    # The worker fails the request: finished_recving plus every destination block invalid.
    blocks = set(scheduler.kv_cache_manager.get_block_ids(req.request_id)[0])
    out, _ = step(scheduler)
    scheduler.update_from_output(
        out,
        worker_output(scheduler, out, finished_recving={req.request_id}, invalid_block_ids=blocks),
    )
    out, _ = step(scheduler)
    # Policy "recompute": the prompt is computed locally from scratch.
    assert req.status == RequestStatus.RUNNING
    assert out.num_scheduled_tokens == {req.request_id: 40}
    assert side(scheduler).is_idle()


def test_decode_abort_while_loading_holds_blocks_until_the_workers_are_done(
    make_scheduler: SchedulerFactory,
    server: MetaServer,
    block_hasher: Callable[[Request], Any],
) -> None:
    scheduler = make_scheduler("kv_consumer")
    req = request(
        "cmpl-ab-0-00000003", list(range(40)), remote_prefill_params(server.url), block_hasher
    )
    scheduler.add_request(req)
    step(scheduler)
    free_before = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    scheduler.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    # A read may still write the destinations: nothing is freed yet.
    assert req.request_id in scheduler.requests
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free_before
    assert side(scheduler).loading().keys() == {req.request_id}
    # The workers report the (aborted) request once no read of it is in flight.
    step(scheduler, finished_recving={req.request_id})
    assert req.request_id not in scheduler.requests
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free_before + 3
    assert side(scheduler).is_idle()


def test_decode_slow_answer_to_a_delivered_rendezvous_does_not_fail_the_request(
    make_scheduler: SchedulerFactory,
    block_hasher: Callable[[Request], Any],
) -> None:
    # Like the existing example proxy: the answer comes once the Prefill dispatch is over,
    # later than FAST's 2 s per attempt (the v1 client re-posted then).
    scheduler = make_scheduler("kv_consumer")
    with ExampleProxy(dispatch_s=2.5) as proxy:
        req = request(
            "cmpl-sl-0-00000004", list(range(40)), remote_prefill_params(proxy.url), block_hasher
        )
        scheduler.add_request(req)
        step(scheduler)
        assert side(scheduler).posting() == {req.request_id}
        wait_for(lambda: not side(scheduler).posting())
        out, _ = step(scheduler)
    assert meta(out).load_failures == []
    assert side(scheduler).loading().keys() == {req.request_id}
    assert (proxy.seen.dispatches, proxy.seen.answered) == (1, 1)


def test_decode_request_finishing_cancels_its_pending_rendezvous_post(
    make_scheduler: SchedulerFactory,
    block_hasher: Callable[[Request], Any],
) -> None:
    scheduler = make_scheduler("kv_consumer")
    with ExampleProxy(dispatch_s=60.0) as proxy:
        req = request(
            "cmpl-cx-0-00000005", list(range(40)), remote_prefill_params(proxy.url), block_hasher
        )
        scheduler.add_request(req)
        step(scheduler)
        wait_for(lambda: bool(proxy.seen.posts))
        assert side(scheduler).posting() == {req.request_id}
        scheduler.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
        assert side(scheduler).posting() == set()
        wait_for(lambda: proxy.seen.cancelled == 1)  # the proxy saw the POST go away
        # The cancelled post is not a load failure: the request is over already.
        out, _ = step(scheduler)
        assert meta(out).load_failures == []
        assert side(scheduler).loading().keys() == {req.request_id}
        step(scheduler, finished_recving={req.request_id})
    assert req.request_id not in scheduler.requests
    assert (proxy.seen.dispatches, proxy.seen.answered) == (1, 0)
    assert side(scheduler).is_idle()


@pytest.mark.parametrize("idempotent", [True, False])
def test_decode_reposts_only_to_a_metaserver_that_declared_itself_idempotent(
    make_scheduler: SchedulerFactory,
    server: MetaServer,
    block_hasher: Callable[[Request], Any],
    idempotent: bool,
) -> None:
    server.script.replies = [503, 200]  # the first post fails after reaching the server
    params = remote_prefill_params(server.url)
    if idempotent:
        params[METASERVER_IDEMPOTENT_KEY] = True  # as rd2h proxy hands it to Decode
    scheduler = make_scheduler("kv_consumer")
    req = request("cmpl-id-0-00000006", list(range(40)), params, block_hasher)
    scheduler.add_request(req)
    step(scheduler)
    wait_for(lambda: not side(scheduler).posting())
    out, _ = step(scheduler)
    if idempotent:
        assert len(server.script.bodies) == 2 and meta(out).load_failures == []
    else:
        assert len(server.script.bodies) == 1
        [failure] = meta(out).load_failures
        assert failure.req_id == req.request_id and "HTTP 503" in failure.message


def test_decode_without_a_metaserver_computes_locally(
    make_scheduler: SchedulerFactory,
    block_hasher: Callable[[Request], Any],
) -> None:
    scheduler = make_scheduler("kv_consumer")
    params = {"do_remote_decode": False, "do_remote_prefill": True}
    req = request("cmpl-n-0-00000004", list(range(40)), params, block_hasher)
    scheduler.add_request(req)
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {req.request_id: 40}
    assert meta(out).is_empty() and side(scheduler).is_idle()


# -- Prefill -------------------------------------------------------------------------------


def rendezvous_params(ext_id: str, *, cached: int = 0, d_tp: int = 1) -> dict[str, object]:
    return Rendezvous(
        request_id=ext_id,
        remote_engine_id="decode-0",
        remote_host="10.0.0.2",
        remote_port=KV_PORT,
        remote_tp_size=d_tp,
        remote_cached_tokens=cached,
    ).to_params()


def test_prefill_chunked_prompt_publishes_each_chunk_and_holds_blocks_until_sent(
    make_scheduler: SchedulerFactory, block_hasher: Callable[[Request], Any]
) -> None:
    scheduler = make_scheduler("kv_producer", tp=2, max_num_batched_tokens=32)
    ext = "cmpl-p-0"
    req = request(
        f"{ext}-00000005", list(range(80)), rendezvous_params(ext, cached=16), block_hasher, 1
    )
    scheduler.add_request(req)
    sends: list[SendSpec] = []
    for _ in range(3):
        out, _ = step(scheduler)
        [send] = meta(out).sends
        sends.append(send)
    assert [(s.transferred_tokens, s.computed_tokens, s.final) for s in sends] == [
        (0, 32, False),
        (32, 64, False),
        (64, 80, True),
    ]
    assert all(s.remote_cached_tokens == 16 and s.ext_id == ext for s in sends)
    assert [len(s.main_block_ids) for s in sends] == [2, 4, 5]
    assert sends[2].main_block_ids[:4] == sends[1].main_block_ids  # the list only grows
    assert sends[0].target.host == "10.0.0.2" and sends[0].target.base_port == KV_PORT
    # max_tokens=1: the final step produced the token and finished the request, but its
    # blocks stay until every Decode read is over.
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert req.request_id in scheduler.requests
    assert side(scheduler).sending() == {req.request_id: True}
    out, _ = step(scheduler, finished_sending={req.request_id})
    assert meta(out).is_empty()
    assert req.request_id not in scheduler.requests
    assert side(scheduler).is_idle()


def test_prefill_prompt_list_children_pick_their_own_rendezvous(
    make_scheduler: SchedulerFactory, block_hasher: Callable[[Request], Any]
) -> None:
    scheduler = make_scheduler("kv_producer")
    batch = {f"cmpl-q-{i}": rendezvous_params(f"cmpl-q-{i}", cached=16 * i) for i in range(2)}
    params = {**rendezvous_params("cmpl-q-0"), BATCH_PARAMS_KEY: batch}
    children = [
        request(f"cmpl-q-{i}-0000000{i}", list(range(40 + i)), params, block_hasher, 1)
        for i in range(3)  # child 2 has no entry: an error, never a guess
    ]
    for child in children:
        scheduler.add_request(child)
    out, engine_outputs = step(scheduler)
    sends = {s.ext_id: s for s in meta(out).sends}
    assert set(sends) == {"cmpl-q-0", "cmpl-q-1"}
    assert sends["cmpl-q-1"].remote_cached_tokens == 16
    assert sends["cmpl-q-1"].computed_tokens == 41 and sends["cmpl-q-1"].final
    assert children[2].request_id not in side(scheduler).sending()
    # ... but its Decode (the list's, from the top-level rendezvous) is told to fail it.
    [abort] = meta(out).send_aborts
    assert (abort.req_id, abort.ext_id) == (children[2].request_id, "cmpl-q-2")
    assert abort.target == sends["cmpl-q-0"].target
    assert "has no entry for request 'cmpl-q-2'" in abort.message
    [stats] = [eco.scheduler_stats for eco in engine_outputs.values() if eco.scheduler_stats]
    assert stats.kv_connector_stats is not None
    assert stats.kv_connector_stats["failures"] == {"MALFORMED": 1}
    # The child that never published frees at once; the others wait for their reads.
    assert children[2].request_id not in scheduler.requests
    assert all(c.request_id in scheduler.requests for c in children[:2])


def test_prefill_refuses_an_unsupported_decode_tp(
    make_scheduler: SchedulerFactory, block_hasher: Callable[[Request], Any]
) -> None:
    scheduler = make_scheduler("kv_producer", tp=2)
    req = request(
        "cmpl-t-0-00000006",
        list(range(40)),
        rendezvous_params("cmpl-t-0", d_tp=4),
        block_hasher,
        max_tokens=1,
    )
    scheduler.add_request(req)
    out, _ = step(scheduler)
    assert meta(out).sends == []
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert req.request_id not in scheduler.requests  # never published: freed at once


def test_prefill_request_aborted_before_publishing_frees_at_once(
    make_scheduler: SchedulerFactory, block_hasher: Callable[[Request], Any]
) -> None:
    scheduler = make_scheduler("kv_producer", max_num_batched_tokens=32)
    req = request("cmpl-u-0-00000007", list(range(40)), rendezvous_params("cmpl-u-0"), block_hasher)
    scheduler.add_request(req)
    step(scheduler)  # first chunk published
    scheduler.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    assert req.request_id in scheduler.requests  # published: held until finished_sending
    other = request(
        "cmpl-v-0-00000008", list(range(40)), rendezvous_params("cmpl-v-0"), block_hasher
    )
    scheduler.add_request(other)
    scheduler.finish_requests(other.request_id, RequestStatus.FINISHED_ABORTED)
    assert other.request_id not in scheduler.requests  # never allocated, never published
    step(scheduler, finished_sending={req.request_id})
    assert side(scheduler).is_idle()


# -- KV-cache groups -------------------------------------------------------------------------


def test_cache_groups_find_main_and_indexer() -> None:
    def group(names: list[str], block_size: int) -> KVCacheGroupSpec:
        spec = FullAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=16, dtype=torch.float32
        )
        return KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec)

    two = KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[
            group(["model.layers.0.self_attn.attn"], 64),
            group(["model.layers.0.self_attn.indexer.k_cache"], 32),
        ],
    )
    groups = CacheGroups.from_kv_cache_config(two)
    assert (groups.main, groups.indexer, groups.smallest_block_size) == (0, 1, 32)
    assert groups.split(([1, 2], [3])) == ([1, 2], [3])
    uniform = KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[group(["layers.0.attn", "layers.0.indexer"], 64)],
    )
    assert CacheGroups.from_kv_cache_config(uniform).split(([4, 5],)) == ([4, 5], [4, 5])
    only_indexer = KVCacheConfig(
        num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[group(["layers.0.indexer"], 64)]
    )
    with pytest.raises(ConfigError, match="no KV-cache group holds a main"):
        CacheGroups.from_kv_cache_config(only_indexer)


@pytest.mark.parametrize(
    ("indexer", "expected"),
    [
        ("none", (0, None, (BLOCK,))),
        ("shared", (0, 0, (BLOCK,))),
        ("group", (0, 1, (BLOCK, INDEXER_BLOCK))),
    ],
)
def test_cache_groups_of_the_groups_vllm_makes(
    make_vllm_config: VllmConfigFactory, indexer: str, expected: tuple[Any, ...]
) -> None:
    """The same on the KV-cache configurations vLLM itself builds (scheduler and worker)."""
    setup = kv_setup(make_vllm_config(), indexer)
    for config in (setup.scheduler, setup.workers[0]):
        groups = CacheGroups.from_kv_cache_config(config)
        assert (groups.main, groups.indexer, groups.block_sizes) == expected
