"""Fixtures for the transfer-backend tests: a Prefill source in a separate process.

The source is ``rd2h_runtime.testing.check_read.prefill_source``: a child process that fills a
buffer with ``check_read.pattern(size, seed)``, registers it with the backend under test
and serves one Decode over ZMQ on 127.0.0.1 (port chosen at run time). The test process
plays Decode with its own backend.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest

from rd2h_runtime.testing.check_read import SourceInfo, prefill_source


@pytest.fixture(scope="module")
def transfer_source() -> Iterator[Callable[[str, int], SourceInfo]]:
    """Factory: ``transfer_source(backend, size)`` -> a running source, one per module+args."""
    with contextlib.ExitStack() as stack:
        started: dict[tuple[str, int], SourceInfo] = {}

        def get(backend: str, size: int) -> SourceInfo:
            if (backend, size) not in started:
                source = prefill_source(backend, size, timeout_s=120)
                started[backend, size] = stack.enter_context(source)
            return started[backend, size]

        yield get
