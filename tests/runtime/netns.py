"""The two-host tests' namespaces: :mod:`rd2h_runtime.testing.netns` made test-aware.

:func:`two_hosts` makes a Prefill/Decode namespace pair for one test and removes it when the
test ends, also on failure. Where namespaces cannot be made (no root, no iproute2),
:func:`require` fails the test in CI (the ``CI`` environment variable set: the suite runs as
root there, so a missing capability is a broken runner) and skips it elsewhere.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import NoReturn

import pytest

from rd2h_runtime.testing import netns
from rd2h_runtime.testing.netns import TwoHosts, leftovers

__all__ = ["TwoHosts", "leftovers", "require", "two_hosts"]


def require(need_tc: bool = False) -> None:
    """Fail (in CI) or skip (elsewhere) the calling test when namespaces cannot be made."""
    reason = netns.unavailable(need_tc)
    if reason is not None:
        _refuse(reason)


def _refuse(reason: str) -> NoReturn:
    message = f"two-host tests cannot run: {reason}"
    if os.environ.get("CI"):
        pytest.fail(f"{message} (CI is set: its runner must allow this)", pytrace=False)
    pytest.skip(message)


@contextlib.contextmanager
def two_hosts() -> Iterator[TwoHosts]:
    """A fresh namespace pair for one test; fails (CI) or skips it when none can be made."""
    with contextlib.ExitStack() as stack:
        try:
            hosts = stack.enter_context(netns.two_hosts())
        except netns.NamespacesUnavailable as exc:
            _refuse(str(exc))
        yield hosts
