"""The decision log (RotatingFileHandler behind a QueueListener) and the server's JSON log."""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import math
import re
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from nightjar_common.types import (
    BinType,
    Choice,
    EngineRuntime,
    RequestSignals,
    StepContext,
    StepOutcome,
)
from policy_server.decision_log import (
    RECORD_REQUESTS,
    DecisionLog,
    context_fields,
    context_from_json,
    decision_record,
    log_files,
    read_records,
)
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
        decision = service.run_step(ctx)
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


def test_a_logged_context_reads_back_as_it_was_runtime_included() -> None:
    # The plugin sends how its engine runs speculation; the default reads it (whether
    # per-request γ applies), so a replay of a real engine's log needs it back as it was.
    ctx = StepContext(
        "e",
        batch_size=4,
        step_index=7,
        runtime=EngineRuntime("0.32.0", "v1", async_scheduling=True, method="draft_model"),
    )
    record = json.loads(json.dumps(context_fields(ctx)))
    assert context_from_json(record["context"]) == ctx


def test_nightjarctl_replay_of_an_engine_that_reports_its_runtime(tmp_path: Path) -> None:
    path = tmp_path / "decisions.jsonl"
    decision_log = DecisionLog(path)
    service = DecisionService("goodput", {"seed": 3}, decision_log=decision_log)
    runtime = EngineRuntime("0.32.0", "v1", method="draft_model")
    for step in range(40):
        ctx = StepContext("e", batch_size=4, step_index=step, max_gamma=3, runtime=runtime)
        decision = service.run_step(ctx)
        tokens = ctx.batch_size * (1 + decision.gamma)
        service.report(StepOutcome(decision.decision_id, "e", decision.gamma, 0.02, tokens))
    decision_log.close()
    replayed = ctl_replay(path, tmp_path / "warm.json")
    assert replayed.returncode == 0, replayed.stderr
    assert "40 decisions, 40 with outcomes" in replayed.stdout


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


# -- the log off the decision path: failures, large contexts, shutdown (issue 54 item 7) --


def _wire_context(step: int, requests: int = 0, accepts: int = 0, max_gamma: int = 0) -> Any:
    """A context of ``requests`` per-request sections (batch size as many, at least 1), each
    with ``accepts`` recent accepts; ``max_gamma`` > 0: an engine speculating up to it (its
    draft resident), 0: not speculating."""
    from nightjar_proto.v1 import policy_pb2

    return policy_pb2.StepContext(
        engine_id="e",
        batch_size=max(requests, 1),
        step_index=step,
        max_gamma=max_gamma,
        draft_resident=max_gamma > 0,
        requests=[
            policy_pb2.RequestSignals(
                request_id=f"r{i}",
                context_tokens=i,
                recent_accepts=[(i + k) % 3 for k in range(accepts)],
            )
            for i in range(requests)
        ],
    )


def _wire_outcome(decided: Any, per_request: bool = False) -> Any:
    """What a step of ``decided`` achieved: every request accepted one draft, if it drafted."""
    from nightjar_proto.v1 import policy_pb2

    batch, accepted = decided.batch_size, min(decided.gamma, 1)
    return policy_pb2.StepOutcome(
        decision_id=decided.decision_id,
        engine_id="e",
        gamma=decided.gamma,
        step_seconds=0.02,
        generated_tokens=2 * batch,
        drafted_tokens=decided.gamma * batch,
        accepted_tokens=accepted * batch,
        requests=[
            policy_pb2.RequestAccepts(request_id=f"r{i}", accepted_tokens=accepted)
            for i in range(batch if per_request else 0)
        ],
    )


def _run_steps(
    server: Any, steps: int, requests: int = 0, accepts: int = 0, max_gamma: int = 0
) -> int:
    """``steps`` decided, run and reported on one stream; the records they make, with the
    policy record of the start."""
    with server.engine() as engine:
        for step in range(steps):
            decided = engine.decide(_wire_context(step, requests, accepts, max_gamma))
            engine.report(_wire_outcome(decided, per_request=requests > 0))
    return 1 + 2 * steps


def _closing_counts(log: str) -> tuple[int, int]:
    """The written and dropped counts of the sidecar's last line about its decision log."""
    found = re.findall(r"decision log \S+ closed: (\d+) records written, (\d+) dropped", log)
    assert found, log
    written, dropped = found[-1]
    return int(written), int(dropped)


