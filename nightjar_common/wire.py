"""Conversions between nightjar.v1 messages and the plain types of nightjar_common.types.

Used by the server and by the client, so both read the contract the same way.
"""

from __future__ import annotations

import functools

from nightjar_proto.v1 import policy_pb2 as pb

from nightjar_common.errors import InvalidArgumentError
from nightjar_common.types import (
    BinType,
    EngineRuntime,
    GammaTable,
    MemoryDirective,
    RanStep,
    RequestSignals,
    StepContext,
    StepOutcome,
)

_ACTIONS = {
    "": pb.MemoryDirective.ACTION_UNSPECIFIED,
    "offload_draft_expand_kv": pb.MemoryDirective.OFFLOAD_DRAFT_EXPAND_KV,
    "compact_kv_reload_draft": pb.MemoryDirective.COMPACT_KV_RELOAD_DRAFT,
}
_ACTION_NAMES = {v: k for k, v in _ACTIONS.items()}
# GammaTable.reason values: the bin types a whole table can have.
_TABLE_REASONS = (BinType.FIXED.value, BinType.FORCED.value)


def context_from_pb(msg: pb.StepContext) -> StepContext:
    return StepContext(
        engine_id=msg.engine_id,
        step_index=msg.step_index,
        batch_size=msg.batch_size,
        num_waiting=msg.num_waiting,
        free_kv_blocks=msg.free_kv_blocks,
        total_kv_blocks=msg.total_kv_blocks,
        max_draft_lag_tokens=msg.max_draft_lag_tokens,
        draft_resident=msg.draft_resident,
        previous_gamma=msg.previous_gamma if msg.HasField("previous_gamma") else None,
        max_gamma=msg.max_gamma,
        learner_key=msg.learner_key,
        context_tokens=msg.context_tokens,
        min_draft_passes=msg.min_draft_passes,
        runtime=runtime_from_pb(msg.runtime) if msg.HasField("runtime") else None,
        requests=tuple(
            RequestSignals(
                request_id=r.request_id,
                context_tokens=r.context_tokens,
                recent_accepts=tuple(r.recent_accepts),
                kl_divergence=r.kl_divergence if r.HasField("kl_divergence") else None,
                draft_entropy=r.draft_entropy if r.HasField("draft_entropy") else None,
            )
            for r in msg.requests
        ),
    )


def runtime_from_pb(msg: pb.EngineRuntime) -> EngineRuntime:
    return EngineRuntime(
        engine_version=msg.engine_version,
        model_runner=msg.model_runner,
        async_scheduling=msg.async_scheduling,
        method=msg.method,
    )


@functools.lru_cache(maxsize=64)
def runtime_to_pb(runtime: EngineRuntime) -> pb.EngineRuntime:
    """Built once per runtime (it is constant over an engine's life and goes with every
    context); callers copy from it and never change it."""
    return pb.EngineRuntime(
        engine_version=runtime.engine_version,
        model_runner=runtime.model_runner,
        async_scheduling=runtime.async_scheduling,
        method=runtime.method,
    )


def context_to_pb(ctx: StepContext) -> pb.StepContext:
    msg = pb.StepContext(
        engine_id=ctx.engine_id,
        step_index=ctx.step_index,
        batch_size=ctx.batch_size,
        num_waiting=ctx.num_waiting,
        free_kv_blocks=ctx.free_kv_blocks,
        total_kv_blocks=ctx.total_kv_blocks,
        max_draft_lag_tokens=ctx.max_draft_lag_tokens,
        draft_resident=ctx.draft_resident,
        max_gamma=ctx.max_gamma,
        learner_key=ctx.learner_key,
        context_tokens=ctx.context_tokens,
        min_draft_passes=ctx.min_draft_passes,
    )
    if ctx.previous_gamma is not None:
        msg.previous_gamma = ctx.previous_gamma
    if ctx.runtime is not None:
        msg.runtime.CopyFrom(runtime_to_pb(ctx.runtime))
    for r in ctx.requests:
        req = msg.requests.add(
            request_id=r.request_id,
            context_tokens=r.context_tokens,
            recent_accepts=list(r.recent_accepts),
        )
        if r.kl_divergence is not None:
            req.kl_divergence = r.kl_divergence
        if r.draft_entropy is not None:
            req.draft_entropy = r.draft_entropy
    return msg


