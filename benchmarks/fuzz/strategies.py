"""Hypothesis strategies for every request message of nightjar.v1, built from the
descriptors: random and boundary values of each field's wire type (negative, huge,
NaN/±inf, empty and 1 MiB strings, unknown enum values), field names that refer to
something on the server (engines, tables, steps, policies, files) drawn from what exists
there and from what does not, near-valid steps with one field pushed out of range, and
raw bytes (random, or a valid request's bytes mutated) as the serialized request.

A StepStream request is what an engine sends (nightjar.v1): the steps it ran from a table
the sidecar issued, their outcomes, and the context of its next step, each near-valid or
pushed out of range in one field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Callable
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st
from nightjar_proto.v1 import policy_pb2

from policy_server.policies import REGISTRY
from policy_server.service import TableOptions

MIB_STRING = "x" * (1 << 20)
ENGINES = ("engine-a", "engine-b", "engine-c")
POLICIES = tuple(sorted(REGISTRY))  # every registered policy, the default included
INT32 = (-(1 << 31), (1 << 31) - 1)
INT64 = (-(1 << 63), (1 << 63) - 1)
UINT64 = (0, (1 << 64) - 1)
FLOAT_EDGES = (
    0.0,
    -0.0,
    math.nan,
    math.inf,
    -math.inf,
    5e-324,
    1e-300,
    1e308,
    -1.0,
    600.0,
    600.0001,
    0.001,
)


@dataclasses.dataclass(frozen=True)
class IssuedTable:
    """A decision table the sidecar issued: the context it was decided for and its entry
    for that context's batch size (a step run from it is that context and that γ)."""

    table_id: str
    context: policy_pb2.StepContext
    gamma: int

    def ran_step(self, number: int, step_offset: int = 0) -> policy_pb2.RanStep:
        """Step ``number`` run from the table (decision_id "<table_id>.<number>")."""
        ctx = policy_pb2.StepContext()
        ctx.CopyFrom(self.context)
        ctx.step_index = min(ctx.step_index + step_offset, INT64[1])
        return policy_pb2.RanStep(
            decision_id=f"{self.table_id}.{number}", context=ctx, gamma=self.gamma
        )


# What a step names before the sidecar issued any table: a made-up table.
NO_TABLE = IssuedTable("t", policy_pb2.StepContext(engine_id=ENGINES[0], batch_size=1), 0)
# Tables of the last few requests: the ones an engine runs its steps from.
RECENT_TABLES = 6


@dataclasses.dataclass
class Issued:
    """What the sidecar issued during the run (the fuzzer fills it): tables that ran
    steps name, and steps reported as run that outcomes name, with the right engine or a
    wrong one."""

    # Steps run from issued tables and applied: (decision_id, engine_id, γ).
    decisions: list[tuple[str, str, int]] = dataclasses.field(default_factory=list)
    # Decision tables it issued, newest last.
    tables: list[IssuedTable] = dataclasses.field(default_factory=list)

    def add(self, decision_id: str, engine_id: str, gamma: int) -> None:
        self.decisions.append((decision_id, engine_id, gamma))
        del self.decisions[:-256]

    def add_table(self, table: IssuedTable) -> None:
        self.tables.append(table)
        del self.tables[:-256]

    def pick(self, index: int) -> tuple[str, str, int]:
        if not self.decisions:
            return ("", ENGINES[0], 0)
        return self.decisions[index % len(self.decisions)]

    def pick_table(self, index: int) -> IssuedTable:
        """A decision table the sidecar issued (ran steps name them), or a made-up one."""
        return self.tables[index % len(self.tables)] if self.tables else NO_TABLE

    def recent_table(self, index: int) -> IssuedTable:
        """One of the newest tables, those the sidecar still holds (it keeps an engine's
        last few), or a made-up one."""
        recent = self.tables[-RECENT_TABLES:]
        return recent[index % len(recent)] if recent else NO_TABLE


def ints(bounds: tuple[int, int]) -> st.SearchStrategy[int]:
    low, high = bounds
    edges = [
        v
        for v in (
            0,
            1,
            -1,
            2,
            64,
            65,
            256,
            65536,
            65537,
            1 << 20,
            10**9,
            INT32[0],
            INT32[1],
            INT64[0],
            INT64[1],
            UINT64[1],
        )
        if low <= v <= high
    ]
    return st.one_of(
        st.integers(max(low, 0), min(high, 100)),
        st.integers(max(low, 0), min(high, 100)),
        st.sampled_from(edges),
        st.integers(low, high),
    )


