"""Learned state is keyed by the engine's learner key (model + hardware), not its engine id:
engines with one key learn together, and a replaced pod continues from the learned state."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from nightjar_proto.v1 import admin_pb2, policy_pb2

KEY = "Llama-3.1-8B@NVIDIA H100 80GB HBM3"
# Tokens per request of a step by γ: γ = 2 is the best arm at every batch size.
TOKENS_PER_REQUEST = (1, 2, 4, 2, 1)
BATCH = 4


def step(server: Any, engine: str, key: str, index: int) -> policy_pb2.Decision:
    ctx = policy_pb2.StepContext(
        engine_id=engine, learner_key=key, batch_size=BATCH, step_index=index, draft_resident=True
    )
    decision = server.policy.Decide(ctx, timeout=5)
    server.policy.Report(
        policy_pb2.StepOutcome(
            decision_id=decision.decision_id,
            engine_id=engine,
            gamma=decision.gamma,
            step_seconds=0.02,
            generated_tokens=BATCH * TOKENS_PER_REQUEST[decision.gamma],
            drafted_tokens=BATCH * decision.gamma,
            accepted_tokens=0,
        ),
        timeout=5,
    )
    return decision


def pulls(state: dict[str, Any], learner: str) -> int:
    return sum(state["state"]["learners"][learner][str(BATCH)]["counts"])


def test_engines_with_one_learner_key_share_learned_state(make_server: Any) -> None:
    server = make_server("--policy", "nightjar")
    for index in range(30):
        step(server, "pod-a", KEY, index)
    for index in range(20):
        step(server, "pod-b", KEY, index)
    step(server, "loner", "", 0)
    state = server.state()
    assert set(state["state"]["learners"]) == {f"shared:{KEY}", "engine:loner"}
    assert pulls(state, f"shared:{KEY}") == 50
    engines = state["state"]["engines"]
    assert engines["pod-a"]["learner"] == engines["pod-b"]["learner"] == f"shared:{KEY}"
    # Per-engine bookkeeping stays per engine id: an outcome is checked against its engine.
    decision = server.policy.Decide(
        policy_pb2.StepContext(engine_id="pod-a", learner_key=KEY, batch_size=BATCH), timeout=5
    )
    with pytest.raises(grpc.RpcError) as error:
        server.policy.Report(
            policy_pb2.StepOutcome(
                decision_id=decision.decision_id,
                engine_id="pod-b",
                gamma=decision.gamma,
                step_seconds=0.02,
                generated_tokens=4,
            ),
            timeout=5,
        )
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "was made for engine 'pod-a'" in (error.value.details() or "")


def test_share_learner_false_keys_by_engine_id(make_server: Any) -> None:
    server = make_server("--params", '{"share_learner": false}')
    step(server, "pod-a", KEY, 0)
    step(server, "pod-b", KEY, 0)
    assert set(server.state()["state"]["learners"]) == {"engine:pod-a", "engine:pod-b"}


def test_a_replaced_pod_starts_warm_after_snapshot_and_restart(make_server: Any) -> None:
    server = make_server("--policy", "nightjar")
    for index in range(200):
        step(server, "pod-a", KEY, index)
    before = server.state()["state"]
    server.admin.Snapshot(admin_pb2.SnapshotRequest(), metadata=server.auth, timeout=5)
    assert server.terminate() == 0
    server.start()  # same state directory: restored from the snapshot
    assert server.state()["state"]["learners"] == before["learners"]

    # The replacement: a new engine id, the same key.
    warm = [step(server, "pod-a-replaced", KEY, index) for index in range(40)]
    after = server.state()["state"]
    # It took over pod-a's place in Algorithm 1's schedule (and went on from there).
    inherited = after["engines"]["pod-a-replaced"]["schedules"][str(BATCH)]
    assert inherited["block"] >= before["engines"]["pod-a"]["schedules"][str(BATCH)]["block"] > 5
    exploited = [d.gamma for d in warm if not d.exploration]
    assert len(exploited) >= 20 and set(exploited) == {2}  # γ = 2 is best, known at once
    assert pulls({"state": after}, f"shared:{KEY}") == 240
    # A cold engine (a key nobody learned under) starts Algorithm 1 at block 1: its
    # first bin explores for sure.
    cold = step(server, "other-model", "Other-Model@NVIDIA H100 80GB HBM3", 0)
    assert cold.exploration and cold.exploration_probability == 1.0
