"""`make fuzz`'s hardening classes (issue 28): what a sidecar reads, in the shapes that once
crashed it, hung it or taught it the impossible.

Four classes, each sent to a real nightjar-server (one per class; a fresh one for each
snapshot file it must start on):

* snapshot documents: valid snapshots of ema, nightjar and goodput with one value made
  bad (a number too large for a float, a 5,000-digit integer, deep nesting, a negative
  or non-numeric created_unix, ema candidates out of range, γ_prev beyond Γmax), restored
  over the Restore RPC, and the named shapes also written as snapshot.json for a server
  to start on;
* file kinds: snapshot.json (and a file Restore names) as a symbolic link to /dev/zero, a
  FIFO, a directory, a file over the 64 MiB cap;
* parameter values: NaN, ±Infinity, 1e400, a 5,000-digit integer, deep nesting for every
  parameter of every policy, by SwapPolicy and SetParameters, each followed by a snapshot;
* implausible outcomes: counts of 10^18, a 1 ns step, more drafts than γ·B, each the
  outcome of a step run from a table the sidecar sent.

After each case the server must be alive and SERVING, answer a table within 0..Γmax (and
within an engine's max_gamma), hold no number beyond what a policy can learn, and, when
the case was refused, hold the learned state it held before.

Three classes of issue 54 (heavy.py) send what is large, repeated or concurrent: sizes,
replays, concurrent heavy requests. Another, failing drivers (issue 54,
failing_drivers.py), runs memory orders against a virtual-memory driver that fails, in
this process, and checks what they leave behind.

The steps go over StepStream as an engine sends them (nightjar.v1): a table for a context,
the step run from it, its outcome.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import random
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
from nightjar_proto.v1 import admin_pb2, admin_pb2_grpc, policy_pb2

from benchmarks.fuzz.processes import ServerProcess
from nightjar_common.sidecar_stream import SyncStream
from policy_server.policies import REGISTRY

TIMEOUT_S = 30.0
REFUSALS = frozenset(
    {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OK}
)
# Stand-ins json.dumps can write, replaced in the text by what it cannot.
BIG_FLOAT, BIG_INT, DEEP = "@1e400@", "@digits@", "@deep@"
RAW = {BIG_FLOAT: "1e400", BIG_INT: "9" * 5000, DEEP: "[" * 100_000 + "]" * 100_000}
BAD_VALUES: tuple[Any, ...] = (BIG_FLOAT, BIG_INT, DEEP, -1, -5, 1000, 99, "x", [1], None)
# Numbers no policy learns: beyond them a value came from outside.
MAX_LEARNED = 2.0**64


@dataclasses.dataclass
class ClassResult:
    name: str
    what: str
    cases: int = 0
    refused: int = 0
    failures: list[str] = dataclasses.field(default_factory=list)
    # What is checked after each case ("": a sidecar's, as the classes here check it).
    checked: str = ""

    def fail(self, case: str, why: str) -> None:
        self.failures.append(f"{case}: {why}")


class StepFailed(Exception):
    """The sidecar answered a StepStream request with an error, or skipped what it sent."""


class Sidecar:
    """A nightjar-server on a state directory, with an engine's stream, the admin stub and
    the admin token."""

    def __init__(self, workdir: Path, name: str, state_dir: Path, token_file: Path) -> None:
        self.state_dir = state_dir
        self.token = token_file.read_text().strip()
        self.stream: SyncStream | None = None
        sock = workdir / f"{name}.sock"
        self.process = ServerProcess(
            name,
            [
                "policy_server.cli",
                "--uds",
                str(sock),
                "--state-dir",
                str(state_dir),
                "--admin-token-file",
                str(token_file),
                "--log-level",
                "WARNING",
            ],
            sock,
            workdir / f"{name}.log",
        )

    def start(self) -> Sidecar:
        channel = self.process.start(timeout=60)
        self.admin = admin_pb2_grpc.AdminServiceStub(channel)
        self.stream = SyncStream(channel, timeout_s=TIMEOUT_S)
        return self

    @property
    def auth(self) -> tuple[tuple[str, str]]:
        return (("authorization", f"Bearer {self.token}"),)

    def state(self) -> admin_pb2.GetStateResponse:
        return self.admin.GetState(admin_pb2.GetStateRequest(), metadata=self.auth, timeout=30)

    def code(self, call: Callable[..., Any], request: Any) -> grpc.StatusCode:
        try:
            call(request, metadata=self.auth, timeout=TIMEOUT_S)
        except grpc.RpcError as exc:
            code: grpc.StatusCode = exc.code()
            return code
        return grpc.StatusCode.OK

    def send(self, request: policy_pb2.StepRequest) -> policy_pb2.StepReply:
        """One request on the engine's stream, and its reply (errors included)."""
        assert self.stream is not None
        return self.stream.send(request)

    def applied(self, request: policy_pb2.StepRequest) -> policy_pb2.StepReply:
        """Send ``request``; StepFailed unless all of it was applied."""
        reply = self.send(request)
        if reply.HasField("error"):
            raise StepFailed(f"error {reply.error.code}: {reply.error.message}")
        if reply.skipped:
            raise StepFailed(f"{reply.skipped} skipped: {reply.skipped_reason}")
        return reply

    def run_step(self, ctx: policy_pb2.StepContext) -> policy_pb2.RanStep:
        """Ask for a table for ``ctx`` and run its entry: the step, to report."""
        table = self.applied(policy_pb2.StepRequest(context=ctx)).table
        entry = ctx.batch_size - table.first_batch_size
        if not 0 <= entry < len(table.gammas):
            raise StepFailed(f"table {table.table_id} has no entry for batch {ctx.batch_size}")
        return policy_pb2.RanStep(
            decision_id=f"{table.table_id}.1", context=ctx, gamma=table.gammas[entry]
        )

    def problem(self) -> str:
        """Why the server is not well ("" when it is): alive, answering tables within
        bounds, nothing impossible learned."""
        if not self.process.alive():
            return "the server exited:\n" + self.process.log_tail(800)
        try:
            state = self.state()
            top = int(json.loads(state.params_json).get("gamma_max", 64))
            for step, cap in enumerate((0, 2, 1)):
                ctx = policy_pb2.StepContext(
                    engine_id="probe", batch_size=4, step_index=step, max_gamma=cap
                )
                table = self.applied(policy_pb2.StepRequest(context=ctx)).table
                bound = min(top, cap) if cap else top
                if not table.gammas or not all(0 <= g <= bound for g in table.gammas):
                    return f"table γ {list(table.gammas)} outside 0..{bound}"
            wrong = _impossible(json.loads(self.state().state_json))
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
        except (StepFailed, ConnectionError, TimeoutError) as exc:
            return f"StepStream: {type(exc).__name__} {exc}"
        return f"learned {wrong}" if wrong else ""

    def stop(self) -> None:
        if self.stream is not None:
            self.stream.close()
            self.stream = None
        self.process.stop()


