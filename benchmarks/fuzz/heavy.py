"""`make fuzz`'s classes of issue 54 for what is large, repeated or concurrent, each against
a real nightjar-server of its own (hardening.Sidecar, goodput with per-request records):

* sizes: contexts with every per-request section at its bound, and past the request size;
  ids at, past and far past their bound, with a NUL or a line break, repeated in a step;
  learned states past gRPC's default 4 MiB read whole (GetState), snapshotted and restored,
  and a Restore past the bound, a 300,000-character learner id, 100,000-deep nesting;
* replays: steps run from a table and their outcomes, sent again (on the same stream and on
  a new one), a ran step twice in one batch, an outcome twice in one batch;
* concurrent heavy requests: engines sending 4,096-request contexts and outcomes, whole
  state reads, snapshots and restores at once, beside a small engine deciding.

After each case the server must be alive and answering (hardening.Sidecar.problem); a case
must be answered as the contract says (accepted, or refused with the code that names its
bound); nothing is learned twice: a learner's step count grows by the distinct steps
applied, not by replays.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from nightjar_proto.v1 import admin_pb2, admin_pb2_grpc, policy_pb2

from benchmarks.fuzz.hardening import ClassResult, Sidecar, StepFailed
from nightjar_common import wire
from nightjar_common.sidecar_stream import StreamEnded, SyncStream
from nightjar_common.types import RequestSignals, StepContext, StepOutcome
from nightjar_common.validation import MAX_ID_LENGTH
from policy_server.config import admin_message_bytes

PER_REQUEST = {"per_request": True, "seed": 3}
LEARNER_KEY = "m@fuzz"
LEARNER = f"shared:{LEARNER_KEY}"
BATCH = 120
# The per-request bounds of one step (validation.Limits).
MAX_REQUESTS, MAX_RECENT = 4096, 256
TIMEOUT_S = 60.0
# Why a step is skipped when a restore came between its table and its report.
RESTORED = "its table is not held"
# Admin calls that carry whole states: as nightjarctl does (any state a snapshot may hold).
LARGE = [
    ("grpc.max_receive_message_length", admin_message_bytes()),
    ("grpc.max_send_message_length", admin_message_bytes() * 2),
]
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def start(workdir: Path, name: str, token_file: Path) -> tuple[Sidecar, Any]:
    """A sidecar on goodput with per-request records, and an admin stub for large states."""
    server = Sidecar(workdir, name, workdir / name, token_file).start()
    server.admin.SwapPolicy(
        admin_pb2.SwapPolicyRequest(name="goodput", params_json=json.dumps(PER_REQUEST)),
        metadata=server.auth,
        timeout=TIMEOUT_S,
    )
    channel = grpc.insecure_channel(server.process.target, options=LARGE)
    # Every admin call of the class reads states of any size (the checks after each case too).
    server.admin = admin_pb2_grpc.AdminServiceStub(channel)
    return server, server.admin


def new_stream(server: Sidecar) -> SyncStream:
    """A stream of its own on the sidecar's channel (an engine, or one reconnecting)."""
    assert server.process.channel is not None
    return SyncStream(server.process.channel, timeout_s=TIMEOUT_S)


def context(engine: str, step: int, **fields: Any) -> policy_pb2.StepContext:
    values: dict[str, Any] = {"batch_size": BATCH, "max_gamma": 4, "learner_key": LEARNER_KEY}
    return wire.context_to_pb(
        StepContext(engine_id=engine, step_index=step, **{**values, **fields})
    )


def outcome(ran: policy_pb2.RanStep, ids: list[str] | None = None) -> policy_pb2.StepOutcome:
    """A plausible outcome of ``ran`` with a per-request section (new request ids each step
    unless ``ids``): each leaves a per-request record of some 200 bytes."""
    gamma, engine = ran.gamma, ran.context.engine_id
    batch = ran.context.batch_size
    ids = ids or [f"{engine}-{ran.decision_id}-{i}-".ljust(180, "x") for i in range(batch)]
    accepts = tuple(i % (gamma + 1) for i in range(batch))
    return wire.outcome_to_pb(
        StepOutcome(
            decision_id=ran.decision_id,
            engine_id=engine,
            gamma=gamma,
            step_seconds=0.05,
            generated_tokens=batch + sum(accepts),
            drafted_tokens=gamma * batch,
            accepted_tokens=sum(accepts),
            request_accepts=accepts,
            request_ids=tuple(ids),
        )
    )


