"""The sidecar as a real process: tables and reports, streams, engines, health, reflection,
metrics."""

from __future__ import annotations

import json
import queue
import time
import urllib.request
from typing import Any

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2
from nightjar_proto.v1 import admin_pb2, policy_pb2
from prometheus_client.parser import text_string_to_metric_families

from nightjar_common import wire
from nightjar_common.types import StepContext
from tests.rigs.sidecar import EngineStream, RanDecision, StepRejected


def context(engine: str = "e", batch_size: int = 4, **kw: object) -> policy_pb2.StepContext:
    return wire.context_to_pb(StepContext(engine_id=engine, batch_size=batch_size, **kw))  # type: ignore[arg-type]


def outcome(decision: RanDecision, engine: str = "e", **kw: object) -> policy_pb2.StepOutcome:
    batch = decision.batch_size  # a plausible outcome of the decided batch
    fields = dict(
        decision_id=decision.decision_id,
        engine_id=engine,
        gamma=decision.gamma,
        step_seconds=0.02,
        generated_tokens=batch * (1 + decision.gamma),
        drafted_tokens=batch * decision.gamma,
        accepted_tokens=3 * batch * decision.gamma // 4,
    )
    fields.update(kw)
    return policy_pb2.StepOutcome(**fields)  # type: ignore[arg-type]


def test_a_table_its_ran_step_and_its_outcome_round_trip(make_server) -> None:
    server = make_server("--policy", "nightjar")
    engine = server.engine()
    decision = engine.decide(context())
    assert 0 <= decision.gamma <= 4
    assert (
        decision.table.first_batch_size
        <= 4
        < decision.table.first_batch_size + len(decision.table.gammas)
    )
    assert decision.policy_name == "nightjar" and decision.policy_version
    assert decision.reason in ("explore", "exploit")
    assert engine.report(outcome(decision)).skipped == 0
    # The ran step and its outcome may ride on the next table request, as an engine sends
    # them.
    nxt = engine.decide(context(step_index=1))
    reply = engine.report(outcome(nxt), context=context(step_index=2))
    assert reply.table.step_index == 2 and reply.table.table_id and reply.skipped == 0
    assert server.state()["reports"] == 2
    learned = server.state()["state"]["learners"]["engine:e"]["4"]["counts"]
    assert sum(learned) == 2


def test_stream_answers_in_order_and_survives_bad_requests(make_server) -> None:
    server = make_server()
    requests = [
        policy_pb2.StepRequest(seq=1, context=context()),
        policy_pb2.StepRequest(seq=2, context=context(batch_size=0)),  # bad
        policy_pb2.StepRequest(seq=3, context=context(batch_size=2)),
    ]
    answered: queue.SimpleQueue[int] = queue.SimpleQueue()

    def one_at_a_time() -> Any:
        # Each request once the one before is answered: requests queued together would
        # supersede one another (a newer context of the engine waiting behind).
        for request in requests:
            yield request
            answered.get(timeout=10)

    replies = []
    for reply in server.policy.StepStream(one_at_a_time(), timeout=10):
        replies.append(reply)
        if reply.seq:
            answered.put(reply.seq)
    # A policy notice first (every stream gets the version it starts with), then the
    # answers in order.
    assert replies[0].seq == 0 and replies[0].policy_version
    replies = replies[1:]
    assert [r.seq for r in replies] == [1, 2, 3]
    assert [r.seq for r in replies if r.HasField("table")] == [1, 3]
    assert replies[1].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "batch_size" in replies[1].error.message


def test_one_sidecar_serves_several_engines(make_server) -> None:
    server = make_server()
    for engine in ("pod-a/dp0", "pod-a/dp1", "pod-b/dp0"):
        stream = server.engine()
        for step in range(5):
            d = stream.decide(context(engine, 4, step_index=step))
            stream.report(outcome(d, engine))
    reply = server.admin.GetState(admin_pb2.GetStateRequest(), timeout=5)
    assert list(reply.engine_ids) == ["pod-a/dp0", "pod-a/dp1", "pod-b/dp0"]
    state = json.loads(reply.state_json)
    assert set(state["learners"]) == {f"engine:{e}" for e in reply.engine_ids}
    one = server.admin.GetState(admin_pb2.GetStateRequest(engine_id="pod-b/dp0"), timeout=5)
    assert list(json.loads(one.state_json)["engines"]) == ["pod-b/dp0"]


def reflect_v1(channel: grpc.Channel, *requests: reflection_pb2.ServerReflectionRequest) -> list:
    """A grpc.reflection.v1 client: v1's method path; v1's messages are v1alpha's with the
    same field numbers (grpc/grpc-proto), so v1alpha's classes write and read them."""
    call = channel.stream_stream(
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    return list(call(iter(requests), timeout=5))


def test_health_and_reflection_v1alpha_and_v1(make_server) -> None:
    from google.protobuf import descriptor_pb2, descriptor_pool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    server = make_server()
    expected = {
        "nightjar.v1.PolicyService",
        "nightjar.v1.AdminService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "grpc.reflection.v1.ServerReflection",
    }
    # v1alpha with grpcio-reflection's own client, resolving a service into descriptors.
    database = ProtoReflectionDescriptorDatabase(server.channel)
    assert set(database.get_services()) == expected
    pool = descriptor_pool.DescriptorPool(database)
    methods = pool.FindServiceByName("nightjar.v1.PolicyService").methods_by_name
    assert set(methods) == {"StepStream"}
    # v1: listing, a symbol's file, and the v1 service describing itself in its package.
    listing, policy_file, v1_file = reflect_v1(
        server.channel,
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="nightjar.v1.AdminService"),
        reflection_pb2.ServerReflectionRequest(
            file_containing_symbol="grpc.reflection.v1.ServerReflection"
        ),
    )
    assert {s.name for s in listing.list_services_response.service} == expected
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(b)
        for b in policy_file.file_descriptor_response.file_descriptor_proto
    ]
    assert "AdminService" in {s.name for f in files for s in f.service}
    (v1,) = [
        descriptor_pb2.FileDescriptorProto.FromString(b)
        for b in v1_file.file_descriptor_response.file_descriptor_proto
    ]
    assert v1.package == "grpc.reflection.v1"
    (method,) = v1.service[0].method
    assert method.input_type == ".grpc.reflection.v1.ServerReflectionRequest"
    unknown = reflect_v1(
        server.channel, reflection_pb2.ServerReflectionRequest(file_containing_symbol="no.Such")
    )
    assert unknown[0].error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


