"""The decision log (RotatingFileHandler behind a QueueListener) and the server's JSON log."""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from nightjar_common.types import StepContext, StepOutcome
from policy_server.decision_log import DecisionLog, log_files, read_records
from policy_server.metrics import Metrics
from policy_server.service import DecisionService
from tests.policy_server.test_ctl import ctl_replay


def test_rotation_keeps_order_sizes_and_the_newest_backups(tmp_path: Path) -> None:
    path = tmp_path / "log" / "decisions.jsonl"
    decision_log = DecisionLog(path, max_bytes=2000, backup_count=3)
    for index in range(400):
        decision_log.write({"kind": "decision", "decision_id": f"d{index}", "pad": "x" * 40})
    decision_log.close()
    files = log_files(path)
    assert [f.name for f in files] == [f"{path.name}.{n}" for n in (3, 2, 1)] + [path.name]
    assert all(0 < f.stat().st_size <= 2000 for f in files)
    ids = [int(r["decision_id"][1:]) for r in read_records(files)]
    # Oldest first, contiguous, ending with the last record: only whole old files went.
    assert ids == list(range(ids[0], 400)) and ids[0] > 0


def test_a_full_queue_drops_and_counts_and_nothing_is_lost_silently(tmp_path: Path) -> None:
    metrics = Metrics()
    path = tmp_path / "decisions.jsonl"
    decision_log = DecisionLog(
        path, max_bytes=1 << 30, queue_size=8, on_drop=metrics.decision_log_dropped.inc
    )
    total = 20_000
    for index in range(total):
        decision_log.write({"kind": "decision", "decision_id": f"d{index}"})
    decision_log.close()
    written = sum(1 for _ in read_records([path]))
    dropped = metrics.registry.get_sample_value("nightjar_decision_log_dropped_total")
    assert dropped is not None and dropped > 0
    assert written + dropped == total


def test_a_bad_record_does_not_stop_the_writer(tmp_path: Path) -> None:
    path = tmp_path / "decisions.jsonl"
    decision_log = DecisionLog(path)
    decision_log.write({"kind": "decision", "decision_id": "before"})
    decision_log.write({"kind": "decision", "decision_id": "nan", "gamma": math.nan})
    decision_log.write({"kind": "decision", "decision_id": "after"})
    decision_log.flush()
    assert [r["decision_id"] for r in read_records([path])] == ["before", "after"]
    decision_log.close()


def test_nightjarctl_replay_reads_the_rotated_files(tmp_path: Path) -> None:
    path = tmp_path / "decisions.jsonl"
    decision_log = DecisionLog(path, max_bytes=3000, backup_count=100)
    service = DecisionService("nightjar", {"seed": 3}, decision_log=decision_log)
    for step in range(60):
        ctx = StepContext("e", batch_size=(1, 4, 16)[step % 3], step_index=step)
        decision = service.decide(ctx)
        tokens = ctx.batch_size * (1 + decision.gamma)
        service.report(StepOutcome(decision.decision_id, "e", decision.gamma, 0.02, tokens))
    decision_log.close()
    assert len(log_files(path)) > 3
    out = tmp_path / "warm.json"
    replayed = ctl_replay(path, out, "--policy", "nightjar")
    assert replayed.returncode == 0, replayed.stderr
    assert "60 decisions, 60 with outcomes" in replayed.stdout
    rebuilt = json.loads(out.read_text())["policy"]["state"]["learners"]
    assert rebuilt == service.state_view().state["learners"]


def test_grpcs_own_log_lines_stay_json(make_server: Any, pki: dict[str, Any]) -> None:
    """gRPC's C core writes to stderr past Python (a plaintext client on a TLS port:
    `I1129 … ssl_transport_security.cc:…] Handshake failed …`); under --log-format json
    those lines arrive as JSON records of the `grpc` logger."""
    import grpc

    from tests.policy_server.test_security import health, mutual_tls_server

    server, target = mutual_tls_server(make_server, pki, "--log-format", "json")
    with grpc.insecure_channel(target) as plaintext, pytest.raises(grpc.RpcError):
        health(plaintext)
    deadline = time.monotonic() + 30
    while "Handshake failed" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    server.terminate()
    lines = [json.loads(line) for line in server.log().splitlines() if line.strip()]
    (handshake, *_) = [r for r in lines if "Handshake failed" in r["message"]]
    assert handshake["logger"] == "grpc" and handshake["level"] == "INFO"
    assert "ssl_transport_security.cc" in handshake["message"]
    assert lines[-1]["message"] == "stopped"


def test_a_native_log_line_keeps_its_level() -> None:
    from policy_server.native_log import record_of

    assert record_of("E1129 00:02:35.601073    4059 chttp2_server.cc:12] bind failed") == (
        logging.ERROR,
        "bind failed (chttp2_server.cc:12)",
    )
    assert record_of("something else") == (logging.WARNING, "something else")


def test_server_log_as_json_lines(make_server: Any, tmp_path: Path) -> None:
    server = make_server("--log-format", "json", "--decision-log", str(tmp_path / "d.jsonl"))
    server.terminate()
    lines = [json.loads(line) for line in server.log().splitlines() if line.strip()]
    assert lines and all({"time", "level", "logger", "message"} <= set(r) for r in lines)
    messages = [r["message"] for r in lines]
    assert any(m.startswith("nightjar-server ") and " listening on " in m for m in messages)
    assert messages[-1] == "stopped"
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "policy_server.cli",
            "--uds",
            str(tmp_path / "s.sock"),
            "--log-format",
            "xml",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "invalid choice: 'xml'" in bad.stderr
