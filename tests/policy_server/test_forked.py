"""Whole-state work in forked children (issue 54 item 4): what the children hand back is
what the work in process gives, errors keep their status codes, a child that times out or
dies changes nothing, children run one at a time, and a real sidecar answers other
engines' decisions while a child of its snapshot, state read or restore is stopped.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import psutil  # type: ignore[import-untyped]
import pytest
from nightjar_proto.v1 import admin_pb2

from nightjar_common import wire
from nightjar_common.errors import AbortedError, FailedPreconditionError, InvalidArgumentError
from nightjar_common.types import RequestSignals, StepContext, StepOutcome
from policy_server import bulk_bytes, forked, json_pieces
from policy_server.service import DecisionService

PER_REQUEST = {"per_request": True}


def context(engine_id: str, requests: int = 8) -> StepContext:
    signals = tuple(RequestSignals(f"{engine_id}-{i}", 900, (1, 2)) for i in range(requests))
    return StepContext(
        engine_id=engine_id,
        learner_key=f"m@{engine_id}",
        batch_size=requests,
        max_gamma=4,
        requests=signals,
    )


def learned(service: DecisionService, engines: int, requests: int = 8) -> None:
    """A step of each engine, with its per-request outcome."""
    for index in range(engines):
        ctx = context(f"e{index}", requests)
        ran = service.run_step(ctx)
        accepts = tuple(i % (ran.gamma + 1) for i in range(requests))
        outcome = StepOutcome(
            decision_id=ran.decision_id,
            engine_id=ctx.engine_id,
            gamma=ran.gamma,
            step_seconds=0.02,
            generated_tokens=requests + sum(accepts),
            drafted_tokens=ran.gamma * requests,
            accepted_tokens=sum(accepts),
            request_accepts=accepts,
            request_ids=tuple(s.request_id for s in ctx.requests),
        )
        assert not service.report(outcome).skipped


def in_process(service: DecisionService) -> contextlib.AbstractContextManager[None]:
    """The service's whole-state work in process for a while, as where there is no fork."""

    @contextlib.contextmanager
    def held() -> Iterator[None]:
        children, service.store.children = service.store.children, None
        try:
            yield
        finally:
            service.store.children = children

    return held()


# -- the children ---------------------------------------------------------------------------


def test_a_child_sees_the_state_at_the_fork_and_hands_back_its_value_and_payload() -> None:
    data = {"x": 0}

    @contextlib.contextmanager
    def freeze() -> Iterator[int]:
        data["x"] = 1  # as held at the fork
        yield 7
        data["x"] = 2  # changed after it: the child never sees this

    def work(frozen: int, sink: forked.Sink) -> Any:
        sink(b"a" * 100_000)
        sink(b"b")
        return {"pid": os.getpid(), "frozen": frozen, "x": data["x"]}

    frozen, result = forked.Children().run(freeze(), work)
    assert frozen == 7 and data["x"] == 2
    assert result.value["pid"] != os.getpid()
    assert result.value["frozen"] == 7 and result.value["x"] == 1
    assert result.payload == b"a" * 100_000 + b"b"


def test_a_childs_error_comes_back_as_its_class_and_message() -> None:
    children = forked.Children()

    def refuse(frozen: None, sink: forked.Sink) -> None:
        raise InvalidArgumentError("no such thing")

    with pytest.raises(forked.ChildError) as caught:
        children.run(forked.nothing_held(), refuse)
    rebuilt = caught.value.rebuilt()
    assert type(rebuilt) is InvalidArgumentError and str(rebuilt) == "no such thing"

    def broken(frozen: None, sink: forked.Sink) -> None:
        raise json.JSONDecodeError("bad", "{", 0)

    with pytest.raises(forked.ChildError) as caught:
        children.run(forked.nothing_held(), broken)
    assert caught.value.is_a(ValueError) and not caught.value.is_a(OSError)
    assert caught.value.rebuilt() is caught.value  # not one of the contract's errors


def test_a_child_past_its_timeout_is_killed_and_one_that_dies_is_reported() -> None:
    # The test session's own children (sidecars of other tests' fixtures) are not these.
    before = {child.pid for child in psutil.Process().children()}

    def hang(frozen: None, sink: forked.Sink) -> None:
        time.sleep(120)

    with pytest.raises(forked.ChildLost) as caught:
        forked.Children(timeout_s=0.2).run(forked.nothing_held(), hang)
    assert isinstance(caught.value, AbortedError) and "ran past 0.2 s" in str(caught.value)

    def die(frozen: None, sink: forked.Sink) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    with pytest.raises(forked.ChildLost, match="signal 9"):
        forked.Children().run(forked.nothing_held(), die)
    assert not {child.pid for child in psutil.Process().children()} - before  # both reaped


