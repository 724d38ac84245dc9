"""The Prefill-first flow: what Prefill answers a standard router, and Decode's claim.

Theory of operation
-------------------
Every router that vLLM P/D deployments run (vllm-router, the production stack's, llm-d's
sidecar, vLLM's example proxy) speaks one flow: it sends the request to Prefill first with
``kv_transfer_params`` ``{"do_remote_decode": true, "do_remote_prefill": false}`` and every
``remote_*`` field null (:func:`is_prefill_first`), takes the ``kv_transfer_params`` of
Prefill's answer and sends the original request to Decode with them.

Prefill computes the prompt, keeps its blocks (the producer endpoint's *kept request*) and
answers :func:`kept_params`: a :class:`KeptSource` naming its engine, its claim port
(Prefill TP rank ``r`` listens on ``remote_port + r``), its TP size, the request's id
there and its prompt length. Decode parses them with :func:`kept_source_from_params`,
allocates its blocks and sends each Prefill rank that serves it a :class:`Claim` over
ZMQ; the rank answers a :class:`ClaimAnswer` and, when it accepts, connects to Decode's
control port and publishes every layer of the request at once, as in the Decode-first
flow. Decode reads, replies and goes on; Prefill frees the blocks when its readers have
answered, or when no claim came within its claim window.

Everything here is strict (types, bounds, the direction flags) and every error names the
field at fault; unknown keys are ignored (the append-only evolution rule).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Final

import msgspec
from msgspec import Meta

from rd2h_protocol.errors import MalformedFrame
from rd2h_protocol.rendezvous import JsonTooDeep, check_json_depth

#: The version of the claim exchange; a claim of a lower version is refused.
CLAIM_VERSION: Final = 1
#: The key that marks ``kv_transfer_params`` as rd2h's Prefill-first answer (its value is
#: the claim version), so a Decode never mistakes another connector's answer for ours.
KEPT_MARKER_KEY: Final = "rd2h_claim_version"
#: The largest claim or answer frame accepted (a real one is a few hundred bytes).
MAX_CLAIM_BYTES: Final = 16 << 10

_MAX_ID_LEN: Final = 4096
_Id = Annotated[str, Meta(min_length=1, max_length=_MAX_ID_LEN)]
_Text = Annotated[str, Meta(max_length=_MAX_ID_LEN)]
_Port = Annotated[int, Meta(ge=1, le=65535)]
_Size = Annotated[int, Meta(ge=1, le=1 << 20)]
_Tokens = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]

#: The ``remote_*`` fields a standard router sends Prefill, all null.
_ROUTER_NULLS: Final = (
    "remote_engine_id",
    "remote_block_ids",
    "remote_host",
    "remote_port",
)


class MalformedClaim(MalformedFrame):
    """Prefill-first parameters, a claim or its answer break a rule (the message says which)."""


class KeptSource(msgspec.Struct, frozen=True, kw_only=True):
    """Where a Prefill-first request's KV is kept: what Prefill answers the router.

    ``remote_port`` is the BASE claim port (Prefill TP rank ``r`` listens on
    ``remote_port + r``); ``remote_request_id`` is the request's external id on Prefill
    (Decode's own id may differ); ``remote_num_tokens`` its prompt length there.
    """

    do_remote_prefill: bool = True
    do_remote_decode: bool = False
    remote_engine_id: _Id
    remote_host: _Id
    remote_port: _Port
    remote_tp_size: _Size
    remote_request_id: _Id
    remote_num_tokens: _Tokens
    rd2h_claim_version: Annotated[int, Meta(ge=1)]

    def __post_init__(self) -> None:
        if not self.do_remote_prefill or self.do_remote_decode:
            raise ValueError(
                "Prefill-first parameters ask Decode to load the KV: expected "
                "do_remote_prefill=true and do_remote_decode=false, got "
                f"do_remote_prefill={self.do_remote_prefill} and "
                f"do_remote_decode={self.do_remote_decode}"
            )
        highest = self.remote_port + self.remote_tp_size - 1
        if highest > 65535:
            raise ValueError(
                f"Prefill TP rank {self.remote_tp_size - 1} would listen on port {highest} "
                f"(base port {self.remote_port} + rank); the highest port is 65535"
            )


class Claim(msgspec.Struct, frozen=True, kw_only=True):
    """Decode claims a kept request from one Prefill rank: publish it to me.

    ``host``/``port``/``tp_size``: Decode's control endpoint (BASE port) and TP size, as
    a rendezvous names them; ``cached_tokens``: prompt tokens Decode holds already (its
    prefix hit, not sent); ``num_tokens``: the prompt length on Decode (Prefill refuses a
    claim whose prompt differs from what it computed).
    """

    version: Annotated[int, Meta(ge=1)]
    request_id: _Id
    engine_id: _Text
    host: _Id
    port: _Port
    tp_size: _Size
    cached_tokens: _Tokens
    num_tokens: _Tokens


class ClaimAnswer(msgspec.Struct, frozen=True, kw_only=True):
    """A Prefill rank's answer to a :class:`Claim`: accepted, or refused and why."""

    request_id: _Id
    ok: bool
    code: Annotated[int, Meta(ge=0, le=1 << 16)] = 0
    message: Annotated[str, Meta(max_length=MAX_CLAIM_BYTES // 2)] = ""


def is_prefill_first(params: Mapping[str, object]) -> bool:
    """Whether Prefill's ``kv_transfer_params`` are a standard router's first step:
    ``do_remote_decode`` true and no Decode named (every ``remote_*`` field absent or
    null)."""
    return params.get("do_remote_decode") is True and all(
        params.get(key) is None for key in _ROUTER_NULLS
    )


def kept_params(source: KeptSource) -> dict[str, object]:
    """``kv_transfer_params`` of Prefill's answer: every field of ``source``."""
    params: dict[str, object] = msgspec.to_builtins(source)
    return params


def is_kept_params(params: Mapping[str, object]) -> bool:
    """Whether ``kv_transfer_params`` carry rd2h's Prefill-first answer (its marker key)."""
    return KEPT_MARKER_KEY in params


def kept_source_from_params(params: Mapping[str, object]) -> KeptSource:
    """Validate Decode's ``kv_transfer_params`` as a :class:`KeptSource`.

    Raises :class:`MalformedClaim` naming the field at fault.
    """
    try:
        return msgspec.convert(params, KeptSource, strict=True)
    except msgspec.ValidationError as exc:
        raise MalformedClaim(f"invalid Prefill-first kv_transfer_params: {exc}") from None


def encode_claim(message: Claim | ClaimAnswer) -> bytes:
    """One frame of the claim exchange (JSON)."""
    return msgspec.json.encode(message)


_CLAIM_DECODER: Final = msgspec.json.Decoder(Claim)
_ANSWER_DECODER: Final = msgspec.json.Decoder(ClaimAnswer)


def _decode(
    frame: bytes, decoder: msgspec.json.Decoder[Claim] | msgspec.json.Decoder[ClaimAnswer]
) -> Claim | ClaimAnswer:
    if len(frame) > MAX_CLAIM_BYTES:
        raise MalformedClaim(f"claim frame of {len(frame)} bytes exceeds {MAX_CLAIM_BYTES}")
    try:
        # The typed decode skips unknown keys by recursing into them: the depth is
        # checked first, so no body reaches the interpreter's recursion limit.
        check_json_depth(frame)
        return decoder.decode(frame)
    except JsonTooDeep as exc:
        raise MalformedClaim(f"malformed claim frame: {exc}") from None
    except msgspec.DecodeError as exc:
        raise MalformedClaim(f"malformed claim frame: {exc}") from None


def decode_claim(frame: bytes) -> Claim:
    """A :class:`Claim` from a frame; :class:`MalformedClaim` names what is wrong."""
    claim = _decode(frame, _CLAIM_DECODER)
    assert isinstance(claim, Claim)
    if claim.port + claim.tp_size - 1 > 65535:
        raise MalformedClaim(
            f"claim of {claim.request_id!r}: Decode rank {claim.tp_size - 1} would listen on "
            f"port {claim.port + claim.tp_size - 1}; the highest port is 65535"
        )
    return claim


def decode_claim_answer(frame: bytes) -> ClaimAnswer:
    """A :class:`ClaimAnswer` from a frame; :class:`MalformedClaim` names what is wrong."""
    answer = _decode(frame, _ANSWER_DECODER)
    assert isinstance(answer, ClaimAnswer)
    return answer