def run_steps(stream: SyncStream, engine: str, steps: int, batch: int = BATCH) -> None:
    """``steps`` steps of ``engine`` at ``batch``, each run from its table and reported
    (applied)."""
    for step in range(steps):
        ran = ran_step(stream, context(engine, step, batch_size=batch))
        reply = stream.send(policy_pb2.StepRequest(ran_steps=[ran], outcomes=[outcome(ran)]))
        if reply.HasField("error") or reply.skipped:
            raise StepFailed(
                f"step {step} of {engine}: {reply.error.message or reply.skipped_reason}"
            )


def ran_step(stream: SyncStream, ctx: policy_pb2.StepContext) -> policy_pb2.RanStep:
    reply = stream.send(policy_pb2.StepRequest(context=ctx))
    if reply.HasField("error"):
        raise StepFailed(f"table for {ctx.engine_id}: {reply.error.message}")
    table = reply.table
    gamma = table.gammas[ctx.batch_size - table.first_batch_size]
    return policy_pb2.RanStep(decision_id=f"{table.table_id}.1", context=ctx, gamma=gamma)


def learned_steps(admin: Any, auth: Any) -> int:
    state = json.loads(admin.GetState(admin_pb2.GetStateRequest(), metadata=auth).state_json)
    return int(state.get("learners", {}).get(LEARNER, {}).get("steps", 0))


def _stream_code(stream: SyncStream, request: policy_pb2.StepRequest) -> tuple[Any, str]:
    """The code a request on the stream is answered with (a StepReply.error's, the stream's
    end status, or OK), and its message."""
    try:
        reply = stream.send(request)
    except StreamEnded as ended:
        return ended.code, ended.details
    if reply.HasField("error"):
        code = next(c for c in grpc.StatusCode if c.value[0] == reply.error.code)
        return code, reply.error.message
    return grpc.StatusCode.OK, reply.skipped_reason


class Cases:
    """Runs named cases against one sidecar, checking each: its answer, then the server."""

    def __init__(self, result: ClassResult, server: Sidecar) -> None:
        self.result, self.server = result, server

    def check(self, name: str, expected: set[Any], got: Any, message: str = "") -> None:
        self.result.cases += 1
        if got != grpc.StatusCode.OK:
            self.result.refused += 1
        if got not in expected:
            self.result.fail(name, f"answered {got} ({message[:200]}), expected one of {expected}")
        elif problem := self.server.problem():
            self.result.fail(name, problem)


def sizes(workdir: Path, token_file: Path, quick: bool, seed: int) -> ClassResult:
    result = ClassResult(
        "sizes",
        "contexts and outcomes with every per-request section at its bound (4,096 requests, "
        "256-character ids, 256 recent accepts) and past the request size; engine ids, "
        "learner keys and request ids of 256, 257 and 300,000 characters, with NUL or a line "
        "break, repeated in a step; a learned state past gRPC's 4 MiB read whole, "
        "snapshotted and restored; a Restore past its bound, a 300,000-character learner id, "
        "100,000-deep nesting",
        checked="each answered as its bound says (accepted, INVALID_ARGUMENT, or "
        "RESOURCE_EXHAUSTED naming the setting), then alive, SERVING, γ within bounds",
    )
    rng = random.Random(seed)
    server, large = start(workdir, "sizes", token_file)
    cases = Cases(result, server)
    try:
        _huge_contexts(cases, server, rng)
        _ids(cases, server)
        _states(cases, server, large, quick)
    finally:
        server.stop()
    return result