def test_children_run_one_at_a_time() -> None:
    children = forked.Children()
    gate_r, gate_w = os.pipe()
    order: list[str] = []
    frozen_first = threading.Event()

    @contextlib.contextmanager
    def freeze(name: str) -> Iterator[None]:
        order.append(f"{name} forks")
        frozen_first.set()
        yield

    def first(frozen: None, sink: forked.Sink) -> str:
        os.read(gate_r, 1)  # until the test opens the gate
        return "first"

    def second(frozen: None, sink: forked.Sink) -> str:
        return "second"

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        one = pool.submit(children.run, freeze("first"), first)
        assert frozen_first.wait(30)
        two = pool.submit(children.run, freeze("second"), second)
        time.sleep(0.3)  # the second would fork now if it could
        assert order == ["first forks"] and not one.done() and not two.done()
        os.write(gate_w, b"x")
        assert one.result(30)[1].value == "first" and two.result(30)[1].value == "second"
    assert order == ["first forks", "second forks"]
    os.close(gate_r)
    os.close(gate_w)


def test_json_pieces_round_trip_in_small_pieces_in_order() -> None:
    records = {f"r{i}": [float(i), 1.0, i] for i in range(3000)}
    value = {
        "schema": "s/1",
        "engines": {f"e{i}": {"requests": dict(records), "steps": i} for i in range(3)},
        "empty": {},
        "small": {"a": 1},
        "big_list": list(range(5000)),
    }
    pieces = list(json_pieces.encode(value, limit=4096))
    decoded = json_pieces.decode(b"".join(pieces))
    assert decoded == value
    assert json.dumps(decoded) == json.dumps(value)  # the members' order too
    big_list = len(json.dumps(value["big_list"]))
    assert max(map(len, pieces)) < big_list + 64  # the large list is one piece
    assert sorted(map(len, pieces))[-2] < 4096 + 64  # every other a member over at most
    assert json_pieces.decode(b"".join(json_pieces.encode({}))) == {}
    with pytest.raises(ValueError):
        list(json_pieces.encode({"x": float("nan")}))


def test_joined_bytes_equal_a_join() -> None:
    parts = [b"head", os.urandom(bulk_bytes.JOIN_IN_FILE_BYTES), b"", b"tail"]
    assert bulk_bytes.joined(parts) == b"".join(parts)
    assert bulk_bytes.joined([b"a", b"b"]) == b"ab"


# -- the state store's work in children ---------------------------------------------------


def test_a_snapshot_and_a_whole_read_from_a_child_equal_the_ones_in_process(
    tmp_path: Path,
) -> None:
    service = DecisionService("goodput", PER_REQUEST, state_dir=tmp_path)
    learned(service, 5, requests=40)
    assert service.store.children is not None
    child_view = service.state_view()
    path = service.write_snapshot()
    from_child = json.loads(path.read_bytes())
    with in_process(service):
        view = service.state_view()
        service.write_snapshot()
        here = json.loads(path.read_bytes())
    assert child_view.state_utf8 == view.state_utf8  # byte for byte
    assert child_view.memory == view.memory and child_view.engine_ids == view.engine_ids
    assert child_view.policy_version == view.policy_version
    assert from_child.pop("created_unix") <= here.pop("created_unix")
    assert from_child == here
    assert len(from_child["policy"]["state"]["engines"]["e0"]["requests"]) == 40


def test_a_child_reads_the_state_holding_every_lock_of_the_policy() -> None:
    service = DecisionService("goodput", PER_REQUEST)
    learned(service, 2)
    store = service.store
    assert store.children is not None

    def work(frozen: Any, sink: forked.Sink) -> list[bool]:
        locks = store.activation.learner_locks._locks
        return [store.activation._lock.locked(), all(lock.locked() for lock in locks)]

    frozen, result = store.children.run(store._frozen(), work)
    assert result.value == [True, True]  # as copied at the fork
    assert not store.activation._lock.locked()  # and released in the parent
    assert frozen.engine_ids == ["e0", "e1"]


def test_a_restore_checked_in_a_child_restores_what_a_restore_in_process_does(
    tmp_path: Path,
) -> None:
    source = DecisionService("goodput", PER_REQUEST, state_dir=tmp_path)
    learned(source, 4, requests=30)
    text = source.write_snapshot().read_text()
    by_child = DecisionService("goodput", PER_REQUEST, state_dir=tmp_path)
    by_child.restore_json(text)
    here = DecisionService("goodput", PER_REQUEST, state_dir=tmp_path)
    with in_process(here):
        here.restore_json(text)
        expected = here.state_view()
    restored = by_child.state_view()
    assert restored.state == expected.state == source.state_view().state
    assert restored.engine_ids == expected.engine_ids == ["e0", "e1", "e2", "e3"]
    by_path = DecisionService("goodput", PER_REQUEST, state_dir=tmp_path)
    by_path.restore_path("snapshot.json")
    assert by_path.state_view().state == expected.state


