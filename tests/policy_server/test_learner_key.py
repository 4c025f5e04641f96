"""Learned state is keyed by the engine's learner key (model + hardware), not its engine id:
engines with one key learn together, and a replaced pod continues from the learned state."""

from __future__ import annotations

from typing import Any

from nightjar_proto.v1 import admin_pb2, policy_pb2

from tests.rigs.sidecar import EngineStream, RanDecision

KEY = "Llama-3.1-8B@NVIDIA H100 80GB HBM3"
# Tokens per request of a step by γ: γ = 2 is the best arm at every batch size.
TOKENS_PER_REQUEST = (1, 2, 4, 2, 1)
BATCH = 4


def step_context(engine: str, key: str, index: int) -> policy_pb2.StepContext:
    return policy_pb2.StepContext(
        engine_id=engine, learner_key=key, batch_size=BATCH, step_index=index, draft_resident=True
    )


def step(stream: EngineStream, engine: str, key: str, index: int) -> RanDecision:
    """A step of ``engine`` run from its table and reported."""
    decision = stream.decide(step_context(engine, key, index))
    reply = stream.report(
        policy_pb2.StepOutcome(
            decision_id=decision.decision_id,
            engine_id=engine,
            gamma=decision.gamma,
            step_seconds=0.02,
            generated_tokens=BATCH * TOKENS_PER_REQUEST[decision.gamma],
            drafted_tokens=BATCH * decision.gamma,
            accepted_tokens=0,
        )
    )
    assert reply.skipped == 0, reply.skipped_reason
    return decision


def pulls(state: dict[str, Any], learner: str) -> int:
    return sum(state["state"]["learners"][learner][str(BATCH)]["counts"])


def test_engines_with_one_learner_key_share_learned_state(make_server: Any) -> None:
    server = make_server("--policy", "nightjar")
    stream = server.engine()
    for index in range(30):
        step(stream, "pod-a", KEY, index)
    for index in range(20):
        step(stream, "pod-b", KEY, index)
    step(stream, "loner", "", 0)
    state = server.state()
    assert set(state["state"]["learners"]) == {f"shared:{KEY}", "engine:loner"}
    assert pulls(state, f"shared:{KEY}") == 50
    engines = state["state"]["engines"]
    assert engines["pod-a"]["learner"] == engines["pod-b"]["learner"] == f"shared:{KEY}"
    # Per-engine bookkeeping stays per engine id: pod-a's step is pod-a's to report; an
    # outcome of it sent as pod-b's is not applied to the shared learner.
    decision = stream.decide(step_context("pod-a", KEY, 30))
    assert stream.report().skipped == 0  # the ran step: its outcome is awaited
    as_pod_b = policy_pb2.StepOutcome(
        decision_id=decision.decision_id,
        engine_id="pod-b",
        gamma=decision.gamma,
        step_seconds=0.02,
        generated_tokens=4,
    )
    reply = stream.report(as_pod_b)
    assert reply.skipped == 1
    assert f"outcome of {decision.decision_id}: unknown decision" in reply.skipped_reason
    assert pulls(server.state(), f"shared:{KEY}") == 50
    as_pod_a = policy_pb2.StepOutcome()
    as_pod_a.CopyFrom(as_pod_b)
    as_pod_a.engine_id = "pod-a"
    assert stream.report(as_pod_a).skipped == 0
    assert pulls(server.state(), f"shared:{KEY}") == 51
    stream.close()


def test_share_learner_false_keys_by_engine_id(make_server: Any) -> None:
    server = make_server("--params", '{"share_learner": false}')
    with server.engine() as stream:
        step(stream, "pod-a", KEY, 0)
        step(stream, "pod-b", KEY, 0)
    assert set(server.state()["state"]["learners"]) == {"engine:pod-a", "engine:pod-b"}


def test_a_replaced_pod_starts_warm_after_snapshot_and_restart(make_server: Any) -> None:
    server = make_server("--policy", "nightjar")
    with server.engine() as stream:
        for index in range(200):
            step(stream, "pod-a", KEY, index)
    before = server.state()["state"]
    server.admin.Snapshot(admin_pb2.SnapshotRequest(), metadata=server.auth, timeout=5)
    assert server.terminate() == 0
    server.start()  # same state directory: restored from the snapshot
    assert server.state()["state"]["learners"] == before["learners"]

    # The replacement: a new engine id, the same key.
    stream = server.engine()  # on the restarted sidecar
    warm = [step(stream, "pod-a-replaced", KEY, index) for index in range(40)]
    after = server.state()["state"]
    # It took over pod-a's place in Algorithm 1's schedule (and went on from there).
    inherited = after["engines"]["pod-a-replaced"]["schedules"][str(BATCH)]
    assert inherited["block"] >= before["engines"]["pod-a"]["schedules"][str(BATCH)]["block"] > 5
    exploited = [d.gamma for d in warm if not d.exploring]
    assert len(exploited) >= 20 and set(exploited) == {2}  # γ = 2 is best, known at once
    assert pulls({"state": after}, f"shared:{KEY}") == 240
    # A cold engine (a key nobody learned under) starts Algorithm 1 at block 1: its
    # first bin explores for sure.
    cold = step(stream, "other-model", "Other-Model@NVIDIA H100 80GB HBM3", 0)
    assert cold.exploring
    stream.close()
