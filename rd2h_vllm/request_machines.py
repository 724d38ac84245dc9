"""The connector worker's per-request state machines, declared once as data.

Theory of operation
-------------------
:mod:`rd2h_vllm.worker` tracks every request vLLM hands the connector between the
endpoint (which moves the KV) and vLLM (which owns the blocks). Two machines hold every
rule that changes that tracking; the worker resolves the guards and binds each named
effect to its handler.

* **vLLM send** (Prefill, one per request with a ``SendSpec``): ``publishing`` once the
  endpoint accepted it (``unpublished`` when it refused: Prefill computes it anyway and
  Decode fails it on its own deadline) -> ``published`` when its final chunk (or a bad
  chunk: nothing more goes out for it) was scheduled -> ``done`` when vLLM finished it
  AND the endpoint's ``RequestFinished`` came (``ended`` and ``finishing`` are the two
  orders those arrive in). A request vLLM finishes before its final chunk was scheduled
  is aborted toward Decode. ``done`` is reported in ``finished_sending``: vLLM may free
  its blocks, since no Decode read of them can happen any more.
* **vLLM load** (Decode, one per request with a ``LoadSpec``): ``loading`` once the
  endpoint accepted its destinations (``failed_locally`` when it refused: its failure
  is reported like an endpoint outcome) -> ``release_pending`` when every TP rank ended
  it (the cross-rank completion rule) and the endpoint was told to release it ->
  ``released`` once no read can still write its blocks; it is then reported in
  ``finished_recving`` (and ``failed_recving`` when it failed on any rank). A rendezvous
  failure or vLLM finishing it while it loads aborts it in the endpoint. A second load
  under an external id already loading is ``released`` (failed) at once.

Inputs follow the naming of :mod:`rd2h_protocol.machines.declare`: ``LOCAL_*`` from vLLM or our
own decisions, ``RECV_*`` from the endpoint's reports.
"""

from __future__ import annotations

from typing import Final

from rd2h_protocol.machines import MachineSpec, stay

# -- vLLM send -----------------------------------------------------------------------------

SEND_NEW: Final = "new"
SEND_UNPUBLISHED: Final = "unpublished"
SEND_PUBLISHING: Final = "publishing"
SEND_PUBLISHED: Final = "published"
SEND_ENDED: Final = "ended"
SEND_FINISHING: Final = "finishing"
SEND_DONE: Final = "done"

S_LOCAL_REGISTERED: Final = "LOCAL_REGISTERED"
S_LOCAL_NOT_REGISTERED: Final = "LOCAL_NOT_REGISTERED"
S_LOCAL_CHUNK: Final = "LOCAL_CHUNK"
S_LOCAL_FINAL_CHUNK: Final = "LOCAL_FINAL_CHUNK"
S_LOCAL_CHUNK_AFTER_END: Final = "LOCAL_CHUNK_AFTER_END"
S_LOCAL_BAD_CHUNK: Final = "LOCAL_BAD_CHUNK"
S_LOCAL_VLLM_FINISHED: Final = "LOCAL_VLLM_FINISHED"
S_RECV_FINISHED: Final = "RECV_FINISHED"

EFFECT_SCHEDULE: Final = "schedule"  # schedule the chunk in the endpoint
EFFECT_ABORT: Final = "abort"  # abort it in the endpoint (toward its Decode)

#: vLLM has finished the request (it may be reported once the endpoint is done too).
SEND_VLLM_FINISHED: Final = frozenset({SEND_FINISHING, SEND_DONE})