def floats() -> st.SearchStrategy[float]:
    return st.one_of(st.floats(0.0005, 2.0), st.sampled_from(FLOAT_EDGES), st.floats())


def plain_strings() -> st.SearchStrategy[str]:
    # one_of picks its branches about evenly: the 1 MiB string is one of 32.
    common = [
        st.just(""),
        st.text(max_size=24),
        st.text(max_size=24),
        st.sampled_from(("\x00", " ", "../../etc/passwd", "é" * 300, "a" * 257)),
    ]
    return st.one_of(*(common * 8)[:31], st.just(MIB_STRING))


def json_text() -> st.SearchStrategy[str]:
    """JSON objects of known parameter names with boundary values, and non-JSON text."""
    scalar = st.one_of(
        st.none(), st.booleans(), ints(INT64), st.floats(allow_nan=False), st.text(max_size=8)
    )
    values = st.recursive(scalar, lambda inner: st.lists(inner, max_size=3), max_leaves=5)
    names = st.sampled_from(
        (
            "gamma_max",
            "max_batch_size",
            "batch_bucketing",
            "seed",
            "share_learner",
            "gamma",
            "prefill_cost_table",
            "epsilon",
            "alpha",
            "table",
            "unknown_param",
        )
    )
    objects = st.dictionaries(names, values, max_size=3).map(json.dumps)
    nan = st.dictionaries(names, st.sampled_from((math.nan, math.inf)), max_size=2).map(json.dumps)
    return st.one_of(objects, objects, nan, plain_strings(), st.just("[1, 2]"), st.just("{"))


def snapshot_text() -> st.SearchStrategy[str]:
    """Snapshot documents that are almost right (format, policy, state, engines)."""
    policy = st.fixed_dictionaries(
        {
            "name": st.one_of(st.sampled_from(POLICIES), st.integers(), st.none()),
            "params": st.one_of(
                st.just({}),
                st.lists(st.integers(), max_size=2),
                st.none(),
                st.dictionaries(st.sampled_from(("gamma_max", "x")), st.integers(), max_size=2),
            ),
            "state": st.one_of(
                st.just({}),
                st.none(),
                st.integers(),
                st.fixed_dictionaries(
                    {"schema": st.text(max_size=12), "gamma_max": st.integers(-1, 70)}
                ),
            ),
        },
    )
    document = st.fixed_dictionaries(
        {"format": st.sampled_from(("nightjar-snapshot/1", "nightjar-snapshot/0", ""))},
        optional={
            "policy": st.one_of(policy, st.integers(), st.none()),
            "engines": st.one_of(
                st.lists(st.sampled_from(ENGINES), max_size=3),
                st.integers(),
                st.none(),
                st.just("engine-a"),
            ),
            "created_unix": st.one_of(st.floats(allow_nan=False), st.text(max_size=4)),
        },
    )
    return st.one_of(document.map(json.dumps), json_text())


def paths() -> st.SearchStrategy[str]:
    return st.one_of(
        st.sampled_from(
            (
                "snapshot.json",
                "/nonexistent/snapshot.json",
                "",
                "/",
                ".",
                "..",
                "\x00",
                "a\x00b",
                "/proc/self/status",
                "x" * 5000,
            )
        ),
        plain_strings(),
    )


def field_strategies(issued: Issued) -> dict[str, st.SearchStrategy[Any]]:
    """Strategies for string fields whose names refer to something on the server."""
    engine = st.one_of(st.sampled_from(ENGINES), st.sampled_from(ENGINES), plain_strings())
    decision = st.one_of(st.integers(0, 1 << 16).map(lambda i: issued.pick(i)[0]), plain_strings())
    return {
        "engine_id": engine,
        "learner_key": st.one_of(st.just(""), st.just("model@cpu"), plain_strings()),
        "decision_id": decision,
        "request_id": st.one_of(st.sampled_from(("r0", "r1")), plain_strings()),
        "name": st.one_of(st.sampled_from(POLICIES), plain_strings()),
        "params_json": json_text(),
        "snapshot_json": snapshot_text(),
        "path": paths(),
    }