def test_a_restore_refused_in_a_child_keeps_its_status_and_changes_nothing(
    tmp_path: Path,
) -> None:
    service = DecisionService("goodput", PER_REQUEST, state_dir=tmp_path)
    learned(service, 2)
    document = json.loads(service.write_snapshot().read_text())
    before = service.state_view()
    with pytest.raises(InvalidArgumentError, match="not a nightjar-snapshot"):
        service.restore_json("{}")
    learner = next(iter(document["policy"]["state"]["learners"].values()))
    learner["step_time"]["squared_error"] = 1.7e308
    with pytest.raises(InvalidArgumentError, match="squared_error"):
        service.restore_json(json.dumps(document))
    after = service.state_view()
    assert after.state == before.state and after.policy_version == before.policy_version


def test_a_lost_child_fails_the_call_and_changes_nothing(tmp_path: Path) -> None:
    service = DecisionService("goodput", PER_REQUEST, state_dir=tmp_path)
    learned(service, 2)
    path = service.write_snapshot()
    kept = path.read_bytes()
    text = path.read_text()
    learned(service, 3)  # more than the snapshot holds
    before = service.state_view()
    service.store.children = forked.Children(timeout_s=0.0)
    with pytest.raises(FailedPreconditionError, match="the last snapshot is kept"):
        service.write_snapshot()
    assert path.read_bytes() == kept
    with pytest.raises(AbortedError, match="nothing was changed"):
        service.restore_json(text)
    with pytest.raises(AbortedError):
        service.state_view()
    service.store.children = forked.Children()
    after = service.state_view()
    assert after.state == before.state and after.policy_version == before.policy_version
    assert not list(tmp_path.glob(".snapshot.json.*"))  # no temporary file left


# -- a real sidecar -----------------------------------------------------------------------


def seeded(server: Any, engines: int, requests: int) -> str:
    """A state of ``engines`` engines with ``requests`` per-request records each, restored
    into ``server``; its snapshot document's JSON."""
    with server.engine() as engine:
        ctx = wire.context_to_pb(context("seed"))
        decided = engine.decide(ctx)
        engine.report(
            wire.outcome_to_pb(
                StepOutcome(
                    decision_id=decided.decision_id,
                    engine_id="seed",
                    gamma=decided.gamma,
                    step_seconds=0.02,
                    generated_tokens=8,
                    drafted_tokens=8 * decided.gamma,
                    accepted_tokens=0,
                )
            )
        )
    server.admin.Snapshot(admin_pb2.SnapshotRequest(), metadata=server.auth, timeout=30)
    document = json.loads((server.state_dir / "snapshot.json").read_text())
    state = document["policy"]["state"]
    seed = state["engines"]["seed"]
    for index in range(engines):
        engine_id = f"held{index}"
        records = {f"{engine_id}-{i}".ljust(120, "x"): [3.0, 1.0, 1] for i in range(requests)}
        state["engines"][engine_id] = {**seed, "requests": records, "observed_steps": 1}
        document["engines"].append(engine_id)
    text = json.dumps(document)
    server.admin.Restore(
        admin_pb2.RestoreRequest(snapshot_json=text), metadata=server.auth, timeout=60
    )
    return text


def stopped_child(server: Any, call: Callable[[], Any]) -> tuple[Any, psutil.Process]:
    """``call`` under way on a pool thread, with the child the sidecar forked for it
    stopped (SIGSTOP); tried again when the child ended before it was seen."""
    sidecar = psutil.Process(server.proc.pid)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    for _ in range(50):
        future = pool.submit(call)
        while not future.done():
            children = sidecar.children()
            if children:
                child = children[0]
                with contextlib.suppress(psutil.NoSuchProcess):
                    # Past its set-up (it lowers its priority last, after asking to die
                    # with the sidecar): a child stopped before that would outlive it.
                    if child.nice() <= sidecar.nice():
                        continue
                    child.send_signal(signal.SIGSTOP)
                    if child.status() != psutil.STATUS_ZOMBIE:
                        pool.shutdown(wait=False)
                        return future, child
        future.result()
    raise AssertionError("never saw the sidecar's child under way")


