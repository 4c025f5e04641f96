"""`make fuzz`: fuzz every RPC of the three services, then the hardening classes of
issue 28 (hardening.py); `--quick` is the CI slice.

    python -m benchmarks.fuzz [--quick] [--hardening-only] [--requests N] [--seed S]
        [--json PATH] [--hardening-json PATH]

Writes the results (docs/reliability/fuzz.json and fuzz-hardening.json by default, in the
Reliability report's format) and exits 1 when a server crashed or answered wrongly.
"""

from __future__ import annotations

import argparse
import datetime
import json
import secrets
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from google.protobuf.message import DecodeError, Message
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from nightjar_proto.v1 import policy_pb2

from benchmarks.fuzz import hardening
from benchmarks.fuzz import strategies as fs
from benchmarks.fuzz.processes import ServerProcess
from benchmarks.fuzz.runner import Method, Sender, Tally, message_class, methods

# Share of the requests each RPC gets: the engines' stream most (it carries every step's
# table request and report), memory orders (which wait for a step boundary) and snapshot
# writes least.
WEIGHTS = {
    "StepStream": 40,
    "GetState": 3,
    "ListPolicies": 1,
    "SwapPolicy": 4,
    "SetParameters": 4,
    "Snapshot": 1,
    "Restore": 4,
    "Reset": 2,
    "GetStatus": 1,
    "OffloadDraft": 1,
    "ReloadDraft": 1,
    "ExpandKv": 2,
    "CompactKv": 2,
}
# Messages hypothesis generates per example (a stream carries them all), and the byte-level
# variants of each in the raw phase.
MESSAGES_PER_EXAMPLE = 4
RAW_VARIANTS = 8
EXAMPLES_PER_RUN = 300


def request_strategy(method: Method, issued: fs.Issued) -> st.SearchStrategy[Message]:
    named = fs.field_strategies(issued)
    descriptor: Any = method.request.DESCRIPTOR
    generic = fs.message(descriptor, message_class, named)
    context = fs.mutated(fs.near_valid_context(issued), policy_pb2.StepContext.DESCRIPTOR, named)
    outcome = fs.mutated(fs.near_valid_outcome(issued), policy_pb2.StepOutcome.DESCRIPTOR, named)
    if method.request is policy_pb2.StepContext:
        return st.one_of(generic, context.map(lambda v: policy_pb2.StepContext(**v)))
    if method.request is policy_pb2.StepOutcome:
        return st.one_of(generic, outcome.map(lambda v: policy_pb2.StepOutcome(**v)))
    if method.request is policy_pb2.StepRequest:
        # A table asked for a context alone (how tables come to be issued), an engine's
        # steps run from an issued table with their outcomes (and its next context or not),
        # and a batch of made-up ran steps and outcomes of any table, with a context or not.
        asks = st.builds(
            lambda seq, c: policy_pb2.StepRequest(seq=seq, context=policy_pb2.StepContext(**c)),
            st.integers(0, 1 << 20),
            context,
        )
        steps = fs.engine_steps(issued, named)
        ran_step = st.builds(
            lambda table, n, c, gamma: policy_pb2.RanStep(
                decision_id=f"{table}.{n}", context=policy_pb2.StepContext(**c), gamma=gamma
            ),
            st.one_of(
                st.integers(0, 1 << 16).map(lambda i: issued.pick_table(i).table_id),
                st.text(max_size=12),
            ),
            st.integers(-1, 1 << 20),
            context,
            st.integers(-2, 80),
        )
        batch = st.builds(
            lambda seq, c, ran, outcomes: policy_pb2.StepRequest(
                seq=seq,
                context=policy_pb2.StepContext(**c) if c else None,
                ran_steps=ran,
                outcomes=[policy_pb2.StepOutcome(**o) for o in outcomes],
            ),
            st.integers(0, 1 << 20),
            st.one_of(st.none(), context),
            st.lists(ran_step, max_size=6),
            st.lists(outcome, max_size=6),
        )
        return st.one_of(generic, asks, steps, steps, batch)
    return generic


