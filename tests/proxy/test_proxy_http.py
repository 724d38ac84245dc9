"""The proxy over real HTTP on 127.0.0.1, between fake vLLM Prefill and Decode servers."""

from __future__ import annotations

import asyncio
import json
import time

from proxy_harness import HOST, Cluster, async_test, closed_port, cluster

from rd2h_protocol.rendezvous import (
    BATCH_PARAMS_KEY,
    METASERVER_IDEMPOTENT_KEY,
    Rendezvous,
    encode_rendezvous,
)
from rd2h_proxy.config import Backend

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def _rendezvous(request_id: str, port: int = 30000) -> Rendezvous:
    return Rendezvous(
        request_id=request_id,
        remote_engine_id="e",
        remote_host=HOST,
        remote_port=port,
        remote_tp_size=1,
        remote_cached_tokens=0,
    )


async def _stats(c: Cluster) -> dict[str, int]:
    async with c.http.get(c.proxy_url + "/healthcheck") as resp:
        assert resp.status == 200
        stats: dict[str, int] = (await resp.json())["stats"]
        return stats


@async_test
async def test_single_prompt_goes_to_decode_then_prefill_once() -> None:
    async with cluster() as c:
        c.cached_tokens = 48
        status, body = await c.complete(
            COMPLETIONS, {"model": "m", "prompt": "hello", "max_tokens": 7}, "abc"
        )
        assert status == 200, body
        assert body["choices"] == [{"index": 0, "text": "decoded:cmpl-abc-0"}]

        (dcall,) = c.decode_calls
        assert dcall.request_id == "abc"
        assert dcall.body["max_tokens"] == 7
        assert dcall.body["kv_transfer_params"] == {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "metaserver": c.proxy_url + "/v1/metaserver",
            METASERVER_IDEMPOTENT_KEY: True,
        }
        (pcall,) = c.prefill_calls
        assert pcall.request_id == "abc"  # Prefill derives the same child ids
        assert pcall.body["max_tokens"] == 1 and pcall.body["stream"] is False
        params = pcall.body["kv_transfer_params"]
        assert BATCH_PARAMS_KEY not in params
        assert params["request_id"] == "cmpl-abc-0"
        assert params["do_remote_decode"] is True and params["do_remote_prefill"] is False
        assert params["remote_port"] == 30000 and params["remote_tp_size"] == 2
        assert params["remote_cached_tokens"] == 48
        assert c.delivered["cmpl-abc-0"].remote_engine_id == "decode-engine-0"

        stats = await _stats(c)
        assert stats["dispatches_ok"] == 1 and stats["rendezvous_recorded"] == 1
        assert stats["requests_ok"] == 1
        await c.wait_idle()


@async_test
async def test_prompt_list_dispatches_once_with_batch_params() -> None:
    async with cluster() as c:
        status, body = await c.complete(
            COMPLETIONS, {"prompt": ["a", "b", "c"], "max_tokens": 4, "min_tokens": 2}, "lst"
        )
        assert status == 200, body
        assert [ch["text"] for ch in body["choices"]] == [
            "decoded:cmpl-lst-0",
            "decoded:cmpl-lst-1",
            "decoded:cmpl-lst-2",
        ]
        (pcall,) = c.prefill_calls
        assert pcall.body["prompt"] == ["a", "b", "c"]  # the ORIGINAL list, once
        assert "min_tokens" not in pcall.body  # would exceed max_tokens=1
        params = pcall.body["kv_transfer_params"]
        assert params["request_id"] == "cmpl-lst-0"  # child 0's params at the top
        batch = params[BATCH_PARAMS_KEY]
        assert sorted(batch) == ["cmpl-lst-0", "cmpl-lst-1", "cmpl-lst-2"]
        assert all(batch[k]["request_id"] == k for k in batch)
        assert sorted(c.delivered) == sorted(batch)
        await c.wait_idle()


