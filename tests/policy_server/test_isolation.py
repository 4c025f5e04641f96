"""One engine's heavy work stays off the loop that answers the others (issue 54 item 4).

The mechanisms, not timings (docs/BENCHMARKS.md, `make bench-isolation`, has the figures):
a StepRequest larger than HEAVY_REQUEST_BYTES is parsed and decided on a heavy-step
thread while small ones are answered on the loop; large bytes that do not parse end the
stream INVALID_ARGUMENT as small ones do; a server hands the GIL over within
GIL_SWITCH_INTERVAL_S; a restore encodes and decodes its state an entry at a time.
"""

from __future__ import annotations

import asyncio
import gc
import json
import subprocess
import sys
import textwrap
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from nightjar_proto.v1 import admin_pb2, policy_pb2

from nightjar_common import wire
from nightjar_common.sidecar_stream import SyncStream
from nightjar_common.types import RequestSignals, StepContext
from policy_server import grpc_server
from policy_server.aio import Deferred, InThreads, Serialized, deferring
from policy_server.audit import describe
from policy_server.grpc_server import (
    GIL_SWITCH_INTERVAL_S,
    HEAVY_REQUEST_BYTES,
    AdminServicer,
    PolicyServicer,
    Received,
    UndecodableRequest,
    build_server,
)
from policy_server.service import DecisionService
from policy_server.state_store import CollectorPause
from policy_server.state_text import round_trip


def context(engine_id: str, requests: int) -> StepContext:
    signals = tuple(
        RequestSignals(f"{engine_id}-{i}-".ljust(180, "x"), 900, (1, 2)) for i in range(requests)
    )
    return StepContext(
        engine_id=engine_id,
        learner_key=f"m@{engine_id}",
        batch_size=max(requests, 8),
        requests=signals,
    )


def as_received(ctx: StepContext, seq: int) -> Received:
    """A request as the deserializer hands it over: large ones unparsed."""
    data = policy_pb2.StepRequest(seq=seq, context=wire.context_to_pb(ctx)).SerializeToString()
    return grpc_server._receive(data)


def test_a_large_request_is_decided_on_a_heavy_step_thread_a_small_one_on_the_loop() -> None:
    """And with the garbage collector paused: what a large request allocates is mostly
    freed by reference counting once it is answered, so collections deferred to then scan
    little, where during it each would scan its thousands of objects holding the GIL."""
    service = DecisionService("goodput")
    threads: dict[str, str] = {}
    collecting: dict[str, bool] = {}
    table_step = service.table_step

    def recording(ran: Any, outcomes: Any, ctx: StepContext | None, decide: bool = True) -> Any:
        assert ctx is not None
        threads[ctx.engine_id] = threading.current_thread().name
        collecting[ctx.engine_id] = gc.isenabled()
        return table_step(ran, outcomes, ctx, decide)

    service.table_step = recording  # type: ignore[assignment]
    large, small = as_received(context("big", 600), 1), as_received(context("small", 0), 2)
    assert large.size > HEAVY_REQUEST_BYTES and large.message is None and large.data
    assert small.size <= HEAVY_REQUEST_BYTES and small.message is not None

    async def run() -> list[policy_pb2.StepReply]:
        async def sent() -> AsyncIterator[Received]:
            yield large
            yield small

        loop_thread = threading.current_thread().name
        replies = [reply async for reply in PolicyServicer(service).StepStream(sent(), None)]
        assert threads["small"] == loop_thread
        return replies

    assert gc.isenabled()
    _, big_reply, small_reply = asyncio.run(run())
    assert threads["big"].startswith("heavy-step")
    assert collecting == {"big": False, "small": True}
    assert gc.isenabled()  # back on once the large request is answered
    assert big_reply.seq == 1 and big_reply.HasField("table")
    assert small_reply.seq == 2 and small_reply.HasField("table")


def test_large_bytes_that_do_not_parse_are_refused_as_undecodable() -> None:
    servicer = PolicyServicer(DecisionService("goodput"))
    garbage = b"\xff" * (HEAVY_REQUEST_BYTES + 1)
    assert grpc_server._receive(garbage).message is None  # not parsed on the loop
    with pytest.raises(UndecodableRequest, match="not a valid message for"):
        servicer._answer_bytes(garbage)


def test_a_large_request_over_a_socket_gets_its_table_and_bad_bytes_end_the_stream(
    tmp_path: Path,
) -> None:
    service = DecisionService("goodput")
    socket = tmp_path / "s.sock"
    running = build_server(service, uds_path=str(socket))
    try:
        assert sys.getswitchinterval() <= GIL_SWITCH_INTERVAL_S
        with grpc.insecure_channel(f"unix:{socket}") as channel:
            stream = SyncStream(channel, timeout_s=30)
            ctx = wire.context_to_pb(context("big", 600))
            reply = stream.send(policy_pb2.StepRequest(context=ctx))
            assert reply.HasField("table"), reply.error.message
            stream.close()
            call = channel.stream_stream(
                f"/{grpc_server.POLICY_SERVICE}/StepStream",
                request_serializer=lambda data: data,
                response_deserializer=policy_pb2.StepReply.FromString,
            )
            with pytest.raises(grpc.RpcError) as refused:
                list(call(iter([b"\xff" * (HEAVY_REQUEST_BYTES + 1)]), timeout=30))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "not a valid message" in (refused.value.details() or "")
    finally:
        running.server.stop(None).wait()


