"""The audit trail of admin calls: one INFO line per call, whatever its answer, and policy
activations in the decision log."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from nightjar_proto.v1 import admin_pb2, admin_pb2_grpc

from policy_server.decision_log import DecisionLog, read_records
from policy_server.grpc_server import RunningServer, build_server
from policy_server.service import DecisionService

TOKEN = "audit-test-token-0123456789"
AUTH = [("authorization", f"Bearer {TOKEN}")]


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[tuple[Any, DecisionService, DecisionLog]]:
    decisions = DecisionLog(tmp_path / "decisions.jsonl")
    service = DecisionService("goodput", state_dir=tmp_path, decision_log=decisions)
    socket = tmp_path / "s.sock"
    running: RunningServer = build_server(service, uds_path=str(socket), admin_token=TOKEN)
    channel = grpc.insecure_channel(f"unix:{socket}")
    try:
        yield channel, service, decisions
    finally:
        channel.close()
        running.server.stop(grace=1).wait()
        decisions.close()


def audit_lines(caplog: pytest.LogCaptureFixture, count: int) -> list[logging.LogRecord]:
    """The audit records, once ``count`` are in (an aborted call's status can reach the
    client a moment before the server logs it)."""
    deadline = time.monotonic() + 5
    while True:
        lines = [r for r in caplog.records if r.name == "nightjar.audit"]
        if len(lines) >= count or time.monotonic() > deadline:
            return lines
        time.sleep(0.01)


def call(fn: Any, request: Any, **kwargs: Any) -> grpc.StatusCode:
    try:
        fn(request, timeout=5, **kwargs)
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def test_every_admin_call_gets_one_info_line(
    sidecar: tuple[Any, DecisionService, DecisionLog], caplog: pytest.LogCaptureFixture
) -> None:
    channel, service, _ = sidecar
    admin = admin_pb2_grpc.AdminServiceStub(channel)
    swap = admin_pb2.SwapPolicyRequest(name="static", params_json='{"gamma": 2}')
    wrong = [("authorization", "Bearer not-the-token-but-long-enough")]
    with caplog.at_level(logging.INFO, logger="nightjar.audit"):
        answers = [
            call(admin.SwapPolicy, swap, metadata=AUTH),
            call(admin.SwapPolicy, swap),
            call(admin.SwapPolicy, swap, metadata=wrong),
            call(admin.Restore, admin_pb2.RestoreRequest(path="/etc/passwd"), metadata=AUTH),
            call(admin.Restore, admin_pb2.RestoreRequest(snapshot_json="{" * 5000), metadata=AUTH),
            call(admin.GetState, admin_pb2.GetStateRequest()),
            call(channel.unary_unary("/nightjar.v1.AdminService/Reset"), b"\xff\xff\xff"),
        ]
        lines = audit_lines(caplog, len(answers))
    codes = grpc.StatusCode
    assert answers == [
        codes.OK,
        codes.UNAUTHENTICATED,
        codes.UNAUTHENTICATED,
        codes.PERMISSION_DENIED,
        codes.INVALID_ARGUMENT,
        codes.OK,
        codes.INVALID_ARGUMENT,
    ]
    assert [r.levelno for r in lines] == [logging.INFO] * len(answers)
    records = [r.audit for r in lines]  # type: ignore[attr-defined]
    assert [(r["method"], r["status"]) for r in records] == [
        ("SwapPolicy", "OK"),
        ("SwapPolicy", "UNAUTHENTICATED"),
        ("SwapPolicy", "UNAUTHENTICATED"),
        ("Restore", "PERMISSION_DENIED"),
        ("Restore", "INVALID_ARGUMENT"),
        ("GetState", "OK"),
        ("Reset", "INVALID_ARGUMENT"),
    ]
    ok = records[0]
    assert ok["params"] == {"name": "static", "params_json": '{"gamma": 2}'}
    assert ok["policy_version"] == service.active.version and ok["peer"].startswith("unix:")
    assert "reason" not in ok
    assert records[1]["reason"].startswith("admin token required")
    assert records[2]["reason"] == "invalid admin token"
    assert "outside the server's state directory" in records[3]["reason"]
    assert records[4]["params"] == {"snapshot_json": "<5000 characters>"}
    assert records[6]["params"] == {"undecodable": True}
    text = "\n".join(r.getMessage() for r in lines)
    assert TOKEN not in text and "not-the-token" not in text
    assert text.splitlines()[0].startswith('admin call method="SwapPolicy" params={"name": ')
    assert len(text.splitlines()) == len(answers)  # no field breaks a line


def test_policy_activations_are_in_the_decision_log(
    sidecar: tuple[Any, DecisionService, DecisionLog],
) -> None:
    channel, service, decisions = sidecar
    admin = admin_pb2_grpc.AdminServiceStub(channel)
    admin.SwapPolicy(admin_pb2.SwapPolicyRequest(name="static"), metadata=AUTH, timeout=5)
    set_params = admin_pb2.SetParametersRequest(params_json='{"gamma": 3}')
    admin.SetParameters(set_params, metadata=AUTH, timeout=5)
    admin.Reset(admin_pb2.ResetRequest(), metadata=AUTH, timeout=5)
    decisions.flush()
    events = [r for r in read_records([decisions.path]) if r["kind"] == "policy"]
    assert [(e["event"], e["policy"], e["state"]) for e in events] == [
        ("start", "goodput", "fresh"),
        ("swap", "static", "fresh"),
        ("set_params", "static", "kept"),
        ("reset", "static", "fresh"),
    ]
    assert events[2]["params"] == {"gamma": 3}
    assert events[-1]["policy_version"] == service.active.version
    assert json.loads(json.dumps(events))  # plain JSON, like every record


def test_every_refused_policy_change_counts_as_a_failed_swap(
    sidecar: tuple[Any, DecisionService, DecisionLog],
) -> None:
    """What NightjarPolicySwapFailed's runbook says: a refused swap, set-params or restore
    counts, whatever refused it (the token, the request, the server)."""
    channel, service, _ = sidecar
    admin = admin_pb2_grpc.AdminServiceStub(channel)
    failed = service.metrics.policy_swaps.labels("failed")
    refused = [
        (admin.SwapPolicy, admin_pb2.SwapPolicyRequest(name="static"), []),
        (admin.SwapPolicy, admin_pb2.SwapPolicyRequest(name="nope"), AUTH),
        (admin.SwapPolicy, admin_pb2.SwapPolicyRequest(name="static", params_json="{"), AUTH),
        (admin.SetParameters, admin_pb2.SetParametersRequest(params_json='{"x": 1}'), AUTH),
        (admin.Restore, admin_pb2.RestoreRequest(path="/etc/passwd"), AUTH),
        (admin.Restore, admin_pb2.RestoreRequest(path="missing.json"), AUTH),
        (admin.Restore, admin_pb2.RestoreRequest(snapshot_json="[]"), AUTH),
        (admin.Restore, admin_pb2.RestoreRequest(), AUTH),
    ]
    for number, (method, request, metadata) in enumerate(refused, start=1):
        assert call(method, request, metadata=metadata) != grpc.StatusCode.OK
        assert failed._value.get() == number, request
    # A refused reset or snapshot changes no policy: not a failed swap.
    assert call(admin.Reset, admin_pb2.ResetRequest(engine_id="unknown"), metadata=AUTH) == (
        grpc.StatusCode.NOT_FOUND
    )
    assert failed._value.get() == len(refused)