@async_test
async def test_flat_token_list_is_one_prompt_and_token_lists_are_several() -> None:
    async with cluster() as c:
        status, body = await c.complete(COMPLETIONS, {"prompt": [1, 2, 3]}, "flat")
        assert status == 200, body
        assert len(body["choices"]) == 1
        assert BATCH_PARAMS_KEY not in c.prefill_calls[0].body["kv_transfer_params"]
        assert c.prefill_calls[0].body["kv_transfer_params"]["request_id"] == "cmpl-flat-0"

        status, body = await c.complete(COMPLETIONS, {"prompt": [[1, 2], [3]]}, "nested")
        assert status == 200, body
        assert len(body["choices"]) == 2
        batch = c.prefill_calls[1].body["kv_transfer_params"][BATCH_PARAMS_KEY]
        assert sorted(batch) == ["cmpl-nested-0", "cmpl-nested-1"]
        await c.wait_idle()


@async_test
async def test_chat_uses_chatcmpl_child_id() -> None:
    async with cluster() as c:
        req = {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 9,
            "stream_options": {"include_usage": True},
        }
        status, body = await c.complete(CHAT, req, "chat1")
        assert status == 200, body
        assert body["choices"][0]["text"] == "decoded:chatcmpl-chat1"
        (pcall,) = c.prefill_calls
        assert pcall.path == CHAT
        assert pcall.body["max_completion_tokens"] == 1 and pcall.body["max_tokens"] == 1
        assert "stream_options" not in pcall.body
        assert pcall.body["kv_transfer_params"]["request_id"] == "chatcmpl-chat1"
        assert c.decode_calls[0].body["max_completion_tokens"] == 9  # Decode gets the original
        await c.wait_idle()


@async_test
async def test_request_without_id_gets_a_fresh_one() -> None:
    async with cluster() as c:
        status, body = await c.complete(COMPLETIONS, {"prompt": "x"})
        assert status == 200, body
        rid = c.decode_calls[0].request_id
        assert len(rid) == 32 and c.prefill_calls[0].request_id == rid
        await c.wait_idle()


@async_test
async def test_streaming_passes_through_chunk_by_chunk() -> None:
    async with cluster() as c:
        c.stream_gate = asyncio.Event()
        async with await c.post(COMPLETIONS, {"prompt": ["a", "b"], "stream": True}, "s1") as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            # The first event arrives while Decode is still holding the rest back.
            first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 3)
            assert json.loads(first[len(b"data: ") :])["choices"][0]["text"] == (
                "decoded:cmpl-s1-0"
            )
            c.stream_gate.set()
            rest = await resp.content.read()
        events = [e for e in rest.split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]"
        assert json.loads(events[0][len(b"data: ") :])["choices"][0]["index"] == 1
        assert len(c.prefill_calls) == 1 and c.prefill_calls[0].body["stream"] is False
        await c.wait_idle()


@async_test
async def test_twenty_concurrent_parents() -> None:
    async with cluster(n_prefill=2, n_decode=2, max_concurrent_dispatches=4) as c:
        ids = [f"par{i}" for i in range(20)]
        results = await asyncio.gather(
            *(
                c.complete(COMPLETIONS, {"prompt": ["x", "y"] if i % 2 else "x"}, rid)
                for i, rid in enumerate(ids)
            )
        )
        for rid, (status, body) in zip(ids, results, strict=True):
            assert status == 200, body
            assert body["choices"][0]["text"] == f"decoded:cmpl-{rid}-0"
        assert sorted(call.request_id for call in c.prefill_calls) == sorted(ids)
        assert {call.node for call in c.prefill_calls} == {0, 1}
        assert {call.node for call in c.decode_calls} == {0, 1}
        stats = await _stats(c)
        assert stats["dispatches_ok"] == 20 and stats["rendezvous_recorded"] == 30
        await c.wait_idle()