def outcome_from_pb(msg: pb.StepOutcome) -> StepOutcome:
    if msg.requests and msg.request_accepted_tokens:
        raise InvalidArgumentError(
            "per-request accepts given twice: set StepOutcome.request_accepted_tokens "
            "or StepOutcome.requests, not both"
        )
    accepts = msg.request_accepted_tokens or [r.accepted_tokens for r in msg.requests]
    return StepOutcome(
        decision_id=msg.decision_id,
        engine_id=msg.engine_id,
        gamma=msg.gamma,
        step_seconds=msg.step_seconds,
        generated_tokens=msg.generated_tokens,
        drafted_tokens=msg.drafted_tokens,
        accepted_tokens=msg.accepted_tokens,
        request_accepts=tuple(accepts),
        prefill_tokens=msg.prefill_tokens,
        draft_gamma=msg.draft_gamma if msg.HasField("draft_gamma") else None,
        request_ids=tuple(r.request_id for r in msg.requests),
    )


def outcome_to_pb(outcome: StepOutcome) -> pb.StepOutcome:
    msg = pb.StepOutcome(
        decision_id=outcome.decision_id,
        engine_id=outcome.engine_id,
        gamma=outcome.gamma,
        step_seconds=outcome.step_seconds,
        generated_tokens=outcome.generated_tokens,
        drafted_tokens=outcome.drafted_tokens,
        accepted_tokens=outcome.accepted_tokens,
        prefill_tokens=outcome.prefill_tokens,
        draft_gamma=outcome.draft_gamma,
    )
    if outcome.request_ids:  # labelled, for a policy that reads per-request signals
        for request_id, accepted in zip(outcome.request_ids, outcome.request_accepts, strict=True):
            msg.requests.add(request_id=request_id, accepted_tokens=accepted)
    else:
        # Packed ints: one RequestAccepts submessage per request of the batch costs far
        # more to build (docs/VLLM_PLUGIN.md, "What an outcome carries").
        msg.request_accepted_tokens.extend(outcome.request_accepts)
    return msg


def directive_to_pb(directive: MemoryDirective) -> pb.MemoryDirective:
    return pb.MemoryDirective(
        action=_ACTIONS[directive.action],
        target_kv_blocks=directive.target_kv_blocks,
        reason=directive.reason,
    )


def directive_from_pb(msg: pb.MemoryDirective) -> MemoryDirective:
    return MemoryDirective(_ACTION_NAMES.get(msg.action, ""), msg.target_kv_blocks, msg.reason)


def table_to_pb(table: GammaTable) -> pb.GammaTable:
    msg = pb.GammaTable(
        table_id=table.table_id,
        policy_name=table.policy_name,
        policy_version=table.policy_version,
        first_batch_size=table.first_batch_size,
        gammas=table.gammas,
        exploring=table.exploring,
        speculation_off=table.speculation_off,
        step_index=table.step_index,
        valid_steps=table.valid_steps,
        valid_ms=table.valid_ms,
        reason=table.reason.value if table.reason is not None else "",
        request_gammas=[pb.RequestGamma(request_id=r, gamma=g) for r, g in table.request_gammas],
        reads_request_signals=table.reads_request_signals,
        any_speculation_state=table.any_speculation_state,
        exploit_gammas=table.exploit_gammas,
    )
    if table.memory_directive.action:
        msg.memory_directive.CopyFrom(directive_to_pb(table.memory_directive))
    return msg


def table_from_pb(msg: pb.GammaTable) -> GammaTable:
    directive = MemoryDirective()
    if msg.HasField("memory_directive"):
        directive = directive_from_pb(msg.memory_directive)
    return GammaTable(
        table_id=msg.table_id,
        policy_name=msg.policy_name,
        policy_version=msg.policy_version,
        first_batch_size=msg.first_batch_size,
        gammas=tuple(msg.gammas),
        exploring=tuple(msg.exploring),
        speculation_off=msg.speculation_off,
        step_index=msg.step_index,
        valid_steps=msg.valid_steps,
        valid_ms=msg.valid_ms,
        memory_directive=directive,
        reason=BinType(msg.reason) if msg.reason in _TABLE_REASONS else None,
        request_gammas=tuple((r.request_id, r.gamma) for r in msg.request_gammas),
        reads_request_signals=msg.reads_request_signals,
        any_speculation_state=msg.any_speculation_state,
        exploit_gammas=tuple(msg.exploit_gammas),
    )


def ran_step_to_pb(step: RanStep) -> pb.RanStep:
    return pb.RanStep(
        decision_id=step.decision_id,
        context=context_to_pb(step.context),
        gamma=step.gamma,
        exploited=step.exploited,
    )


def ran_step_from_pb(msg: pb.RanStep) -> RanStep:
    return RanStep(msg.decision_id, context_from_pb(msg.context), msg.gamma, msg.exploited)
