"""`rd2h proxy` as a real process: starts, answers /healthcheck, stops cleanly on SIGINT."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from proxy_harness import HOST, closed_port


def test_rd2h_proxy_command_serves_and_stops() -> None:
    port = closed_port()
    cmd = [
        sys.executable,
        "-m",
        "rd2h_app.cli",
        "proxy",
        "--host",
        HOST,
        "--port",
        str(port),
        "--prefiller-ports",
        "8100",
        "8101",
        "--decoder-ports",
        "8200",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        health = None
        deadline = time.monotonic() + 6.0
        while health is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://{HOST}:{port}/healthcheck", timeout=1) as r:
                    health = json.load(r)
            except (urllib.error.URLError, ConnectionError):
                assert proc.poll() is None, proc.communicate()[0]
                time.sleep(0.05)
        assert health is not None, "the proxy did not come up"
        assert health["prefill_instances"] == 2 and health["decode_instances"] == 1
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=5)
        assert proc.returncode == 0, out
        assert f"metaserver http://{HOST}:{port}/v1/metaserver" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