@async_test
async def test_prefill_failure_fails_fast_and_proxy_survives() -> None:
    async with cluster() as c:
        c.prefill_status = 500
        started = time.monotonic()
        status, body = await c.complete(COMPLETIONS, {"prompt": "x"}, "boom")
        assert status == 502, body
        assert "500" in body["error"]["message"]
        assert time.monotonic() - started < c.decode_kv_timeout_s  # not Decode's timeout
        await c.wait_idle()
        await c.until(lambda: c.decode_aborted == ["boom"])  # the Decode exchange was dropped
        stats = await _stats(c)
        assert stats["dispatches_failed"] == 1 and stats["requests_failed"] == 1

        c.prefill_status = 200  # the next request is served normally
        status, body = await c.complete(COMPLETIONS, {"prompt": "x"}, "fine")
        assert status == 200, body
        await c.wait_idle()


@async_test
async def test_prefill_failure_after_stream_headers_ends_with_error_event() -> None:
    async with cluster() as c:
        c.prefill_status = 503
        c.stream_headers_early = True  # like a server that sends headers before any token
        async with await c.post(COMPLETIONS, {"prompt": "x", "stream": True}, "sx") as resp:
            assert resp.status == 200  # already sent by Decode; the status cannot change
            text = await resp.text()
        events = [e for e in text.split("\n\n") if e.strip()]
        assert len(events) == 1 and events[0].startswith("data: ")
        error = json.loads(events[0][len("data: ") :])["error"]
        assert error["code"] == 502 and "503" in error["message"]
        await c.wait_idle()
        await c.until(lambda: c.decode_aborted == ["sx"])


@async_test
async def test_slow_prefill_times_out() -> None:
    async with cluster(dispatch_timeout_s=0.3) as c:
        c.prefill_delay_s = 5.0
        started = time.monotonic()
        status, body = await c.complete(COMPLETIONS, {"prompt": "x"}, "slow")
        assert status == 504, body
        assert "0.3 s" in body["error"]["message"]
        assert time.monotonic() - started < 2.0
        stats = await _stats(c)
        assert stats["dispatches_timed_out"] == 1
        await c.wait_idle()  # the Prefill call was cancelled, nothing holds the parent


@async_test
async def test_duplicate_metaserver_posts_are_idempotent() -> None:
    async with cluster() as c:
        c.decode_posts_per_child = 3
        status, body = await c.complete(COMPLETIONS, {"prompt": ["a", "b"]}, "dup")
        assert status == 200, body
        assert len(c.prefill_calls) == 1
        answers = [a["status"] for s, a in c.metaserver_answers if s == 200]
        assert len(answers) == 6
        assert answers.count("ready") == 1 and answers.count("duplicate") == 4
        stats = await _stats(c)
        assert stats["rendezvous_duplicate"] == 4 and stats["dispatches_started"] == 1
        await c.wait_idle()


@async_test
async def test_retried_request_never_runs_the_same_children_twice() -> None:
    async with cluster() as c:
        c.decode_hold = asyncio.Event()
        first = asyncio.ensure_future(c.complete(COMPLETIONS, {"prompt": "x"}, "again"))
        while not c.prefill_calls:  # the first attempt's children are dispatched
            await asyncio.sleep(0.01)
        status, body = await c.complete(COMPLETIONS, {"prompt": "x"}, "again")
        assert status == 409, body
        assert "in flight" in body["error"]["message"]
        assert len(c.decode_calls) == 1 and len(c.prefill_calls) == 1
        c.decode_hold.set()
        status, _ = await first
        assert status == 200
        await c.wait_idle()
        # Once the first one is over the id is free again: a new request, a new dispatch.
        status, _ = await c.complete(COMPLETIONS, {"prompt": "x"}, "again")
        assert status == 200
        assert len(c.prefill_calls) == 2
        await c.wait_idle()


