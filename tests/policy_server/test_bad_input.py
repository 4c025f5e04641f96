"""Bad input gets the right gRPC status and a clear message, and changes no learned state.

Over the stream a bad request is answered with a StepReply.error carrying the status code
(StepRejected), and a bad item of a report batch is skipped and said (StepReply.skipped):
either way nothing of what was refused is applied, and nothing good beside it is lost."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from nightjar_proto.v1 import admin_pb2, policy_pb2

from nightjar_common.types import RequestSignals
from tests.policy_server.test_server import context, outcome
from tests.rigs.sidecar import EngineStream, RanDecision, StepRejected

INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def warm_server(make_server_module: Any) -> Any:
    server = make_server_module()
    with server.engine() as engine:
        for step in range(20):  # some learned state to protect
            d = engine.decide(context(step_index=step))
            assert engine.report(outcome(d)).skipped == 0
    return server


@pytest.fixture
def self_checked_server(warm_server: Any) -> Any:
    """For tests that make valid calls too and compare state around the bad ones themselves."""
    return warm_server


@pytest.fixture
def server(warm_server: Any) -> Any:
    before = warm_server.state()
    yield warm_server
    assert warm_server.state() == before, "a rejected request changed the learned state"


@pytest.fixture
def engine(warm_server: Any) -> Iterator[EngineStream]:
    with warm_server.engine() as stream:
        yield stream


def expect(code: grpc.StatusCode, fragment: str, call: Any, *args: Any, **kw: Any) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, timeout=5, **kw)
    assert info.value.code() == code, info.value.details()
    assert fragment in (info.value.details() or "")


def rejected(
    code: grpc.StatusCode, fragment: str, engine: EngineStream, request: policy_pb2.StepRequest
) -> None:
    """``request`` is answered with a StepReply.error of ``code`` saying ``fragment``."""
    with pytest.raises(StepRejected) as info:
        engine.send(request)
    assert info.value.code == code, info.value.message
    assert fragment in info.value.message


def ran_and_open(engine: EngineStream) -> RanDecision:
    """A step decided from a table and reported as run: its outcome is awaited."""
    decision = engine.decide(context())
    assert engine.report().skipped == 0  # the ran step alone
    return decision


@pytest.mark.parametrize(
    ("ctx", "fragment"),
    [
        (context(batch_size=0), "batch_size must be in 1..65536, got 0"),
        (context(batch_size=-3), "got -3"),
        (context(batch_size=10**9), "got 1000000000"),
        (context(engine=""), "engine_id is required"),
        (context(free_kv_blocks=9, total_kv_blocks=4), "exceeds total_kv_blocks"),
        (context(num_waiting=-1), "num_waiting must be >= 0"),
        (context(previous_gamma=99), "previous_gamma"),
        (context(learner_key="k" * 257), "learner_key is longer than 256 characters"),
        (context(max_gamma=3, min_draft_passes=4), "min_draft_passes must be in 0..3"),
        (context(min_draft_passes=-1), "min_draft_passes must be in 0..64"),
        (
            context(requests=(RequestSignals("r1"), RequestSignals("r2"), RequestSignals("r1"))),
            "request id 'r1' appears more than once in the context",
        ),
        (context(requests=(RequestSignals("r\0x"),)), "holds a NUL or a line break"),
        (context(requests=(RequestSignals("r1\nr2"),)), "holds a NUL or a line break"),
    ],
)
def test_bad_contexts(
    server: Any, engine: EngineStream, ctx: policy_pb2.StepContext, fragment: str
) -> None:
    rejected(INVALID, fragment, engine, policy_pb2.StepRequest(context=ctx))


def test_nan_signal_in_request_section(server: Any, engine: EngineStream) -> None:
    ctx = context()
    ctx.requests.add(request_id="r1", kl_divergence=math.nan)
    rejected(INVALID, "kl_divergence must be finite", engine, policy_pb2.StepRequest(context=ctx))


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"step_seconds": math.nan}, "step_seconds must be finite"),
        ({"step_seconds": math.inf}, "step_seconds must be finite"),
        ({"step_seconds": -0.01}, "step_seconds"),
        ({"step_seconds": 0.0}, "step_seconds"),
        ({"generated_tokens": -5}, "negative goodput"),
        ({"accepted_tokens": 9, "drafted_tokens": 2}, "exceeds drafted_tokens"),
        ({"gamma": 5}, "gamma must be in 0..4"),
        ({"gamma": -1}, "gamma must be in 0..4"),
        ({"draft_gamma": -1}, "draft_gamma must be in 0..64"),
        ({"draft_gamma": 65}, "draft_gamma must be in 0..64"),
        ({"decision_id": ""}, "decision_id is required"),
        ({"request_accepted_tokens": [1, -1]}, "per-request accepted_tokens must be in 0..gamma"),
        (
            {"gamma": 1, "request_accepted_tokens": [2]},
            "per-request accepted_tokens must be in 0..gamma",
        ),
        (
            {
                "gamma": 3,
                "accepted_tokens": 2,
                "drafted_tokens": 9,
                "request_accepted_tokens": [2, 1],
            },
            "more than the step's accepted_tokens",
        ),
        (
            {"requests": [policy_pb2.RequestAccepts(request_id="r" * 300, accepted_tokens=1)]},
            "a request_id is longer than",
        ),
        (
            {
                "requests": [
                    policy_pb2.RequestAccepts(request_id=rid, accepted_tokens=0)
                    for rid in ("a", "b", "a")
                ]
            },
            "request id 'a' appears more than once in the outcome of",
        ),
        (
            {"requests": [policy_pb2.RequestAccepts(request_id="a\nb", accepted_tokens=0)]},
            "holds a NUL or a line break",
        ),
        # Implausible for the decision (batch 4, Γmax 4), as reported in issue 28.
        (
            {"generated_tokens": 10**18, "drafted_tokens": 10**18, "accepted_tokens": 10**18},
            "generated_tokens must be in 0..2147483648",
        ),
        ({"step_seconds": 1e-9}, "step_seconds must be finite and in [1e-06"),
        (
            {"gamma": 3, "draft_gamma": 3, "drafted_tokens": 10**6, "accepted_tokens": 0},
            "drafted_tokens (1000000) exceeds gamma (3) times the decision's batch size (4)",
        ),
        (  # below the batch size: fewer tokens than the requests that verified drafts
            {
                "gamma": 3,
                "drafted_tokens": 12,
                "accepted_tokens": 4,
                "request_accepted_tokens": [1, 1, 1, 1],
                "generated_tokens": 3,
            },
            "generated_tokens (3) must be in 4..65552",
        ),
        (
            {"gamma": 3, "drafted_tokens": 12, "accepted_tokens": 9, "generated_tokens": 0},
            "generated_tokens (0) must be in 1..65552",
        ),
        (
            {"gamma": 3, "drafted_tokens": 12, "accepted_tokens": 9, "generated_tokens": 65553},
            "generated_tokens (65553) must be in 1..65552",
        ),
    ],
)
def test_bad_reports(self_checked_server: Any, changes: dict[str, Any], fragment: str) -> None:
    """A bad outcome is skipped and said, alone or beside a good one; the good one is
    applied, and the decision it would have answered stays open for the real one."""
    server = self_checked_server
    with server.engine() as engine:
        decision = ran_and_open(engine)
        before = server.state()
        reply = engine.report(outcome(decision, **changes))
        assert (reply.skipped, fragment in reply.skipped_reason) == (1, True), reply
        assert server.state() == before
        # Beside the real outcome of another step: that one is applied, not lost.
        other = ran_and_open(engine)
        reply = engine.report(outcome(other), outcome(decision, **changes))
        assert (reply.skipped, fragment in reply.skipped_reason) == (1, True), reply
        assert server.state()["reports"] == before["reports"] + 1
        # The decision is still open: its real outcome is accepted afterwards.
        assert engine.report(outcome(decision)).skipped == 0
        assert server.state()["reports"] == before["reports"] + 2


def test_an_outcome_sent_as_another_engines_is_not_applied(self_checked_server: Any) -> None:
    """A report batch is one engine's: an outcome of another engine is skipped, alone (that
    engine holds no such decision) or beside the request's own."""
    server = self_checked_server
    with server.engine() as engine:
        decision = ran_and_open(engine)
        before = server.state()
        reply = engine.report(outcome(decision, engine_id="someone-else"))
        assert reply.skipped == 1
        assert f"outcome of {decision.decision_id}: unknown decision" in reply.skipped_reason
        assert server.state() == before
        other = ran_and_open(engine)
        reply = engine.report(outcome(other), outcome(decision, engine_id="someone-else"))
        assert reply.skipped == 1
        assert "is of engine 'someone-else', not the request's 'e'" in reply.skipped_reason
        assert server.state()["reports"] == before["reports"] + 1
        assert engine.report(outcome(decision)).skipped == 0


