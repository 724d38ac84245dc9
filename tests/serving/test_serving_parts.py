"""The pieces of rd2h_vllm.serving that need no server: models, prompts, metrics, CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rd2h_app import demo
from rd2h_vllm.serving.client import completion_body, parse_metrics
from rd2h_vllm.serving.model import build_model, make_prompts
from rd2h_vllm.serving.processes import (
    ManagedProcess,
    ServerSpec,
    kv_transfer_config,
    server_command,
)


@pytest.mark.parametrize("kind", ["llama", "deepseek"])
def test_models_are_the_same_bytes_wherever_they_are_built(tmp_path: Path, kind: str) -> None:
    a = build_model(tmp_path / "a", kind)  # type: ignore[arg-type]
    b = build_model(tmp_path / "b", kind)  # type: ignore[arg-type]
    names = sorted(p.name for p in a.path.iterdir())
    assert names == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    for name in names:
        assert (a.path / name).read_bytes() == (b.path / name).read_bytes(), name
    config = json.loads((a.path / "config.json").read_text())
    assert config["vocab_size"] == a.vocab_size <= 512
    assert a.kv_bytes_per_token == (576 * 4 * 3 if kind == "deepseek" else 2 * 2 * 32 * 4 * 4)


def test_prompts_are_distinct_and_reproducible() -> None:
    prompts = make_prompts(20, seed=7, words=(5, 30))
    assert len(set(prompts)) == 20
    assert prompts == make_prompts(20, seed=7, words=(5, 30))
    assert all(5 <= len(p.split()) <= 30 for p in prompts)


def test_server_command_carries_the_connector_json(tmp_path: Path) -> None:
    model = build_model(tmp_path / "m", "deepseek")
    spec = ServerSpec(model, "decode", "mooncake", extra_config={"kv_load_timeout_s": 5})
    cmd = server_command(spec, port=8200, kv_port=20050)
    transfer = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert transfer == kv_transfer_config(spec, 20050)
    assert transfer["kv_role"] == "kv_consumer" and transfer["kv_port"] == 20050
    assert transfer["kv_connector_extra_config"] == {
        "transfer_backend": "mooncake",
        "advertise_host": "127.0.0.1",
        "kv_load_timeout_s": 5,
    }
    assert "-rotary_embedding" in cmd[cmd.index("--compilation-config") + 1]
    assert kv_transfer_config(ServerSpec(model, "plain"), None) is None
    producer = kv_transfer_config(ServerSpec(model, "prefill"), None)
    assert producer is not None and "kv_port" not in producer


def test_completion_requests_are_greedy_and_ask_for_token_ids() -> None:
    body = completion_body("m", "hi", 7)
    assert body["temperature"] == 0.0 and body["return_token_ids"] is True
    assert body["ignore_eos"] is True and body["max_tokens"] == 7


def test_metrics_are_summed_over_labels() -> None:
    text = "\n".join(
        [
            "# TYPE vllm:num_requests_running gauge",
            'vllm:num_requests_running{engine="0",model_name="m"} 2.0',
            "# TYPE vllm:prompt_tokens_by_source counter",
            'vllm:prompt_tokens_by_source_total{engine="0",source="local_compute"} 3.0',
            'vllm:prompt_tokens_by_source_total{engine="0",source="external_kv_transfer"} 40.0',
            "# TYPE vllm:rd2h_read_bytes counter",
            'vllm:rd2h_read_bytes_total{engine="0",layer="0"} 100.0',
            'vllm:rd2h_read_bytes_total{engine="0",layer="1"} 50.0',
            "# TYPE vllm:rd2h_aborts counter",
            'vllm:rd2h_aborts_total{engine="0",direction="sent"} 2.0',
            "",
        ]
    )
    metrics = parse_metrics(text)
    assert metrics.running == 2 and metrics.waiting == 0 and not metrics.idle
    assert metrics.prompt_tokens("external_kv_transfer") == 40
    assert metrics.prompt_tokens("local_compute") == 3
    assert metrics.rd2h_read_bytes == 150
    assert metrics.read_bytes_by_layer() == {"0": 100.0, "1": 50.0}
    assert metrics.rd2h_aborts("sent") == 2 and metrics.rd2h_aborts("received") == 0
    assert "external_kv_transfer=40" in repr(metrics)


def test_demo_vllm_is_delegated(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        demo.main(["--vllm", "--help"])
    assert exc.value.code == 0
    assert "rd2h demo --vllm" in capsys.readouterr().out


def test_the_demo_loads_rd2h_vllm_only_for_vllm() -> None:
    code = "import sys, rd2h_app.demo, rd2h_app.cli; print('rd2h_vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_set_cpu_priority_nices_the_child_and_its_session(tmp_path: Path) -> None:
    child = ManagedProcess(
        "sleeper", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "s.log"
    )
    autogroup = Path(f"/proc/{child.pid}/autogroup")

    def nice() -> tuple[int, str | None]:
        group = autogroup.read_text().split()[-1] if autogroup.exists() else None
        return os.getpriority(os.PRIO_PROCESS, child.pid), group

    try:
        child.set_cpu_priority(7)
        # Kernels that share CPU time by session first have the session's nice too.
        assert nice() == (7, "7" if autogroup.exists() else None)
        child.set_cpu_priority(0)  # back to full priority: only root may lower a nice
        want = 0 if os.geteuid() == 0 else 7
        assert nice() == (want, str(want) if autogroup.exists() else None)
    finally:
        child.kill()