STATIC = ("--policy", "static", "--params", '{"gamma": 2}')


def test_a_full_disk_drops_and_counts_records_with_one_error_and_stops_cleanly(
    make_server: Any,
) -> None:
    """The decision log on /dev/full, where every write fails with ENOSPC as on a full disk
    (no root needed): each record is counted in nightjar_decision_log_dropped_total, the
    server says so in one ERROR line, without a traceback, and SIGTERM ends it with rc 0."""
    from tests.policy_server.test_server import scrape

    server = make_server(*STATIC, "--decision-log", "/dev/full")
    records = _run_steps(server, 40)
    deadline = time.monotonic() + 30

    def dropped() -> float:
        (sample,) = [
            s
            for s in scrape(server.metrics_port)["nightjar_decision_log_dropped"]
            if s.name.endswith("_total")
        ]
        return float(sample.value)

    while dropped() < records and time.monotonic() < deadline:
        time.sleep(0.05)
    assert dropped() == records
    assert server.terminate() == 0
    log = server.log()
    assert "Traceback" not in log, log
    errors = [line for line in log.splitlines() if " ERROR " in line]
    assert len(errors) == 1, log
    assert "/dev/full" in errors[0] and "No space left on device" in errors[0]
    assert "nightjar_decision_log_dropped_total" in errors[0]
    assert _closing_counts(log) == (0, records)
    assert log.splitlines()[-1].endswith("stopped")


