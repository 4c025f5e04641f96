"""`nightjarctl`: inspect and steer a running Nightjar sidecar.

One command line: its subcommands (state, swap, set-params, snapshot,
restore, export/import, reset, health, decide, memory, replay, evaluate) share one parser,
one channel set-up and one error rendering; the work behind them lives in their own
modules (fleet, replay, counterfactual).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from nightjar_proto.v1 import admin_pb2, admin_pb2_grpc, policy_pb2

from nightjar_common import tls, wire
from nightjar_common.json_input import JsonError, load_json
from nightjar_common.sidecar_stream import StreamEnded, SyncStream
from nightjar_common.types import BinType, RanStep, StepContext, StepOutcome
from nightjar_common.validation import MAX_ID_LENGTH
from policy_server import fleet, snapshot
from policy_server.config import admin_message_bytes
from policy_server.policies import DEFAULT_POLICY

DEFAULT_TARGET = "unix:/run/nightjar/nightjar.sock"
DESCRIPTION = (
    "Inspect and steer a running Nightjar sidecar (nightjar-server): its health, policy, "
    "parameters and learned state; offline, rebuild learned state from decision logs "
    "(replay) or value another policy on them (evaluate). Mutating calls need the admin "
    "token (--token-file)."
)
# 128 + SIGPIPE: what a shell reports for a writer whose reader went away.
EXIT_BROKEN_PIPE = 141
# The largest admin message any sidecar sends or takes (its state at the most a snapshot
# may be, config.admin_message_bytes): gRPC's default of 4 MiB stopped states past it.
MAX_MESSAGE_BYTES = admin_message_bytes()
# How gRPC itself words a message over its bound.
GRPC_SIZE_REFUSAL = "larger than max"
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]


def _global_flags(parser: argparse.ArgumentParser, *, defaults: bool) -> None:
    """--target, --token-file, --timeout, --tls-*. Added to every subcommand too (without defaults,
    so that one given before the subcommand is not reset), to go either side of it."""

    def default(value: Any) -> Any:
        return value if defaults else argparse.SUPPRESS

    parser.add_argument(
        "--target",
        default=default(os.environ.get("NIGHTJAR_TARGET", DEFAULT_TARGET)),
        help=f"sidecar address: unix:PATH or HOST:PORT (env NIGHTJAR_TARGET; default "
        f"{DEFAULT_TARGET}, the socket of the deployment's pod)",
    )
    parser.add_argument(
        "--token-file",
        default=default(os.environ.get("NIGHTJAR_TOKEN_FILE")),
        help="file with the admin token, read by mutating calls and state reads (env "
        "NIGHTJAR_TOKEN_FILE); without it a server with a token shows a state summary",
    )
    parser.add_argument(
        "--timeout", type=float, default=default(5.0), help="seconds per call (default 5)"
    )
    # TLS to a HOST:PORT target (nightjar-server --tls-cert ...); any of these turns it on.
    parser.add_argument(
        "--tls",
        action="store_true",
        default=default(False),
        help="connect with TLS, the server checked against the system's CAs",
    )
    for flag, env, what in (
        ("--tls-ca", "NIGHTJAR_TLS_CA", "PEM CA that signed the server's certificate"),
        ("--tls-cert", "NIGHTJAR_TLS_CERT", "PEM client certificate (mutual TLS)"),
        ("--tls-key", "NIGHTJAR_TLS_KEY", "PEM key of --tls-cert"),
        (
            "--tls-server-name",
            "NIGHTJAR_TLS_SERVER_NAME",
            "name to check the server's certificate against (default: the target's host)",
        ),
    ):
        parser.add_argument(
            flag, default=default(os.environ.get(env, "")), help=f"{what} (env {env})"
        )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nightjarctl", description=DESCRIPTION)
    _global_flags(p, defaults=True)
    common = argparse.ArgumentParser(add_help=False)
    _global_flags(common, defaults=False)
    subcommands = p.add_subparsers(dest="command", required=True)

    def command(name: str, **kwargs: Any) -> argparse.ArgumentParser:
        return subcommands.add_parser(name, parents=[common], **kwargs)

    s = command("state", help="show the active policy and its learned state")
    s.add_argument("--json", action="store_true", help="print the full state as JSON")
    s.add_argument("--engine", default="", help="only this engine's state")
    command("policies", help="list the registered policies")
    s = command("swap", help="activate a policy")
    s.add_argument("name")
    s.add_argument("--params", default="", help="parameters as a JSON object")
    s.add_argument("--keep-state", action="store_true", help="carry the learned state over")
    s = command("set-params", help="change parameters of the active policy")
    s.add_argument("params", help="parameters to change, as a JSON object")
    command("snapshot", help="write the learned state to the state directory now")
    s = command("restore", help="restore a snapshot file")
    s.add_argument("file", help="a snapshot file on this machine (sent to the sidecar)")
    s.add_argument(
        "--server-path", action="store_true", help="FILE is a path on the sidecar's disk instead"
    )
    s = command("export", help="write one learner's state to a file (fleet warm start)")
    who = s.add_mutually_exclusive_group(required=True)
    who.add_argument("--learner-key", default="", help="the engines' learner key (model@device)")
    who.add_argument("--engine", default="", help="an engine that learns alone")
    s.add_argument("--out", default="-", help="file to write (default: standard output)")
    s = command("import", help="merge an exported learner into the active policy's state")
    s.add_argument("file", help="a document written by `nightjarctl export`")
    s = command("reset", help="forget learned state")
    s.add_argument("--engine", default="", help="only this engine's state")
    command("health", help="gRPC health of the sidecar")
    s = command("decide", help="ask for one decision (debugging)")
    s.add_argument("--batch-size", type=int, required=True)
    s.add_argument("--engine-id", default="nightjarctl")
    s.add_argument("--learner-key", default="", help="key the engine learns under")
    s.add_argument("--step-index", type=int, default=0)
    s.add_argument("--waiting", type=int, default=0)
    s.add_argument("--free-blocks", type=int, default=0)
    s.add_argument("--total-blocks", type=int, default=0)
    s.add_argument("--lag", type=int, default=0, help="L_max: tokens the draft lags behind")
    s.add_argument("--previous-gamma", type=int, default=None)
    s.add_argument("--not-resident", action="store_true", help="the draft is offloaded")
    s.add_argument(
        "--report-step-seconds",
        type=float,
        default=None,
        help="also report an outcome with this step time",
    )
    s.add_argument("--report-tokens", type=int, default=0, help="generated tokens to report")
    s = command(
        "memory",
        help="the memory agent in a vLLM engine (--target its NIGHTJAR_MEMORY_SOCKET)",
        description="Show or force the engine's elastic-memory state. A forcing call waits "
        "(up to --timeout, at most 30 s) for the engine's step boundary; an order still queued "
        "when it gives up (an idle engine reaches none) is withdrawn and never runs "
        "(DEADLINE_EXCEEDED). A failed order is undone (ABORTED). `cancel ID` withdraws a "
        "queued order (status lists them in pending_orders; 0 or none: every queued order).",
    )
    s.add_argument("action", choices=("status", "offload", "reload", "expand", "compact", "cancel"))
    s.add_argument(
        "blocks",
        nargs="?",
        type=int,
        default=0,
        help="expand/compact: the KV pool size to reach, in blocks; cancel: the order's id",
    )
    s.add_argument(
        "--keep-kv",
        action="store_true",
        help="offload without growing, reload without compacting the pool",
    )
    s = command(
        "replay",
        help="rebuild learned state offline from decision logs",
        description="Feed every logged step to a fresh policy: by default the one the logs "
        "were last written under, with its parameters (their last policy record), so that "
        "restoring the result continues where the sidecar was.",
    )
    s.add_argument("logs", nargs="+", help="decision-log files (rotated backups are included)")
    s.add_argument(
        "--policy",
        default=None,
        help="replay into this policy, with the parameters it last had in the logs "
        f"(default: the logs' last policy, else {DEFAULT_POLICY})",
    )
    s.add_argument("--params", default="", help="parameters as a JSON object, over those")
    s.add_argument("--out", help="write the rebuilt state as a snapshot file")
    s = command(
        "evaluate",
        help="what a policy would have chosen on a decision log, valued on its engine",
        description="Run a policy with fresh state on a decision log's contexts; each step's "
        "outcome is drawn from the log's decode steps of the chosen γ at the nearest batch "
        "sizes. Prints the share of the best γ's goodput its decode decisions reach, beside "
        "the logged choices'. The batch sizes stay the logged ones.",
    )
    s.add_argument("logs", nargs="+", help="decision-log files (rotated backups are included)")
    s.add_argument("--policy", default=DEFAULT_POLICY)
    s.add_argument("--params", default="", help="parameters as a JSON object")
    s.add_argument("--seeds", type=int, default=6, help="policy seeds 0..N-1 (default 6)")
    s.add_argument(
        "--min-batch", type=int, default=1, help="value decode decisions at batch sizes >= this"
    )
    s.add_argument(
        "--version",
        default="",
        help="replay only the decisions of this policy version (e.g. one "
        "bench-vllm pass); the whole log still prices the steps",
    )
    return p


# The service each command calls, and where an operator finds it.
SIDECAR = "the sidecar's socket (nightjar-server --uds)"
SERVICE_OF = {
    "memory": ("MemoryAgentService", "the engine's memory-agent socket (NIGHTJAR_MEMORY_SOCKET)"),
    "health": ("grpc.health.v1.Health", SIDECAR),
    "decide": ("PolicyService", SIDECAR),
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = _run(args)
        sys.stdout.flush()  # a closed pipe shows here, not in Python's flush at exit
        return code
    except BrokenPipeError:
        # The reader went away (`nightjarctl state | head -2`): stop quietly, as `cat` does.
        # Python's own flush at exit would fail on the closed pipe again: point stdout at
        # /dev/null first.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def _run(args: argparse.Namespace) -> int:
    if args.command == "replay":
        return _replay(args)
    if args.command == "evaluate":
        return _evaluate(args)
    target = args.target
    if target.startswith(("/", ".")) or (":" not in target and target.endswith(".sock")):
        # gRPC would resolve a bare path as a host name ("Domain name not found").
        print(
            f"nightjarctl: --target {args.target} is a path: write unix:{args.target}",
            file=sys.stderr,
        )
        return 2
    try:
        with tls.open_channel(args.target, _client_tls(args), CHANNEL_OPTIONS) as channel:
            return COMMANDS[args.command](args, channel)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
            service, where = SERVICE_OF.get(args.command, ("AdminService", SIDECAR))
            print(
                f"nightjarctl: {args.target} serves no {service} ({exc.details()}); point "
                f"--target at {where}",
                file=sys.stderr,
            )
        else:
            print(
                f"nightjarctl: {exc.code().name}: {exc.details()}{_hint(exc, args)}",
                file=sys.stderr,
            )
        return 1
    except BrokenPipeError:
        raise  # main's: the reader went away, nothing to report
    except (OSError, ValueError) as exc:
        print(f"nightjarctl: {exc}", file=sys.stderr)
        return 2


def _hint(error: grpc.RpcError, args: argparse.Namespace) -> str:
    """What to check when the sidecar could not be reached at all, or refused a message
    for its size with gRPC's own words (past the largest any of its methods takes; below
    it the sidecar's own message names the bound)."""
    code = error.code()
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and GRPC_SIZE_REFUSAL in str(error.details()):
        return (
            " (a sidecar takes a Restore of at most its snapshot_max_bytes plus "
            f"{MAX_MESSAGE_BYTES - snapshot.MAX_BYTES:,} bytes, other requests of at most "
            "its max_receive_bytes)"
        )
    if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return ""
    return (
        f" (is nightjar-server running and listening at {args.target}? --target or "
        "NIGHTJAR_TARGET names it: unix:PATH for its --uds socket, HOST:PORT for --port)"
    )


