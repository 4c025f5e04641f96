"""Sends the fuzz cases and judges every answer.

Every request goes out as bytes on a generic channel (identity serializers), so a
hypothesis-built message and random bytes take the same path. An answer is judged by its
status: OK or a code that names the client's mistake (INVALID_ARGUMENT, NOT_FOUND,
FAILED_PRECONDITION, UNAUTHENTICATED, PERMISSION_DENIED, RESOURCE_EXHAUSTED for an
oversized message) is
right; anything else (UNKNOWN, INTERNAL, UNAVAILABLE, a deadline) is a wrong code. After a
rejected request the server's observable state is read again and compared with what it
was before the request.

A StepStream opens with a policy notice (a StepReply of seq 0 with the policy version),
which answers no request: it is counted (``stream["notices"]``) and set apart from the
replies, which answer the requests in order.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import DecodeError, Message
from nightjar_proto.v1 import admin_pb2, memory_pb2, policy_pb2

from benchmarks.fuzz.processes import ServerProcess
from policy_server.grpc_server import SUPERSEDED

RIGHT_CODES = frozenset(
    {
        grpc.StatusCode.OK,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)
CODE_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}
TIMEOUT_S = 30.0
# Memory orders wait for a step boundary; a short deadline keeps an idle wait short.
MEMORY_TIMEOUT_S = 5.0
MAX_EXAMPLES = 20
# The fuzzer resets the sidecar's learned state this often (an accepted admin call, not
# counted): engines made up by accepted requests would otherwise pile up in every GetState.
RESET_EVERY = 2_000


Metadata = tuple[tuple[str, str | bytes], ...]


def unary(channel: grpc.Channel, path: str) -> grpc.UnaryUnaryMultiCallable[bytes, bytes]:
    """A call that sends and returns bytes as they are (no serializers)."""
    return channel.unary_unary(path, None, None)


@dataclasses.dataclass
class Tally:
    requests: int = 0
    crashes: int = 0
    non_grpc_errors: int = 0
    wrong_codes: int = 0
    state_changes_on_reject: int = 0
    rejected: int = 0
    state_checks: int = 0
    by_code: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    by_method: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    # StepStream replies: notices, replies carrying a table, ran steps and outcomes the
    # sidecar applied, and those it skipped (StepReply.skipped: malformed, or naming what
    # it does not hold).
    stream: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    examples: list[str] = dataclasses.field(default_factory=list)

    def failure(self, kind: str, method: str, detail: str, payload: bytes) -> None:
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(
                f"{kind} {method}: {detail[:300]} (request {payload[:80]!r}"
                f"{'...' if len(payload) > 80 else ''}, {len(payload)} bytes)"
            )

    @property
    def failures(self) -> int:
        return self.crashes + self.non_grpc_errors + self.wrong_codes + self.state_changes_on_reject

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "crashes": self.crashes,
            "non_grpc_errors": self.non_grpc_errors,
            "wrong_codes": self.wrong_codes,
            "state_changes_on_reject": self.state_changes_on_reject,
            "rejected": self.rejected,
            "state_checks": self.state_checks,
            "by_code": dict(sorted(self.by_code.items())),
            "by_method": dict(sorted(self.by_method.items())),
            "stream": dict(sorted(self.stream.items())),
            "examples": self.examples,
        }


@dataclasses.dataclass(frozen=True)
class Method:
    service: str  # full name, e.g. nightjar.v1.PolicyService
    name: str
    request: type[Message]
    response: type[Message]
    streaming: bool
    target: str  # "sidecar" | "memory"
    mutating: bool

    @property
    def path(self) -> str:
        return f"/{self.service}/{self.name}"

    @property
    def label(self) -> str:
        return f"{self.service.rsplit('.', 1)[-1]}.{self.name}"


READ_ONLY = {"GetState", "ListPolicies", "GetStatus"}


def methods() -> list[Method]:
    """Every RPC of the three services, from the descriptors (a new RPC is fuzzed too)."""
    found = []
    for module, target in ((policy_pb2, "sidecar"), (admin_pb2, "sidecar"), (memory_pb2, "memory")):
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                found.append(_method(module, service.full_name, method, target))
    return found


def _method(module: Any, service: str, method: MethodDescriptor, target: str) -> Method:
    return Method(
        service,
        method.name,
        message_class(method.input_type),
        message_class(method.output_type),
        method.client_streaming,
        target,
        mutating=service.endswith(("AdminService", "MemoryAgentService"))
        and method.name not in READ_ONLY,
    )


def message_class(descriptor: Any) -> type[Message]:
    for module in (policy_pb2, admin_pb2, memory_pb2):
        if descriptor.file.name == module.DESCRIPTOR.name:
            cls: type[Message] = getattr(module, descriptor.name)
            return cls
    raise KeyError(descriptor.full_name)


@dataclasses.dataclass
class Answer:
    code: grpc.StatusCode
    detail: str
    replies: list[Message]


class Sender:
    """Sends one request's bytes to its server and judges the answer."""

    def __init__(
        self,
        servers: dict[str, ServerProcess],
        tally: Tally,
        token: str,
        on_reply: Callable[[Method, bytes, Message], None],
    ) -> None:
        self.servers = servers
        self.tally = tally
        self.token = token
        self.on_reply = on_reply
        self._state: dict[str, Any] = {}
        self._next_reset = RESET_EVERY

    def metadata(self, auth: int) -> Metadata:
        """0: none, 1: the admin token, 2: a wrong one, 3: a malformed header."""
        return (
            (),
            (("authorization", f"Bearer {self.token}"),),
            (("authorization", "Bearer " + "0" * len(self.token)),),
            (("authorization", "Basic"),),
        )[auth % 4]

    def send(self, method: Method, payloads: list[bytes], auth: int) -> None:
        if self.tally.requests >= self._next_reset:
            self._next_reset += RESET_EVERY
            self._reset_sidecar()
        server = self.servers[method.target]
        before = self._observe(method.target)
        answer = self._call(server, method, payloads, self.metadata(auth))
        self.tally.requests += len(payloads)
        self.tally.by_method[method.label] += len(payloads)
        if answer is None:
            return
        self.tally.by_code[answer.code.name] += 1
        if answer.code not in RIGHT_CODES:
            self.tally.wrong_codes += 1
            self.tally.failure(
                "wrong-code", method.label, f"{answer.code.name}: {answer.detail}", payloads[0]
            )
        steps = [r for r in answer.replies if isinstance(r, policy_pb2.StepReply)]
        self.tally.stream["tables"] += sum(r.HasField("table") for r in steps)
        self.tally.stream["skipped items"] += sum(r.skipped for r in steps)
        errors = [r for r in steps if r.HasField("error")]
        # A context still queued when a newer one of its engine arrives behind it is answered
        # ABORTED with its outcome applied (StepStream's contract): right, and not a reject.
        superseded = [r for r in errors if _superseded(r)]
        self.tally.by_code["stream:ABORTED (superseded)"] += len(superseded)
        errors = [r for r in errors if not _superseded(r)]
        for reply in errors:
            code = CODE_BY_VALUE.get(reply.error.code)
            self.tally.by_code[f"stream:{code.name if code else reply.error.code}"] += 1
            if code not in RIGHT_CODES:
                self.tally.wrong_codes += 1
                self.tally.failure("wrong-code", method.label, reply.error.message, payloads[0])
        for payload, reply in zip(payloads, answer.replies, strict=False):
            self.on_reply(method, payload, reply)
            if isinstance(reply, policy_pb2.StepReply) and not reply.HasField("error"):
                self.tally.stream["applied items"] += _items(payload) - reply.skipped
        # Rejected: nothing of it was applied (no reply without an error; a unary call
        # that failed has no reply at all).
        rejected = not superseded and len(errors) == len(answer.replies)
        if not rejected:
            self._state.pop(method.target, None)  # an applied request may change state
            return
        self.tally.rejected += 1
        after = self._observe(method.target, fresh=True)
        if before is not None and after is not None:
            self.tally.state_checks += 1
            if after != before:
                self.tally.state_changes_on_reject += 1
                changed = sorted(k for k in before if before[k] != after.get(k))
                self.tally.failure("state-change", method.label, f"changed: {changed}", payloads[0])

    def _call(
        self, server: ServerProcess, method: Method, payloads: list[bytes], metadata: Metadata
    ) -> Answer | None:
        timeout = MEMORY_TIMEOUT_S if method.target == "memory" else TIMEOUT_S
        # Replies as they arrive: a stream that ends with an error status (an oversized or
        # undecodable message) has answered, and applied, the messages before it.
        raw: list[bytes] = []
        try:
            assert server.channel is not None
            if method.streaming:
                call = server.channel.stream_stream(method.path, None, None)
                raw.extend(call(iter(payloads), metadata=metadata, timeout=timeout))
            else:
                raw.append(
                    unary(server.channel, method.path)(
                        payloads[0], metadata=metadata, timeout=timeout
                    )
                )
            return Answer(grpc.StatusCode.OK, "", self._replies(method, raw))
        except grpc.RpcError as exc:
            if not server.alive():
                self._crashed(server, method, payloads[0])
                return None
            return Answer(exc.code(), exc.details() or "", self._replies(method, raw))
        except (DecodeError, Exception) as exc:  # counted, never hidden
            self.tally.non_grpc_errors += 1
            self.tally.failure("non-grpc-error", method.label, repr(exc), payloads[0])
            if not server.alive():
                self._crashed(server, method, payloads[0])
            return None

    def _replies(self, method: Method, raw: list[bytes]) -> list[Message]:
        """The replies that answer requests, in order: policy notices counted, set apart."""
        replies = [method.response.FromString(r) for r in raw]
        answers = [r for r in replies if not _notice(r)]
        self.tally.stream["notices"] += len(replies) - len(answers)
        return answers

    def _reset_sidecar(self) -> None:
        channel = self.servers["sidecar"].channel
        assert channel is not None
        with contextlib.suppress(grpc.RpcError):  # a dead server is found by the next call
            unary(channel, "/nightjar.v1.AdminService/Reset")(
                admin_pb2.ResetRequest().SerializeToString(),
                metadata=self.metadata(1),
                timeout=TIMEOUT_S,
            )
        self._state.pop("sidecar", None)

    def _crashed(self, server: ServerProcess, method: Method, payload: bytes) -> None:
        self.tally.crashes += 1
        self.tally.failure("crash", method.label, server.log_tail(600), payload)
        server.stop()
        server.start()
        self._state.pop(server.name, None)

    def _observe(self, target: str, fresh: bool = False) -> dict[str, Any] | None:
        """What a rejected request must leave as it was (None when it cannot be read)."""
        if not fresh and target in self._state:
            return dict(self._state[target])
        channel = self.servers[target].channel
        assert channel is not None
        try:
            if target == "sidecar":
                get_state = unary(channel, "/nightjar.v1.AdminService/GetState")
                # With the token: without it the state of all engines is a summary.
                state = admin_pb2.GetStateResponse.FromString(
                    get_state(
                        admin_pb2.GetStateRequest().SerializeToString(),
                        metadata=self.metadata(1),
                        timeout=TIMEOUT_S,
                    )
                )
                view = {
                    "policy_name": state.policy_name,
                    "policy_version": state.policy_version,
                    "params": state.params_json,
                    "state": json.loads(state.state_json),
                    "decisions_total": state.decisions_total,
                    "reports_total": state.reports_total,
                    "engine_ids": list(state.engine_ids),
                    "memory": state.memory_json,
                }
            else:
                get_status = unary(channel, "/nightjar.v1.MemoryAgentService/GetStatus")
                status = memory_pb2.MemoryStatus.FromString(
                    get_status(
                        memory_pb2.MemoryStatusRequest().SerializeToString(), timeout=TIMEOUT_S
                    )
                )
                # Learned / applied state only: last_error and pending_action report the
                # rejection itself, free blocks and timings move with the engine's steps.
                view = {
                    name: getattr(status, name)
                    for name in (
                        "draft_resident",
                        "draft_state",
                        "total_kv_blocks",
                        "draft_bytes",
                        "offloads",
                        "reloads",
                        "migrated_blocks",
                    )
                }
        except grpc.RpcError:
            return None
        self._state[target] = view
        return dict(view)


def chunks(payloads: Iterator[bytes], size: int) -> Iterator[list[bytes]]:
    batch: list[bytes] = []
    for payload in payloads:
        batch.append(payload)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _superseded(reply: policy_pb2.StepReply) -> bool:
    code: int = grpc.StatusCode.ABORTED.value[0]
    return bool(reply.error.code == code and reply.error.message == SUPERSEDED)


def _notice(reply: Message) -> bool:
    """A StepStream policy notice: only a notice carries a policy version."""
    return isinstance(reply, policy_pb2.StepReply) and bool(reply.policy_version)


def _items(payload: bytes) -> int:
    """Ran steps and outcomes in a serialized StepRequest (0 when it does not parse)."""
    try:
        request = policy_pb2.StepRequest.FromString(payload)
    except DecodeError:
        return 0
    return len(request.ran_steps) + len(request.outcomes)