VLLM_SEND: Final = MachineSpec(
    name="vLLM send",
    doc="""
    One Prefill request as the connector worker tracks it. Its chunks are scheduled in
    the endpoint until the final one; it is reported finished (its blocks free) once vLLM
    finished it and the endpoint's RequestFinished came. A request vLLM finishes before
    its final chunk was scheduled is aborted.
    """,
    states=(
        SEND_NEW,
        SEND_UNPUBLISHED,
        SEND_PUBLISHING,
        SEND_PUBLISHED,
        SEND_ENDED,
        SEND_FINISHING,
        SEND_DONE,
    ),
    initial=SEND_NEW,
    terminal=frozenset({SEND_DONE}),
    transitions=(
        {"trigger": S_LOCAL_REGISTERED, "source": SEND_NEW, "dest": SEND_PUBLISHING},
        {"trigger": S_LOCAL_NOT_REGISTERED, "source": SEND_NEW, "dest": SEND_UNPUBLISHED},
        *stay(S_LOCAL_CHUNK, [SEND_PUBLISHING], EFFECT_SCHEDULE),
        {
            "trigger": S_LOCAL_FINAL_CHUNK,
            "source": SEND_PUBLISHING,
            "dest": SEND_PUBLISHED,
            "effect": EFFECT_SCHEDULE,
        },
        # The endpoint finished it (an ABORT from Decode, a failure) and refuses the
        # chunk; scheduling it is harmless and keeps the step's bookkeeping as it was.
        *stay(S_LOCAL_CHUNK, [SEND_ENDED], EFFECT_SCHEDULE),
        *stay(S_LOCAL_FINAL_CHUNK, [SEND_ENDED], EFFECT_SCHEDULE),
        # Nothing goes out for a request the endpoint refused or whose final chunk went.
        *stay(S_LOCAL_CHUNK, [SEND_UNPUBLISHED, SEND_PUBLISHED]),
        *stay(S_LOCAL_FINAL_CHUNK, [SEND_UNPUBLISHED, SEND_PUBLISHED]),
        # The endpoint finished it; its RequestFinished is not collected yet.
        *stay(
            S_LOCAL_CHUNK_AFTER_END,
            [SEND_UNPUBLISHED, SEND_PUBLISHING, SEND_PUBLISHED, SEND_ENDED],
            conditions="endpoint_finished_it",
        ),
        {
            "trigger": S_LOCAL_BAD_CHUNK,
            "source": [SEND_PUBLISHING, SEND_PUBLISHED],
            "dest": SEND_PUBLISHED,
            "effect": EFFECT_ABORT,
        },
        *stay(S_LOCAL_BAD_CHUNK, [SEND_ENDED], EFFECT_ABORT),
        {
            "trigger": S_LOCAL_VLLM_FINISHED,
            "source": SEND_PUBLISHING,
            "dest": SEND_FINISHING,
            "effect": EFFECT_ABORT,
        },
        {"trigger": S_LOCAL_VLLM_FINISHED, "source": SEND_PUBLISHED, "dest": SEND_FINISHING},
        {
            "trigger": S_LOCAL_VLLM_FINISHED,
            "source": [SEND_UNPUBLISHED, SEND_ENDED],
            "dest": SEND_DONE,
        },
        {
            "trigger": S_RECV_FINISHED,
            "source": [SEND_PUBLISHING, SEND_PUBLISHED],
            "dest": SEND_ENDED,
        },
        {"trigger": S_RECV_FINISHED, "source": SEND_FINISHING, "dest": SEND_DONE},
    ),
)

# -- vLLM load -----------------------------------------------------------------------------

LOAD_NEW: Final = "new"
LOAD_LOADING: Final = "loading"
LOAD_FAILED_LOCALLY: Final = "failed_locally"
LOAD_RELEASE_PENDING: Final = "release_pending"
LOAD_RELEASED: Final = "released"

L_LOCAL_ADDED: Final = "LOCAL_ADDED"
L_LOCAL_ADD_FAILED: Final = "LOCAL_ADD_FAILED"
L_LOCAL_DUPLICATE: Final = "LOCAL_DUPLICATE"
L_LOCAL_FAIL: Final = "LOCAL_FAIL"
L_LOCAL_COMPLETED: Final = "LOCAL_COMPLETED"
L_LOCAL_QUIESCENT: Final = "LOCAL_QUIESCENT"

EFFECT_REPORT_LOCAL: Final = "report_local"  # report the local failure as an outcome
EFFECT_RELEASE: Final = "release"  # release it in the endpoint

#: Terminal on every rank: being released, or released.
LOAD_FINISHED: Final = frozenset({LOAD_RELEASE_PENDING, LOAD_RELEASED})

VLLM_LOAD: Final = MachineSpec(
    name="vLLM load",
    doc="""
    One Decode request as the connector worker tracks it. It loads until every TP rank
    ended it; its blocks are handed back to vLLM only once no read can still write them.
    A rendezvous failure, or vLLM finishing it first, aborts the load.
    """,
    states=(LOAD_NEW, LOAD_LOADING, LOAD_FAILED_LOCALLY, LOAD_RELEASE_PENDING, LOAD_RELEASED),
    initial=LOAD_NEW,
    terminal=frozenset({LOAD_RELEASED}),
    transitions=(
        {"trigger": L_LOCAL_ADDED, "source": LOAD_NEW, "dest": LOAD_LOADING},
        {
            "trigger": L_LOCAL_ADD_FAILED,
            "source": LOAD_NEW,
            "dest": LOAD_FAILED_LOCALLY,
            "effect": EFFECT_REPORT_LOCAL,
        },
        # Two live loads under one external id: Prefill could not tell them apart.
        {"trigger": L_LOCAL_DUPLICATE, "source": LOAD_NEW, "dest": LOAD_RELEASED},
        *stay(L_LOCAL_FAIL, [LOAD_LOADING], EFFECT_ABORT),
        # The first failure is the one reported; one after the end changes nothing.
        *stay(L_LOCAL_FAIL, [LOAD_FAILED_LOCALLY, LOAD_RELEASE_PENDING, LOAD_RELEASED]),
        {
            "trigger": L_LOCAL_COMPLETED,
            "source": LOAD_LOADING,
            "dest": LOAD_RELEASE_PENDING,
            "effect": EFFECT_RELEASE,
        },
        # Nothing of it is in the endpoint: no read can write its blocks.
        {"trigger": L_LOCAL_COMPLETED, "source": LOAD_FAILED_LOCALLY, "dest": LOAD_RELEASED},
        {
            "trigger": L_LOCAL_QUIESCENT,
            "source": LOAD_RELEASE_PENDING,
            "dest": LOAD_RELEASED,
            "conditions": "no_read_in_flight",
        },
    ),
)

#: Every machine of the vLLM connector, for the docs generator and the table tests.
VLLM_MACHINES: Final[tuple[MachineSpec, ...]] = (VLLM_SEND, VLLM_LOAD)