def test_tcp_listener_is_loopback_by_default(make_server) -> None:
    from tests.rigs.sidecar import free_port

    port = free_port()
    server = make_server("--port", str(port))
    assert f"listening on unix:{server.uds}, 127.0.0.1:{port}" in server.log()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel, EngineStream(channel) as engine:
        assert engine.decide(context()).decision_id


def scrape(port: int) -> dict[str, list]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(body)}


def test_metrics_are_scraped_over_http_and_parse(make_server) -> None:
    server = make_server("--policy", "nightjar")
    engine = server.engine()
    for step in range(6):
        d = engine.decide(context(step_index=step))
        engine.report(outcome(d))
    with pytest.raises(StepRejected):
        engine.decide(context(batch_size=-1))
    server.admin.Snapshot(admin_pb2.SnapshotRequest(), metadata=server.auth, timeout=5)
    families = scrape(server.metrics_port)

    decisions = [s for s in families["nightjar_decisions"] if s.name.endswith("_total")]
    assert sum(s.value for s in decisions) == 6
    assert {s.labels["bin_type"] for s in decisions} <= {"explore", "exploit"}
    assert all(s.labels["policy"] == "nightjar" for s in decisions)
    reports = [s for s in families["nightjar_reports"] if s.name.endswith("_total")]
    assert sum(s.value for s in reports) == 6
    goodput_count = [
        s for s in families["nightjar_goodput_tokens_per_second"] if s.name.endswith("_count")
    ]
    assert sum(s.value for s in goodput_count) == 6
    latency = [
        s for s in families["nightjar_decision_latency_seconds"] if s.name.endswith("_count")
    ]
    assert latency[0].value == 6
    invalid = [s for s in families["nightjar_invalid_requests"] if s.name.endswith("_total")]
    # The usual rejections are exported at 0 from the start (increase() sees the first).
    assert len(invalid) == 3
    assert [(s.labels["method"], s.labels["code"], s.value) for s in invalid if s.value] == [
        ("StepStream", "INVALID_ARGUMENT", 1.0)
    ]
    last_snapshot = families["nightjar_snapshot_last_success_timestamp_seconds"][0].value
    assert 0 <= time.time() - last_snapshot < 60
    assert families["nightjar_serving"][0].value == 1
    assert families["nightjar_engines"][0].value == 1
    chosen = [s for s in families["nightjar_gamma_chosen"] if s.name.endswith("_count")]
    assert sum(s.value for s in chosen) == 6
    assert {s.labels["batch_bucket"] for s in chosen if s.value} == {"4-7"}
    # Hygiene: no *_created series, the process collectors are there.
    assert not [s for f in families.values() for s in f if s.name.endswith("_created")]
    assert families["process_cpu_seconds"][0].value > 0
    swaps = [s for s in families["nightjar_policy_swaps"] if s.name.endswith("_total")]
    assert any(s.labels["result"] == "ok" and s.value >= 1 for s in swaps)
    info = families["nightjar_policy_info"][0]
    assert info.labels["name"] == "nightjar"


def test_per_request_accepts_with_ids_teach_what_the_packed_form_does(make_server) -> None:
    """Per-request accepts with request ids (RequestAccepts, what a per-request policy
    needs) teach the policy what the packed form does: an engine per form ends with the
    same acceptance estimate, which is not the one the batch totals alone give."""
    server = make_server("--policy", "goodput")
    streams = {engine: server.engine() for engine in ("packed", "with-ids", "totals")}
    for step in range(40):
        for engine, stream in streams.items():
            decision = stream.decide(context(engine, step_index=step))
            accepts = [min(decision.gamma, k) for k in (0, 1, 2, 3)]
            per_request: dict[str, Any] = {
                "packed": {"request_accepted_tokens": accepts},
                "with-ids": {
                    "requests": [
                        policy_pb2.RequestAccepts(request_id=f"cmpl-{i}", accepted_tokens=k)
                        for i, k in enumerate(accepts)
                    ]
                },
                "totals": {},
            }[engine]
            report = outcome(decision, engine, accepted_tokens=sum(accepts), **per_request)
            assert stream.report(report).skipped == 0
    learners = server.state()["state"]["learners"]
    packed, with_ids = learners["engine:packed"], learners["engine:with-ids"]
    assert packed["acceptance"] == with_ids["acceptance"]
    assert packed["acceptance"] != learners["engine:totals"]["acceptance"]
