"""The claim exchange over real ZMQ sockets on 127.0.0.1 (Prefill-first flow)."""

from __future__ import annotations

import queue

import pytest
import zmq

from rd2h_protocol.claim import CLAIM_VERSION, Claim, ClaimAnswer, decode_claim_answer
from rd2h_protocol.errors import ErrorCode
from rd2h_runtime.claims import ClaimClient, ClaimDoor
from rd2h_runtime.control import BindError

pytestmark = pytest.mark.timeout(30)


def claim(request_id: str) -> Claim:
    return Claim(
        version=CLAIM_VERSION,
        request_id=request_id,
        engine_id="decode",
        host="127.0.0.1",
        port=20050,
        tp_size=1,
        cached_tokens=0,
        num_tokens=12,
    )


def test_a_claim_reaches_the_door_and_its_answer_comes_back() -> None:
    seen: list[Claim] = []

    def on_claim(c: Claim) -> ClaimAnswer:
        seen.append(c)
        ok = c.request_id == "kept"
        return ClaimAnswer(request_id=c.request_id, ok=ok, code=0 if ok else 6, message="why")

    door = ClaimDoor("127.0.0.1", 0, on_claim)
    door.start()
    answers: queue.Queue[tuple[str, ClaimAnswer]] = queue.Queue()
    client = ClaimClient(lambda conn, a: answers.put((conn, a)), answer_timeout_s=5.0)
    try:
        client.claim("127.0.0.1", door.port, claim("kept"))
        client.claim("127.0.0.1", door.port, claim("other"))
        got = {a.request_id: (conn, a) for conn, a in (answers.get(timeout=5) for _ in range(2))}
        assert got["kept"] == (
            f"127.0.0.1:{door.port}",
            ClaimAnswer(request_id="kept", ok=True, message="why"),
        )
        assert got["other"][1].ok is False and got["other"][1].message == "why"
        assert [c.request_id for c in seen] == ["kept", "other"]
        assert client.waiting() == 0
    finally:
        client.close()
        door.close()


def test_a_malformed_claim_is_answered_with_what_is_wrong() -> None:
    door = ClaimDoor("127.0.0.1", 0, lambda c: ClaimAnswer(request_id=c.request_id, ok=True))
    door.start()
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    try:
        sock.connect(f"tcp://127.0.0.1:{door.port}")
        sock.send(b'{"version": 1}')
        frames = sock.recv_multipart()
        answer = decode_claim_answer(frames[-1])
        assert answer.ok is False and answer.code == int(ErrorCode.MALFORMED)
        assert "request_id" in answer.message
        assert door.malformed == 1
    finally:
        sock.close()
        door.close()


def test_an_unanswered_claim_is_refused_after_the_timeout() -> None:
    answers: queue.Queue[tuple[str, ClaimAnswer]] = queue.Queue()
    client = ClaimClient(lambda conn, a: answers.put((conn, a)), answer_timeout_s=0.3)
    probe = zmq.Context.instance().socket(zmq.ROUTER)
    port = probe.bind_to_random_port("tcp://127.0.0.1")
    probe.close(linger=0)  # nothing listens there any more
    try:
        client.claim("127.0.0.1", port, claim("lost"))
        conn, answer = answers.get(timeout=5)
        assert conn == f"127.0.0.1:{port}"
        assert answer.ok is False and answer.code == int(ErrorCode.TIMEOUT)
        assert "did not answer the claim within 0.3 s" in answer.message
    finally:
        client.close()


def test_a_door_on_a_taken_port_says_so() -> None:
    first = ClaimDoor("127.0.0.1", 0, lambda c: ClaimAnswer(request_id=c.request_id, ok=True))
    first.start()
    try:
        second = ClaimDoor(
            "127.0.0.1", first.port, lambda c: ClaimAnswer(request_id=c.request_id, ok=True)
        )
        with pytest.raises(BindError):
            second.start()
    finally:
        first.close()