def _impossible(value: Any, path: str = "state") -> str:
    """A number in a learned state no policy can have learned ("" if none)."""
    if isinstance(value, dict):
        # An RNG's state is any integer (goodput's PCG64: 128 bits).
        items = ((k, v) for k, v in value.items() if k != "rng")
        return next((w for k, v in items if (w := _impossible(v, f"{path}.{k}"))), "")
    if isinstance(value, list):
        return next((w for i, v in enumerate(value) if (w := _impossible(v, f"{path}[{i}]"))), "")
    if isinstance(value, bool) or not isinstance(value, int | float):
        return ""
    if not math.isfinite(value) or abs(value) > MAX_LEARNED:
        return f"{path} = {value}"
    return ""


def _text(document: Any) -> str:
    text = json.dumps(document)
    for stand_in, raw in RAW.items():
        text = text.replace(json.dumps(stand_in), raw)
    return text


def _leaves(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Paths of the numeric leaves of a document."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _leaves(item, (*path, index))
    elif isinstance(value, int | float) and not isinstance(value, bool):
        yield path


def _set(document: Any, path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        document = document[key]
    document[path[-1]] = value


def learned_snapshots(server: Sidecar) -> dict[str, dict[str, Any]]:
    """A valid snapshot of ema, nightjar and goodput, each having learned a few steps."""
    documents = {}
    for name in ("ema", "nightjar", "goodput"):
        server.admin.SwapPolicy(admin_pb2.SwapPolicyRequest(name=name), metadata=server.auth)
        drive(server, steps=30)
        server.admin.Snapshot(admin_pb2.SnapshotRequest(), metadata=server.auth)
        documents[name] = json.loads((server.state_dir / "snapshot.json").read_text())
    return documents


def outcome_fields(ran: policy_pb2.RanStep) -> dict[str, Any]:
    """A plausible outcome of a step run at batch 4 (half its drafts accepted)."""
    gamma = ran.gamma
    return {
        "decision_id": ran.decision_id,
        "engine_id": ran.context.engine_id,
        "gamma": gamma,
        "step_seconds": 0.02,
        "generated_tokens": 4 + 2 * gamma,
        "drafted_tokens": 4 * gamma,
        "accepted_tokens": 2 * gamma,
    }


def drive(server: Sidecar, steps: int) -> None:
    """``steps`` steps of engine e0 at batch 4: each run from the table sent for its
    context and reported with its outcome."""
    for step in range(steps):
        ran = server.run_step(policy_pb2.StepContext(engine_id="e0", batch_size=4, step_index=step))
        server.applied(
            policy_pb2.StepRequest(
                ran_steps=[ran], outcomes=[policy_pb2.StepOutcome(**outcome_fields(ran))]
            )
        )


def named_documents(base: dict[str, dict[str, Any]]) -> dict[str, str]:
    """The shapes of issue 28, each as snapshot text."""
    out: dict[str, str] = {}

    def variant(name: str, policy: str, change: Callable[[dict[str, Any]], None]) -> None:
        document = copy.deepcopy(base[policy])
        change(document)
        out[name] = _text(document)

    def learner(document: dict[str, Any]) -> dict[str, Any]:
        learners: dict[str, Any] = document["policy"]["state"]["learners"]
        first: dict[str, Any] = learners[sorted(learners)[0]]
        return first

    def slot(document: dict[str, Any]) -> dict[str, Any]:
        slots: dict[str, Any] = document["policy"]["state"]["slots"]["e0"]
        first: dict[str, Any] = slots[sorted(slots)[0]]
        return first

    variant("1e400 in a counter", "goodput", lambda d: learner(d).update(steps=BIG_FLOAT))
    variant("5,000-digit counter", "goodput", lambda d: learner(d).update(steps=BIG_INT))
    variant("created_unix a string", "ema", lambda d: d.update(created_unix="yesterday"))
    variant("created_unix a list", "ema", lambda d: d.update(created_unix=[1]))
    variant("created_unix 1e400", "ema", lambda d: d.update(created_unix=BIG_FLOAT))
    variant("deep nesting", "nightjar", lambda d: d["policy"].update(state=DEEP))
    variant("ema candidate -5", "ema", lambda d: slot(d).update(candidates=[-5], index=0))
    variant("ema candidate 1000", "ema", lambda d: slot(d).update(candidates=[1000], index=0))
    variant("ema index out of range", "ema", lambda d: slot(d).update(index=40))
    variant(
        "nightjar previous_gamma 99",
        "nightjar",
        lambda d: d["policy"]["state"]["engines"]["e0"].update(previous_gamma=99),
    )
    return out


def generated_documents(
    base: dict[str, dict[str, Any]], count: int, rng: random.Random
) -> list[str]:
    """Snapshots with one numeric value replaced by a bad one, anywhere in them."""
    out = []
    for _ in range(count):
        document = copy.deepcopy(base[rng.choice(sorted(base))])
        path = rng.choice(list(_leaves(document)))
        _set(document, path, rng.choice(BAD_VALUES))
        out.append(_text(document))
    return out


def snapshot_documents(workdir: Path, token_file: Path, count: int, seed: int) -> ClassResult:
    result = ClassResult(
        "snapshot documents",
        "valid ema/nightjar/goodput snapshots with one value made bad (1e400, a 5,000-digit "
        "integer, 100,000-deep nesting, non-numeric or list created_unix, ema candidates "
        "-5/1000 or an index out of range, γ_prev 99, or any numeric leaf replaced by one "
        "of these), restored over Restore and, the named shapes, written as snapshot.json "
        "for a fresh server to start on",
    )
    server = Sidecar(workdir, "documents", workdir / "documents", token_file).start()
    try:
        base = learned_snapshots(server)
        named = named_documents(base)
        for name, text in [
            *named.items(),
            *(
                (f"generated {i}", t)
                for i, t in enumerate(generated_documents(base, count, random.Random(seed)))
            ),
        ]:
            result.cases += 1
            before = server.state().state_json
            code = server.code(server.admin.Restore, admin_pb2.RestoreRequest(snapshot_json=text))
            if code not in REFUSALS:
                result.fail(name, f"Restore answered {code.name}")
            elif code != grpc.StatusCode.OK:
                result.refused += 1
                if server.state().state_json != before:
                    result.fail(name, "refused, yet the state changed")
            problem = server.problem()
            if problem:
                result.fail(name, problem)
                break
    finally:
        server.stop()
    for name, text in named.items():
        result.cases += 1
        state_dir = workdir / f"start-{result.cases}"
        state_dir.mkdir()
        (state_dir / "snapshot.json").write_text(text)
        starting(result, workdir, token_file, state_dir, f"start on {name}")
    return result


def starting(
    result: ClassResult, workdir: Path, token_file: Path, state_dir: Path, case: str
) -> None:
    """A fresh server started on ``state_dir``: up, well, the bad snapshot moved aside."""
    server = Sidecar(workdir, f"start-{result.cases}", state_dir, token_file)
    try:
        server.start()
        problem = server.problem()
        if problem:
            result.fail(case, problem)
        elif (state_dir / "snapshot.json").exists() and not (state_dir / "snapshot.json").is_file():
            result.fail(case, "snapshot.json, not a regular file, was left in place")
        else:
            result.refused += 1
    except RuntimeError as exc:
        result.fail(case, f"did not start: {str(exc)[-300:]}")
    finally:
        server.stop()


def _huge(path: Path) -> None:
    with path.open("wb") as fh:
        fh.truncate(65 << 20)  # sparse: no disk needed


FILE_KINDS: dict[str, Callable[[Path], None]] = {
    "symlink to /dev/zero": lambda p: p.symlink_to("/dev/zero"),
    "FIFO": lambda p: os.mkfifo(p),
    "directory": lambda p: p.mkdir(),
    "65 MiB file": lambda p: _huge(p),
}


def file_kinds(workdir: Path, token_file: Path) -> ClassResult:
    result = ClassResult(
        "snapshot file kinds",
        "snapshot.json as a symbolic link to /dev/zero, a FIFO, a directory, a 65 MiB file "
        "(cap 64 MiB): a fresh server started on each; the same as a file Restore names",
    )
    for kind, make in FILE_KINDS.items():
        result.cases += 1
        state_dir = workdir / f"kind-{result.cases}"
        state_dir.mkdir()
        make(state_dir / "snapshot.json")
        starting(result, workdir, token_file, state_dir, f"start on a {kind}")
    server = Sidecar(workdir, "kinds", workdir / "kinds", token_file).start()
    try:
        drive(server, 5)
        server.state_dir.mkdir(parents=True, exist_ok=True)
        for kind, make in FILE_KINDS.items():
            result.cases += 1
            make(server.state_dir / f"{result.cases}.json")
            before = server.state().state_json
            code = server.code(
                server.admin.Restore, admin_pb2.RestoreRequest(path=f"{result.cases}.json")
            )
            # PERMISSION_DENIED: a link that leads out of the state directory.
            if code in (
                grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.FAILED_PRECONDITION,
                grpc.StatusCode.PERMISSION_DENIED,
            ):
                result.refused += 1
            else:
                result.fail(f"Restore of a {kind}", f"answered {code.name}")
            if server.state().state_json != before:
                result.fail(f"Restore of a {kind}", "the state changed")
            problem = server.problem()
            if problem:
                result.fail(f"Restore of a {kind}", problem)
                break
    finally:
        server.stop()
    return result


PARAM_VALUES = ("NaN", "Infinity", "-Infinity", "1e400", "9" * 5000, "[" * 100_000 + "]" * 100_000)


def parameter_values(workdir: Path, token_file: Path) -> ClassResult:
    result = ClassResult(
        "parameter values",
        "NaN, Infinity, -Infinity, 1e400, a 5,000-digit integer and 100,000-deep nesting as "
        "every parameter of every policy, by SwapPolicy and SetParameters, each followed by a "
        "snapshot",
    )
    server = Sidecar(workdir, "params", workdir / "params", token_file).start()
    try:
        for name, spec in sorted(REGISTRY.items()):
            server.admin.SwapPolicy(admin_pb2.SwapPolicyRequest(name=name), metadata=server.auth)
            for key in sorted(spec.default_params()):
                for raw in PARAM_VALUES:
                    params = '{"%s": %s}' % (key, raw)  # noqa: UP031 (raw JSON text)
                    for call, request in (
                        (
                            server.admin.SwapPolicy,
                            admin_pb2.SwapPolicyRequest(name=name, params_json=params),
                        ),
                        (
                            server.admin.SetParameters,
                            admin_pb2.SetParametersRequest(params_json=params),
                        ),
                    ):
                        case = f"{name}.{key} = {raw[:12]} ({type(request).__name__})"
                        result.cases += 1
                        code = server.code(call, request)
                        if code == grpc.StatusCode.INVALID_ARGUMENT:
                            result.refused += 1
                        else:
                            result.fail(case, f"answered {code.name}")
                        snap = server.code(server.admin.Snapshot, admin_pb2.SnapshotRequest())
                        if snap != grpc.StatusCode.OK:
                            result.fail(case, f"the snapshot after it answered {snap.name}")
                    problem = server.problem()
                    if problem:
                        result.fail(f"{name}.{key} = {raw[:12]}", problem)
                        return result
    finally:
        server.stop()
    return result


OUTCOMES: dict[str, dict[str, Any]] = {
    "counts 10^18": {
        "generated_tokens": 10**18,
        "drafted_tokens": 10**18,
        "accepted_tokens": 10**18,
    },
    "a 1 ns step": {"step_seconds": 1e-9},
    "10^6 drafts at batch 4": {"drafted_tokens": 10**6},
    "accepted > drafted": {"drafted_tokens": 4, "accepted_tokens": 8},
    "10^9 generated at batch 4": {"generated_tokens": 10**9},
}


def implausible_outcomes(workdir: Path, token_file: Path) -> ClassResult:
    result = ClassResult(
        "implausible outcomes",
        "for every learning policy, a step run at batch 4 from the table the sidecar sent, "
        "its outcome reported with counts of 10^18, a 1 ns step, 10^6 drafts, more accepted "
        "than drafted, 10^9 generated: refused (skipped, with the reason), nothing learned",
    )
    server = Sidecar(workdir, "outcomes", workdir / "outcomes", token_file).start()
    try:
        for name in sorted(REGISTRY):
            params = json.dumps({"gamma": 3}) if name == "static" else ""
            server.admin.SwapPolicy(
                admin_pb2.SwapPolicyRequest(name=name, params_json=params), metadata=server.auth
            )
            drive(server, 10)
            for kind, change in OUTCOMES.items():
                result.cases += 1
                case = f"{name}: {kind}"
                ctx = policy_pb2.StepContext(engine_id="e0", batch_size=4, step_index=100)
                ran = server.run_step(ctx)
                # The step first (committing it may move the policy), then its outcome.
                server.applied(policy_pb2.StepRequest(ran_steps=[ran]))
                before = server.state().state_json
                fields = {
                    **outcome_fields(ran),
                    "generated_tokens": 4,
                    "drafted_tokens": 0,
                    "accepted_tokens": 0,
                    **change,
                }
                reply = server.send(
                    policy_pb2.StepRequest(outcomes=[policy_pb2.StepOutcome(**fields)])
                )
                refusal = refused_outcome(reply)
                if refusal:
                    result.fail(case, refusal)
                else:
                    result.refused += 1
                    if server.state().state_json != before:
                        result.fail(case, "refused, yet learned")
                problem = server.problem()
                if problem:
                    result.fail(case, problem)
                    return result
    finally:
        server.stop()
    return result


def refused_outcome(reply: policy_pb2.StepReply) -> str:
    """What is wrong with ``reply`` as the refusal of a batch's one implausible outcome
    ("" when it is one): the outcome skipped with its reason, or the request refused as
    INVALID_ARGUMENT, never applied nor answered another code."""
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    if reply.HasField("error"):
        if reply.error.code == invalid.value[0] and reply.error.message:
            return ""
        return f"answered error {reply.error.code}: {reply.error.message}"
    if reply.skipped == 1 and reply.skipped_reason:
        return ""
    return f"applied (skipped {reply.skipped}: {reply.skipped_reason!r})"


def run(workdir: Path, quick: bool, seed: int) -> list[ClassResult]:
    from benchmarks.fuzz import failing_drivers, heavy  # they build on ClassResult

    token_file = workdir / "hardening-token"
    token_file.write_text(secrets.token_hex(16))
    return [
        snapshot_documents(workdir, token_file, 20 if quick else 300, seed),
        file_kinds(workdir, token_file),
        parameter_values(workdir, token_file),
        implausible_outcomes(workdir, token_file),
        *heavy.run(workdir, token_file, quick, seed),
        failing_drivers.run(quick, seed),
    ]
