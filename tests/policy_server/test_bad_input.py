"""Bad input gets the right gRPC status and a clear message, and changes no learned state."""

from __future__ import annotations

import json
import math
import os
from typing import Any

import grpc
import pytest
from nightjar_proto.v1 import admin_pb2, policy_pb2

from tests.policy_server.test_server import context, outcome

INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def warm_server(make_server_module: Any) -> Any:
    server = make_server_module()
    for step in range(20):  # some learned state to protect
        d = server.policy.Decide(context(step_index=step), timeout=5)
        server.policy.Report(outcome(d), timeout=5)
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


def expect(code: grpc.StatusCode, fragment: str, call: Any, *args: Any, **kw: Any) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, timeout=5, **kw)
    assert info.value.code() == code, info.value.details()
    assert fragment in info.value.details()


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
    ],
)
def test_bad_contexts(server: Any, ctx: policy_pb2.StepContext, fragment: str) -> None:
    expect(INVALID, fragment, server.policy.Decide, ctx)


def test_nan_signal_in_request_section(server: Any) -> None:
    ctx = context()
    ctx.requests.add(request_id="r1", kl_divergence=math.nan)
    expect(INVALID, "kl_divergence must be finite", server.policy.Decide, ctx)


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
        ({"engine_id": "someone-else"}, "was made for engine 'e'"),
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
            {
                "request_accepted_tokens": [1],
                "requests": [policy_pb2.RequestAccepts(request_id="r1", accepted_tokens=1)],
            },
            "not both",
        ),
        (
            {"requests": [policy_pb2.RequestAccepts(request_id="r" * 300, accepted_tokens=1)]},
            "a request_id is longer than",
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
    server = self_checked_server
    decision = server.policy.Decide(context(), timeout=5)
    before = server.state()
    expect(INVALID, fragment, server.policy.Report, outcome(decision, **changes))
    assert server.state() == before
    # The decision is still open: its real outcome is accepted afterwards.
    assert server.policy.Report(outcome(decision), timeout=5).applied


def test_unknown_and_duplicate_decision_ids(self_checked_server: Any) -> None:
    server = self_checked_server
    decision = server.policy.Decide(context(), timeout=5)
    forged = policy_pb2.Decision(decision_id="nope-1", gamma=1)
    expect(
        grpc.StatusCode.NOT_FOUND,
        "unknown decision_id 'nope-1'",
        server.policy.Report,
        outcome(forged),
    )
    server.policy.Report(outcome(decision), timeout=5)
    expect(grpc.StatusCode.NOT_FOUND, "already reported", server.policy.Report, outcome(decision))


def test_step_is_all_or_nothing(self_checked_server: Any) -> None:
    server = self_checked_server
    decision = server.policy.Decide(context(), timeout=5)
    before = server.state()
    bad = policy_pb2.StepRequest(outcome=outcome(decision), context=context(batch_size=0))
    expect(INVALID, "batch_size", server.policy.Step, bad)
    assert server.state() == before  # the valid outcome was not applied either
    assert server.policy.Report(outcome(decision), timeout=5).applied
    expect(
        INVALID, "needs an outcome, a context or both", server.policy.Step, policy_pb2.StepRequest()
    )


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


def test_a_failed_restore_is_all_or_nothing(self_checked_server: Any) -> None:
    """A malformed engine table or a number out of range: INVALID_ARGUMENT, and the engine
    table, the policy and the decision in flight are as they were."""
    server = self_checked_server
    decision = server.policy.Decide(context(), timeout=5)
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
    assert server.policy.Report(outcome(decision), timeout=5).applied


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
