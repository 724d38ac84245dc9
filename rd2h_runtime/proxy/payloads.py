"""Request bodies and child ids: what the proxy sends to Decode and to Prefill.

vLLM's OpenAI server names a completion request ``cmpl-<X-Request-Id>`` and runs one child
per prompt, ``cmpl-<X-Request-Id>-<i>``; a chat request is ``chatcmpl-<X-Request-Id>``. Its
engine then appends a 9-character suffix that both connector sides strip again, so the
EXTERNAL ids Decode posts in its rendezvous are exactly the child ids computed here, and
Prefill, given the same X-Request-Id and body, derives the same ones.

How many children a ``prompt`` makes (vLLM's rules): a string is one prompt, a flat list
of token ids is ONE prompt, a list of strings or a list of token-id lists is one prompt per
element.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

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


class BadRequest(Exception):
    """The client request cannot be proxied; the message says why (HTTP 400)."""


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
