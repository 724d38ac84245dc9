"""``rd2h check-read``: PASS on real backends between two processes, FAIL said clearly."""

from __future__ import annotations

import itertools
import socket

import numpy as np
import pytest

from rd2h_protocol.errors import ConfigError
from rd2h_runtime.testing.check_read import _parse_options, main, run_check_read
from rd2h_runtime.testing.check_read_sides import CheckResult, pattern, scatter_ranges

pytestmark = pytest.mark.timeout(90)
SIZE = str(8 << 20)


@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_two_processes_pass(backend: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--backend", backend, "--size", SIZE, "--timeout", "60"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith(f"PASS: {backend}: {SIZE} bytes verified")
    text = "\n".join(lines)
    assert "SHA-256 verified" in text and "GiB/s" in text
    assert text.count("TransferError as expected") == 2


def test_loopback_runs_both_sides_in_this_process(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--backend", "loopback", "--size", SIZE, "--chunk", "65536"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("PASS: loopback")
    assert any("128 descriptors of 65536 bytes" in line for line in out)


def test_decode_without_a_prefill_fails_within_its_timeout(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["--backend", "loopback", "--role", "decode", "--port", str(port), "--timeout", "1"]
    assert main(argv) == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("FAIL:") and "no answer from Prefill" in last


def test_memfabric_without_an_npu_fails_and_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--backend", "memfabric", "--size", "65536", "--timeout", "60"]) == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("FAIL:") and "Ascend" in last


def test_bad_arguments_fail_cleanly(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--backend", "loopback", "--option", "novalue"]) == 1
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("FAIL: --option")
    assert main(["--backend", "no-such-engine", "--size", "65536"]) == 1
    assert "unknown transfer backend" in capsys.readouterr().out.strip().splitlines()[-1]
    result = run_check_read("loopback", role="decode", port=0)
    assert not result.ok and "needs --port" in result.reason
    assert not run_check_read("loopback", size=0).ok


def test_scatter_ranges_are_disjoint_non_contiguous_and_offset() -> None:
    size = 1 << 20
    ranges = scatter_ranges(size)
    srcs = sorted((s, s + n) for s, _, n in ranges)
    dsts = sorted((d, d + n) for _, d, n in ranges)
    for spans in (srcs, dsts):
        assert all(a[1] < b[0] for a, b in itertools.pairwise(spans))
        assert spans[0][0] > 0 and spans[-1][1] <= size
    assert [d for _, d, _ in ranges] != sorted(d for _, d, _ in ranges)  # permuted
    with pytest.raises(ConfigError):
        scatter_ranges(64)


def test_pattern_is_deterministic_and_options_parse() -> None:
    assert np.array_equal(pattern(1000, 3), pattern(1000, 3))
    assert not np.array_equal(pattern(1000, 3), pattern(1000, 4))
    assert _parse_options(["protocol=device_rdma", "device_id=3"]) == {
        "protocol": "device_rdma",
        "device_id": 3,
    }
    result = CheckResult(True, "fine", "nixl", bytes_read=2**30, seconds=0.5)
    assert result.gib_per_s == 2.0 and result.verdict == "PASS: fine"