@async_test
async def test_metaserver_unknown_id_is_404() -> None:
    async with cluster() as c:
        async with c.http.post(
            c.proxy_url + "/v1/metaserver", data=encode_rendezvous(_rendezvous("cmpl-nope-0"))
        ) as resp:
            assert resp.status == 404
            assert "cmpl-nope-0" in (await resp.json())["error"]["message"]
        assert (await _stats(c))["rendezvous_unknown"] == 1
        assert c.prefill_calls == []


@async_test
async def test_metaserver_malformed_is_400() -> None:
    bad_bodies = [
        b"not json",
        b"[1, 2]",
        b'{"request_id": "cmpl-x-0"}',
        json.dumps({**_rendezvous("cmpl-x-0").to_params(), "remote_port": "80"}).encode(),
        json.dumps({**_rendezvous("cmpl-x-0").to_params(), "do_remote_decode": False}).encode(),
    ]
    async with cluster() as c:
        for data in bad_bodies:
            async with c.http.post(c.proxy_url + "/v1/metaserver", data=data) as resp:
                assert resp.status == 400, data
                assert (await resp.json())["error"]["message"]
        assert (await _stats(c))["rendezvous_malformed"] == len(bad_bodies)


@async_test
async def test_decode_error_propagates_with_its_status() -> None:
    async with cluster() as c:
        c.decode_error = (400, "prompt too long")
        status, body = await c.complete(COMPLETIONS, {"prompt": "x"}, "derr")
        assert status == 400 and body == {"error": "prompt too long"}
        assert c.prefill_calls == []
        assert (await _stats(c))["decode_errors"] == 1
        await c.wait_idle()


@async_test
async def test_rendezvous_timeout_drops_decode_and_cleans_up() -> None:
    async with cluster(rendezvous_timeout_s=0.3) as c:
        c.decode_posts = False
        status, body = await c.complete(COMPLETIONS, {"prompt": ["a", "b"]}, "late")
        assert status == 504, body
        assert "2 of 2" in body["error"]["message"]
        await c.wait_idle()
        await c.until(lambda: c.decode_aborted == ["late"])
        assert (await _stats(c))["rendezvous_timeouts"] == 1


@async_test
async def test_client_disconnect_leaves_nothing_behind() -> None:
    async with cluster() as c:
        c.decode_hold = asyncio.Event()
        task = asyncio.ensure_future(c.complete(COMPLETIONS, {"prompt": "x"}, "gone"))
        while not c.prefill_calls:
            await asyncio.sleep(0.01)
        task.cancel()  # the client gives up and closes its connection
        await asyncio.gather(task, return_exceptions=True)
        await c.wait_idle()
        await c.until(lambda: c.decode_aborted == ["gone"])


@async_test
async def test_least_loaded_decode_is_chosen() -> None:
    async with cluster(n_decode=2) as c:
        c.decode_hold = hold = asyncio.Event()
        first = asyncio.ensure_future(c.complete(COMPLETIONS, {"prompt": "x"}, "busy"))
        await c.until(lambda: c.decode_holding == 1)
        busy = c.decode_calls[0].node
        c.decode_hold = None  # later requests answer at once
        for i in range(3):
            status, body = await c.complete(COMPLETIONS, {"prompt": "x"}, f"q{i}")
            assert status == 200
            assert body["node"] != busy  # the idle node, every time
        assert c.server.decode.nodes[busy].in_flight == 1
        hold.set()
        assert (await first)[0] == 200
        await c.wait_idle()


@async_test
async def test_unreachable_decode_fails_over_to_the_next() -> None:
    dead = Backend(HOST, closed_port())
    async with cluster(n_decode=1, extra_decoders=(dead,)) as c:
        for i in range(2):
            status, body = await c.complete(COMPLETIONS, {"prompt": "x"}, f"fo{i}")
            assert status == 200, body
        assert c.server.decode.nodes[0].failures >= 1  # the dead one was tried and skipped
        await c.wait_idle()