def _huge_contexts(cases: Cases, server: Sidecar, rng: random.Random) -> None:
    assert server.stream is not None
    ids = [f"r{i}-".ljust(MAX_ID_LENGTH, "x") for i in range(MAX_REQUESTS)]
    full = tuple(
        RequestSignals(
            rid, rng.randrange(1 << 16), tuple(rng.randrange(5) for _ in range(MAX_RECENT))
        )
        for rid in ids
    )
    ctx = context("big", 0, requests=full, batch_size=MAX_REQUESTS)
    code, message = _stream_code(server.stream, policy_pb2.StepRequest(context=ctx))
    cases.check("4,096 requests at every bound", {grpc.StatusCode.OK}, code, message)
    ran = ran_step(server.stream, context("big", 1))
    big = outcome(ran, ids[: ran.context.batch_size])
    code, message = _stream_code(
        server.stream, policy_pb2.StepRequest(ran_steps=[ran], outcomes=[big])
    )
    cases.check("an outcome with 256-character request ids", {grpc.StatusCode.OK}, code, message)
    over = context("big", 2, requests=(*full, RequestSignals("one-more")), batch_size=4097)
    code, message = _stream_code(server.stream, policy_pb2.StepRequest(context=over))
    cases.check("4,097 requests", {INVALID}, code, message)
    # Past the request size the stream ends (RESOURCE_EXHAUSTED): a new one goes on.
    huge = context("big", 3, learner_key="k" * (5 << 20))
    code, message = _stream_code(server.stream, policy_pb2.StepRequest(context=huge))
    server.stream.close()
    server.stream = new_stream(server)
    named = (code, "max_receive_bytes" in message)
    cases.check("a 5 MiB context, its bound named", {(RESOURCE_EXHAUSTED, True)}, named, message)


def _ids(cases: Cases, server: Sidecar) -> None:
    assert server.stream is not None
    for length in (MAX_ID_LENGTH, MAX_ID_LENGTH + 1, 300_000):
        expected = {grpc.StatusCode.OK} if length <= MAX_ID_LENGTH else {INVALID}
        for field in ("engine_id", "learner_key"):
            ctx = context("ids", 0)
            setattr(ctx, field, "i" * length)
            code, message = _stream_code(server.stream, policy_pb2.StepRequest(context=ctx))
            cases.check(f"{field} of {length:,} characters", expected, code, message)
        ctx = context("ids", 0, requests=(RequestSignals("r" * length),))
        code, message = _stream_code(server.stream, policy_pb2.StepRequest(context=ctx))
        cases.check(f"request id of {length:,} characters", expected, code, message)
    for name, request_ids in (
        ("a NUL", ("r\0x",)),
        ("a line break", ("r\nx",)),
        ("a carriage return", ("r\rx",)),
        ("repeated", ("a", "b", "a")),
    ):
        ctx = context("ids", 0, requests=tuple(RequestSignals(r) for r in request_ids))
        code, message = _stream_code(server.stream, policy_pb2.StepRequest(context=ctx))
        cases.check(f"request ids: {name}", {INVALID}, code, message)
        ran = ran_step(server.stream, context("ids", 1))
        bad = outcome(ran, [*request_ids, *(f"ok{i}" for i in range(BATCH - len(request_ids)))])
        reply = server.stream.send(policy_pb2.StepRequest(ran_steps=[ran], outcomes=[bad]))
        skipped = not reply.HasField("error") and reply.skipped == 1
        cases.check(
            f"outcome request ids: {name}",
            {True},
            skipped and "request id" in reply.skipped_reason,
            reply.skipped_reason or reply.error.message,
        )