Metadata = list[tuple[str, str]]


def _client_tls(args: argparse.Namespace) -> tls.ClientTls | None:
    files = tls.ClientTls(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
    wanted = args.tls or any((files.ca, files.cert, files.key, files.server_name))
    return files if wanted else None


def _auth(args: argparse.Namespace) -> Metadata:
    """The admin token as call metadata; read only by the calls that mutate, so that a
    missing token file does not stop health, state or policies."""
    if not args.token_file:
        return []
    try:
        token = Path(args.token_file).read_text().strip()
    except OSError as exc:
        raise OSError(
            f"cannot read the admin token file {args.token_file} (--token-file or "
            f"NIGHTJAR_TOKEN_FILE), which this call needs: {exc.strerror or exc}"
        ) from None
    return [("authorization", f"Bearer {token}")]


def _read_auth(args: argparse.Namespace) -> Metadata:
    """The admin token for a read of the state: sent when there is one, since a server with
    a token answers GetState without it with a summary of a few engines. An unreadable
    token file is said, not fatal: the summary is still worth showing."""
    try:
        return _auth(args)
    except OSError as exc:
        print(f"nightjarctl: {exc}; asking without it", file=sys.stderr)
        return []


def _full_state(reply: Any) -> dict[str, Any]:
    """The state of a GetState reply that must be whole (export, import); ValueError for
    a summary (the server wants the admin token)."""
    state: dict[str, Any] = json.loads(reply.state_json)
    if "summary" in state:
        raise ValueError(
            "the server answered a summary of its state (it has an admin token): give "
            "--token-file (or NIGHTJAR_TOKEN_FILE) to read all of it"
        )
    return state


def _request_mode_line(mode: dict[str, Any]) -> str:
    """An engine's per-request mode (goodput's state ``request_mode``) for people: which
    γ it decides, why, and under "auto" the plans' predicted gain it decides by."""
    line = f"γ {'per request' if mode.get('mode') == 'per-request' else 'per batch'}"
    line += f" ({mode.get('reason')}"
    bounds = mode.get("gain_bounds")
    if isinstance(bounds, list) and len(bounds) == 2:
        low, high = bounds
        line += f", plan gain {mode.get('gain_mean', 0.0):.2%} [{low:.2%}, {high:.2%}]"
    if "checks" in mode:
        line += f", {mode['checks']} checks, {mode.get('switches', 0)} switches"
    return line + ")"


def _fleet_line(fleet: dict[str, Any]) -> str:
    """GetStateResponse.fleet_json in one line."""
    link = {True: "link up", False: "link DOWN", None: "no round yet"}[fleet.get("link_up")]
    pools = "" if fleet.get("pools", True) else "; the active policy does not pool"
    return (
        f"member {fleet.get('member')} of deployment {fleet.get('deployment')}: {link}, "
        f"{fleet.get('members')} members, last merge {fleet.get('last_merge_age_s')} s ago"
        f"{pools}"
    )


def _admin(channel: grpc.Channel) -> Any:
    return admin_pb2_grpc.AdminServiceStub(channel)


def _state(args: argparse.Namespace, channel: grpc.Channel) -> int:
    reply = _admin(channel).GetState(
        admin_pb2.GetStateRequest(engine_id=args.engine),
        metadata=_read_auth(args),
        timeout=args.timeout,
    )
    state = json.loads(reply.state_json)
    runtimes = json.loads(reply.engines_json or "{}")
    fleet = json.loads(reply.fleet_json or "{}")
    if args.json:
        document = {
            "policy": reply.policy_name,
            "version": reply.policy_version,
            "params": json.loads(reply.params_json),
            "decisions_total": reply.decisions_total,
            "reports_total": reply.reports_total,
            "engines": list(reply.engine_ids),
            "last_snapshot_unix": reply.last_snapshot_unix,
            "runtimes": runtimes,
            "fleet": fleet,
            "state": state,
        }
        print(json.dumps(document, indent=2, sort_keys=True))
        return 0
    print(f"policy   {reply.policy_name} ({reply.policy_version})")
    print(f"params   {reply.params_json}")
    print(f"served   {reply.decisions_total} decisions, {reply.reports_total} reports")
    print(f"engines  {', '.join(reply.engine_ids) or '-'}")
    for engine_id, runtime in sorted(runtimes.items()):
        print(
            f"  {engine_id}: vLLM {runtime['engine_version']}, {runtime['model_runner']} "
            f"runner, {'async' if runtime['async_scheduling'] else 'sync'} scheduling, "
            f"{runtime['method']}, drafter passes ≥ {runtime['min_draft_passes']} a step"
        )
    for engine_id, engine in sorted(state.get("engines", {}).items()):
        mode = engine.get("request_mode") if isinstance(engine, dict) else None
        if isinstance(mode, dict):
            print(f"  {engine_id}: {_request_mode_line(mode)}")
    if fleet:
        print(f"fleet    {_fleet_line(fleet)}")
    summary = state.get("summary")
    if isinstance(summary, dict):
        print(f"summary  {summary.get('engines_total')} engines: {summary.get('note')}")
    for learner, data in sorted(state.get("learners", {}).items()):
        _print_learner(learner, data)
    return 0


def _print_learner(learner: str, data: Any) -> None:
    """One learner's state for people: the model's view (goodput), the arm table
    (nightjar), or the raw JSON of the other policies."""
    if isinstance(data, dict) and "best_gamma" in data:
        print(
            f"learner {learner}: α={data['alpha']:.3f} over {data['steps']} steps; "
            "batch size -> best γ (predicted goodput tok/s)"
        )
        _print_fleet(data.get("fleet"))
        for key, (gamma, goodput) in sorted(data["best_gamma"].items(), key=lambda kv: int(kv[0])):
            print(f"  B={int(key):>4}  γ={gamma} ({goodput:.1f})")
        return
    if isinstance(data, dict) and all(k.isdigit() for k in data):
        print(f"learner {learner}: batch size -> best γ (mean goodput tok/s, pulls per γ)")
        for key, arms in sorted(data.items(), key=lambda kv: int(kv[0])):
            means, counts = arms["means"], arms["counts"]
            pulled = [g for g, n in enumerate(counts) if n]
            best = max(pulled, key=lambda g: means[g]) if pulled else None
            best_text = f"γ={best} ({means[best]:.1f})" if best is not None else "-"
            print(f"  B={int(key):>4}  {best_text:<18} pulls {counts}")
        return
    print(f"learner {learner}: {json.dumps(data, sort_keys=True)}")


def _print_fleet(share: Any) -> None:
    """Where a pooled learner's evidence came from: this sidecar's engines or the fleet's
    (fleet learning, docs/OPERATIONS.md); nothing for a learner that never pooled."""
    if not isinstance(share, dict) or not isinstance(share.get("evidence"), dict):
        return
    parts = []
    for source in ("local", "fleet"):
        evidence = share["evidence"].get(source, {})
        parts.append(
            f"{source} {evidence.get('steps', 0)} steps, "
            f"{evidence.get('acceptance_tokens', 0):,.0f} acceptance tokens"
        )
    print(f"  evidence: {'; '.join(parts)} (member {share.get('member', '?')})")


def _policies(args: argparse.Namespace, channel: grpc.Channel) -> int:
    reply = _admin(channel).ListPolicies(admin_pb2.ListPoliciesRequest(), timeout=args.timeout)
    for info in reply.policies:
        marker = "*" if info.active else " "
        print(f"{marker} {info.name:<10} {info.description}")
        print(f"  {'':<10} defaults {info.default_params_json}")
    return 0


def _restore_request(args: argparse.Namespace) -> Any:
    if args.server_path:
        return admin_pb2.RestoreRequest(path=args.file)
    size = Path(args.file).stat().st_size
    if size > snapshot.MAX_BYTES:
        raise ValueError(
            f"{args.file} is {size:,} bytes, more than the {snapshot.MAX_BYTES:,} a sidecar "
            "restores (snapshot_max_bytes is at most that): no sidecar could write it back"
        )
    return admin_pb2.RestoreRequest(snapshot_json=Path(args.file).read_text())


# Mutating admin commands: (rpc name, request from the arguments, line printed from the reply).
MUTATIONS: dict[str, tuple[str, Callable[[argparse.Namespace], Any], Callable[[Any], str]]] = {
    "swap": (
        "SwapPolicy",
        lambda a: admin_pb2.SwapPolicyRequest(
            name=a.name, params_json=a.params, keep_state=a.keep_state
        ),
        lambda r: f"active: {r.policy_name} ({r.policy_version})",
    ),
    "set-params": (
        "SetParameters",
        lambda a: admin_pb2.SetParametersRequest(params_json=a.params),
        lambda r: f"active: {r.policy_name} ({r.policy_version})",
    ),
    "snapshot": (
        "Snapshot",
        lambda a: admin_pb2.SnapshotRequest(),
        lambda r: f"snapshot written to {r.path}",
    ),
    "restore": (
        "Restore",
        _restore_request,
        lambda r: f"restored: {r.policy_name} ({r.policy_version})",
    ),
    "reset": (
        "Reset",
        lambda a: admin_pb2.ResetRequest(engine_id=a.engine),
        lambda r: f"reset; policy version {r.policy_version}",
    ),
}


def _mutate(args: argparse.Namespace, channel: grpc.Channel) -> int:
    rpc, build, describe = MUTATIONS[args.command]
    reply = getattr(_admin(channel), rpc)(build(args), metadata=_auth(args), timeout=args.timeout)
    print(describe(reply))
    return 0


def _health(args: argparse.Namespace, channel: grpc.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=args.timeout)
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(status)
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def _decide(args: argparse.Namespace, channel: grpc.Channel) -> int:
    ctx = StepContext(
        engine_id=args.engine_id,
        learner_key=args.learner_key,
        batch_size=args.batch_size,
        step_index=args.step_index,
        num_waiting=args.waiting,
        free_kv_blocks=args.free_blocks,
        total_kv_blocks=args.total_blocks,
        max_draft_lag_tokens=args.lag,
        draft_resident=not args.not_resident,
        previous_gamma=args.previous_gamma,
    )
    with SyncStream(channel, args.timeout) as stream:
        reply = _send(stream, policy_pb2.StepRequest(context=wire.context_to_pb(ctx)))
        table = wire.table_from_pb(reply.table)
        index = ctx.batch_size - table.first_batch_size
        gamma, decision_id = table.gammas[index], f"{table.table_id}.1"
        reason = table.reason or (BinType.EXPLORE if table.exploring[index] else BinType.EXPLOIT)
        print(
            json.dumps(
                {
                    "gamma": gamma,
                    "decision_id": decision_id,
                    "reason": reason.value,
                    "policy": table.policy_name,
                    "policy_version": table.policy_version,
                    "table": {"first_batch_size": table.first_batch_size, "gammas": table.gammas},
                }
            )
        )
        if args.report_step_seconds is not None:
            outcome = StepOutcome(
                decision_id=decision_id,
                engine_id=ctx.engine_id,
                gamma=gamma,
                step_seconds=args.report_step_seconds,
                generated_tokens=args.report_tokens,
            )
            reply = _send(
                stream,
                policy_pb2.StepRequest(
                    ran_steps=[wire.ran_step_to_pb(RanStep(decision_id, ctx, gamma))],
                    outcomes=[wire.outcome_to_pb(outcome)],
                ),
            )
            print(json.dumps({"reported": True, "applied": reply.skipped == 0}))
    return 0


def _send(stream: SyncStream, request: policy_pb2.StepRequest) -> policy_pb2.StepReply:
    """``request``'s reply; a refusal (StepReply.error) or the stream's end status as the
    gRPC error a unary call would have raised, so every command reports them one way."""
    try:
        reply = stream.send(request)
    except StreamEnded as exc:
        if exc.code is None:
            raise
        raise StepRefused(exc.code, exc.details) from None
    if reply.HasField("error"):
        code = next(c for c in grpc.StatusCode if c.value[0] == reply.error.code)
        raise StepRefused(code, reply.error.message)
    return reply


class StepRefused(grpc.RpcError):
    """The sidecar refused a request on the stream."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def _replay(args: argparse.Namespace) -> int:
    from policy_server import snapshot
    from policy_server.policies import PolicyError, UnknownPolicyError, parse_params_json
    from policy_server.replay import replay, replay_policy

    try:
        policy, params, origin = replay_policy(args.logs, args.policy)
        params = {**params, **parse_params_json(args.params)}
        result = replay(args.logs, policy, params)
    except (PolicyError, UnknownPolicyError, OSError) as exc:
        print(f"nightjarctl: {exc}", file=sys.stderr)
        return 2
    print(
        f"{result.decisions} decisions, {result.outcomes} with outcomes replayed into "
        f"{result.policy.name} ({origin}) with {json.dumps(result.policy.params(), sort_keys=True)}"
    )
    print(f"{'B':>5} {'γ':>3} {'steps':>7} {'mean goodput tok/s':>20}")
    for bs, gamma, steps, goodput in result.table():
        print(f"{bs:>5} {gamma:>3} {steps:>7} {goodput:>20.1f}")
    if args.out:
        snapshot.write_atomic(Path(args.out), result.snapshot_document())
        print(f"snapshot written to {args.out} (load it with `nightjarctl restore {args.out}`)")
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    from policy_server.counterfactual import EvaluationError, evaluate, read_log
    from policy_server.policies import PolicyError, UnknownPolicyError, parse_params_json

    if args.seeds < 1 or args.min_batch < 1:
        print("nightjarctl: --seeds and --min-batch must be >= 1", file=sys.stderr)
        return 2
    try:
        result = evaluate(
            read_log(args.logs),
            args.policy,
            parse_params_json(args.params),
            seeds=args.seeds,
            min_batch=args.min_batch,
            version=args.version,
        )
    except (PolicyError, UnknownPolicyError, EvaluationError, OSError) as exc:
        print(f"nightjarctl: {exc}", file=sys.stderr)
        return 2
    r = result
    values = ", ".join(f"{v:.3f}" for v in r.values)
    print(f"{r.decisions} decode decisions at batch >= {r.min_batch}, γ 0..{r.gamma_top}")
    print(
        f"{r.policy}: {r.mean:.3f} of the best γ's goodput ({r.seeds} seeds: {values})"
        f"{_unpriced(statistics.fmean(r.unpriced))}"
    )
    print(
        f"logged ({', '.join(r.logged_policies)}): {r.logged_value:.3f}"
        f"{_unpriced(r.logged_unpriced)}"
    )
    print("(outcomes drawn from the log's decode steps; the batch sizes are the logged ones)")
    return 0


def _unpriced(count: float) -> str:
    """The note on decisions the log could not value (no step of their γ near their
    batch size, policy_server/counterfactual.py)."""
    if not count:
        return ""
    return f"; {count:g} unpriced (no logged step of their γ near their batch size)"


def _memory(args: argparse.Namespace, channel: grpc.Channel) -> int:
    from google.protobuf import json_format
    from nightjar_proto.v1 import memory_pb2, memory_pb2_grpc

    stub = memory_pb2_grpc.MemoryAgentServiceStub(channel)
    if args.action in ("expand", "compact") and args.blocks <= 0:
        raise ValueError(f"memory {args.action} needs the pool size in blocks")
    if args.action == "cancel" and args.blocks < 0:
        raise ValueError("memory cancel needs an order id (0: every queued order)")
    calls: dict[str, tuple[Any, Any]] = {
        "status": (stub.GetStatus, memory_pb2.MemoryStatusRequest()),
        "offload": (stub.OffloadDraft, memory_pb2.OffloadDraftRequest(expand_kv=not args.keep_kv)),
        "reload": (stub.ReloadDraft, memory_pb2.ReloadDraftRequest(compact_kv=not args.keep_kv)),
        "expand": (stub.ExpandKv, memory_pb2.ExpandKvRequest(target_kv_blocks=args.blocks)),
        "compact": (stub.CompactKv, memory_pb2.CompactKvRequest(target_kv_blocks=args.blocks)),
        "cancel": (stub.CancelOrder, memory_pb2.CancelOrderRequest(order_id=args.blocks)),
    }
    method, request = calls[args.action]
    md = [] if args.action == "status" else _auth(args)
    reply = method(request, metadata=md, timeout=args.timeout)
    status = json_format.MessageToDict(
        reply, always_print_fields_with_no_presence=True, preserving_proto_field_name=True
    )
    print(json.dumps(status, indent=2, sort_keys=True))
    return 0


def _export(args: argparse.Namespace, channel: grpc.Channel) -> int:
    reply = _admin(channel).GetState(
        admin_pb2.GetStateRequest(), metadata=_read_auth(args), timeout=args.timeout
    )
    learner = fleet.learner_id_for(args.learner_key, args.engine)
    document = fleet.export_learner(reply.policy_name, _full_state(reply), learner)
    text = json.dumps(document, sort_keys=True)
    if args.out == "-":
        print(text)
    else:
        Path(args.out).write_text(text + "\n")
        print(f"exported {learner} ({reply.policy_name}) to {args.out}", file=sys.stderr)
    return 0


def _learner_document(path: str) -> dict[str, Any]:
    """The document `nightjarctl export` wrote at ``path``; ValueError saying what is
    wrong with anything else (not JSON as the sidecar reads it, no learner id of ours)."""
    try:
        document = load_json(Path(path).read_bytes())
    except JsonError as exc:
        raise ValueError(f"{path} is not a learner document: {exc}") from None
    if not isinstance(document, dict):
        raise ValueError(f"{path} is not a learner document: not a JSON object")
    learner = document.get("learner")
    prefix, _, learner_id = str(learner).partition(":")
    if not isinstance(learner, str) or prefix not in ("shared", "engine") or not learner_id:
        raise ValueError(f"{path}: learner must be 'shared:<learner key>' or 'engine:<id>'")
    if len(learner_id) > MAX_ID_LENGTH:
        raise ValueError(
            f"{path}: the learner's id is {len(learner_id):,} characters, more than the "
            f"{MAX_ID_LENGTH} of any learner key or engine id"
        )
    return document


def _import(args: argparse.Namespace, channel: grpc.Channel) -> int:
    document = _learner_document(args.file)
    admin = _admin(channel)
    reply = admin.GetState(admin_pb2.GetStateRequest(), metadata=_auth(args), timeout=args.timeout)
    merged = fleet.import_learner(
        reply.policy_name,
        json.loads(reply.params_json),
        _full_state(reply),
        reply.engine_ids,
        document,
    )
    # Learning between the read and the restore is lost: import before the engine serves.
    restored = admin.Restore(
        # Encoded as snapshots are: a state that fits a snapshot fits the request.
        admin_pb2.RestoreRequest(snapshot_json=snapshot.encode_text(merged)),
        metadata=_auth(args),
        timeout=args.timeout,
    )
    print(f"imported {document['learner']} into {restored.policy_name} ({restored.policy_version})")
    return 0


COMMANDS = {
    "state": _state,
    "export": _export,
    "import": _import,
    "memory": _memory,
    "policies": _policies,
    **dict.fromkeys(MUTATIONS, _mutate),
    "health": _health,
    "decide": _decide,
}


if __name__ == "__main__":
    sys.exit(main())