@async_test
async def test_bad_client_requests_are_400() -> None:
    async with cluster() as c:
        cases = [
            (COMPLETIONS, {"max_tokens": 1}, None),
            (COMPLETIONS, {"prompt": []}, None),
            (COMPLETIONS, {"prompt": [1, "a"]}, None),
            (COMPLETIONS, b"{not json", None),
            (COMPLETIONS, [1, 2], None),
            (CHAT, {"messages": []}, None),
            (COMPLETIONS, {"prompt": "x"}, "has space"),
        ]
        for path, body, rid in cases:
            status, answer = await c.complete(path, body, rid)
            assert status == 400, (body, answer)
        assert c.decode_calls == []
        await c.wait_idle()


@async_test
async def test_overload_is_503() -> None:
    async with cluster(max_inflight_requests=1) as c:
        c.decode_hold = asyncio.Event()
        first = asyncio.ensure_future(c.complete(COMPLETIONS, {"prompt": "x"}, "o1"))
        while not c.decode_calls:
            await asyncio.sleep(0.01)
        status, _ = await c.complete(COMPLETIONS, {"prompt": "x"}, "o2")
        assert status == 503
        c.decode_hold.set()
        assert (await first)[0] == 200
        await c.wait_idle()


@async_test
async def test_reset_prefix_cache_fans_out_and_reports_each_node() -> None:
    async with cluster(n_prefill=2, n_decode=2) as c:
        async with c.http.post(c.proxy_url + "/reset_prefix_cache") as resp:
            assert resp.status == 200
            report = await resp.json()
        nodes = [n.url for n in (*c.server.prefill.nodes, *c.server.decode.nodes)]
        assert report["ok"] is True
        assert [r["url"] for r in report["results"]] == nodes
        assert sorted(c.resets) == sorted(nodes)

        c.reset_status[nodes[3]] = 500
        async with c.http.post(c.proxy_url + "/reset_prefix_cache") as resp:
            assert resp.status == 502
            report = await resp.json()
        assert [r["ok"] for r in report["results"]] == [True, True, True, False]
        assert report["results"][3]["status"] == 500


@async_test
async def test_reset_prefix_cache_reports_unreachable_node() -> None:
    dead = Backend(HOST, closed_port())
    async with cluster(extra_decoders=(dead,)) as c:
        async with c.http.post(c.proxy_url + "/reset_prefix_cache") as resp:
            assert resp.status == 502
            results = (await resp.json())["results"]
        bad = [r for r in results if not r["ok"]]
        assert len(bad) == 1 and bad[0]["status"] is None and bad[0]["error"]


@async_test
async def test_healthcheck_and_stats() -> None:
    async with cluster(n_prefill=2, n_decode=3) as c:
        async with c.http.get(c.proxy_url + "/healthcheck") as resp:
            assert resp.status == 200
            health = await resp.json()
        assert health["status"] == "ok"
        assert health["prefill_instances"] == 2 and health["decode_instances"] == 3
        await c.complete(COMPLETIONS, {"prompt": "x"}, "h1")
        async with c.http.get(c.proxy_url + "/stats") as resp:
            stats = await resp.json()
        assert stats["parents"] == 0 and stats["children"] == 0
        assert sum(n["total"] for n in stats["nodes"]) == 2  # one Decode, one Prefill
        assert stats["stats"]["requests"] == 1


@async_test
async def test_late_metaserver_post_after_parent_ended_is_404() -> None:
    async with cluster() as c:
        c.prefill_status = 500
        status, _ = await c.complete(COMPLETIONS, {"prompt": "x"}, "fz")
        assert status == 502
        await c.wait_idle()
        # The parent is gone now: a late post for its child is unknown.
        async with c.http.post(
            c.proxy_url + "/v1/metaserver", data=encode_rendezvous(_rendezvous("cmpl-fz-0"))
        ) as resp:
            assert resp.status == 404