def test_per_request_accepts_given_twice_are_skipped_alone(self_checked_server: Any) -> None:
    """An outcome with both forms of per-request accepts cannot be read: it alone is
    skipped and said (one bad item does not lose the batch), the other outcome of the
    request is applied, and the step's own outcome is taken afterwards. Alone in a request
    it is refused (INVALID_ARGUMENT): nothing else was asked."""
    server = self_checked_server
    with server.engine() as engine:
        decision, other = ran_and_open(engine), ran_and_open(engine)
        twice = outcome(
            decision,
            request_accepted_tokens=[1],
            requests=[policy_pb2.RequestAccepts(request_id="r1", accepted_tokens=1)],
        )
        before = server.state()
        rejected(INVALID, "not both", engine, policy_pb2.StepRequest(outcomes=[twice]))
        assert server.state() == before
        reply = engine.report(outcome(other), twice)
        assert reply.skipped == 1 and "not both" in reply.skipped_reason
        assert decision.decision_id in reply.skipped_reason
        assert server.state()["reports"] == before["reports"] + 1
        assert engine.report(outcome(decision)).skipped == 0
        assert server.state()["reports"] == before["reports"] + 2


def test_unknown_and_duplicate_decision_ids(self_checked_server: Any) -> None:
    """An outcome or a ran step naming what the sidecar does not hold is skipped and said;
    nothing is learned from it."""
    server = self_checked_server
    with server.engine() as engine:
        decision = ran_and_open(engine)
        before = server.state()
        reply = engine.report(outcome(decision, decision_id="nope-1.1"))
        assert reply.skipped == 1
        assert "outcome of nope-1.1: unknown decision" in reply.skipped_reason
        forged = policy_pb2.RanStep(decision_id="nope-1.1", context=context(), gamma=1)
        reply = engine.send(policy_pb2.StepRequest(ran_steps=[forged]))
        assert reply.skipped == 1
        assert "ran step nope-1.1: its table is not held" in reply.skipped_reason
        garbled = policy_pb2.RanStep(decision_id="no-number", context=context(), gamma=1)
        reply = engine.send(policy_pb2.StepRequest(ran_steps=[garbled]))
        assert reply.skipped == 1
        assert "'no-number' is not '<table_id>.<n>'" in reply.skipped_reason
        assert server.state() == before
        assert engine.report(outcome(decision)).skipped == 0
        reported = server.state()["reports"]
        assert reported == before["reports"] + 1
        reply = engine.report(outcome(decision))  # again: already reported
        assert reply.skipped == 1
        assert f"outcome of {decision.decision_id}: it was already learned from" in (
            reply.skipped_reason
        )
        assert server.state()["reports"] == reported


