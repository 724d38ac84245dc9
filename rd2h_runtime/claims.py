"""The claim exchange of the Prefill-first flow, bound to ZMQ.

A Prefill TP rank opens a :class:`ClaimDoor` (a ROUTER on ``claim port + rank``): each
:class:`~rd2h_protocol.claim.Claim` a Decode sends is decoded and handed to ``on_claim``
on the door's I/O thread, which returns the :class:`~rd2h_protocol.claim.ClaimAnswer` sent
back (the Prefill worker publishes the request before it returns). A Decode TP rank sends
its claims through one :class:`ClaimClient` (a DEALER per Prefill rank it claims from) and
gets every answer through ``on_answer``, or a refusal of its own when no answer came
within ``answer_timeout_s`` (a Prefill gone, a door never bound).

Both take no protocol decision: what a claim means is the producer endpoint's
(:meth:`~rd2h_protocol.producer.ProducerEndpoint.claim`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from rd2h_protocol.claim import (
    Claim,
    ClaimAnswer,
    MalformedClaim,
    decode_claim,
    decode_claim_answer,
    encode_claim,
)
from rd2h_protocol.errors import ErrorCode
from rd2h_runtime.control import (
    ClientEvent,
    ConnFrame,
    ControlError,
    ControlOptions,
    DecodeControlServer,
    PeerFrame,
    PrefillControlClient,
    ServerEvent,
    TimerDue,
)

__all__ = ["ClaimClient", "ClaimDoor"]

log = logging.getLogger("rd2h_runtime.claims")


class ClaimDoor:
    """The ROUTER a Prefill TP rank binds on ``host:port`` for Decodes' claims.

    ``on_claim`` runs on the door's I/O thread and must return quickly (publishing is
    queueing frames). A malformed claim is answered with a refusal that says what is
    wrong, and counted in ``malformed``. :meth:`start` raises
    :class:`~rd2h_runtime.control.BindError` when the port is taken.
    """

    def __init__(
        self,
        host: str,
        port: int,
        on_claim: Callable[[Claim], ClaimAnswer],
        *,
        options: ControlOptions | None = None,
    ) -> None:
        self._on_claim = on_claim
        self._server = DecodeControlServer(host, port, handler=self._on_event, options=options)
        self.malformed = 0

    @property
    def port(self) -> int:
        """The bound port (after :meth:`start`)."""
        return self._server.port

    def start(self) -> None:
        self._server.start()

    def close(self) -> None:
        self._server.close()

    def _on_event(self, event: ServerEvent) -> None:
        if not isinstance(event, PeerFrame):
            return
        try:
            claim = decode_claim(bytes(event.payload))  # claims are small: bytes already
        except MalformedClaim as exc:
            self.malformed += 1
            answer = ClaimAnswer(
                request_id="?", ok=False, code=int(ErrorCode.MALFORMED), message=exc.message
            )
        else:
            try:
                answer = self._on_claim(claim)
            except Exception as exc:  # the door must answer whatever happens
                log.exception("claim of %r raised", claim.request_id)
                answer = ClaimAnswer(
                    request_id=claim.request_id,
                    ok=False,
                    code=int(ErrorCode.UNKNOWN),
                    message=f"Prefill failed to publish it: {exc}",
                )
        try:
            self._server.send(event.peer, encode_claim(answer))
        except ControlError as exc:
            log.warning("claim answer for %r not sent: %s", answer.request_id, exc)


class ClaimClient:
    """The DEALERs a Decode TP rank sends its claims through, one per Prefill rank.

    :meth:`claim` never blocks; ``on_answer(conn, answer)`` runs on the client's I/O
    thread for each answer, and for each claim left unanswered ``answer_timeout_s`` after
    it was sent (a refusal with code TIMEOUT). Thread-safe.
    """

    def __init__(
        self,
        on_answer: Callable[[str, ClaimAnswer], None],
        *,
        answer_timeout_s: float = 10.0,
        options: ControlOptions | None = None,
        name: str = "claims",
    ) -> None:
        self._on_answer = on_answer
        self._timeout_s = answer_timeout_s
        self._lock = threading.Lock()
        self._waiting: dict[tuple[str, str], float] = {}  # (conn, request id) -> deadline
        self._client = PrefillControlClient(handler=self._on_event, options=options, name=name)
        self._client.start()

    def claim(self, host: str, port: int, claim: Claim) -> None:
        """Send ``claim`` to the Prefill rank listening on ``host:port``."""
        conn = f"{host}:{port}"
        deadline = time.monotonic() + self._timeout_s
        with self._lock:
            self._waiting[(conn, claim.request_id)] = deadline
            first = min(self._waiting.values())
        self._client.set_timer(first)
        self._client.send(conn, encode_claim(claim))

    def waiting(self) -> int:
        """Claims sent and not answered yet."""
        with self._lock:
            return len(self._waiting)

    def close(self) -> None:
        self._client.close()

    def _on_event(self, event: ClientEvent) -> None:
        if isinstance(event, ConnFrame):
            try:
                answer = decode_claim_answer(event.payload)
            except MalformedClaim as exc:
                log.warning("malformed claim answer from %s: %s", event.conn, exc)
                return
            with self._lock:
                known = self._waiting.pop((event.conn, answer.request_id), None)
            if known is not None:
                self._on_answer(event.conn, answer)
        elif isinstance(event, TimerDue):
            with self._lock:
                late = [key for key, deadline in self._waiting.items() if deadline <= event.now]
                for key in late:
                    del self._waiting[key]
                following = min(self._waiting.values(), default=None)
            self._client.set_timer(following)
            for conn, request_id in late:
                self._on_answer(
                    conn,
                    ClaimAnswer(
                        request_id=request_id,
                        ok=False,
                        code=int(ErrorCode.TIMEOUT),
                        message=f"Prefill rank {conn} did not answer the claim within "
                        f"{self._timeout_s:g} s (is it running, with its claim port open?)",
                    ),
                )