def test_a_restore_round_trips_its_state_an_entry_at_a_time() -> None:
    state = {
        "schema": "s/1",
        "engines": {f"e{i}": {"requests": {"r": [1.0, 2.0, 3]}} for i in range(3)},
        "learners": {"shared:m": {"steps": 4}},
    }
    loaded, size = round_trip(state)
    assert loaded == state
    assert size == len(json.dumps(state, separators=(",", ":")))
    with pytest.raises(ValueError):
        round_trip({"engines": {"e": {"x": float("nan")}}})


def test_a_large_admin_request_is_parsed_on_its_thread_and_described_there() -> None:
    parse = admin_pb2.RestoreRequest.FromString
    small = admin_pb2.RestoreRequest(path="snapshot.json").SerializeToString()
    large = admin_pb2.RestoreRequest(snapshot_json="x" * HEAVY_REQUEST_BYTES).SerializeToString()
    deserialize = deferring("/m/Restore", parse, HEAVY_REQUEST_BYTES)
    assert isinstance(deserialize(small), admin_pb2.RestoreRequest)  # on the loop: cheap
    deferred = deserialize(large)
    assert isinstance(deferred, Deferred) and describe(deferred) == {"bytes": len(large)}
    seen: list[tuple[str, int]] = []

    class Servicer:
        def Restore(self, request: admin_pb2.RestoreRequest, context: Any) -> str:
            seen.append((threading.current_thread().name, len(request.snapshot_json)))
            return "done"

    class Context:
        async def abort(self, code: grpc.StatusCode, details: str) -> None:
            seen.append((code.name, len(details)))

    restore = InThreads(Servicer(), describe).Restore

    async def handler(request: Any, context: Any) -> Any:
        return await restore(request, context)

    loop_thread = threading.current_thread().name
    assert asyncio.run(handler(deferred, Context())) == "done"
    assert seen[0][0] != loop_thread and seen[0][1] == HEAVY_REQUEST_BYTES
    assert describe(deferred) == {"snapshot_json": f"<{HEAVY_REQUEST_BYTES} characters>"}
    garbage = deserialize(b"\xff" * (HEAVY_REQUEST_BYTES + 1))
    asyncio.run(handler(garbage, Context()))
    assert seen[1][0] == "INVALID_ARGUMENT" and describe(garbage) == {"undecodable": True}


def test_get_state_is_answered_serialized_by_its_thread() -> None:
    service = DecisionService("goodput")
    service.table_step([], [], context("e", 0))
    servicer = AdminServicer(service, None)

    class Context:
        def invocation_metadata(self) -> tuple[()]:
            return ()

    reply = servicer.GetState(admin_pb2.GetStateRequest(), Context())  # type: ignore[arg-type]
    assert isinstance(reply, Serialized)
    parsed = admin_pb2.GetStateResponse.FromString(reply.data)
    assert json.loads(parsed.state_json) == service.state_view().state
    assert parsed.policy_name == "goodput" and list(parsed.engine_ids) == ["e"]
    assert grpc_server._string_field(4, b"") == []
    text = "é" * (1 << 20)
    field = b"".join(grpc_server._string_field(4, text.encode()))
    assert admin_pb2.GetStateResponse.FromString(field).state_json == text


def test_whole_state_work_runs_with_the_collector_paused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pause = CollectorPause()
    assert gc.isenabled()
    with pause.paused():
        with pause.paused():  # overlapping holders: on again with the last
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with pause.paused():
            pass
        assert not gc.isenabled()  # off before the first: left off
    finally:
        gc.enable()
    service = DecisionService("goodput", state_dir=tmp_path)
    service.store.children = None  # in process, as where there is no fork
    service.table_step([], [], context("e", 0))
    seen: list[bool] = []
    read_state = service.store._read_state

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(gc.isenabled())
        return read_state(*args, **kwargs)

    monkeypatch.setattr(service.store, "_read_state", recording)
    service.write_snapshot()
    service.state_view()
    assert seen == [False, False] and gc.isenabled()


# Run in a fresh interpreter: in the test process other tests have imported everything.
FIRST_DECISIONS = textwrap.dedent(
    """
    import sys
    from nightjar_common.types import StepContext, StepOutcome
    from policy_server.policies import REGISTRY
    from policy_server.service import DecisionService

    services = {name: DecisionService(name) for name in sorted(REGISTRY)}
    before = set(sys.modules)
    for name, service in services.items():
        for step in range(40):  # past goodput's warm-up: its model's first decisions too
            ctx = StepContext("e", 8, step_index=step, context_tokens=3200)
            ran = service.run_step(ctx)
            accepted = 8 * ran.gamma // 2
            seconds = 0.02 + 0.002 * ran.gamma
            service.report(
                StepOutcome(ran.decision_id, "e", ran.gamma, seconds, 8 + accepted,
                            8 * ran.gamma, accepted)
            )
    print(sorted(set(sys.modules) - before))
    """
)


def test_no_policys_first_decisions_import_a_module_on_the_decision_loop() -> None:
    """A module imported on first use (numpy loads numpy.random lazily) would stall every
    engine of the sidecar while the first engine's first decision imports it: each
    registered policy's first decisions, warm-up and model alike, import nothing."""
    run = subprocess.run(
        [sys.executable, "-c", FIRST_DECISIONS], capture_output=True, text=True, check=True
    )
    assert run.stdout.strip() == "[]", run.stdout
