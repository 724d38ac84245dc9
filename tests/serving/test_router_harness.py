"""The vllm-router harness's command line (no router or server is started here)."""

from __future__ import annotations

from rd2h_vllm.serving.processes import HOST
from rd2h_vllm.serving.router import READY_PATH, router_command


def test_router_command_is_the_documented_pd_invocation() -> None:
    cmd = router_command(
        ["http://127.0.0.1:8100"], ["http://127.0.0.1:8200"], port=9000, prometheus_port=9001
    )
    assert cmd[:6] == [
        "vllm-router",
        "--vllm-pd-disaggregation",
        "--prefill",
        "http://127.0.0.1:8100",
        "--decode",
        "http://127.0.0.1:8200",
    ]
    flags = dict(zip(cmd[6::2], cmd[7::2], strict=True))
    assert flags == {
        "--host": HOST,
        "--port": "9000",
        # the router's default Prometheus port (29000) is one per host: never shared
        "--prometheus-host": HOST,
        "--prometheus-port": "9001",
        "--worker-startup-check-interval": "1",
        "--log-level": "warning",
    }
    assert READY_PATH == "/readiness"


def test_router_command_repeats_prefill_and_decode_and_appends_extra_args() -> None:
    cmd = router_command(
        ["http://a:1", "http://b:2"], ["http://c:3"], 9000, 9001, extra_args=["--disable-retries"]
    )
    assert cmd.count("--prefill") == 2 and cmd.count("--decode") == 1
    assert cmd[-1] == "--disable-retries"