@async_test
async def test_failure_after_decode_started_streaming_keeps_the_answer() -> None:
    async with cluster() as c:
        c.prefill_status = 500
        c.prefill_gate = asyncio.Event()  # Prefill fails only after its KV went out
        c.stream_gate = asyncio.Event()
        async with await c.post(COMPLETIONS, {"prompt": ["a", "b"], "stream": True}, "k") as resp:
            first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 3)
            assert b"decoded:cmpl-k-0" in first
            c.prefill_gate.set()
            await c.until(lambda: c.server.stats.dispatches_failed == 1)
            c.stream_gate.set()
            rest = await resp.content.read()
        assert b"decoded:cmpl-k-1" in rest and rest.endswith(b"data: [DONE]\n\n")
        assert b"error" not in rest
        assert c.server.stats.failures_after_first_byte == 1
        assert c.server.stats.requests_ok == 1  # the client got a complete answer
        await c.wait_idle()


@async_test
async def test_decode_timeout_mid_stream_ends_with_error_event() -> None:
    async with cluster(decode_timeout_s=0.5) as c:
        c.stream_gate = asyncio.Event()  # never set: Decode stalls after one event
        async with await c.post(COMPLETIONS, {"prompt": ["a", "b"], "stream": True}, "t") as resp:
            assert resp.status == 200
            text = await resp.text()
        events = [e for e in text.split("\n\n") if e.strip()]
        assert "decoded:cmpl-t-0" in events[0]
        error = json.loads(events[-1][len("data: ") :])["error"]
        assert error["code"] == 504
        await c.wait_idle()
        assert c.server.stats.decode_errors == 1 and c.server.stats.requests_failed == 1


@async_test
async def test_decode_timeout_without_stream_is_504() -> None:
    async with cluster(decode_timeout_s=0.3) as c:
        c.decode_hold = asyncio.Event()
        status, body = await c.complete(COMPLETIONS, {"prompt": "x"}, "t2")
        assert status == 504, body
        await c.wait_idle()


@async_test
async def test_decode_dropping_the_connection_is_502() -> None:
    async with cluster() as c:
        c.decode_crash = True
        status, body = await c.complete(COMPLETIONS, {"prompt": "x"}, "crash")
        assert status == 502, body
        assert "failed" in body["error"]["message"]
        await c.wait_idle()


@async_test
async def test_unreachable_prefill_fails_over_and_all_down_is_502() -> None:
    dead = Backend(HOST, closed_port())
    async with cluster(extra_prefillers=(dead,)) as c:
        for i in range(2):
            status, body = await c.complete(COMPLETIONS, {"prompt": "x"}, f"pf{i}")
            assert status == 200, body
        assert c.server.prefill.nodes[0].failures >= 1
        await c.wait_idle()
    async with cluster(n_prefill=0, extra_prefillers=(dead,)) as c:
        status, body = await c.complete(COMPLETIONS, {"prompt": "x"}, "pfdown")
        assert status == 502 and "unreachable" in body["error"]["message"], body
        await c.wait_idle()


@async_test
async def test_all_decoders_unreachable_is_502() -> None:
    dead = Backend(HOST, closed_port())
    async with cluster(n_decode=0, extra_decoders=(dead,)) as c:
        status, body = await c.complete(COMPLETIONS, {"prompt": "x"}, "ddown")
        assert status == 502 and "unreachable" in body["error"]["message"], body
        await c.wait_idle()


@async_test
async def test_shutdown_with_a_dispatch_in_flight_is_prompt() -> None:
    async with cluster() as c:
        c.prefill_delay_s = 30.0
        pending = asyncio.ensure_future(c.complete(COMPLETIONS, {"prompt": "x"}, "sd"))
        await c.until(lambda: bool(c.prefill_calls))
        started = time.monotonic()
    # Leaving the block closed the client, the proxy (cancelling its dispatch) and the fakes.
    assert time.monotonic() - started < 2.0
    assert isinstance((await asyncio.gather(pending, return_exceptions=True))[0], BaseException)