@pytest.mark.parametrize("method", ["Snapshot", "GetState", "Restore"])
def test_other_engines_are_answered_while_an_admin_calls_child_is_stopped(
    make_server: Any, method: str
) -> None:
    server = make_server("--policy", "goodput", "--params", json.dumps(PER_REQUEST))
    document = seeded(server, engines=8, requests=2000)
    calls = {
        "Snapshot": lambda: server.admin.Snapshot(
            admin_pb2.SnapshotRequest(), metadata=server.auth, timeout=120
        ),
        "GetState": lambda: server.admin.GetState(
            admin_pb2.GetStateRequest(), metadata=server.auth, timeout=120
        ),
        "Restore": lambda: server.admin.Restore(
            admin_pb2.RestoreRequest(snapshot_json=document), metadata=server.auth, timeout=120
        ),
    }
    future, child = stopped_child(server, calls[method])
    try:
        with server.engine() as engine:
            tables = [engine.decide(wire.context_to_pb(context("small", 4))) for _ in range(20)]
        assert all(t.table.table_id for t in tables)
        assert not future.done()  # the admin call waits for its stopped child
    finally:
        child.send_signal(signal.SIGCONT)
    reply = future.result(120)
    if method == "GetState":
        state = json.loads(reply.state_json)
        assert len(state["engines"]["held7"]["requests"]) == 2000
    elif method == "Snapshot":
        written = json.loads((server.state_dir / "snapshot.json").read_text())
        assert len(written["policy"]["state"]["engines"]["held7"]["requests"]) == 2000
    else:
        assert reply.policy_name == "goodput"
        assert "small" not in server.state()["state"]["engines"]  # restored over it


def test_a_killed_child_fails_its_call_with_nothing_changed(make_server: Any) -> None:
    server = make_server("--policy", "goodput", "--params", json.dumps(PER_REQUEST))
    document = seeded(server, engines=8, requests=2000)
    kept = (server.state_dir / "snapshot.json").read_bytes()
    before = server.state()
    call = lambda: server.admin.Snapshot(  # noqa: E731
        admin_pb2.SnapshotRequest(), metadata=server.auth, timeout=120
    )
    future, child = stopped_child(server, call)
    child.send_signal(signal.SIGKILL)
    with pytest.raises(grpc.RpcError) as caught:
        future.result(120)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "signal 9" in str(caught.value.details())
    assert (server.state_dir / "snapshot.json").read_bytes() == kept
    restore = lambda: server.admin.Restore(  # noqa: E731
        admin_pb2.RestoreRequest(snapshot_json=document), metadata=server.auth, timeout=120
    )
    future, child = stopped_child(server, restore)
    child.send_signal(signal.SIGKILL)
    with pytest.raises(grpc.RpcError) as caught:
        future.result(120)
    assert caught.value.code() == grpc.StatusCode.ABORTED
    assert server.state() == before


def test_released_json_is_emptied_but_what_another_holds_is_left_whole() -> None:
    kept = {"r1": [1.0, 2.0, 3], "r2": [4.0, 5.0, 6]}
    value: dict[str, Any] = {
        "engines": {"e0": {"requests": kept}, "e1": {"requests": {"r3": [7.0]}}},
        "list": [{"a": 1}, [2, 3]],
    }
    engines = value["engines"]
    json_pieces.release(value)
    assert value == {}
    assert engines == {"e0": {"requests": kept}, "e1": {"requests": {"r3": [7.0]}}}
    inner: dict[str, Any] = {"requests": dict(kept)}
    json_pieces.release({"engines": {"e0": inner}})
    assert inner == {"requests": kept}  # held here as well: let go of, not emptied
    assert kept == {"r1": [1.0, 2.0, 3], "r2": [4.0, 5.0, 6]}


def test_a_restore_keeps_what_it_made_out_of_the_collectors_scans(tmp_path: Path) -> None:
    source = DecisionService("goodput", PER_REQUEST, state_dir=tmp_path)
    learned(source, 3, requests=30)
    text = source.write_snapshot().read_text()
    service = DecisionService("goodput", PER_REQUEST)
    frozen = gc.get_freeze_count()
    try:
        service.restore_json(text)
        assert gc.get_freeze_count() > frozen
        assert gc.isenabled()
    finally:
        gc.unfreeze()


def test_a_child_dies_with_its_sidecar(make_server: Any) -> None:
    server = make_server("--policy", "goodput", "--params", json.dumps(PER_REQUEST))
    seeded(server, engines=8, requests=2000)
    call = lambda: server.admin.GetState(  # noqa: E731
        admin_pb2.GetStateRequest(), metadata=server.auth, timeout=120
    )
    future, child = stopped_child(server, call)
    server.kill9()
    with pytest.raises(grpc.RpcError):
        future.result(120)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and gone(child) is False:
        time.sleep(0.05)
    assert gone(child)  # killed with its sidecar, though stopped


def gone(process: psutil.Process) -> bool:
    try:
        return bool(process.status() == psutil.STATUS_ZOMBIE)  # dead, not reaped yet
    except psutil.NoSuchProcess:
        return True