def test_a_bad_context_rejects_the_whole_request(self_checked_server: Any) -> None:
    """A request whose context is malformed is refused (INVALID_ARGUMENT) before anything
    of it is applied: its ran step and outcome are not, and can be sent again."""
    server = self_checked_server
    with server.engine() as engine:
        decision = engine.decide(context())
        ran = policy_pb2.RanStep(
            decision_id=decision.decision_id, context=decision.context, gamma=decision.gamma
        )
        before = server.state()
        bad = policy_pb2.StepRequest(
            ran_steps=[ran], outcomes=[outcome(decision)], context=context(batch_size=0)
        )
        rejected(INVALID, "batch_size", engine, bad)
        assert server.state() == before  # the valid outcome was not applied either
        assert engine.report(outcome(decision)).skipped == 0  # with the ran step, again
        assert server.state()["reports"] == before["reports"] + 1
        empty = policy_pb2.StepRequest()
        rejected(INVALID, "needs an outcome, a context or both", engine, empty)


def test_admin_calls_need_the_token(server: Any) -> None:
    swap = admin_pb2.SwapPolicyRequest(name="static")
    unauth = grpc.StatusCode.UNAUTHENTICATED
    expect(unauth, "admin token required", server.admin.SwapPolicy, swap)
    expect(
        unauth,
        "invalid admin token",
        server.admin.SwapPolicy,
        swap,
        metadata=[("authorization", "Bearer wrong")],
    )
    expect(
        unauth,
        "invalid admin token",
        server.admin.Reset,
        admin_pb2.ResetRequest(),
        metadata=[("authorization", "Basic abc")],
    )
    expect(unauth, "admin token required", server.admin.Snapshot, admin_pb2.SnapshotRequest())