def _states(cases: Cases, server: Sidecar, large: Any, quick: bool) -> None:
    """A state past 4 MiB (engines of 4,096 per-request records, ~800 KB each) read,
    snapshotted and restored whole; then what must be refused."""
    assert server.stream is not None
    engines = 6 if quick else 40
    for engine in range(engines):  # 4,096 records an engine, the most it keeps
        run_steps(server.stream, f"s{engine}", 8, batch=512)
    auth = server.auth
    try:
        whole = large.GetState(admin_pb2.GetStateRequest(), metadata=auth, timeout=TIMEOUT_S)
        size, code = whole.ByteSize(), grpc.StatusCode.OK
    except grpc.RpcError as exc:
        whole, size, code = None, 0, exc.code()
    cases.check(f"GetState of a {size:,}-byte state", {grpc.StatusCode.OK}, code)
    if whole is None:
        return
    shown = set(json.loads(whole.state_json)["engines"])
    missing = {f"s{engine}" for engine in range(engines)} - shown
    cases.check(f"GetState shows all {engines} engines", {0}, len(missing), str(missing))
    code = server.code(server.admin.Snapshot, admin_pb2.SnapshotRequest())
    cases.check("snapshot of the large state", {grpc.StatusCode.OK}, code)
    text = (server.state_dir / "snapshot.json").read_text()
    code = _admin_code(large.Restore, admin_pb2.RestoreRequest(snapshot_json=text), auth)
    cases.check(f"Restore of a {len(text):,}-byte snapshot", {grpc.StatusCode.OK}, code)
    document = json.loads(text)
    document["policy"]["state"]["learners"]["shared:" + "k" * 300_000] = {}
    code = _admin_code(
        large.Restore, admin_pb2.RestoreRequest(snapshot_json=json.dumps(document)), auth
    )
    cases.check("Restore with a 300,000-character learner id", {INVALID}, code)
    deep = text[:-1] + ',"deep":' + "[" * 100_000 + "]" * 100_000 + "}"
    code = _admin_code(large.Restore, admin_pb2.RestoreRequest(snapshot_json=deep), auth)
    cases.check("Restore nested 100,000 levels deep", {INVALID}, code)
    past = admin_pb2.RestoreRequest(snapshot_json=" " * (admin_message_bytes() + 1))
    code = _admin_code(large.Restore, past, auth)
    cases.check("Restore past its bound", {RESOURCE_EXHAUSTED}, code)


def _admin_code(call: Callable[..., Any], request: Any, auth: Any) -> grpc.StatusCode:
    try:
        call(request, metadata=auth, timeout=TIMEOUT_S)
    except grpc.RpcError as exc:
        code: grpc.StatusCode = exc.code()
        return code
    return grpc.StatusCode.OK


def replays(workdir: Path, token_file: Path, quick: bool, seed: int) -> ClassResult:
    result = ClassResult(
        "replays",
        "steps run from a table and their outcomes sent again (1-20 times, on the same "
        "stream and on a new one), a ran step twice in one batch, an outcome twice in one "
        "batch",
        checked="every replay skipped and said; the learner's step count grows by the "
        "distinct steps applied only; then alive, SERVING, γ within bounds",
    )
    rng = random.Random(seed)
    server, large = start(workdir, "replays", token_file)
    assert server.stream is not None
    try:
        for case in range(6 if quick else 100):
            engine = f"r{case % 4}"
            before = learned_steps(large, server.auth)
            ran = ran_step(server.stream, context(engine, case))
            report = policy_pb2.StepRequest(ran_steps=[ran], outcomes=[outcome(ran)])
            first = server.stream.send(report)
            times = rng.randint(1, 20)
            for again in range(times):
                stream = server.stream
                if again % 2:  # on a new stream, as after a reconnect
                    stream = new_stream(server)
                reply = stream.send(report)
                if stream is not server.stream:
                    stream.close()
                result.cases += 1
                result.refused += bool(reply.skipped)
                if reply.HasField("error") or reply.skipped != 2:
                    result.fail(f"replay {case}.{again}", f"not skipped: {reply}")
            twice = _twice_in_a_batch(server, engine, case, rng.random() < 0.5)
            result.cases += 1
            learned = learned_steps(large, server.auth) - before
            if first.skipped or twice or learned != 2:
                result.fail(
                    f"case {case}",
                    f"first {first.skipped} skipped, in a batch: {twice}; learned {learned} "
                    "steps, 2 distinct ones applied",
                )
            elif problem := server.problem():
                result.fail(f"case {case}", problem)
    finally:
        server.stop()
    return result


def _twice_in_a_batch(server: Sidecar, engine: str, case: int, ran_twice: bool) -> str:
    """A ran step (or its outcome) twice in one batch: applied once, the other skipped;
    what went wrong ("" when nothing)."""
    assert server.stream is not None
    ran = ran_step(server.stream, context(engine, 10_000 + case))
    done = outcome(ran)
    request = policy_pb2.StepRequest(
        ran_steps=[ran, ran] if ran_twice else [ran], outcomes=[done, done]
    )
    reply = server.stream.send(request)
    expected = 2 if ran_twice else 1  # the second ran step (and so its outcome) skipped
    if reply.HasField("error") or reply.skipped < expected:
        return f"{reply.skipped} skipped of {len(request.ran_steps)} ran, 2 outcomes"
    return ""


