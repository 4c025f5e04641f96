"""What is written is readable (issue 54 item 1): the snapshot writer keeps within the size
the reader accepts (trimming per-request records, oldest first, or refusing and keeping the
last snapshot), and Restore refuses a state the next snapshot or start could not take."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import grpc
import pytest
from nightjar_proto.v1 import admin_pb2, policy_pb2

from nightjar_common import wire
from nightjar_common.errors import ConfigError, FailedPreconditionError, InvalidArgumentError
from nightjar_common.types import RanStep, StepContext, StepOutcome
from policy_server import snapshot
from policy_server.config import ServerConfig
from policy_server.service import DecisionService
from tests.rigs.sidecar import EngineStream, ServerProcess

PER_REQUEST = {"per_request": True, "seed": 2}
LEARNER = "m@cpu"
BATCH = 120


def context(step: int, engine_id: str = "e0") -> StepContext:
    return StepContext(
        engine_id=engine_id,
        batch_size=BATCH,
        step_index=step,
        previous_gamma=2 if step else None,
        max_gamma=4,
        context_tokens=300 * BATCH,
        learner_key=LEARNER,
    )


def outcome(decision_id: str, gamma: int, step: int, engine_id: str = "e0") -> StepOutcome:
    """A step of BATCH requests with long ids, new ones every step: each leaves a
    per-request record of some 200 bytes in the snapshot."""
    ids = tuple(f"{engine_id}-step{step}-request{i}-".ljust(180, "x") for i in range(BATCH))
    accepts = tuple(i % (gamma + 1) for i in range(BATCH))
    return StepOutcome(
        decision_id=decision_id,
        engine_id=engine_id,
        gamma=gamma,
        step_seconds=0.05,
        generated_tokens=BATCH + sum(accepts),
        drafted_tokens=gamma * BATCH,
        accepted_tokens=sum(accepts),
        request_accepts=accepts,
        request_ids=ids,
    )


def run_steps(service: DecisionService, steps: int) -> None:
    for step in range(steps):
        table = service.table_step([], [], context(step)).table
        assert table is not None
        gamma = table.gammas[BATCH - table.first_batch_size]
        ran = RanStep(f"{table.table_id}.1", context(step), gamma)
        result = service.table_step([ran], [outcome(ran.decision_id, gamma, step)], None)
        assert result.skipped == 0, result.skipped_reason


def records(document: dict[str, Any]) -> int:
    engines = document["policy"]["state"]["engines"]
    return sum(len(engine["requests"]) for engine in engines.values())


def learned_steps(document: dict[str, Any]) -> int:
    learners = document["policy"]["state"]["learners"]
    return sum(int(learner["steps"]) for learner in learners.values())


def test_a_snapshot_past_the_readers_limit_is_trimmed_oldest_records_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    service = DecisionService("goodput", PER_REQUEST, state_dir=tmp_path)
    run_steps(service, 6)
    whole = service.snapshot_document()
    size = len(snapshot.encode(whole))
    assert records(whole) == 6 * BATCH
    monkeypatch.setattr(snapshot, "MAX_BYTES", size * 2 // 3)
    path = service.write_snapshot()
    written = snapshot.read(path)  # what a start reads: within the limit
    assert path.stat().st_size <= snapshot.MAX_BYTES
    assert 0 < records(written) < records(whole)
    assert learned_steps(written) == learned_steps(whole) == 6
    # The newest records are kept: the last step's requests are all there.
    kept = written["policy"]["state"]["engines"]["e0"]["requests"]
    assert all(rid in kept for rid in outcome("x", 1, 5).request_ids)
    assert "trimmed" in caplog.text and "per-request records" in caplog.text
    fresh = DecisionService("goodput", PER_REQUEST)
    fresh.restore_document(written, from_client=False)
    assert learned_steps(fresh.snapshot_document()) == 6


def test_a_snapshot_that_cannot_fit_is_refused_and_the_last_one_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = DecisionService("goodput", PER_REQUEST, state_dir=tmp_path)
    run_steps(service, 2)
    path = service.write_snapshot()
    before = path.read_bytes()
    run_steps(service, 2)
    # Smaller than the learner alone: nothing to trim makes it fit.
    monkeypatch.setattr(snapshot, "MAX_BYTES", 2048)
    with pytest.raises(FailedPreconditionError, match="2,048 bytes"):
        service.write_snapshot()
    assert path.read_bytes() == before
    assert not list(tmp_path.glob(".snapshot.json.*"))


def test_restore_refuses_a_state_no_snapshot_could_hold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A state that, trimmed as the writer trims, is still larger than a snapshot may be
    would leave every later snapshot failing: refused, the active state kept."""
    source = DecisionService("goodput", PER_REQUEST)
    run_steps(source, 3)
    document = source.snapshot_document()
    service = DecisionService("goodput", PER_REQUEST, state_dir=tmp_path)
    run_steps(service, 1)
    before = service.snapshot_document()["policy"]["state"]
    monkeypatch.setattr(snapshot, "MAX_BYTES", 2048)
    with pytest.raises(InvalidArgumentError, match="more than the 2,048"):
        service.restore_document(document)
    assert service.snapshot_document()["policy"]["state"] == before
    # Records are what can be dropped: a state larger only by them is restored.
    monkeypatch.setattr(snapshot, "MAX_BYTES", len(snapshot.encode(document)) * 2 // 3)
    service.restore_document(document)
    assert learned_steps(service.snapshot_document()) == 3


def learned(engine: EngineStream, steps: int) -> None:
    """Steps of a goodput engine over the wire, each with its outcome."""
    ran: list[policy_pb2.RanStep] = []
    outcomes: list[policy_pb2.StepOutcome] = []
    for step in range(steps):
        ctx = wire.context_to_pb(context(step))
        reply = engine.send(policy_pb2.StepRequest(context=ctx, ran_steps=ran, outcomes=outcomes))
        gamma = reply.table.gammas[BATCH - reply.table.first_batch_size]
        decision_id = f"{reply.table.table_id}.1"
        ran = [policy_pb2.RanStep(decision_id=decision_id, context=ctx, gamma=gamma)]
        outcomes = [wire.outcome_to_pb(outcome(decision_id, gamma, step))]
    reply = engine.send(policy_pb2.StepRequest(ran_steps=ran, outcomes=outcomes))
    assert reply.skipped == 0, reply.skipped_reason


def saved(server: ServerProcess) -> dict[str, Any]:
    server.admin.Snapshot(admin_pb2.SnapshotRequest(), metadata=server.auth, timeout=30)
    document: dict[str, Any] = json.loads((server.state_dir / "snapshot.json").read_text())
    return document


def _learner(document: dict[str, Any]) -> dict[str, Any]:
    learner: dict[str, Any] = next(iter(document["policy"]["state"]["learners"].values()))
    return learner


@dataclasses.dataclass(frozen=True)
class Corruption:
    field: str
    where: tuple[str | int, ...]
    value: Any


CORRUPTIONS = [
    Corruption("squared_error", ("step_time", "squared_error"), 1.7e308),
    Corruption("count", ("step_time", "count"), 1.7e308),
    Corruption("moment", ("step_time", "moment", 0), 1.7e308),
    Corruption("context_per_request", ("context_per_request",), 1.7e308),
    Corruption("steps", ("steps",), 1 << 63),
]


def corrupted(document: dict[str, Any], corruption: Corruption) -> dict[str, Any]:
    bad = copy.deepcopy(document)
    node: Any = _learner(bad)
    for key in corruption.where[:-1]:
        node = node[key]
    node[corruption.where[-1]] = corruption.value
    return bad


@pytest.mark.parametrize("corruption", CORRUPTIONS, ids=[c.field for c in CORRUPTIONS])
def test_restore_refuses_a_state_the_next_snapshot_or_start_could_not_take(
    make_server: Any, corruption: Corruption
) -> None:
    server = make_server("--policy", "goodput", "--params", json.dumps(PER_REQUEST))
    with server.engine() as engine:
        learned(engine, 3)
    document = saved(server)
    before = server.state()
    bad = json.dumps(corrupted(document, corruption))
    with pytest.raises(grpc.RpcError) as caught:
        server.admin.Restore(
            admin_pb2.RestoreRequest(snapshot_json=bad), metadata=server.auth, timeout=30
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert corruption.field in str(caught.value.details())
    assert server.state() == before  # nothing lost
    assert saved(server)["policy"]["state"] == document["policy"]["state"]


def test_a_restored_counter_at_its_limit_cannot_lose_the_state_at_restart(
    make_server: Any,
) -> None:
    """A counter at 2^63 grows past what a start reads with the next step: refused at
    Restore, the state learned before survives a restart."""
    server = make_server("--policy", "goodput", "--params", json.dumps(PER_REQUEST))
    with server.engine() as engine:
        learned(engine, 3)
    bad = corrupted(saved(server), CORRUPTIONS[-1])
    with pytest.raises(grpc.RpcError) as caught:
        server.admin.Restore(
            admin_pb2.RestoreRequest(snapshot_json=json.dumps(bad)),
            metadata=server.auth,
            timeout=30,
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with server.engine() as engine:
        learned(engine, 1)
    assert server.terminate() == 0  # writes the final snapshot
    server.start()
    assert "unusable" not in server.log()
    assert learned_steps({"policy": {"state": server.state()["state"]}}) == 4


def test_the_snapshot_budget_is_never_past_what_a_start_reads() -> None:
    with pytest.raises(ConfigError, match="snapshot_max_bytes must be in 1024"):
        ServerConfig(uds="s.sock", snapshot_max_bytes=snapshot.MAX_BYTES + 1).validate()
    ServerConfig(uds="s.sock", snapshot_max_bytes=snapshot.MAX_BYTES).validate()


def test_a_restart_reads_what_a_snapshot_over_its_budget_became(
    make_server: Any, tmp_path: Path
) -> None:
    """The writer's budget (snapshot_max_bytes) is never past the reader's limit: a state
    grown past it is trimmed at the SIGTERM snapshot, and the restarted sidecar has it."""
    config = tmp_path / "nightjar.toml"
    config.write_text("snapshot_max_bytes = 60000\n")
    server = make_server(
        "--policy", "goodput", "--params", json.dumps(PER_REQUEST), "--config", str(config)
    )
    with server.engine() as engine:
        learned(engine, 5)
    assert server.terminate() == 0
    written = server.state_dir / "snapshot.json"
    assert written.stat().st_size <= 60000
    assert "trimmed" in server.log()
    server.start()
    assert "unusable" not in server.log()
    state = server.state()["state"]
    assert learned_steps({"policy": {"state": state}}) == 5
    assert 0 < records({"policy": {"state": state}}) < 5 * BATCH
