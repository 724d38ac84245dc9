"""Fixtures for tests/serving: tiny models built once, one server pool per session.

Each test class names the cluster it uses in a ``cluster`` class attribute. The pool's
plan is the cluster of every collected serving test in run order, so each server starts
once, ahead of use, and stops after the last test that needs it (see serving_pool.py).
Server logs go to a temporary folder (``RD2H_SERVING_LOG_DIR`` names another one to keep
them); a server that fails to start raises with its log tail, and a failed test gets
report sections with the errors, RD2H's warnings and the last lines of every log. The
start-up time of every server is printed at the end of the run.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator, Iterator
from pathlib import Path

# The servers must never reach for a hub; UCX must stay off InfiniBand (see README).
os.environ.setdefault("UCX_MODULES", "^ib")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
from serving_pool import FIGURES, ServerPool, server_specs

from rd2h_vllm.serving.cluster import PDCluster
from rd2h_vllm.serving.model import ModelKind, TinyModel, build_model
from rd2h_vllm.serving.router import RouterProcess, start_router

_STARTUPS: dict[str, float] = {}
_POOL: list[ServerPool] = []  # the session's pool while it exists


def _planned_cluster(item: pytest.Item) -> str | None:
    cls = getattr(item, "cls", None)
    name = getattr(cls, "cluster", None)
    return name if isinstance(name, str) else None


@pytest.fixture(scope="session")
def serving_pool(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerPool]:
    """The session's servers (started lazily, in the order the tests use them)."""
    models: dict[ModelKind, TinyModel] = {}
    model_root = tmp_path_factory.mktemp("models")

    def model(kind: ModelKind) -> TinyModel:
        if kind not in models:
            models[kind] = build_model(model_root / kind, kind)
        return models[kind]

    kept = os.environ.get("RD2H_SERVING_LOG_DIR")
    log_dir = Path(kept) if kept else tmp_path_factory.mktemp("serving-logs")
    pool = ServerPool(server_specs(model, tmp_path_factory.mktemp("traces")), log_dir)
    _POOL.append(pool)
    try:
        order = [c for c in map(_planned_cluster, request.session.items) if c is not None]
        pool.plan(order)
        yield pool
    finally:
        pool.close()
        _POOL.clear()
        _STARTUPS.update(pool.startup_s)


@pytest.fixture(scope="session")
def router_for(serving_pool: ServerPool) -> Iterator[Callable[[PDCluster], RouterProcess]]:
    """``vllm-router`` in P/D mode in front of a cluster's servers (one per cluster, started
    on first use, stopped at the end of the session)."""
    routers: dict[str, RouterProcess] = {}

    def router(cluster: PDCluster) -> RouterProcess:
        if cluster.name not in routers:
            routers[cluster.name] = start_router(
                cluster.prefill, cluster.decode, serving_pool.log_dir, name=f"{cluster.name}-router"
            )
        return routers[cluster.name]

    try:
        yield router
    finally:
        for proc in routers.values():
            proc.stop(grace_s=2.0)


@pytest.fixture(autouse=True)
def _advance_pool(request: pytest.FixtureRequest, serving_pool: ServerPool) -> Iterator[None]:
    """After each planned test: stop servers no later test needs, launch the next ones."""
    yield
    if _planned_cluster(request.node) is not None:
        serving_pool.finished()


LOG_LINES = 25


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed serving test's report gets the log tail of each process of its cluster."""
    report = yield
    name = _planned_cluster(item)
    pool = _POOL[0] if _POOL else None
    if report.failed and name is not None and pool is not None:
        cluster = pool.clusters.get(name)
        procs = [*cluster.prefill, *cluster.decode, cluster.proxy] if cluster else []
        procs += [s for s in pool.servers.values() if s not in procs]
        for proc in procs:
            if proc is None:
                continue
            problems = "\n".join(proc.log_problems(LOG_LINES)) or "(none)"
            report.sections.append((f"errors and RD2H warnings of {proc.name}", problems))
            report.sections.append((f"log tail of {proc.name}", proc.log_tail(LOG_LINES)))
    return report


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if FIGURES:
        terminalreporter.write_sep("-", "RD2H transfers through the proxy (Decode's metrics)")
        for line in FIGURES:
            terminalreporter.write_line(line)
    if _STARTUPS:
        terminalreporter.write_sep("-", "vLLM server start-up (launch to /health)")
        for name, seconds in _STARTUPS.items():
            terminalreporter.write_line(f"{name}: {seconds:.1f} s")
