"""Admin at any size (issue 54 item 6): nightjarctl state, export, import and restore work
for any state a snapshot may hold, past gRPC's default 4 MiB; past the bounds a request is
refused with a message naming the bound and its setting; and hostile documents (100,000
levels deep, a 300,000-character learner id) get a clear error, not a traceback."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
from nightjar_proto.v1 import admin_pb2, admin_pb2_grpc, policy_pb2

from policy_server import config, snapshot
from policy_server.grpc_server import RunningServer, build_server
from policy_server.service import DecisionService
from tests.policy_server.test_snapshot_readable import LEARNER, PER_REQUEST, run_steps

PARAMS = ("--policy", "goodput", "--params", json.dumps(PER_REQUEST))


def large_snapshot(path: Path, min_bytes: int) -> dict[str, Any]:
    """A goodput snapshot of at least ``min_bytes``, written to ``path``: one engine's
    4,096 per-request records (~800 KB), cloned as further engines of its learner."""
    service = DecisionService("goodput", PER_REQUEST)
    run_steps(service, 40)
    document = service.snapshot_document()
    engines = document["policy"]["state"]["engines"]
    while len(snapshot.encode(document)) < min_bytes:
        engine_id = f"e{len(engines)}"
        engines[engine_id] = copy.deepcopy(engines["e0"])
        document["engines"].append(engine_id)
    path.write_bytes(snapshot.encode(document))
    return document


def ctl(server: Any, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "policy_server.ctl", "--target", server.target,
         "--token-file", str(server.token_file), "--timeout", "60", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip


def test_state_export_import_and_restore_past_4_mib(make_server: Any, tmp_path: Path) -> None:
    document = large_snapshot(tmp_path / "large.json", 6 << 20)
    server = make_server(*PARAMS)
    restored = ctl(server, "restore", str(tmp_path / "large.json"))
    assert restored.returncode == 0, restored.stderr
    shown = ctl(server, "state", "--json")
    assert shown.returncode == 0, shown.stderr
    state = json.loads(shown.stdout)["state"]
    assert sorted(state["engines"]) == sorted(document["policy"]["state"]["engines"])
    assert (
        state["engines"]["e7"]["requests"]
        == document["policy"]["state"]["engines"]["e0"]["requests"]
    )
    exported = ctl(server, "export", "--learner-key", LEARNER, "--out", str(tmp_path / "l.json"))
    assert exported.returncode == 0, exported.stderr
    # The import reads the whole state and restores it with the learner merged in.
    imported = ctl(server, "import", str(tmp_path / "l.json"))
    assert imported.returncode == 0, imported.stderr
    assert sorted(json.loads(ctl(server, "state", "--json").stdout)["state"]["engines"]) == sorted(
        state["engines"]
    )


def test_a_restore_past_the_snapshot_bound_is_refused_naming_it(
    make_server: Any, tmp_path: Path
) -> None:
    bound = config.admin_message_bytes(1024)
    large_snapshot(tmp_path / "large.json", bound + (1 << 20))
    (tmp_path / "nightjar.toml").write_text("snapshot_max_bytes = 1024\n")
    server = make_server(*PARAMS, "--config", str(tmp_path / "nightjar.toml"))
    before = server.state()
    refused = ctl(server, "restore", str(tmp_path / "large.json"))
    assert refused.returncode == 1
    assert "RESOURCE_EXHAUSTED" in refused.stderr, refused.stderr
    assert f"more than the {bound:,} bytes" in refused.stderr
    assert "snapshot_max_bytes = 1,024" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert server.state() == before


def test_a_step_request_past_max_receive_bytes_ends_the_stream_naming_it(
    make_server: Any,
) -> None:
    server = make_server()
    huge = policy_pb2.StepContext(engine_id="e", batch_size=1, learner_key="k" * (5 << 20))
    with server.engine() as engine, pytest.raises(ConnectionError) as info:
        engine.send(policy_pb2.StepRequest(context=huge))
    ended = info.value
    assert getattr(ended, "code", None) == grpc.StatusCode.RESOURCE_EXHAUSTED, ended
    assert "max_receive_bytes" in ended.details  # type: ignore[attr-defined]
    assert f"more than the {4 << 20:,} bytes" in ended.details  # type: ignore[attr-defined]
    with server.engine() as engine:  # the server goes on serving
        assert engine.send(
            policy_pb2.StepRequest(context=policy_pb2.StepContext(engine_id="e", batch_size=1))
        ).HasField("table")


def test_getstate_past_its_bound_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A state that grew past what a snapshot may take (per-request records are trimmed
    from snapshots, not from memory) is refused, not sent half-way."""
    monkeypatch.setattr(config, "ADMIN_ENVELOPE_BYTES", 1024)
    service = DecisionService("goodput", PER_REQUEST, snapshot_max_bytes=4096)
    run_steps(service, 2)
    socket = tmp_path / "s.sock"
    running: RunningServer = build_server(service, uds_path=str(socket))
    channel = grpc.insecure_channel(f"unix:{socket}")
    try:
        admin = admin_pb2_grpc.AdminServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            admin.GetState(admin_pb2.GetStateRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "more than the 5,120 a GetState reply may carry" in str(info.value.details())
        assert "snapshot_max_bytes = 4,096" in str(info.value.details())
    finally:
        channel.close()
        running.server.stop(grace=1).wait()


def test_import_refuses_deep_json_and_overlong_learner_ids(
    make_server_module: Any, tmp_path: Path
) -> None:
    server = make_server_module()
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    result = ctl(server, "import", str(deep))
    assert result.returncode == 2
    assert "not a learner document: nested more than 32 levels deep" in result.stderr
    assert "Traceback" not in result.stderr
    long_id = tmp_path / "long.json"
    long_id.write_text(
        json.dumps({"format": "nightjar-learner/1", "learner": "shared:" + "k" * 300_000})
    )
    result = ctl(server, "import", str(long_id))
    assert result.returncode == 2
    assert "the learner's id is 300,000 characters, more than the 256" in result.stderr


def test_restore_refuses_an_overlong_learner_id(make_server_module: Any) -> None:
    """The server's own check, for a client other than nightjarctl."""
    server = make_server_module()
    document = json.loads(
        server.admin.GetState(
            admin_pb2.GetStateRequest(), metadata=server.auth, timeout=5
        ).state_json
    )
    learners = document.setdefault("learners", {})
    learners["shared:" + "k" * 300_000] = next(iter(learners.values()), {})
    before = server.state()
    request = admin_pb2.RestoreRequest(
        snapshot_json=json.dumps(
            {
                "format": snapshot.FORMAT,
                "policy": {"name": before["policy"], "params": before["params"], "state": document},
            }
        )
    )
    with pytest.raises(grpc.RpcError) as info:
        server.admin.Restore(request, metadata=server.auth, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "an object key of 300,007 characters" in str(info.value.details())
    assert server.state() == before


def test_nightjarctl_refuses_a_file_no_sidecar_restores(
    make_server_module: Any, tmp_path: Path
) -> None:
    """Past the most any sidecar restores, nightjarctl says so without sending it."""
    server = make_server_module()
    huge = tmp_path / "huge.json"
    with huge.open("wb") as out:  # sparse: nothing is written but its size
        out.truncate(snapshot.MAX_BYTES + 1)
    result = ctl(server, "restore", str(huge))
    assert result.returncode == 2
    assert f"more than the {snapshot.MAX_BYTES:,} a sidecar restores" in result.stderr