def repeated(field: FieldDescriptor) -> bool:
    # ``is_repeated`` replaced ``label`` in protobuf 6; 5.29 (our floor) has only ``label``.
    flag = getattr(field, "is_repeated", None)
    if flag is None:
        flag = getattr(field, "label") == FieldDescriptor.LABEL_REPEATED  # noqa: B009
    return bool(flag)


def message(
    descriptor: Descriptor,
    cls_of: Callable[[Descriptor], type[Message]],
    named: dict[str, st.SearchStrategy[Any]],
    depth: int = 0,
) -> st.SearchStrategy[Message]:
    """Any message of ``descriptor``: every field set or not, values from its wire type."""
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for field in descriptor.fields:
        value = _value(field, cls_of, named, depth)
        if value is None:
            continue
        if repeated(field):
            value = st.lists(value, max_size=4 if depth == 0 else 3)
        fields[field.name] = value

    def build(values: dict[str, Any]) -> Message:
        msg = cls_of(descriptor)()
        for name, value in values.items():
            field = descriptor.fields_by_name[name]
            target = getattr(msg, name)
            if repeated(field):
                if field.type == FieldDescriptor.TYPE_MESSAGE:
                    for item in value:
                        target.add().CopyFrom(item)
                else:
                    target.extend(value)
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                target.CopyFrom(value)
            else:
                setattr(msg, name, value)
        return msg

    return st.fixed_dictionaries({}, optional=fields).map(build)


def _value(
    field: FieldDescriptor,
    cls_of: Callable[[Descriptor], type[Message]],
    named: dict[str, st.SearchStrategy[Any]],
    depth: int,
) -> st.SearchStrategy[Any] | None:
    kind = field.type
    if kind == FieldDescriptor.TYPE_STRING:
        return named.get(field.name, plain_strings())
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_ENUM):
        return ints(INT32)
    if kind == FieldDescriptor.TYPE_INT64:
        return ints(INT64)
    if kind == FieldDescriptor.TYPE_UINT64:
        return ints(UINT64)
    if kind in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return floats()
    if kind == FieldDescriptor.TYPE_MESSAGE and depth < 2 and field.message_type is not None:
        return message(field.message_type, cls_of, named, depth + 1)
    return None


def near_valid_context(issued: Issued) -> st.SearchStrategy[dict[str, Any]]:
    """StepContext fields a real engine sends; the fuzzer's mutations push one out."""
    return st.fixed_dictionaries(
        {
            "engine_id": st.sampled_from(ENGINES),
            "step_index": st.integers(0, 10**6),
            "batch_size": st.integers(1, 64),
            "num_waiting": st.integers(0, 16),
            "free_kv_blocks": st.integers(0, 500),
            "total_kv_blocks": st.just(1000),
            "max_draft_lag_tokens": st.integers(0, 64),
            "draft_resident": st.booleans(),
            "max_gamma": st.integers(0, 8),
            "context_tokens": st.integers(0, 10**5),
            "min_draft_passes": st.integers(0, 1),
        }
    )


def near_valid_outcome(issued: Issued) -> st.SearchStrategy[dict[str, Any]]:
    def fill(values: dict[str, Any]) -> dict[str, Any]:
        decision_id, engine_id, gamma = issued.pick(values.pop("pick"))
        drafted = values["drafted_tokens"]
        return {
            **values,
            "decision_id": decision_id,
            "engine_id": engine_id,
            "gamma": gamma,
            "accepted_tokens": min(values["accepted_tokens"], drafted),
        }

    return st.fixed_dictionaries(
        {
            "pick": st.integers(0, 1 << 16),
            "step_seconds": st.floats(0.001, 1.0),
            "generated_tokens": st.integers(1, 256),
            "drafted_tokens": st.integers(0, 256),
            "accepted_tokens": st.integers(0, 256),
            "prefill_tokens": st.integers(0, 512),
        }
    ).map(fill)


