"""The typed rendezvous payload (rd2h_protocol.rendezvous)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rd2h_protocol.errors import MalformedFrame, RemoteProtocolError
from rd2h_protocol.rendezvous import (
    BATCH_PARAMS_KEY,
    MAX_RENDEZVOUS_BYTES,
    MalformedRendezvous,
    Rendezvous,
    decode_rendezvous,
    encode_rendezvous,
    params_for_child,
    parse_rendezvous_json,
    remote_prefill_params,
    rendezvous_from_params,
)

# What a v1 Decode posts: every key present, booleans as JSON booleans.
V1_POST: dict[str, Any] = {
    "request_id": "cmpl-abc-0",
    "do_remote_prefill": False,
    "do_remote_decode": True,
    "remote_engine_id": "3f0c-engine",
    "remote_host": "10.0.0.7",
    "remote_port": 26000,
    "remote_tp_size": 4,
    "remote_pcp_size": 1,
    "remote_dcp_size": 1,
    "remote_cached_tokens": 128,
}


def test_v1_post_decodes_and_reencodes_to_the_same_object() -> None:
    r = decode_rendezvous(json.dumps(V1_POST).encode())
    assert r.request_id == "cmpl-abc-0" and r.remote_port == 26000
    assert r.remote_tp_size == 4 and r.remote_cached_tokens == 128
    assert json.loads(encode_rendezvous(r)) == V1_POST
    assert r.to_params() == V1_POST
    assert decode_rendezvous(json.dumps(V1_POST)) == r  # str input too


def test_optional_fields_take_their_v1_meaning() -> None:
    post = {
        k: v
        for k, v in V1_POST.items()
        if k not in ("do_remote_prefill", "do_remote_decode", "remote_pcp_size", "remote_dcp_size")
    }
    r = rendezvous_from_params(post)
    assert (r.do_remote_prefill, r.do_remote_decode) == (False, True)
    assert (r.remote_pcp_size, r.remote_dcp_size) == (1, 1)
    # A relay re-emits every key, so a v1 Prefill finds all of them.
    assert r.to_params() == V1_POST


def test_unknown_keys_are_ignored_but_returned_for_relaying() -> None:
    data = json.dumps({**V1_POST, "future_key": [1, 2]}).encode()
    r, raw = parse_rendezvous_json(data)
    assert r == rendezvous_from_params(V1_POST)
    assert raw["future_key"] == [1, 2]


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"remote_port": "26000"}, "remote_port"),
        ({"remote_port": 0}, "remote_port"),
        ({"remote_port": 70000}, "remote_port"),
        ({"remote_port": 65534, "remote_tp_size": 4}, "65537"),
        ({"remote_tp_size": 0}, "remote_tp_size"),
        ({"remote_tp_size": True}, "remote_tp_size"),  # bool is not an int here
        ({"remote_cached_tokens": -1}, "remote_cached_tokens"),
        ({"remote_cached_tokens": 1.5}, "remote_cached_tokens"),
        ({"request_id": ""}, "request_id"),
        ({"request_id": 7}, "request_id"),
        ({"remote_host": ""}, "remote_host"),
        ({"do_remote_decode": False}, "do_remote_decode"),
        ({"do_remote_prefill": True}, "do_remote_prefill"),
        ({"do_remote_prefill": "false"}, "do_remote_prefill"),
        ({"remote_dcp_size": 0}, "remote_dcp_size"),
    ],
)
def test_invalid_fields_are_refused_naming_the_field(change: dict[str, Any], needle: str) -> None:
    with pytest.raises(MalformedRendezvous, match=needle):
        decode_rendezvous(json.dumps({**V1_POST, **change}).encode())


@pytest.mark.parametrize(
    "field", ["request_id", "remote_engine_id", "remote_host", "remote_port", "remote_tp_size"]
)
def test_required_fields_must_be_present(field: str) -> None:
    post = {k: v for k, v in V1_POST.items() if k != field}
    with pytest.raises(MalformedRendezvous, match=f"missing required field `{field}`"):
        rendezvous_from_params(post)


def test_remote_cached_tokens_is_required() -> None:
    # Defaulting it to 0 would make Prefill send blocks Decode already holds.
    post = {k: v for k, v in V1_POST.items() if k != "remote_cached_tokens"}
    with pytest.raises(MalformedRendezvous, match="remote_cached_tokens"):
        rendezvous_from_params(post)


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (b"", "not valid JSON"),
        (b"{", "not valid JSON"),
        (b"[1]", "JSON object, got list"),
        (b'"x"', "JSON object, got str"),
        (b"null", "JSON object, got NoneType"),
        (b" " * (MAX_RENDEZVOUS_BYTES + 1), "exceeds"),
    ],
)
def test_bodies_that_are_not_a_rendezvous(data: bytes, needle: str) -> None:
    with pytest.raises(MalformedRendezvous, match=needle):
        decode_rendezvous(data)


def test_error_is_a_remote_protocol_error() -> None:
    # Input from the peer: callers catch it like any other malformed peer input.
    with pytest.raises(RemoteProtocolError) as info:
        decode_rendezvous(b"{}")
    assert isinstance(info.value, MalformedFrame)


def test_remote_prefill_params_is_what_decode_gets() -> None:
    assert remote_prefill_params("http://10.0.0.1:9000/v1/metaserver") == {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "metaserver": "http://10.0.0.1:9000/v1/metaserver",
    }


def _child(i: int) -> dict[str, Any]:
    return {**V1_POST, "request_id": f"cmpl-abc-{i}", "remote_cached_tokens": 16 * i}


def test_params_for_child_single_and_batch() -> None:
    assert params_for_child(V1_POST, "cmpl-abc-0") == rendezvous_from_params(V1_POST)
    batch_params = {**_child(0), BATCH_PARAMS_KEY: {f"cmpl-abc-{i}": _child(i) for i in range(3)}}
    for i in range(3):
        r = params_for_child(batch_params, f"cmpl-abc-{i}")
        assert r.request_id == f"cmpl-abc-{i}" and r.remote_cached_tokens == 16 * i


def test_params_for_child_refuses_missing_or_mismatched_entries() -> None:
    with pytest.raises(MalformedRendezvous, match="not of request 'cmpl-abc-1'"):
        params_for_child(V1_POST, "cmpl-abc-1")
    batch_params = {**_child(0), BATCH_PARAMS_KEY: {"cmpl-abc-0": _child(0)}}
    with pytest.raises(MalformedRendezvous, match="no entry for request 'cmpl-abc-1'"):
        params_for_child(batch_params, "cmpl-abc-1")
    swapped = {**_child(0), BATCH_PARAMS_KEY: {"cmpl-abc-1": _child(0)}}
    with pytest.raises(MalformedRendezvous, match="is the rendezvous of 'cmpl-abc-0'"):
        params_for_child(swapped, "cmpl-abc-1")
    with pytest.raises(MalformedRendezvous, match="must be an object"):
        params_for_child({**_child(0), BATCH_PARAMS_KEY: [_child(0)]}, "cmpl-abc-0")
    with pytest.raises(MalformedRendezvous, match="request_id"):
        params_for_child({**_child(0), BATCH_PARAMS_KEY: {"cmpl-abc-0": {}}}, "cmpl-abc-0")


def test_struct_is_frozen_and_hashable() -> None:
    r = rendezvous_from_params(V1_POST)
    with pytest.raises(AttributeError):
        r.remote_port = 1  # type: ignore[misc]
    assert hash(r) == hash(rendezvous_from_params(dict(V1_POST)))
    assert isinstance(r, Rendezvous)
