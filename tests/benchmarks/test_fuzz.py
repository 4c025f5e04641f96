"""Protocol fuzzing (`make fuzz`): the CI slice through real server processes, and the
fixes it led to (undecodable requests, unusable file paths) checked directly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
from nightjar_proto.v1 import admin_pb2, policy_pb2

from benchmarks.fuzz.runner import methods
from tests.policy_server.test_server import context, outcome

INVALID = grpc.StatusCode.INVALID_ARGUMENT


def test_quick_fuzz_slice_finds_no_crash_wrong_code_or_state_change(tmp_path: Path) -> None:
    out, hardened = tmp_path / "fuzz.json", tmp_path / "fuzz-hardening.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.fuzz",
            "--quick",
            "--seed",
            "7",
            "--json",
            str(out),
            "--hardening-json",
            str(hardened),
        ],
        capture_output=True,
        text=True,
        # The failing-drivers class imports torch and vLLM's block pool (~30 s on a small host).
        timeout=420,
    )
    assert out.exists(), run.stderr[-3000:]
    result = json.loads(out.read_text())
    details = result["details"]
    assert run.returncode == 0 and result["passed"], json.dumps(details["examples"], indent=1)
    assert details["requests"] >= 4000
    assert (details["crashes"], details["non_grpc_errors"], details["wrong_codes"]) == (0, 0, 0)
    assert details["state_changes_on_reject"] == 0
    # Every RPC of the three services was fuzzed, and the fuzz reached both sides of the
    # input checks: requests served and requests refused (with state compared).
    assert set(details["by_method"]) == {m.label for m in methods()}
    # A request refused inside the engines' stream is a StepReply.error (stream:CODE).
    by_code = details["by_code"]
    assert by_code["OK"] > 100
    assert by_code["INVALID_ARGUMENT"] + by_code["stream:INVALID_ARGUMENT"] > 500
    assert by_code["UNAUTHENTICATED"] > 0 and details["state_checks"] > 1000
    # The stream was fuzzed with what the sidecar accepts too: tables answered, and steps
    # run from them and their outcomes applied, besides the items it skipped; every stream
    # opened with its policy notice (set apart from the replies).
    stream = details["stream"]
    assert stream["tables"] > 100 and stream["applied items"] > 300
    assert stream["skipped items"] > 0 and stream["notices"] > 100
    assert {"test", "what", "figure", "passed", "date", "machine", "command"} <= set(result)
    # The hardening classes of issues 28 and 54: every case ran, none failed.
    rows = json.loads(hardened.read_text())
    assert [row["test"].split(": ", 1)[1] for row in rows] == [
        "snapshot documents",
        "snapshot file kinds",
        "parameter values",
        "implausible outcomes",
        "sizes",
        "replays",
        "concurrent heavy requests",
        "failing drivers",
    ]
    drivers = rows[-1]
    assert "were undone" in drivers["what"] and "(0 orders" not in drivers["what"]
    assert all(row["passed"] and " 0 failures" in row["figure"] for row in rows), rows


def raw_call(channel: grpc.Channel, path: str, payload: bytes) -> grpc.StatusCode:
    try:
        channel.unary_unary(path, None, None)(payload, timeout=5)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_undecodable_requests_are_invalid_argument_and_change_nothing(make_server: Any) -> None:
    server = make_server()
    with server.engine() as engine:
        decision = engine.decide(context(engine="e"))
        engine.report(outcome(decision))
    before = server.state()
    channel = server.channel
    for payload in (b"\n", b"\xff\xff\xff", b"\n\x02\xc3\x28"):  # truncated, bad tag, bad UTF-8
        assert raw_call(channel, "/nightjar.v1.AdminService/SwapPolicy", payload) == INVALID
    stream = channel.stream_stream("/nightjar.v1.PolicyService/StepStream", None, None)
    good = policy_pb2.StepRequest(seq=1, context=context(engine="e")).SerializeToString()
    # Repeated: the undecodable message is read while the reply to the first is being
    # written, and the status must not race that write (it once hung the stream). b"": an
    # empty request, answered with an error; b"\xff...": undecodable as the first message.
    for first_payload in [good, b"", None] * 10:
        sent = [b"\xff\xff\xff"] if first_payload is None else [first_payload, b"\xff\xff\xff"]
        replies = stream(iter(sent), timeout=5)
        answers = []
        try:
            for raw in replies:
                reply = policy_pb2.StepReply.FromString(raw)
                if reply.seq == 0 and reply.policy_version:  # the stream's policy notice
                    continue
                answers.append(reply)
            raise AssertionError("the stream went on after an undecodable message")
        except grpc.RpcError as exc:
            assert exc.code() == INVALID and "not a valid message" in (exc.details() or "")
        if first_payload is None:
            assert answers == []
        elif first_payload:
            assert [a.seq for a in answers] == [1] and answers[0].table.table_id
        else:
            assert len(answers) == 1 and answers[0].error.code == INVALID.value[0]
    after = server.state()
    assert after["state"] == before["state"] and after["version"] == before["version"]
    assert after["reports"] == before["reports"] == 1
    with server.engine() as engine:  # the server still answers tables
        assert engine.decide(context(engine="e")).table.table_id


def test_unusable_file_paths_are_invalid_argument(make_server: Any) -> None:
    server = make_server()
    before = server.state()
    for path in ("a\x00b", "x" * 300, "d/" * 2100):
        try:
            server.admin.Restore(admin_pb2.RestoreRequest(path=path), metadata=server.auth)
            raise AssertionError(f"restore of {path[:10]!r} succeeded")
        except grpc.RpcError as exc:
            assert exc.code() == INVALID, exc.details()
    assert server.state() == before


def test_huge_token_counts_do_not_break_the_goodput_models_fit(make_server: Any) -> None:
    """Found by the fuzzer: context tokens near 2^62 made the step-time regression's
    normal equations numerically singular, and GetState and the decision answered UNKNOWN."""
    server = make_server("--policy", "goodput")
    engine = server.engine()
    for tokens in (10, 1 << 62, 5, 1 << 40, 7) * 4:
        decision = engine.decide(context(engine="e", context_tokens=tokens))
        # Outcomes' token counts are bounded (no step computes 2^31 tokens): refused whole.
        prefill = min(tokens, 1 << 31)
        assert engine.report(outcome(decision, prefill_tokens=prefill)).skipped == 0
    state = server.state()
    assert state["policy"] == "goodput" and state["reports"] == 20
    decision = engine.decide(context(engine="e"))
    refused = engine.report(outcome(decision, prefill_tokens=1 << 62))
    # Skipped with its reason (the step it names was applied and stays pending); the stream
    # and the rest of the batch go on.
    assert refused.skipped == 1 and "prefill_tokens must be in 0.." in refused.skipped_reason
    assert server.state()["reports"] == 20
    assert engine.report(outcome(decision)).skipped == 0  # the step's real outcome
    assert server.state()["reports"] == 21
    engine.close()
