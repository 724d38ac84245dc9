"""rd2h_vllm.multi: RD2H composed with a layerwise store, on real vLLM Schedulers.

The store (tests/vllm/rd2h_fake_store.py) is listed BEFORE RD2H in the configuration, so
every ordering guarantee below comes from :class:`Rd2hMultiConnector`, not from the
configured order; vLLM's own MultiConnector, given the same children, is the control
that shows the checks can fail.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from conftest import VllmConfigFactory
from rd2h_fake_store import FakeLayerwiseStore
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
from vllm.v1.request import RequestStatus
from vllm_metaserver_harness import MetaServer
from vllm_pd_harness import (
    MAIN,
    Engine,
    build_engine,
    engines,
    free_port_block,
    make_request,
    run_until,
    start_remote_prefill,
    status,
    wrap_in,
)

from rd2h_protocol.rendezvous import Rendezvous
from rd2h_vllm.connector import SfaRemoteD2HConnector
from rd2h_vllm.metadata import Rd2hConnectorMetadata
from rd2h_vllm.multi import Rd2hMultiConnector

STORE = {
    "kv_connector": "FakeLayerwiseStore",
    "kv_connector_module_path": "rd2h_fake_store",
    "kv_role": "kv_producer",
}
PLAIN = {
    "kv_connector": "PlainConnector",
    "kv_connector_module_path": "rd2h_fake_store",
    "kv_role": "kv_producer",
}


@pytest.fixture(autouse=True)
def clean_log() -> Iterator[list[tuple[Any, ...]]]:
    FakeLayerwiseStore.log.clear()
    yield FakeLayerwiseStore.log
    FakeLayerwiseStore.log.clear()


def child(connector: Any, cls: type) -> Any:
    [found] = [c for c in connector.sub_connectors if type(c) is cls]
    return found


def rendezvous(ext: str, d_tp: int = 1, port: int = 20050) -> dict[str, object]:
    return Rendezvous(
        request_id=ext,
        remote_engine_id="decode-0",
        remote_host="127.0.0.1",
        remote_port=port,
        remote_tp_size=d_tp,
        remote_cached_tokens=0,
    ).to_params()


def test_full_blocks_go_to_rd2h_when_another_connector_was_chosen(
    make_vllm_config: VllmConfigFactory, clean_log: list[tuple[Any, ...]]
) -> None:
    prefill = build_engine(
        make_vllm_config,
        "kv_producer",
        wrap=wrap_in(Rd2hMultiConnector, STORE, PLAIN, hit_tokens=16),
        worker_cls=Rd2hMultiConnector,
    )
    with engines(prefill):
        multi = prefill.scheduler.connector
        assert isinstance(multi, Rd2hMultiConnector)
        rd2h = child(multi, SfaRemoteD2HConnector)
        assert rd2h.requires_full_blocks_on_update_after_alloc
        seen: list[tuple[list[list[int]], int]] = []
        original = rd2h.update_state_after_alloc

        def spy(request: Any, blocks: Any, num_external_tokens: int) -> None:
            seen.append(([list(g) for g in blocks.get_block_ids()], num_external_tokens))
            original(request, blocks, num_external_tokens)

        rd2h.update_state_after_alloc = spy
        req = prefill.add(
            make_request("cmpl-m-0-00000001", list(range(40)), rendezvous("cmpl-m-0"), 1)
        )
        out = prefill.scheduler.schedule()  # the scheduler side only: no Decode here
        full = [list(g) for g in prefill.block_ids(req.request_id)]
        assert len(full[0]) == 3
        # The store was chosen for lookup (16 tokens); RD2H still got every block.
        assert ("store.update_state_after_alloc", tuple(full), 16) in [
            (e[0], tuple(map(list, e[1])), e[2]) for e in clean_log if e[0].startswith("store.upd")
        ]
        assert seen == [(full, 16)]
        # A child neither chosen nor asking for full blocks gets none (vllm-ascend's rule).
        [plain] = [e for e in clean_log if e[0] == "plain.update_state_after_alloc"]
        assert plain[2] == 0 and all(len(g) == 0 for g in plain[1])
        # RD2H's metadata publishes the request over its full block list.
        meta = out.kv_connector_metadata
        rd2h_meta = [m for m in meta.metadata if isinstance(m, Rd2hConnectorMetadata)]  # type: ignore[union-attr]
        [send] = rd2h_meta[0].sends
        assert send.main_block_ids == full[0]


def run_pd(
    make_vllm_config: VllmConfigFactory,
    server: MetaServer,
    cls: type[MultiConnector],
    *,
    cache_written_hook: bool,
) -> tuple[Engine, Engine, list[str]]:
    decode = build_engine(make_vllm_config, "kv_consumer", kv_port=free_port_block(1))
    prefill = build_engine(
        make_vllm_config, "kv_producer", wrap=wrap_in(cls, STORE), worker_cls=cls
    )
    prefill.cache_written_hook = cache_written_hook
    store = child(prefill.workers[0], FakeLayerwiseStore)
    store.rd2h = prefill.rd2h()
    with engines(prefill, decode):
        prompt = list(range(60))
        d_req = start_remote_prefill(prefill, decode, server, "cmpl-mw-0", prompt)
        run_until([prefill, decode], lambda: status(d_req) == RequestStatus.RUNNING)
        bad = decode.mismatches("cmpl-mw-0", decode.block_ids(d_req.request_id)[0])
        run_until([prefill, decode], lambda: not prefill.scheduler.requests)
        return prefill, decode, bad


@pytest.mark.parametrize("cache_written_hook", [False, True])
def test_rd2h_runs_first_and_the_store_waits_for_reads(
    make_vllm_config: VllmConfigFactory,
    server: MetaServer,
    clean_log: list[tuple[Any, ...]],
    cache_written_hook: bool,
) -> None:
    prefill, _, bad = run_pd(
        make_vllm_config, server, Rd2hMultiConnector, cache_written_hook=cache_written_hook
    )
    assert bad == []
    multi = prefill.workers[0]
    assert isinstance(multi, Rd2hMultiConnector)
    assert [type(c) for c in multi.waiter_handed_to] == [FakeLayerwiseStore]
    assert [type(c) for c in multi.ordered_connectors] == [
        SfaRemoteD2HConnector,
        FakeLayerwiseStore,
    ]
    kinds = {e[0] for e in clean_log}
    assert "store.no_waiter" not in kinds
    # At each layer entry RD2H's wait had already run: its storage was free.
    entries = [e for e in clean_log if e[0] == "store.wait_for_layer_load"]
    assert len(entries) == len(MAIN) and all(e[2] for e in entries)
    # When the store reused the previous layer's buffer, every Decode read of it was over.
    reuses = [e for e in clean_log if e[0] == "store.reuse"]
    assert reuses and all(e[2] for e in reuses)
    # After each write RD2H had already published the layer (closing its gate first).
    hook = "store.on_kv_cache_written" if cache_written_hook else "store.save_kv_layer"
    saves = [e for e in clean_log if e[0] == hook]
    assert len(saves) == len(MAIN) and all(e[2] for e in saves)


def test_control_vllm_multiconnector_runs_the_store_first(
    make_vllm_config: VllmConfigFactory, server: MetaServer, clean_log: list[tuple[Any, ...]]
) -> None:
    _, _, bad = run_pd(make_vllm_config, server, MultiConnector, cache_written_hook=False)
    assert bad == []  # the KV still arrives ...
    saves = [e for e in clean_log if e[0] == "store.save_kv_layer"]
    # ... but the store ran before RD2H published, and nobody handed it a waiter.
    assert saves and not any(e[2] for e in saves)
    assert any(e[0] == "store.no_waiter" for e in clean_log)
