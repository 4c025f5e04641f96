"""Operations on a live sidecar: hot swap, snapshots across kill -9, restore, reset, params."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from nightjar_proto.v1 import admin_pb2

from nightjar_common.client import ClientConfig, NightjarClient
from nightjar_common.types import StepContext, StepOutcome
from tests.policy_server.test_server import context, outcome


def drive(
    server: Any, steps: int, engine: str = "e", batch_sizes: tuple[int, ...] = (1, 4, 16)
) -> None:
    """``steps`` steps of ``engine``: each decided from a table, run and reported."""
    with server.engine() as stream:
        for step in range(steps):
            d = stream.decide(
                context(engine, batch_sizes[step % len(batch_sizes)], step_index=step)
            )
            assert stream.report(outcome(d, engine)).skipped == 0


def test_swap_under_a_running_client_loop(make_server: Any) -> None:
    server = make_server()
    client = NightjarClient(
        ClientConfig(target=server.target, engine_id="live", deadline_s=0.5, connect_timeout_s=5)
    )
    seen: list[tuple[str, str, int]] = []
    stop = threading.Event()

    def engine_loop() -> None:
        step = 0
        while not stop.is_set():
            d = client.decide(StepContext("live", batch_size=2, step_index=step))
            seen.append((d.source, d.policy_name, d.gamma))
            if d.decision_id:
                client.report(StepOutcome(d.decision_id, "live", d.gamma, 0.01, 2 + d.gamma))
            step += 1

    thread = threading.Thread(target=engine_loop)
    thread.start()
    try:
        while len(seen) < 200:
            threading.Event().wait(0.01)
        reply = server.admin.SwapPolicy(
            admin_pb2.SwapPolicyRequest(name="static", params_json='{"gamma": 2}'),
            metadata=server.auth,
            timeout=5,
        )
        swapped_at = len(seen)
        while len(seen) < swapped_at + 200:
            threading.Event().wait(0.01)
    finally:
        stop.set()
        thread.join(timeout=10)
        client.close()
    assert reply.policy_name == "static"
    assert all(source == "sidecar" for source, _, _ in seen), client.stats
    assert client.stats.fallbacks_total == 0
    # Every decision after the swap returned comes from the new policy.
    names = [name for _, name, _ in seen]
    first_static = names.index("static")
    assert first_static <= swapped_at + 1
    assert set(names[first_static:]) == {"static"}
    assert {g for _, n, g in seen if n == "static"} == {2}


def test_snapshot_kill9_restart_restores_identical_state(make_server: Any) -> None:
    server = make_server("--policy", "nightjar")
    drive(server, 60)
    server.admin.Snapshot(admin_pb2.SnapshotRequest(), metadata=server.auth, timeout=5)
    before = server.state()
    server.kill9()
    restarted = server.start()  # same socket, same state dir
    after = restarted.state()
    assert after["state"] == before["state"]
    assert (after["policy"], after["params"]) == (before["policy"], before["params"])
    assert "restored nightjar" in restarted.log()
    # And it continues exactly as the original would have: same next decisions.
    assert after["state"]["engines"]["e"]["rng"] == before["state"]["engines"]["e"]["rng"]


def test_sigterm_writes_a_final_snapshot(make_server: Any) -> None:
    server = make_server("--snapshot-interval", "3600")
    drive(server, 10)
    before = server.state()["state"]
    assert server.terminate() == 0
    document = json.loads((server.state_dir / "snapshot.json").read_text())
    assert document["policy"]["state"] == before


def test_corrupt_snapshot_gives_a_clear_log_line_and_a_fresh_start(make_server: Any) -> None:
    server = make_server(start=False)
    server.state_dir.mkdir(parents=True)
    (server.state_dir / "snapshot.json").write_text('{"format": "nightjar-snapshot/1", "pol')
    server.start()
    assert "is unusable" in server.log() and "starting fresh" in server.log()
    assert server.state()["state"]["engines"] == {}
    quarantined = list(server.state_dir.glob("snapshot.json.corrupt-*"))
    assert len(quarantined) == 1
    # The next start does not trip on it again.
    drive(server, 3)
    server.kill9()
    server.start()
    assert server.log().count("is unusable") == 1


def test_keep_state_swap_set_params_and_reset(make_server: Any) -> None:
    server = make_server("--policy", "nightjar")
    drive(server, 30)
    learned = server.state()["state"]["learners"]
    md = server.auth
    server.admin.SwapPolicy(
        admin_pb2.SwapPolicyRequest(name="nightjar", params_json='{"seed": 5}', keep_state=True),
        metadata=md,
        timeout=5,
    )
    after = server.state()
    assert after["params"]["seed"] == 5 and after["state"]["learners"] == learned
    server.admin.SetParameters(
        admin_pb2.SetParametersRequest(params_json='{"batch_bucketing": "exact"}'),
        metadata=md,
        timeout=5,
    )
    assert server.state()["state"]["learners"] == learned
    drive(server, 5, engine="other")
    server.admin.Reset(admin_pb2.ResetRequest(engine_id="e"), metadata=md, timeout=5)
    state = server.state()["state"]
    assert set(state["engines"]) == {"other"} and "engine:e" not in state["learners"]
    server.admin.Reset(admin_pb2.ResetRequest(), metadata=md, timeout=5)
    assert server.state()["state"]["learners"] == {}
    # Without keep_state a swap starts fresh.
    drive(server, 5)
    server.admin.SwapPolicy(admin_pb2.SwapPolicyRequest(name="nightjar"), metadata=md, timeout=5)
    assert server.state()["state"]["learners"] == {}


def test_warm_start_from_another_replicas_snapshot(make_server: Any) -> None:
    donor = make_server("--policy", "nightjar", name="donor")
    drive(donor, 40)
    donor.admin.Snapshot(admin_pb2.SnapshotRequest(), metadata=donor.auth, timeout=5)
    document = (donor.state_dir / "snapshot.json").read_text()
    fresh = make_server("--policy", "nightjar", name="fresh")
    reply = fresh.admin.Restore(
        admin_pb2.RestoreRequest(snapshot_json=document), metadata=fresh.auth, timeout=5
    )
    assert reply.policy_name == "nightjar"
    assert fresh.state()["state"] == donor.state()["state"]


def test_decision_log_is_written_rotated_and_replayable(make_server: Any, tmp_path: Path) -> None:
    from policy_server.decision_log import join, log_files, read_records
    from policy_server.replay import replay

    log_path = tmp_path / "decisions" / "log.jsonl"
    config = tmp_path / "server.toml"
    config.write_text(
        f'policy = "nightjar"\ndecision_log = "{log_path}"\ndecision_log_max_bytes = 4000\n'
        "decision_log_backups = 50\n"
    )
    server = make_server("--config", str(config))
    drive(server, 40)
    live = server.state()["state"]
    server.terminate()  # flushes the log
    files = log_files(log_path)
    assert len(files) > 2, "the log should have rotated"
    assert all(f.stat().st_size <= 4000 for f in files)
    joined = list(join(read_records(files)))
    assert len(joined) == 40 and all(j.outcome is not None for j in joined)
    first = joined[0].decision
    assert {
        "decision_id",
        "engine_id",
        "context",
        "gamma",
        "exploration",
        "exploration_probability",
        "policy_version",
    } <= set(first)
    # Replaying the log rebuilds the same goodput tables the live server learned.
    rebuilt = replay([log_path], "nightjar").policy.state()
    assert rebuilt["learners"] == live["learners"]