@pytest.mark.parametrize(
    ("request_", "code", "fragment"),
    [
        (
            admin_pb2.SwapPolicyRequest(name="magic"),
            grpc.StatusCode.NOT_FOUND,
            "unknown policy 'magic'",
        ),
        (
            admin_pb2.SwapPolicyRequest(name="static", params_json='{"gamma": -2}'),
            INVALID,
            "gamma must be in 0..64",
        ),
        (
            admin_pb2.SwapPolicyRequest(name="static", params_json="{gamma: 2"),
            INVALID,
            "not valid JSON",
        ),
        (
            admin_pb2.SwapPolicyRequest(name="ema", params_json='{"down_hysteresis": NaN}'),
            INVALID,
            "NaN is not a finite number",
        ),
        (
            admin_pb2.SwapPolicyRequest(name="ema", params_json='{"up_hysteresis": Infinity}'),
            INVALID,
            "Infinity is not a finite number",
        ),
        (
            admin_pb2.SwapPolicyRequest(name="ema", params_json='{"up_hysteresis": -Infinity}'),
            INVALID,
            "-Infinity is not a finite number",
        ),
        (
            admin_pb2.SwapPolicyRequest(name="ema", params_json='{"up_hysteresis": 1e400}'),
            INVALID,
            "1e400 is too large for a float",
        ),
        (
            admin_pb2.SwapPolicyRequest(
                name="ema", params_json='{"tiers": ' + "[" * 100_000 + "]" * 100_000 + "}"
            ),
            INVALID,
            "nested more than 32 levels deep",
        ),
        (
            admin_pb2.SwapPolicyRequest(
                name="ema", params_json='{"tiers": ' + "[" * 40 + "]" * 40 + "}"
            ),
            INVALID,
            "nested more than 32 levels deep",
        ),
        (
            admin_pb2.SwapPolicyRequest(name="nightjar", params_json='{"gama_max": 2}'),
            INVALID,
            "unknown parameter(s) ['gama_max']",
        ),
        (
            admin_pb2.SwapPolicyRequest(name="static", keep_state=True),
            grpc.StatusCode.FAILED_PRECONDITION,
            "cannot keep state",
        ),
        (
            admin_pb2.SwapPolicyRequest(
                name="goodput", params_json='{"gamma_max": 2}', keep_state=True
            ),
            grpc.StatusCode.FAILED_PRECONDITION,
            "gamma_max",
        ),
    ],
)
def test_failed_swaps_keep_the_last_good_policy(
    server: Any, request_: Any, code: grpc.StatusCode, fragment: str
) -> None:
    expect(code, fragment, server.admin.SwapPolicy, request_, metadata=server.auth)


