"""The proxy's pure parts: child ids and bodies, the registry, the balancer, the config."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rd2h_protocol.errors import ConfigError
from rd2h_protocol.rendezvous import BATCH_PARAMS_KEY, METASERVER_IDEMPOTENT_KEY
from rd2h_proxy import build_parser, config_from_args, main
from rd2h_proxy.balancer import LeastLoaded
from rd2h_proxy.config import Backend, ProxyConfig, is_wildcard, pair_backends
from rd2h_proxy.payloads import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    MAX_PROMPTS,
    BadRequest,
    check_request_id,
    child_ids,
    count_prompts,
    decode_body,
    prefill_body,
)
from rd2h_proxy.phases import (
    P_TIMER_RENDEZVOUS_EXPIRED,
    PHASE_DISPATCHED,
    PHASE_DISPATCHING,
)
from rd2h_proxy.registry import (
    Outcome,
    ParentInFlight,
    Registry,
    RendezvousRefused,
    UnknownChild,
)

# -- child ids and bodies -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "count"),
    [
        ("one", 1),
        ("", 1),
        ([7, 8, 9], 1),  # a flat token list is ONE prompt
        (["a"], 1),
        (["a", "b", "c"], 3),
        ([[1], [2, 3]], 2),
    ],
)
def test_count_prompts(prompt: Any, count: int) -> None:
    assert count_prompts(prompt) == count


@pytest.mark.parametrize(
    "prompt", [[], None, 5, {"a": 1}, [1, "a"], [[1], "a"], [[]], [True, False], ["a", 1]]
)
def test_count_prompts_refuses(prompt: Any) -> None:
    with pytest.raises(BadRequest):
        count_prompts(prompt)


def test_count_prompts_is_bounded() -> None:
    with pytest.raises(BadRequest, match="prompts"):
        count_prompts(["x"] * (MAX_PROMPTS + 1))


def test_child_ids_follow_vllm_naming() -> None:
    assert child_ids(COMPLETIONS, "p", {"prompt": "x"}) == ("cmpl-p-0",)
    assert child_ids(COMPLETIONS, "p", {"prompt": ["x", "y"]}) == ("cmpl-p-0", "cmpl-p-1")
    assert child_ids(CHAT_COMPLETIONS, "p", {"messages": [{"role": "user"}]}) == ("chatcmpl-p",)
    with pytest.raises(BadRequest, match="prompt"):
        child_ids(COMPLETIONS, "p", {})
    with pytest.raises(BadRequest, match="messages"):
        child_ids(CHAT_COMPLETIONS, "p", {"messages": "hi"})
    with pytest.raises(BadRequest, match="unsupported"):
        child_ids("/v1/embeddings", "p", {"input": "x"})


@pytest.mark.parametrize("value", ["", "a b", "é", "x" * 257, "tab\there"])
def test_check_request_id_refuses(value: str) -> None:
    with pytest.raises(BadRequest):
        check_request_id(value)


def test_check_request_id_accepts_uuid_like_ids() -> None:
    assert check_request_id("3f0c-AB_9.z:1") == "3f0c-AB_9.z:1"


def test_decode_body_keeps_the_request_and_asks_for_remote_prefill() -> None:
    original = {"prompt": "x", "stream": True, "kv_transfer_params": {"junk": 1}}
    out = decode_body(original, "http://h:1/v1/metaserver")
    assert out["stream"] is True and out["prompt"] == "x"
    assert out["kv_transfer_params"]["metaserver"] == "http://h:1/v1/metaserver"
    assert out["kv_transfer_params"][METASERVER_IDEMPOTENT_KEY] is True
    assert "junk" not in out["kv_transfer_params"]
    assert original["kv_transfer_params"] == {"junk": 1}  # the original is untouched


def test_prefill_body_single_and_batch() -> None:
    params = {c: {"request_id": c, "remote_port": 1} for c in ("cmpl-p-0", "cmpl-p-1")}
    original = {"prompt": ["a", "b"], "stream": True, "max_tokens": 50, "stream_options": {}}
    one = prefill_body(original, ("cmpl-p-0",), params)
    assert one["kv_transfer_params"] == params["cmpl-p-0"]
    assert one["max_tokens"] == 1 and one["stream"] is False and "stream_options" not in one
    assert "max_completion_tokens" not in one
    two = prefill_body(original, ("cmpl-p-0", "cmpl-p-1"), params)
    assert two["kv_transfer_params"]["request_id"] == "cmpl-p-0"
    assert two["kv_transfer_params"][BATCH_PARAMS_KEY] == params
    assert original["max_tokens"] == 50 and "kv_transfer_params" not in original
    assert BATCH_PARAMS_KEY not in params["cmpl-p-0"]  # the recorded params are not mutated


# -- registry -----------------------------------------------------------------------------


def _open(reg: Registry, pid: str = "p", n: int = 2) -> Any:
    children = tuple(f"cmpl-{pid}-{i}" for i in range(n))
    return reg.open(pid, COMPLETIONS, {"prompt": ["x"] * n}, {}, children, 0.0)


def test_registry_ready_exactly_once_and_duplicates() -> None:
    reg = Registry()
    parent = _open(reg)
    assert reg.record("cmpl-p-0", {"a": 1}) == (parent, Outcome.RECORDED)
    assert reg.record("cmpl-p-0", {"a": 1}) == (parent, Outcome.DUPLICATE)
    assert reg.record("cmpl-p-1", {"b": 2}) == (parent, Outcome.READY)
    assert parent.state == PHASE_DISPATCHING and parent.dispatch_running
    for child, params in (("cmpl-p-0", {"a": 1}), ("cmpl-p-1", {"b": 2})):
        assert reg.record(child, params) == (parent, Outcome.DUPLICATE)
    with pytest.raises(RendezvousRefused) as info:
        reg.record("cmpl-p-1", {"b": 3})
    assert info.value.status == 409
    with pytest.raises(UnknownChild):
        reg.record("cmpl-q-0", {})


def test_registry_refuses_ids_in_flight_until_client_and_dispatch_are_over() -> None:
    reg = Registry()
    parent = _open(reg, n=1)
    with pytest.raises(ParentInFlight, match="still in flight"):
        _open(reg, n=1)
    reg.record("cmpl-p-0", {})
    reg.close_client(parent)  # client gone, dispatch still running
    assert len(reg) == 1
    with pytest.raises(ParentInFlight):
        _open(reg, n=1)
    reg.finish_dispatch(parent)
    assert len(reg) == 0 and reg.child_count == 0
    _open(reg, n=1)  # free again


def test_registry_refuses_a_child_id_used_by_another_parent() -> None:
    reg = Registry()
    reg.open("a", COMPLETIONS, {}, {}, ("shared",), 0.0)
    with pytest.raises(ParentInFlight, match="'shared'"):
        reg.open("b", COMPLETIONS, {}, {}, ("shared",), 0.0)
    with pytest.raises(ValueError, match="duplicate"):
        reg.open("c", COMPLETIONS, {}, {}, ("x", "x"), 0.0)


def test_registry_post_for_failed_or_closed_parent_is_gone() -> None:
    reg = Registry()
    parent = _open(reg)
    assert reg.fail(parent, P_TIMER_RENDEZVOUS_EXPIRED, 504, "rendezvous timed out")
    # The first failure wins.
    assert not reg.fail(parent, P_TIMER_RENDEZVOUS_EXPIRED, 502, "second failure")
    assert parent.failure == (504, "rendezvous timed out") and parent.failed.is_set()
    with pytest.raises(RendezvousRefused, match="timed out") as info:
        reg.record("cmpl-p-0", {})
    assert info.value.status == 410
    reg.close_client(parent)
    assert len(reg) == 0
    with pytest.raises(UnknownChild):
        reg.record("cmpl-p-0", {})


def test_registry_dispatch_success_and_timer_cancel() -> None:
    async def scenario() -> None:
        reg = Registry()
        parent = _open(reg, n=1)
        fired: list[bool] = []
        parent.timer = asyncio.get_running_loop().call_later(0.05, fired.append, True)
        assert reg.record("cmpl-p-0", {})[1] is Outcome.READY
        assert parent.timer is None  # completing the set stops the rendezvous timer
        reg.dispatch_succeeded(parent)
        assert parent.state == PHASE_DISPATCHED
        reg.finish_dispatch(parent)
        assert len(reg) == 1  # the client exchange still runs
        reg.close_client(parent)
        assert len(reg) == 0
        await asyncio.sleep(0.1)
        assert fired == []

    asyncio.run(scenario())


# -- balancer -----------------------------------------------------------------------------


def test_least_loaded_picks_fewest_in_flight_and_rotates_ties() -> None:
    lb = LeastLoaded("decode", [Backend("h", p) for p in (1, 2, 3)])
    a, b, c = (lb.acquire() for _ in range(3))
    assert [n.index for n in (a, b, c) if n] == [0, 1, 2]  # ties go round-robin
    assert b is not None
    lb.release(b)
    again = lb.acquire()
    assert again is b  # the only node with room
    assert lb.in_flight == 3
    for node in lb.nodes:
        lb.release(node)
    picks = [lb.acquire() for _ in range(6)]
    # The rotation continues after the last pick (node 1), so nobody is favoured.
    assert [n.index for n in picks if n] == [2, 0, 1, 2, 0, 1]
    assert [n.total for n in lb.nodes] == [3, 4, 3]


def test_least_loaded_exclude() -> None:
    lb = LeastLoaded("prefill", [Backend("h", 1), Backend("h", 2)])
    node = lb.acquire(exclude={0})
    assert node is not None and node.index == 1
    assert lb.acquire(exclude={0, 1}) is None
    assert node.as_dict() == {
        "role": "prefill",
        "url": "http://h:2",
        "in_flight": 1,
        "total": 1,
        "failures": 0,
    }


# -- config and command line --------------------------------------------------------------

GUIDE_ARGS = [
    "--host",
    "127.0.0.1",
    "--port",
    "9000",
    "--prefiller-hosts",
    "127.0.0.1",
    "--prefiller-ports",
    "8100",
    "--decoder-hosts",
    "127.0.0.1",
    "--decoder-ports",
    "8200",
]


def test_deployment_guide_command_line() -> None:
    config = config_from_args(build_parser().parse_args(GUIDE_ARGS))
    assert config.prefillers == (Backend("127.0.0.1", 8100),)
    assert config.decoders == (Backend("127.0.0.1", 8200),)
    assert config.metaserver == "http://127.0.0.1:9000/v1/metaserver"


def test_client_limit_flags() -> None:
    default = config_from_args(build_parser().parse_args(GUIDE_ARGS))
    assert (default.header_timeout_s, default.body_timeout_s) == (10.0, 60.0)
    assert default.max_connections == 8192 > default.max_inflight_requests
    flags = ["--header-timeout", "2.5", "--body-timeout", "7", "--max-connections", "100"]
    config = config_from_args(build_parser().parse_args([*GUIDE_ARGS, *flags]))
    assert (config.header_timeout_s, config.body_timeout_s) == (2.5, 7.0)
    assert config.max_connections == 100


def test_lists_pair_up_and_one_host_serves_many_ports() -> None:
    assert pair_backends(["a", "b"], [1, 2], "decode") == (Backend("a", 1), Backend("b", 2))
    assert pair_backends(["a"], [1, 2], "decode") == (Backend("a", 1), Backend("a", 2))
    with pytest.raises(ConfigError, match="--prefiller-hosts has 2 entries"):
        pair_backends(["a", "b"], [1, 2, 3], "prefill")


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", "0:0:0:0:0:0:0:0", "", "*"])
def test_wildcard_host_is_refused(host: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert is_wildcard(host)
    args = ["--host", host, *GUIDE_ARGS[2:]]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "wildcard" in err and "reach" in err and "--metaserver-url" in err


def test_wildcard_bind_with_explicit_metaserver_url() -> None:
    config = ProxyConfig(
        host="0.0.0.0",
        port=9000,
        prefillers=(Backend("p", 1),),
        decoders=(Backend("d", 2),),
        metaserver_url="http://10.1.2.3:9000/v1/metaserver",
    )
    assert config.metaserver == "http://10.1.2.3:9000/v1/metaserver"


def test_config_validation_messages() -> None:
    base: dict[str, Any] = {
        "host": "10.0.0.1",
        "port": 9000,
        "prefillers": (Backend("p", 1),),
        "decoders": (Backend("d", 2),),
    }
    assert ProxyConfig(**{**base, "host": "fe80::1"}).metaserver == (
        "http://[fe80::1]:9000/v1/metaserver"
    )
    cases: list[tuple[dict[str, Any], str]] = [
        ({"prefillers": ()}, "Prefill"),
        ({"decoders": ()}, "Decode"),
        ({"port": 0}, "--port"),
        ({"metaserver_url": "10.0.0.1:9000"}, "http"),
        ({"max_concurrent_dispatches": 0}, "max_concurrent_dispatches"),
        ({"dispatch_timeout_s": 0.0}, "dispatch_timeout_s"),
        ({"header_timeout_s": 0.0}, "header_timeout_s"),
        ({"body_timeout_s": -1.0}, "body_timeout_s"),
        ({"max_connections": 0}, "max_connections"),
    ]
    for change, needle in cases:
        with pytest.raises(ConfigError, match=needle):
            ProxyConfig(**{**base, **change})
    with pytest.raises(ConfigError, match="port"):
        Backend("h", 70000)
    with pytest.raises(ConfigError, match="empty"):
        Backend("", 1)


def test_loopback_proxy_with_remote_decoders_is_flagged() -> None:
    config = ProxyConfig(
        host="localhost",
        port=9000,
        prefillers=(Backend("p", 1),),
        decoders=(Backend("10.0.0.9", 2), Backend("127.0.0.1", 3)),
    )
    assert config.loopback_mismatch() == ["10.0.0.9"]


def test_main_usage_errors_return_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--host", "127.0.0.1"]) == 2  # the port lists are required
    assert "--prefiller-ports" in capsys.readouterr().err
    assert main([*GUIDE_ARGS, "--decoder-hosts", "a", "b"]) == 2
    assert "--decoder-hosts has 2 entries" in capsys.readouterr().err
    assert main(["--help"]) == 0