def run_method(
    method: Method, sender: Sender, issued: fs.Issued, budget: int, raw: bool, run_seed: int
) -> None:
    """Send about ``budget`` requests of one RPC. Hypothesis generates the messages; in
    the raw phase each generated message also seeds :data:`RAW_VARIANTS` byte-level
    variants (random bytes, or its own bytes flipped, cut or extended)."""
    typed = request_strategy(method, issued).map(lambda m: m.SerializeToString())
    per_example = (RAW_VARIANTS if raw else 1) * (MESSAGES_PER_EXAMPLE + 1) // 2
    examples = max(1, budget // per_example)
    # Hypothesis caches thousands of test cases per run: runs of a few hundred examples
    # (each with its own seed) keep the fuzzer's memory flat over 100,000 requests.
    for chunk in range(0, examples, EXAMPLES_PER_RUN):
        run_chunk(
            method,
            sender,
            typed,
            min(EXAMPLES_PER_RUN, examples - chunk),
            raw,
            run_seed * 1000 + chunk // EXAMPLES_PER_RUN,
        )


def run_chunk(
    method: Method,
    sender: Sender,
    typed: st.SearchStrategy[bytes],
    examples: int,
    raw: bool,
    run_seed: int,
) -> None:
    @seed(run_seed)
    @settings(
        max_examples=examples,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(
        st.lists(typed, min_size=1, max_size=MESSAGES_PER_EXAMPLE),
        st.integers(0, (1 << 32) - 1),
        st.integers(0, 3) if method.mutating else st.just(0),
    )
    def case(messages: list[bytes], variant_seed: int, auth: int) -> None:
        payloads = fs.byte_variants(messages, RAW_VARIANTS, variant_seed) if raw else messages
        if method.streaming:  # one stream carries them all, in order
            sender.send(method, payloads, auth)
        else:
            for payload in payloads:
                sender.send(method, [payload], auth)

    case()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fuzz", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the CI slice (about 4,000 requests)")
    parser.add_argument("--requests", type=int, help="requests in all (default 110,000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=Path("docs/reliability/fuzz.json"))
    parser.add_argument(
        "--hardening-json", type=Path, default=Path("docs/reliability/fuzz-hardening.json")
    )
    parser.add_argument(
        "--hardening-only",
        action="store_true",
        help="only the hardening classes (snapshot documents and files, parameter values, "
        "outcomes), not the protocol fuzzing",
    )
    args = parser.parse_args(argv)
    passed = True
    if not args.hardening_only:
        total = args.requests or (4_000 if args.quick else 110_000)
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="nj-fuzz-") as tmp:
            tally = fuzz(Path(tmp), total, args.seed)
        elapsed = time.monotonic() - started
        result = report(tally, elapsed, args.quick, args.requests)
        print(json.dumps({**result, "details": tally.as_dict()}, indent=2))
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**result, "details": tally.as_dict()}, indent=2) + "\n")
        passed = bool(result["passed"])
    with tempfile.TemporaryDirectory(prefix="nj-fuzz-hardening-") as tmp:
        rows = hardening_rows(hardening.run(Path(tmp), args.quick, args.seed), args)
    print(json.dumps(rows, indent=2))
    args.hardening_json.parent.mkdir(parents=True, exist_ok=True)
    args.hardening_json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if passed and all(row["passed"] for row in rows) else 1


