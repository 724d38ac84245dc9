"""Request bodies and child ids: what the proxy sends to Decode and to Prefill.

vLLM's OpenAI server names a completion request ``cmpl-<X-Request-Id>`` and runs one child
per prompt, ``cmpl-<X-Request-Id>-<i>``; a chat request is ``chatcmpl-<X-Request-Id>``. Its
engine then appends a 9-character suffix that both connector sides strip again, so the
EXTERNAL ids Decode posts in its rendezvous are exactly the child ids computed here, and
Prefill, given the same X-Request-Id and body, derives the same ones.

How many children a ``prompt`` makes (vLLM's rules): a string is one prompt, a flat list
of token ids is ONE prompt, a list of strings or a list of token-id lists is one prompt per
element.

Every JSON body the proxy accepts goes through :func:`check_json_shape` first: msgspec (like
any recursive parser) raises RecursionError on a body nested deeper than the interpreter's
stack allows, a body that decodes here but is nested a few hundred levels deep could still
break an encoder or the vLLM server behind us, and a body of millions of tiny arrays costs
seconds and gigabytes to decode. :func:`decode_json_object` is the one decoder of client
bodies.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from itertools import accumulate
from typing import Any, Final

import msgspec

from rd2h_protocol.rendezvous import (
    BATCH_PARAMS_KEY,
    METASERVER_IDEMPOTENT_KEY,
    remote_prefill_params,
)

COMPLETIONS: Final = "/v1/completions"
CHAT_COMPLETIONS: Final = "/v1/chat/completions"

#: Upper bound on prompts in one prompt list (each is a child request on Decode).
MAX_PROMPTS: Final = 4096
#: X-Request-Id values become part of every child id; keep them short and printable.
MAX_REQUEST_ID_LEN: Final = 256
#: Deepest nesting of JSON arrays and objects accepted in a body. Real requests stay far
#: below it (a chat message with content parts is 5 levels, a tool's JSON schema a few
#: dozen at most) and it is far from the ~1000 levels at which Python's recursion limit
#: stops msgspec, or anything else, that walks the value recursively.
MAX_JSON_DEPTH: Final = 128
#: Most JSON arrays and objects accepted in one body. A real request holds at most a few
#: thousand (MAX_PROMPTS token-id lists, messages and their content parts, tool schemas);
#: a million empty arrays decode to ~60 MB of lists in ~0.5 s, the 21 million that fit in
#: 64 MiB would take 1.5 GB and seconds of the event loop.
MAX_JSON_CONTAINERS: Final = 1 << 20

# check_json_shape: the bytes that open, close or hide (inside a string) arrays and objects.
_STRUCTURE: Final = b'"[]{}'
_NOT_STRUCTURE: Final = bytes(sorted(set(range(256)) - set(_STRUCTURE)))
_CURLY_AS_SQUARE: Final = bytes.maketrans(b"{}", b"[]")
_STRING: Final = re.compile(rb'"[^"]*"')
_DEPTH_STEP: Final = tuple(1 if b == ord("[") else -1 if b == ord("]") else 0 for b in range(256))


class BadRequest(Exception):
    """The client request cannot be proxied; the message says why (HTTP 400)."""


def _brackets(data: bytes | bytearray) -> bytes:
    """The brackets of JSON ``data`` outside its strings, ``{}`` written as ``[]``.

    Linear, every pass in C: drop the two escapes that can hide a quote (JSON pairs
    backslashes left to right, as these non-overlapping replacements do), keep only quotes
    and brackets, drop what remains of the strings (a regex that cannot backtrack).
    """
    text = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    return _STRING.sub(b"", text.translate(None, _NOT_STRUCTURE)).translate(_CURLY_AS_SQUARE)


def _deeper_than(brackets: bytes, limit: int) -> bool:
    """Whether ``brackets`` (from :func:`_brackets`) nest more than ``limit`` levels deep.

    Exact for valid JSON; on malformed JSON it may err towards "deeper" (the body is refused
    either way). Python-level work only over what is left once the empty pairs are gone.
    """
    if brackets.count(b"[") <= limit:
        return False
    if b"[" * (limit + 1) in brackets:
        return True
    # Every deepest "[" of balanced brackets opens an empty pair: removing the pairs lowers
    # the depth by exactly one, and turns "[[],[],...]" shaped bodies into almost nothing.
    inner = brackets.replace(b"[]", b"")
    return bool(inner) and max(accumulate(map(_DEPTH_STEP.__getitem__, inner))) + 1 > limit


def check_json_shape(data: bytes | bytearray, what: str = "the request body") -> None:
    """Refuse (:class:`BadRequest`) a JSON body nested deeper than :data:`MAX_JSON_DEPTH`, or
    holding more than :data:`MAX_JSON_CONTAINERS` arrays and objects, before it is decoded.

    Cheap: two byte counts for an ordinary body, a few linear passes in C otherwise, and
    Python-level work over at most 2 x :data:`MAX_JSON_CONTAINERS` brackets. Malformed JSON
    may pass (the decoder then refuses it); a body that passes cannot make a decoder recurse
    deeper than the limit.
    """
    if data.count(b"[") + data.count(b"{") <= MAX_JSON_DEPTH:
        return  # the common case: too few brackets to reach either limit
    brackets = _brackets(data)
    too_deep = f"{what} nests JSON arrays and objects more than {MAX_JSON_DEPTH} levels deep"
    if b"[" * (MAX_JSON_DEPTH + 1) in brackets:
        raise BadRequest(too_deep)
    if len(brackets) > 2 * MAX_JSON_CONTAINERS:  # valid JSON: one "[" and one "]" each
        raise BadRequest(f"{what} holds more than {MAX_JSON_CONTAINERS} JSON arrays and objects")
    if _deeper_than(brackets, MAX_JSON_DEPTH):
        raise BadRequest(too_deep)


def decode_json_object(data: bytes | bytearray) -> dict[str, Any]:
    """Decode a client request body, which must be a JSON object (:class:`BadRequest`)."""
    check_json_shape(data)
    try:
        body = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:  # not reachable after check_json_shape; kept as the last word
        raise BadRequest(
            f"the request body nests JSON more than {MAX_JSON_DEPTH} levels deep"
        ) from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def check_request_id(value: str) -> str:
    """Validate a client-chosen X-Request-Id (printable ASCII, no spaces, bounded)."""
    if not value or len(value) > MAX_REQUEST_ID_LEN:
        raise BadRequest(
            f"X-Request-Id must have 1..{MAX_REQUEST_ID_LEN} characters, got {len(value)}"
        )
    if not all("!" <= ch <= "~" for ch in value):
        raise BadRequest("X-Request-Id must be printable ASCII without spaces")
    return value


def _is_token(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def count_prompts(prompt: object) -> int:
    """Number of child requests vLLM makes for ``prompt`` (see the module docstring)."""
    if isinstance(prompt, str):
        return 1
    if not isinstance(prompt, list):
        raise BadRequest(
            "`prompt` must be a string, a list of strings, a list of token ids or a list of "
            f"token-id lists, got {type(prompt).__name__}"
        )
    if not prompt:
        raise BadRequest("`prompt` must not be an empty list")
    if all(_is_token(x) for x in prompt):
        return 1  # one tokenised prompt
    strings = all(isinstance(x, str) for x in prompt)
    token_lists = all(isinstance(x, list) and x and all(map(_is_token, x)) for x in prompt)
    if not (strings or token_lists):
        raise BadRequest(
            "`prompt` list must hold only strings, only token ids, or only non-empty token-id lists"
        )
    count = len(prompt)
    if count > MAX_PROMPTS:
        raise BadRequest(f"`prompt` holds {count} prompts; the proxy accepts {MAX_PROMPTS}")
    return count


def child_ids(api: str, parent_id: str, body: Mapping[str, Any]) -> tuple[str, ...]:
    """External ids of the child requests Decode will run for this client request."""
    if api == CHAT_COMPLETIONS:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("a chat completion needs a non-empty `messages` list")
        return (f"chatcmpl-{parent_id}",)
    if api == COMPLETIONS:
        if "prompt" not in body:
            raise BadRequest("a completion needs `prompt` (the proxy counts prompts from it)")
        n = count_prompts(body["prompt"])
        return tuple(f"cmpl-{parent_id}-{i}" for i in range(n))
    raise BadRequest(f"unsupported endpoint {api!r}")


def decode_body(body: Mapping[str, Any], metaserver_url: str) -> dict[str, Any]:
    """The client request as Decode gets it: remote prefill, rendezvous posted to us."""
    params = {**remote_prefill_params(metaserver_url), METASERVER_IDEMPOTENT_KEY: True}
    return {**body, "kv_transfer_params": params}


def prefill_body(
    body: Mapping[str, Any],
    children: tuple[str, ...],
    params: Mapping[str, Mapping[str, Any]],
) -> dict[str, Any]:
    """The original request as Prefill gets it: one token, no streaming, Decode's rendezvous.

    One child: its rendezvous is the kv_transfer_params. Several: child 0's rendezvous plus
    ``batch_kv_transfer_params`` with every child's own entry, keyed by external id.
    """
    out: dict[str, Any] = {**body, "stream": False, "max_tokens": 1}
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1  # chat: it overrides max_tokens in vLLM
    out.pop("stream_options", None)  # only valid with stream=true
    out.pop("min_tokens", None)  # must not exceed max_tokens
    first = dict(params[children[0]])
    if len(children) > 1:
        first[BATCH_PARAMS_KEY] = {child: dict(params[child]) for child in children}
    out["kv_transfer_params"] = first
    return out