def test_bad_set_params_restore_reset_and_state_queries(server: Any) -> None:
    md = server.auth
    expect(
        INVALID,
        "must be in 1..64",
        server.admin.SetParameters,
        admin_pb2.SetParametersRequest(params_json='{"gamma_max": 0}'),
        metadata=md,
    )
    expect(
        INVALID,
        "NaN is not a finite number",
        server.admin.SetParameters,
        admin_pb2.SetParametersRequest(params_json='{"gamma_max": NaN}'),
        metadata=md,
    )
    expect(
        grpc.StatusCode.NOT_FOUND,
        "does not exist",
        server.admin.Restore,
        admin_pb2.RestoreRequest(path="missing/snapshot.json"),
        metadata=md,
    )
    expect(
        INVALID,
        "not valid JSON",
        server.admin.Restore,
        admin_pb2.RestoreRequest(snapshot_json="{]"),
        metadata=md,
    )
    expect(
        INVALID,
        "needs a path or snapshot_json",
        server.admin.Restore,
        admin_pb2.RestoreRequest(),
        metadata=md,
    )
    expect(
        grpc.StatusCode.NOT_FOUND,
        "unknown engine 'ghost'",
        server.admin.Reset,
        admin_pb2.ResetRequest(engine_id="ghost"),
        metadata=md,
    )
    expect(
        grpc.StatusCode.NOT_FOUND,
        "unknown engine 'ghost'",
        server.admin.GetState,
        admin_pb2.GetStateRequest(engine_id="ghost"),
    )


def snapshot_json(server: Any, **changes: Any) -> str:
    """The server's own state as a Restore document, with top-level ``changes``."""
    reply = server.admin.GetState(admin_pb2.GetStateRequest(), timeout=5)
    policy = {
        "name": reply.policy_name,
        "params": json.loads(reply.params_json),
        "state": json.loads(reply.state_json),
    }
    document = {"format": "nightjar-snapshot/1", "policy": policy, "engines": ["e"]}
    return json.dumps({**document, **changes})


def test_a_failed_restore_is_all_or_nothing(self_checked_server: Any, engine: EngineStream) -> None:
    """A malformed engine table or a number out of range: INVALID_ARGUMENT, and the engine
    table, the policy and the decision in flight are as they were."""
    server = self_checked_server
    decision = ran_and_open(engine)
    before = server.state()
    restore = server.admin.Restore
    bad_engines = snapshot_json(server, engines=["e", 7])
    request = admin_pb2.RestoreRequest(snapshot_json=bad_engines)
    expect(INVALID, "engines must be a list", restore, request, metadata=server.auth)
    # goodput's counters as an integer no float holds: OverflowError in its load_state
    document = json.loads(snapshot_json(server))
    for learner in document["policy"]["state"]["learners"].values():
        learner["acceptance"]["successes"] = 10**400
    request = admin_pb2.RestoreRequest(snapshot_json=json.dumps(document))
    expect(INVALID, "snapshot state is malformed", restore, request, metadata=server.auth)
    created = snapshot_json(server, created_unix="yesterday")
    request = admin_pb2.RestoreRequest(snapshot_json=created)
    expect(INVALID, "created_unix must be a number", restore, request, metadata=server.auth)
    assert server.state() == before
    assert engine.report(outcome(decision)).skipped == 0  # the decision in flight is kept


def test_a_restored_ema_state_out_of_range_is_refused(server: Any) -> None:
    slot = {"candidates": [-5, 1000], "index": 0, "ema": 0.0, "batches": 0}
    document = {
        "format": "nightjar-snapshot/1",
        "policy": {
            "name": "ema",
            "params": {},
            "state": {"schema": "ema/1", "slots": {"e": {"1": slot}}},
        },
    }
    expect(
        INVALID,
        "candidates must be in 0..7 (gamma_max), got [-5, 1000]",
        server.admin.Restore,
        admin_pb2.RestoreRequest(snapshot_json=json.dumps(document)),
        metadata=server.auth,
    )


def test_restore_refuses_a_fifo_and_a_huge_file_without_blocking(server: Any) -> None:
    server.state_dir.mkdir(parents=True, exist_ok=True)
    fifo = server.state_dir / "pipe.json"
    if not fifo.exists():
        os.mkfifo(fifo)
    huge = server.state_dir / "huge.json"
    with huge.open("wb") as fh:
        fh.truncate(300 << 20)  # sparse: 300 MB that take no disk
    for name, fragment in (
        ("pipe.json", "is not a regular file (a FIFO)"),
        ("huge.json", "is larger than"),
    ):
        request = admin_pb2.RestoreRequest(path=name)
        expect(INVALID, fragment, server.admin.Restore, request, metadata=server.auth)
    # The admin workers are free: the next call is answered.
    server.admin.GetState(admin_pb2.GetStateRequest(), timeout=5)