def test_a_disk_that_fills_keeps_the_records_before_it_and_counts_the_rest(
    make_server: Any, tmp_path: Path
) -> None:
    """The running sidecar's file size limited to 64 KiB (RLIMIT_FSIZE, which needs no
    root): its log fills as on a full disk, the write that reaches the limit leaving a torn
    line and every later one failing (EFBIG). The records before are whole and in order,
    the rest counted as dropped, with one ERROR line and rc 0 at SIGTERM."""
    path = tmp_path / "decisions.jsonl"
    server = make_server(*STATIC, "--decision-log", str(path))
    resource.prlimit(server.proc.pid, resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))
    records = _run_steps(server, 200)
    assert server.terminate() == 0
    log = server.log()
    assert "Traceback" not in log, log
    errors = [line for line in log.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "File too large" in errors[0], log
    written, dropped = _closing_counts(log)
    assert written + dropped == records and written > 0 and dropped > 0
    assert path.stat().st_size == 64 << 10
    kinds = [r["kind"] for r in read_records([path])]  # the torn last line skipped
    assert kinds == ["policy", *(["decision", "outcome"] * records)][:written]


def test_a_large_context_is_trimmed_in_its_record(make_server: Any, tmp_path: Path) -> None:
    """A step of 4,096 requests with 256 recent accepts each (the most a context may carry):
    its decision and outcome records keep the first RECORD_REQUESTS per-request sections,
    each with its last RECORD_RECENT_ACCEPTS recent accepts, and say how many went; a
    small step's records are whole and say nothing; nightjarctl replay reads both."""
    path = tmp_path / "decisions.jsonl"
    server = make_server(*STATIC, "--decision-log", str(path))
    _run_steps(server, 1, requests=4096, accepts=256)
    _run_steps(server, 1, requests=2, accepts=3)
    assert server.terminate() == 0
    records = list(read_records([path]))
    large, small = [r for r in records if r["kind"] == "decision"]
    large_outcome, small_outcome = [r for r in records if r["kind"] == "outcome"]

    sections = large["context"]["requests"]
    assert len(sections) < 4096 and large.get("requests_cut") == 4096 - len(sections)
    from policy_server import decision_log

    kept, recent = decision_log.RECORD_REQUESTS, decision_log.RECORD_RECENT_ACCEPTS
    assert [r["request_id"] for r in sections] == [f"r{i}" for i in range(kept)]
    assert all(
        r["recent_accepts"] == [(i + k) % 3 for k in range(256 - recent, 256)]
        for i, r in enumerate(sections)
    )
    assert large["requests_cut"] == 4096 - kept
    assert large["recent_accepts_cut"] == kept * (256 - recent)
    assert large["context"]["batch_size"] == 4096  # what the policy saw is unchanged
    assert large_outcome["outcome"]["request_ids"] == [f"r{i}" for i in range(kept)]
    accepted = min(large["gamma"], 1)  # by each request (_wire_outcome)
    assert large_outcome["outcome"]["request_accepts"] == [accepted] * kept
    assert large_outcome["outcome"]["accepted_tokens"] == accepted * 4096  # the totals whole
    assert large_outcome["requests_cut"] == 4096 - kept

    assert [r["recent_accepts"] for r in small["context"]["requests"]] == [[0, 1, 2], [1, 2, 0]]
    assert not {"requests_cut", "recent_accepts_cut"} & (set(small) | set(small_outcome))
    replayed = ctl_replay(path, tmp_path / "warm.json", "--policy", "goodput")
    assert replayed.returncode == 0, replayed.stderr
    assert "2 decisions, 2 with outcomes" in replayed.stdout


def test_a_decision_record_names_each_requests_gamma_trimmed_like_its_context() -> None:
    """A per-request decision's record says what γ each request was told (the first
    RECORD_REQUESTS of them, and how many went); a batch decision's record has no such
    field."""
    count = RECORD_REQUESTS + 44
    ids = [f"r{i}" for i in range(count)]
    ctx = StepContext(
        engine_id="e1",
        step_index=1,
        batch_size=count,
        max_gamma=4,
        requests=tuple(RequestSignals(rid, 100, (1,)) for rid in ids),
    )
    planned = Choice(
        3, BinType.FIXED, request_gammas=tuple((rid, i % 4) for i, rid in enumerate(ids))
    )
    record = json.loads(json.dumps(decision_record(1.0, "t.1", planned, "goodput", "v", ctx)))
    assert record["request_gammas"] == {rid: i % 4 for i, rid in enumerate(ids[:RECORD_REQUESTS])}
    assert record["request_gammas_cut"] == 44
    assert len(record["context"]["requests"]) == RECORD_REQUESTS  # the same requests kept

    small = dataclasses.replace(ctx, batch_size=2, requests=ctx.requests[:2])
    few = Choice(3, BinType.FIXED, request_gammas=(("r0", 0), ("r1", 3)))
    record = decision_record(1.0, "t.2", few, "goodput", "v", small)
    assert record["request_gammas"] == {"r0": 0, "r1": 3} and "request_gammas_cut" not in record
    batch = decision_record(1.0, "t.3", Choice(3, BinType.FIXED), "goodput", "v", small)
    assert not {"request_gammas", "request_gammas_cut"} & set(batch)


def test_a_replay_learns_each_request_at_the_gamma_it_was_told(tmp_path: Path) -> None:
    """Replayed, a logged per-request decision teaches each request's record at its own γ:
    r0, told γ 1, accepted its one draft (no failure); read at the step's γ 3 instead (a
    log without request_gammas), the same accept counts as a failure."""
    from policy_server.decision_log import outcome_record
    from policy_server.replay import replay

    ids = ("r0", "r1")
    ctx = StepContext(
        engine_id="e1",
        step_index=1,
        batch_size=2,
        max_gamma=3,
        requests=tuple(RequestSignals(rid, 100, ()) for rid in ids),
    )
    outcome = StepOutcome(
        decision_id="t.1",
        engine_id="e1",
        gamma=3,
        step_seconds=0.02,
        generated_tokens=5,
        drafted_tokens=4,
        accepted_tokens=3,
        request_accepts=(1, 2),
        request_ids=ids,
    )

    def failures_of_r0(choice: Choice, name: str) -> float:
        path = tmp_path / name
        records = [
            decision_record(1.0, "t.1", choice, "goodput", "v", ctx),
            outcome_record(1.1, outcome),
        ]
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        state = replay([path], "goodput", {"per_request": True}).policy.state()
        return float(state["engines"]["e1"]["requests"]["r0"][1])

    told = Choice(3, BinType.FIXED, request_gammas=(("r0", 1), ("r1", 3)))
    assert failures_of_r0(told, "told.jsonl") == 0.0
    assert failures_of_r0(Choice(3, BinType.FIXED), "batch.jsonl") == 1.0


def test_a_per_request_policys_records_name_the_gammas_its_engine_was_told(
    make_server: Any, tmp_path: Path
) -> None:
    """dsde decides per request once calibrated: each such decision record the real server
    writes holds the request_gammas its table sent, one for each of the context's requests,
    none above the step's γ."""
    path = tmp_path / "decisions.jsonl"
    params = '{"calibration_steps": 2}'
    server = make_server("--policy", "dsde", "--params", params, "--decision-log", str(path))
    _run_steps(server, 6, requests=5, accepts=4, max_gamma=4)
    assert server.terminate() == 0
    decisions = [r for r in read_records([path]) if r["kind"] == "decision"]
    calibrating = [r for r in decisions if r["exploration"]]
    assert len(calibrating) == 2 and not any("request_gammas" in r for r in calibrating)
    assert len(decisions) == 6
    for record in decisions[2:]:
        told = record["request_gammas"]
        assert set(told) == {f"r{i}" for i in range(5)}
        assert all(0 <= gamma <= record["gamma"] for gamma in told.values())


def test_sigterm_with_records_in_flight_writes_each_or_counts_it(
    make_server: Any, tmp_path: Path
) -> None:
    """SIGTERM right after steps whose records the writer may still hold: rc 0, no
    traceback, and every record is in the file or counted as dropped in the closing line."""
    path = tmp_path / "decisions.jsonl"
    server = make_server(*STATIC, "--decision-log", str(path))
    records = _run_steps(server, 30, requests=1024, accepts=64)
    assert server.terminate() == 0
    log = server.log()
    assert "Traceback" not in log, log
    written, dropped = _closing_counts(log)
    assert written + dropped == records
    assert sum(1 for _ in read_records([path])) == written


class _FailingDisk:
    """A log file whose writes fail with EIO while ``failing`` is set, after writing half
    of what they were given (a torn line, as a disk failing mid-write leaves)."""

    failing = False

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        if not _FailingDisk.failing:
            return int(self._stream.write(text))
        self._stream.write(text[: len(text) // 2])
        self._stream.flush()
        raise OSError(errno.EIO, "Input/output error")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def test_a_disk_that_fails_and_recovers_loses_only_the_records_it_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Writes failing with EIO are dropped and counted with one ERROR line, the torn lines
    they leave never swallow a later record, and writing resumes when the disk does."""
    metrics = Metrics()
    path = tmp_path / "decisions.jsonl"
    decision_log = DecisionLog(path, on_drop=metrics.decision_log_dropped.inc)
    handler = decision_log._handler
    real_open = handler._open
    monkeypatch.setattr(handler, "_open", lambda: _FailingDisk(real_open()))
    handler.stream.close()
    handler.stream = None  # reopened through the failing disk

    def write(*ids: str) -> None:
        for decision_id in ids:
            decision_log.write({"kind": "decision", "decision_id": decision_id})
        decision_log.flush()

    with caplog.at_level(logging.INFO, logger="policy_server.decision_log"):
        write("a", "b")
        monkeypatch.setattr(_FailingDisk, "failing", True)
        write("lost1", "lost2", "lost3")
        monkeypatch.setattr(_FailingDisk, "failing", False)
        write("c", "d")
        decision_log.close()
    assert [r["decision_id"] for r in read_records([path])] == ["a", "b", "c", "d"]
    assert metrics.registry.get_sample_value("nightjar_decision_log_dropped_total") == 3
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "Input/output error" in errors[0], errors
    assert not any(r.exc_info for r in caplog.records)
    assert any("writing again" in r.getMessage() for r in caplog.records)
    assert (decision_log.written, decision_log.dropped) == (4, 3)


def test_close_counts_what_a_hung_writer_holds_as_dropped(tmp_path: Path) -> None:
    """close() waits for the writer at most its timeout: a record it hangs on (a hung disk)
    and the records queued behind it are counted as dropped, and close returns."""
    metrics = Metrics()
    path = tmp_path / "decisions.jsonl"
    decision_log = DecisionLog(path, on_drop=metrics.decision_log_dropped.inc)
    decision_log.write({"kind": "decision", "decision_id": "written"})
    decision_log.flush()
    release = threading.Event()
    decision_log.write(lambda: release.wait() and {"kind": "decision", "decision_id": "hung"})
    for index in range(5):
        decision_log.write({"kind": "decision", "decision_id": f"queued{index}"})
    decision_log.close(timeout=0.2)
    try:
        assert (decision_log.written, decision_log.dropped) == (1, 6)
        assert metrics.registry.get_sample_value("nightjar_decision_log_dropped_total") == 6
        decision_log.write({"kind": "decision", "decision_id": "after close"})
        assert decision_log.dropped == 7
    finally:
        release.set()