def concurrent_heavy(workdir: Path, token_file: Path, quick: bool, seed: int) -> ClassResult:
    result = ClassResult(
        "concurrent heavy requests",
        "4 engines sending 4,096-request contexts and outcomes with 180-character request "
        "ids, whole-state reads, snapshots and restores of the state they build, all at "
        "once, beside a small engine deciding a step at a time",
        checked="every request answered (tables, reads, snapshots and restores OK; steps "
        "applied, or skipped as 'its table is not held' when a restore came between table "
        "and report, counted as refused); then alive, SERVING, γ within bounds",
    )
    rng = random.Random(seed)
    server, large = start(workdir, "heavy", token_file)
    rounds = 3 if quick else 40
    errors: list[str] = []
    latencies: list[float] = []
    # Items skipped because a restore between a table and its report replaced the tables
    # the sidecar held (the contract: nothing is learned from them, the engine goes on).
    forgotten: list[int] = []
    stop = threading.Event()

    def guarded(name: str, work: Callable[[], None]) -> threading.Thread:
        def run() -> None:
            try:
                work()
            except Exception as exc:  # any failure of a worker is a finding
                errors.append(f"{name}: {type(exc).__name__} {exc}"[:400])

        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        return thread

    def heavy_engine(index: int) -> Callable[[], None]:
        def work() -> None:
            stream = new_stream(server)
            try:
                signals = tuple(
                    RequestSignals(f"h{index}-{i}-".ljust(180, "x"), 900, (1, 2, 0, 3))
                    for i in range(MAX_REQUESTS)
                )
                for step in range(rounds):
                    ctx = context(f"heavy{index}", step, requests=signals, batch_size=MAX_REQUESTS)
                    ran = ran_step(stream, ctx)
                    ids = [s.request_id for s in signals]
                    reply = stream.send(
                        policy_pb2.StepRequest(ran_steps=[ran], outcomes=[outcome(ran, ids)])
                    )
                    if reply.HasField("error"):
                        raise StepFailed(reply.error.message)
                    if reply.skipped and RESTORED not in reply.skipped_reason:
                        raise StepFailed(reply.skipped_reason)
                    forgotten.append(reply.skipped)
            finally:
                stream.close()

        return work

    def admin_work() -> None:
        calls = (
            lambda: large.GetState(admin_pb2.GetStateRequest(), metadata=server.auth),
            lambda: server.admin.Snapshot(admin_pb2.SnapshotRequest(), metadata=server.auth),
            lambda: large.Restore(
                admin_pb2.RestoreRequest(
                    snapshot_json=(server.state_dir / "snapshot.json").read_text()
                ),
                metadata=server.auth,
            ),
        )
        calls[1]()  # a snapshot to restore
        for _ in range(rounds * 2):
            rng.choice(calls)()

    def small_engine() -> None:
        stream = new_stream(server)
        try:
            step = 0
            while not stop.is_set():
                started = time.perf_counter()
                reply = stream.send(policy_pb2.StepRequest(context=context("small", step)))
                latencies.append(time.perf_counter() - started)
                if reply.HasField("error"):
                    raise StepFailed(reply.error.message)
                step += 1
        finally:
            stream.close()

    try:
        small = guarded("small engine", small_engine)
        workers = [guarded(f"heavy {i}", heavy_engine(i)) for i in range(4)]
        workers.append(guarded("admin", admin_work))
        for worker in workers:
            worker.join(timeout=600)
        stop.set()
        small.join(timeout=60)
        result.cases = 4 * rounds * 2 + rounds * 2 + len(latencies)
        result.refused = sum(forgotten)
        for error in errors:
            result.fail("concurrent", error)
        if problem := server.problem():
            result.fail("after", problem)
        if latencies:
            latencies.sort()
            p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
            result.what += (
                f" (the small engine's round trips meanwhile: {len(latencies):,}, p99 "
                f"{1000 * p99:.1f} ms, max {1000 * latencies[-1]:.1f} ms, for the record)"
            )
    finally:
        stop.set()
        server.stop()
    return result


def run(workdir: Path, token_file: Path, quick: bool, seed: int) -> list[ClassResult]:
    return [
        sizes(workdir, token_file, quick, seed),
        replays(workdir, token_file, quick, seed),
        concurrent_heavy(workdir, token_file, quick, seed),
    ]