def hardening_rows(
    results: Sequence[hardening.ClassResult], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """The Reliability report's rows of the hardening classes."""
    from benchmarks.host import machine

    command = "make fuzz" + (" FUZZ_ARGS=--quick" if args.quick else "")
    if args.hardening_only:
        command = "make fuzz FUZZ_ARGS='--hardening-only" + (" --quick'" if args.quick else "'")
    return [
        {
            "test": f"fuzz, hardening: {result.name}",
            "what": result.what
            + "; "
            + (
                result.checked
                or "after each: alive, SERVING, γ within 0..Γmax and the engine's max_gamma, "
                "no number beyond what a policy learns, a refusal changes nothing"
            ),
            "figure": (
                f"{result.cases:,} cases, {result.refused:,} refused, "
                f"{len(result.failures)} failures"
                + (f" (first: {result.failures[0][:300]})" if result.failures else "")
            ),
            "passed": not result.failures,
            "date": datetime.date.today().isoformat(),
            "machine": machine(),
            "command": command,
        }
        for result in results
    ]


def fuzz(workdir: Path, total: int, run_seed: int) -> Tally:
    token = secrets.token_hex(16)
    token_file = workdir / "admin-token"
    token_file.write_text(token)
    sidecar = ServerProcess(
        "sidecar",
        [
            "policy_server.cli",
            "--uds",
            str(workdir / "sidecar.sock"),
            "--state-dir",
            str(workdir / "state"),
            "--admin-token-file",
            str(token_file),
            "--log-level",
            "WARNING",
        ],
        workdir / "sidecar.sock",
        workdir / "sidecar.log",
    )
    memory = ServerProcess(
        "memory",
        [
            "benchmarks.fuzz.memory_host",
            "--uds",
            str(workdir / "memory.sock"),
            "--admin-token-file",
            str(token_file),
        ],
        workdir / "memory.sock",
        workdir / "memory.log",
    )
    issued = fs.Issued()
    tally = Tally()

    def on_reply(method: Method, payload: bytes, reply: Message) -> None:
        """Remember what the sidecar issued, for later requests to name: the table it
        answered a context with, and the steps an applied report batch ran."""
        if not isinstance(reply, policy_pb2.StepReply) or reply.HasField("error"):
            return
        try:
            request = policy_pb2.StepRequest.FromString(payload)
        except DecodeError:
            return
        table, ctx = reply.table, request.context
        entry = ctx.batch_size - table.first_batch_size
        if table.table_id and request.HasField("context") and 0 <= entry < len(table.gammas):
            issued.add_table(fs.IssuedTable(table.table_id, ctx, table.gammas[entry]))
        if reply.skipped == 0:  # every step applied: an outcome may name it, once
            reported = {o.decision_id for o in request.outcomes}
            for step in request.ran_steps:
                if step.decision_id not in reported:
                    issued.add(step.decision_id, step.context.engine_id, step.gamma)

    sender = Sender({"sidecar": sidecar, "memory": memory}, tally, token, on_reply)
    try:
        memory.spawn()  # vLLM's import is slow: both start at once
        sidecar.start()
        memory.wait_ready()
        rpcs = methods()
        weight = sum(WEIGHTS.get(m.name, 1) for m in rpcs)
        for raw in (False, True):
            for index, method in enumerate(rpcs):
                # Three quarters typed messages, one quarter raw bytes.
                share = (1 if raw else 3) / 4 * WEIGHTS.get(method.name, 1) / weight
                run_method(
                    method,
                    sender,
                    issued,
                    max(1, int(total * share)),
                    raw,
                    run_seed * 100 + index + (50 if raw else 0),
                )
                print(
                    f"{'raw' if raw else 'typed'} {method.label}: {tally.requests} requests, "
                    f"{tally.failures} failures",
                    file=sys.stderr,
                    flush=True,
                )
        for server in (sidecar, memory):
            if not server.alive():
                tally.crashes += 1
                tally.failure("crash", server.name, server.log_tail(600), b"")
    finally:
        sidecar.stop()
        memory.stop()
    return tally


def report(tally: Tally, elapsed: float, quick: bool, requests: int | None) -> dict[str, Any]:
    from benchmarks.host import machine

    command = "make fuzz" + (" FUZZ_ARGS=--quick" if quick else "")
    if requests:
        command += f" FUZZ_ARGS='--requests {requests}'"
    return {
        "test": "Protocol fuzzing" + (" (quick slice)" if quick else ""),
        "what": (
            f"{len(methods())} RPCs of PolicyService, AdminService and MemoryAgentService, "
            "hypothesis-generated messages (boundary ints, NaN/±inf, empty and 1 MiB strings, "
            "unknown ids, steps of tables never issued, wrong engine for a step, bad tokens; "
            "on StepStream an engine's contexts, steps run from the tables it was sent and "
            "their outcomes) and raw/mutated bytes as the serialized request, sent to a real "
            "nightjar-server and a real memory-agent process; state read before/after every "
            "rejected request"
        ),
        "figure": (
            f"{tally.requests:,} requests in {elapsed:.0f} s: {tally.crashes} crashes, "
            f"{tally.non_grpc_errors} non-gRPC errors, {tally.wrong_codes} wrong status codes, "
            f"{tally.state_changes_on_reject} state changes on {tally.state_checks:,} "
            "checked rejections"
        ),
        "passed": tally.failures == 0 and tally.requests >= (requests or (0 if quick else 100_000)),
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "command": command,
    }


if __name__ == "__main__":
    raise SystemExit(main())
