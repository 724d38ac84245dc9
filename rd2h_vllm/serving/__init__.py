"""Real vLLM serving on this host: tiny models, servers, proxy, client, ``rd2h demo --vllm``.

Theory of operation
-------------------
A Prefill/Decode deployment is reproduced on 127.0.0.1 with nothing but this machine:

1. :mod:`~rd2h_vllm.serving.model` writes a tiny model folder (a byte-level BPE
   tokenizer trained here, a small ``LlamaForCausalLM`` or MLA ``DeepseekV3ForCausalLM``
   config, seeded random weights in safetensors). The weights are large enough that the
   output depends on the whole prompt, so a wrong KV cache shows as wrong tokens.
2. :mod:`~rd2h_vllm.serving.processes` starts ``python -m
   vllm.entrypoints.openai.api_server`` children, one process group each: Prefill
   (``kv_producer``), Decode (``kv_consumer``, control ports chosen free at run time) or
   plain (no connector), and ``rd2h proxy``; it waits for ``/health`` with a deadline and
   puts the child's log tail into every error. Stopping is SIGTERM then SIGKILL to the
   whole group; children die with the process that started them (``PR_SET_PDEATHSIG``,
   and an ``atexit`` hook) so nothing outlives a test run. Start children from a
   long-lived thread: the death signal follows the starting *thread*.
3. :mod:`~rd2h_vllm.serving.cluster` groups servers and the proxy into a
   :class:`~rd2h_vllm.serving.cluster.PDCluster`; launching is separate from waiting so
   the slow vLLM start-ups (about a minute each on two cores) overlap.
4. :mod:`~rd2h_vllm.serving.client` sends greedy fixed-length completions and returns
   their token ids (``return_token_ids``), streams and drops a connection mid-stream
   (vLLM aborts that request), and reads ``/metrics``: request and KV-usage gauges,
   prompt tokens by source (``external_kv_transfer`` = loaded by the connector) and
   RD2H's ``vllm:rd2h_*`` series.
5. ``rd2h demo --vllm`` (:mod:`rd2h_app.vllm_demo`, in the application package above
   this one) puts these pieces together: the single-instance tokens come from the Prefill
   server with no ``kv_transfer_params`` (salted out of the prefix cache), then the same
   prompts go through the proxy; it prints ``tokens match: N/N``.

6. :mod:`~rd2h_vllm.serving.router` starts ``vllm-router`` (vLLM's Rust router) in P/D
   mode in front of Prefill and Decode: the standard Prefill-first flow, for vLLM's
   NixlConnector servers (``ServerSpec`` role "nixl_connector") and RD2H's alike
   (``python -m benchmarks.bench_serving`` compares them).

``tests/serving`` uses the same pieces. Nothing here imports vLLM: the servers do.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RouterProcess", "start_router"]


def __getattr__(name: str) -> Any:
    """The router harness, imported on first use (``from rd2h_vllm.serving import
    start_router``)."""
    if name in ("RouterProcess", "start_router"):
        from rd2h_vllm.serving import router

        return getattr(router, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