def mutated(
    fields: st.SearchStrategy[dict[str, Any]],
    descriptor: Descriptor,
    named: dict[str, st.SearchStrategy[Any]],
) -> st.SearchStrategy[dict[str, Any]]:
    """Near-valid fields, most left as they are and at most one replaced by any value of
    its wire type (the boundary values included)."""
    scalar = [
        f for f in descriptor.fields if f.type != FieldDescriptor.TYPE_MESSAGE and not repeated(f)
    ]

    def one(draw: Callable[[st.SearchStrategy[Any]], Any]) -> dict[str, Any]:
        values = dict(draw(fields))
        if draw(st.integers(0, 2)):  # two in three are pushed out of range in one field
            field = draw(st.sampled_from(scalar))
            strategy = _value(field, lambda d: Message, named, 3)
            assert strategy is not None
            values[field.name] = draw(strategy)
        return values

    return st.composite(lambda draw: one(draw))()


def engine_steps(
    issued: Issued, named: dict[str, st.SearchStrategy[Any]]
) -> st.SearchStrategy[policy_pb2.StepRequest]:
    """What an engine sends once it ran steps from a table the sidecar issued: the ran
    steps (the table's context and entry γ, numbered), most with their outcomes (plausible
    for the step, one in six with a field pushed out of range), and the context of its
    next step, or none (a report batch)."""
    outcome_fields = policy_pb2.StepOutcome.DESCRIPTOR

    # Every draw's range is fixed: what is drawn may not depend on what the sidecar issued
    # (hypothesis replays a case's draws and refuses data generation that varies).
    def plausible(draw: Callable[[st.SearchStrategy[Any]], Any], ran: Any) -> dict[str, Any]:
        batch, gamma = ran.context.batch_size, ran.gamma
        drafted = max(0, batch * gamma)
        accepted = draw(st.integers(0, 1 << 20)) % (drafted + 1)
        return {
            "decision_id": ran.decision_id,
            "engine_id": ran.context.engine_id,
            "gamma": gamma,
            "step_seconds": draw(st.floats(0.001, 1.0)),
            "generated_tokens": max(1, batch) + accepted,
            "drafted_tokens": drafted,
            "accepted_tokens": accepted,
        }

    def build(draw: Callable[[st.SearchStrategy[Any]], Any]) -> policy_pb2.StepRequest:
        table = issued.recent_table(draw(st.integers(0, 1 << 16)))
        request = policy_pb2.StepRequest(seq=draw(st.integers(0, 1 << 20)))
        # Numbered as a client numbers them: a table serves steps 1..valid_steps (the
        # sidecar refuses others); a number drawn again is a replay, skipped.
        steps = draw(st.integers(1, 4))
        first = draw(st.integers(1, TableOptions().valid_steps - steps + 1))
        for k in range(steps):
            ran = table.ran_step(first + k, k)
            request.ran_steps.append(ran)
            if draw(st.integers(0, 3)):  # three in four report the outcome with the step
                fields = plausible(draw, ran)
                if not draw(st.integers(0, 3)):
                    fields = draw(mutated(st.just(fields), outcome_fields, named))
                request.outcomes.add(**fields)
        if draw(st.booleans()):  # and ask for a table for the next step
            request.context.CopyFrom(table.context)
            ctx = table.context
            request.context.step_index = min(ctx.step_index + steps, INT64[1])
            batch = ctx.batch_size + draw(st.integers(-2, 2))
            request.context.batch_size = min(max(1, batch), INT64[1])
        return request

    return st.composite(lambda draw: build(draw))()


def byte_variants(messages: list[bytes], count: int, variant_seed: int) -> list[bytes]:
    """``count`` variants of each message's bytes: random bytes, or the message with up
    to four bytes flipped, inserted, or the rest cut off."""
    rng = random.Random(variant_seed)
    variants = []
    for data in messages:
        for _ in range(count):
            if rng.random() < 0.25:
                variants.append(rng.randbytes(rng.randint(0, 512)))
                continue
            buf = bytearray(data)
            for _ in range(rng.randint(1, 4)):
                at = rng.randint(0, len(buf))
                kind = rng.randrange(3)
                if kind == 0 and buf:
                    buf[min(at, len(buf) - 1)] = rng.randrange(256)
                elif kind == 1:
                    buf.insert(at, rng.randrange(256))
                else:
                    del buf[at:]
            variants.append(bytes(buf))
    return variants
