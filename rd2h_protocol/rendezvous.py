"""The rendezvous: what Decode tells Prefill (through the proxy) about where to send KV.

Theory of operation
-------------------
The proxy first sends a client request to Decode with ``kv_transfer_params`` asking for a
remote prefill and naming the proxy's metaserver URL (:func:`remote_prefill_params`). For
each child request it runs (one per prompt of a prompt list), Decode allocates destination
blocks, keeps their ids to itself, and POSTs a :class:`Rendezvous` as JSON to that URL: the
child's EXTERNAL request id (vLLM's internal id without its 9-character suffix), its control
endpoint (host and BASE port: Decode TP rank ``r`` listens on ``remote_port + r``), its
parallel topology and how many prompt tokens it already holds.

Once every child of a client request has posted, the proxy sends the original request to
Prefill once, with ``kv_transfer_params`` set to the single child's rendezvous, or, for a
prompt list, child 0's rendezvous plus :data:`BATCH_PARAMS_KEY` mapping every child's
external id to its own rendezvous. Prefill picks each child's entry with
:func:`params_for_child`; a child without an entry is an error, never a guess.

Decoding is strict (types, bounds, the two direction flags) and every error says which
field was wrong and why. Unknown keys are ignored so a newer Decode may add keys (the
append-only evolution rule); the proxy relays them unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Final

import msgspec
from msgspec import Meta

from rd2h_protocol.errors import MalformedFrame

#: Key of the per-child map in the kv_transfer_params of a prompt-list Prefill dispatch.
BATCH_PARAMS_KEY: Final = "batch_kv_transfer_params"
#: Key under which the proxy hands Decode its metaserver URL.
METASERVER_KEY: Final = "metaserver"
#: Key by which a proxy tells Decode that its metaserver answers a rendezvous as soon as it
#: is recorded and treats an identical repeat as a duplicate (never a second dispatch), so
#: Decode may post it again when an answer is lost. A metaserver that does not set it (the
#: existing example proxy, which answers only after its Prefill dispatch) gets each
#: delivered POST exactly once.
METASERVER_IDEMPOTENT_KEY: Final = "metaserver_idempotent"
#: The largest rendezvous body a receiver accepts (a real one is a few hundred bytes).
MAX_RENDEZVOUS_BYTES: Final = 64 << 10

_MAX_PORT: Final = 65535
_MAX_ID_LEN: Final = 4096

_Id = Annotated[str, Meta(min_length=1, max_length=_MAX_ID_LEN)]
_Port = Annotated[int, Meta(ge=1, le=_MAX_PORT)]
_Size = Annotated[int, Meta(ge=1, le=1 << 20)]
_Tokens = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]


#: The deepest nesting of arrays and objects a JSON body of the rendezvous or the claim
#: exchange may have (a real one nests 3 levels: the batch map, a rendezvous, a value).
MAX_JSON_DEPTH: Final = 32


# An innermost pair of brackets, and the bytes that are not brackets.
_PAIR: Final = re.compile(rb"\[\]")
_SQUARE: Final = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS: Final = bytes(b for b in range(256) if b not in b"[]{}")


class JsonTooDeep(ValueError):
    """A JSON body nests deeper than :data:`MAX_JSON_DEPTH` (or its brackets do not pair)."""


def check_json_depth(data: bytes | str) -> None:
    """Raise :class:`JsonTooDeep` unless ``data``'s arrays and objects nest at most
    :data:`MAX_JSON_DEPTH` levels and pair up.

    A JSON decoder recurses once per level, so a small body nested deep enough reaches
    the interpreter's recursion limit (a ``RecursionError``, not a decode error). This
    looks at the brackets alone, outside strings, with a few passes over the bytes in C
    (one per level: each removes the innermost pairs), before any decoder recurses.
    Valid JSON within the bound always passes; what it refuses is too deep or not JSON
    (a body with at most that many openers passes unexamined: it cannot nest deeper).
    """
    raw = data.encode() if isinstance(data, str) else bytes(data)
    # Strings out: escape pairs first (a backslash always starts one, left to right, as
    # in the tokenizer), then every other run between quotes.
    unescaped = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    outside = b"".join(unescaped.split(b'"')[::2])
    skeleton = outside.translate(_SQUARE, _NOT_BRACKETS)
    if skeleton.count(b"[") <= MAX_JSON_DEPTH:
        return  # no decoder can recurse deeper than there are openers
    if b"[" * (MAX_JSON_DEPTH + 1) in skeleton:
        raise JsonTooDeep(f"the JSON body nests deeper than {MAX_JSON_DEPTH} levels")
    for _ in range(MAX_JSON_DEPTH):
        if not skeleton:
            return
        skeleton = _PAIR.sub(b"", skeleton)
    if skeleton:
        raise JsonTooDeep(
            f"the JSON body nests deeper than {MAX_JSON_DEPTH} levels (or its brackets do not pair)"
        )


class MalformedRendezvous(MalformedFrame):
    """A rendezvous (or kv_transfer_params holding one) is not valid JSON or breaks a rule."""


class Rendezvous(msgspec.Struct, frozen=True, kw_only=True):
    """One child request's rendezvous, posted by Decode and relayed to Prefill.

    ``request_id`` is the EXTERNAL id (``cmpl-<parent>-<i>`` or ``chatcmpl-<parent>``);
    ``remote_port`` is Decode's BASE control port, so ``remote_port + remote_tp_size - 1``
    must still be a valid port. The direction flags say "Prefill sends, Decode reads":
    ``do_remote_decode`` true and ``do_remote_prefill`` false, as v1 posts them.
    """

    request_id: _Id
    do_remote_prefill: bool = False
    do_remote_decode: bool = True
    remote_engine_id: Annotated[str, Meta(max_length=_MAX_ID_LEN)]
    remote_host: _Id
    remote_port: _Port
    remote_tp_size: _Size
    remote_pcp_size: _Size = 1
    remote_dcp_size: _Size = 1
    remote_cached_tokens: _Tokens

    def __post_init__(self) -> None:
        # Raised errors become msgspec.ValidationError, which the decoders below rewrap.
        if self.do_remote_prefill or not self.do_remote_decode:
            raise ValueError(
                "a rendezvous asks Prefill to send its KV: expected do_remote_decode=true and "
                f"do_remote_prefill=false, got do_remote_decode={self.do_remote_decode} and "
                f"do_remote_prefill={self.do_remote_prefill}"
            )
        highest = self.remote_port + self.remote_tp_size - 1
        if highest > _MAX_PORT:
            raise ValueError(
                f"Decode TP rank {self.remote_tp_size - 1} would listen on port {highest} "
                f"(base port {self.remote_port} + rank); the highest port is {_MAX_PORT}"
            )

    def to_params(self) -> dict[str, object]:
        """This rendezvous as a plain JSON-ready dict, every field present (v1 reads them all)."""
        params: dict[str, object] = msgspec.to_builtins(self)
        return params


def rendezvous_from_params(params: object) -> Rendezvous:
    """Validate an already-parsed JSON object as a :class:`Rendezvous`.

    Raises :class:`MalformedRendezvous` naming the offending field.
    """
    if not isinstance(params, Mapping):
        raise MalformedRendezvous(
            f"a rendezvous must be a JSON object, got {type(params).__name__}"
        )
    try:
        return msgspec.convert(params, Rendezvous, strict=True)
    except msgspec.ValidationError as exc:
        raise MalformedRendezvous(f"invalid rendezvous: {exc}") from None


def parse_rendezvous_json(data: bytes | str) -> tuple[Rendezvous, dict[str, object]]:
    """Parse a rendezvous body; return it and the JSON object it came from.

    The object is returned too so a relay can forward keys this version does not know.
    Raises :class:`MalformedRendezvous` for a body that is too large, not JSON, nested
    deeper than :data:`MAX_JSON_DEPTH`, not an object, or not a valid rendezvous (and
    nothing else, whatever the body).
    """
    if len(data) > MAX_RENDEZVOUS_BYTES:
        raise MalformedRendezvous(
            f"rendezvous body of {len(data)} bytes exceeds the {MAX_RENDEZVOUS_BYTES}-byte bound"
        )
    try:
        check_json_depth(data)
        obj = msgspec.json.decode(data)
    except JsonTooDeep as exc:
        raise MalformedRendezvous(f"rendezvous body refused: {exc}") from None
    except msgspec.DecodeError as exc:
        raise MalformedRendezvous(f"rendezvous body is not valid JSON: {exc}") from None
    rendezvous = rendezvous_from_params(obj)
    assert isinstance(obj, dict)  # rendezvous_from_params refused anything else
    return rendezvous, obj


def decode_rendezvous(data: bytes | str) -> Rendezvous:
    """Parse and validate a rendezvous JSON body (see :func:`parse_rendezvous_json`)."""
    return parse_rendezvous_json(data)[0]


def encode_rendezvous(rendezvous: Rendezvous) -> bytes:
    """The JSON body Decode posts to the metaserver."""
    return msgspec.json.encode(rendezvous)


def remote_prefill_params(metaserver_url: str) -> dict[str, object]:
    """The kv_transfer_params the proxy sends to Decode: prefill remotely, post here."""
    return {"do_remote_decode": False, "do_remote_prefill": True, METASERVER_KEY: metaserver_url}


def params_for_child(params: Mapping[str, object], external_id: str) -> Rendezvous:
    """The rendezvous of child ``external_id`` inside a Prefill request's kv_transfer_params.

    With :data:`BATCH_PARAMS_KEY` present (a prompt-list dispatch) the child's own entry is
    used and a missing entry is an error; without it the params are the single child's
    rendezvous, whose ``request_id`` must then name ``external_id``.
    """
    batch = params.get(BATCH_PARAMS_KEY)
    if batch is None:
        rendezvous = rendezvous_from_params(params)
        if rendezvous.request_id != external_id:
            raise MalformedRendezvous(
                f"kv_transfer_params are the rendezvous of {rendezvous.request_id!r}, "
                f"not of request {external_id!r}, and carry no {BATCH_PARAMS_KEY}"
            )
        return rendezvous
    if not isinstance(batch, Mapping):
        raise MalformedRendezvous(
            f"{BATCH_PARAMS_KEY} must be an object keyed by request id, got {type(batch).__name__}"
        )
    if external_id not in batch:
        raise MalformedRendezvous(
            f"{BATCH_PARAMS_KEY} has no entry for request {external_id!r} "
            f"(it holds {len(batch)} entries)"
        )
    rendezvous = rendezvous_from_params(batch[external_id])
    if rendezvous.request_id != external_id:
        raise MalformedRendezvous(
            f"{BATCH_PARAMS_KEY}[{external_id!r}] is the rendezvous of {rendezvous.request_id!r}"
        )
    return rendezvous
