"""vLLM scheduler subclasses that take the step's γ from the Nightjar sidecar.

Select one with ``--scheduler-cls vllm_client_patch.scheduler.NightjarScheduler`` (or
``NightjarAsyncScheduler`` with async scheduling), or let the plugin install it
(plugin.py). With the plugin off (no NIGHTJAR_SIDECAR) they behave exactly as vLLM's.

The hook is the dynamic speculative decoding path of vLLM ≥ 0.32. ``schedule()`` builds
the step's ``SchedulerOutput`` with ``num_spec_tokens_to_schedule`` taken from the
dynamic-SD table and, as its last act, calls ``_update_after_schedule``. We overwrite the
number there: the batch is then fully known, so γ is decided for the requests that
actually draft after this step (those that sample in it: decodes and prefills that
complete; partial prefill chunks draft nothing), and vLLM's async scheduler still reads
our γ for its placeholders. The dynamic-SD table must be configured: it is what switches
vLLM's per-step-γ code paths on (no uniform-decode padding, piecewise CUDA graphs).

KV look-ahead: the step's blocks were allocated earlier in ``schedule()`` with vLLM's
look-ahead of Γmax slots per request, before the batch (and so γ) is known. Γmax ≥ γ
always covers the drafts; the surplus is at most Γmax slots per request, consumed by its
next tokens anyway. Shrinking it to γ would need γ before the batch is known.

Reporting happens in ``update_from_output``.

Memory agent (NIGHTJAR_MEMORY_AGENT, memory.py): its orders run at the top of
``schedule()``, before any block is allocated, and ride to the worker on the step's
``SchedulerOutput``; while the draft is not resident γ is 0 whatever the sidecar or the
fallback table says, and the step contexts carry the agent's pool size and draft state.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput

from nightjar_common.validation import MAX_ID_LENGTH
from vllm_client_patch.config import PluginConfig
from vllm_client_patch.controller import GammaController, HookTime
from vllm_client_patch.memory import ORDER_ATTR, SchedulerMemory
from vllm_client_patch.metrics import PluginMetrics
from vllm_client_patch.release import SUPPORTED, vllm_release
from vllm_client_patch.runtime import describe, request_gammas_note
from vllm_client_patch.step_journal import EngineView, VerifiedStep

log = logging.getLogger(__name__)


def default_learner_key(vllm_config: Any) -> str:
    """``<model>@<device>``, plus ``;tp=N`` and ``;draft=<name>`` when they apply: what the
    goodput of a γ depends on, stable across pod restarts (unlike the engine id). The
    model is the served model name's last path part (a path or a Hugging Face id)."""
    from vllm.platforms import current_platform

    model_config = vllm_config.model_config
    served = model_config.served_model_name or model_config.model
    model = _basename(served[0] if isinstance(served, list | tuple) else served)
    try:
        device = current_platform.get_device_name()  # NVML on NVIDIA: no CUDA context
    except Exception:  # a platform without it: its kind ("cuda", "cpu", ...)
        device = str(current_platform.device_name)
    key = f"{model}@{device}"
    tensor_parallel = vllm_config.parallel_config.tensor_parallel_size
    if tensor_parallel > 1:
        key += f";tp={tensor_parallel}"
    spec = vllm_config.speculative_config
    if spec is not None:
        # MTP's draft is the target's own layers (vLLM names the target as its model).
        own = not spec.model or spec.model == model_config.model
        key += f";draft={spec.method if own else _basename(spec.model)}"
    return key[:MAX_ID_LENGTH]


def _basename(name: str) -> str:
    return str(name).rstrip("/").rsplit("/", 1)[-1] or str(name)


@dataclasses.dataclass(slots=True)
class BatchShape:
    """The scheduled step as the policy sees it."""

    # Requests that sample in the step, hence draft after it (the batch size B).
    drafting: int
    # Tokens in their contexts after the step (the KV their attention reads).
    context_tokens: int
    # Prompt tokens computed in the step (prefill chunks, also of completing prefills).
    prefill_tokens: int
    # The drafting requests' ids, when asked for.
    request_ids: tuple[str, ...] = ()


def batch_shape(
    output: SchedulerOutput, requests: Mapping[str, Any], with_ids: bool = False
) -> BatchShape:
    """Who drafts after this step, their context, and the prefill sharing the step
    (``with_ids``: naming them, for a policy that reads per-request signals).

    Called before ``_update_after_schedule`` advances ``num_computed_tokens``: the
    request samples when the scheduled tokens reach its end — vLLM's own
    ``is_prefill_chunk`` test, taken one step early. A decode has all but its last
    token computed; anything behind that is prefill.

    This runs on the engine's thread for every request of the step: the token count is
    read as the list's length (what vLLM's ``num_tokens`` property returns, without a
    Python call per request), and the tokens left are taken first, a small number
    (Python allocates no object for it).
    """
    batch = output.num_scheduled_tokens
    computed_tokens = prefill = chunk_tokens = 0
    # Requests that do not sample (partial prefill chunks, the rare ones): the rest draft.
    chunks: list[str] = []
    for req_id, scheduled in batch.items():
        request = requests[req_id]
        computed = request.num_computed_tokens
        left = len(request._all_token_ids) - computed + request.num_output_placeholders
        if left > 1:
            prefill += scheduled
        if scheduled < left:
            chunks.append(req_id)
            chunk_tokens += scheduled
            continue
        computed_tokens += computed
    # The drafting requests' scheduled tokens summed at once (sum() runs in C).
    context = computed_tokens + sum(batch.values()) - chunk_tokens
    ids = _drafting_ids(batch, chunks) if with_ids else ()
    return BatchShape(len(batch) - len(chunks), context, prefill, ids)


def _drafting_ids(batch: Mapping[str, int], chunks: list[str]) -> tuple[str, ...]:
    """The batch's requests but ``chunks``, in the batch's order."""
    if not chunks:
        return tuple(batch)
    skipped = set(chunks)
    return tuple(req_id for req_id in batch if req_id not in skipped)


def verified_step(
    output: SchedulerOutput,
    result: ModelRunnerOutput,
    requests: Mapping[str, Any],
    with_ids: bool = False,
    finished_kept: bool = False,
) -> VerifiedStep:
    """Drafted / accepted / generated tokens of a finished step, counted as vLLM counts
    them in ``update_from_output`` (call it before vLLM's, which drops finished requests):
    requests aborted meanwhile are skipped, grammar-invalidated drafts are not drafts.
    ``with_ids``: the per-request counts name their requests. ``finished_kept``: a
    request aborted meanwhile may still be among ``requests`` (vLLM keeps those whose KV
    a connector still transfers: ``delay_free_blocks``); else an aborted request is gone.

    This runs on the engine's thread for every request of the step, after a forward pass
    that evicted the CPU caches: one pass over the output's lists, reading a request
    object only where an aborted one may be kept (a status read from each cold request
    object cost as much as the rest; docs/BENCHMARKS.md)."""
    sampled = result.sampled_token_ids
    if not sampled:
        return VerifiedStep(0, 0, 0)
    drafted = generated = 0
    accepts: list[int] = []
    ids: list[str] = []  # appending costs less than asking whether to, per request
    index_of = result.req_id_to_index
    request_of = requests.get
    drafts_of = output.scheduled_spec_decode_tokens.get
    invalid = output.num_invalid_spec_tokens
    for req_id in output.num_scheduled_tokens:
        try:  # a subscript, not a call of get(): a request left out of the result is rare
            tokens = len(sampled[index_of[req_id]])
        except KeyError:
            continue
        if finished_kept:
            request = request_of(req_id)
            if request is None or request.is_finished():
                continue
        elif req_id not in requests:
            continue
        generated += tokens
        drafts = drafts_of(req_id)
        if drafts and tokens:
            drafts_valid = len(drafts) - invalid.get(req_id, 0) if invalid else len(drafts)
            # Not min(): a call with an argument tuple, per request; a comparison is none.
            taken = tokens - 1 if tokens <= drafts_valid else drafts_valid
            drafted += drafts_valid
            accepts.append(taken)
            ids.append(req_id)
    accepted = sum(accepts)  # in C, not a Python addition per request
    return VerifiedStep(
        drafted, accepted, generated, tuple(accepts), tuple(ids) if with_ids else ()
    )


def cut_drafts(requests: Mapping[str, Any], limits: Mapping[str, int]) -> tuple[int, int]:
    """Cut each named request's drafts or draft slots (``spec_token_ids``) to its limit;
    the requests and drafts cut. Fewer drafts verify the same tokens: lossless. A new list
    each time: vLLM's async scheduler gives every request the same placeholder list."""
    cut_requests = cut_tokens = 0
    for request_id, limit in limits.items():
        request = requests.get(request_id)
        if request is None:
            continue
        drafts = request.spec_token_ids
        if drafts and len(drafts) > limit:
            cut_requests += 1
            cut_tokens += len(drafts) - limit
            request.spec_token_ids = drafts[:limit]
    return cut_requests, cut_tokens


class _NightjarMixin:
    """The hook, for vLLM's Scheduler and AsyncScheduler alike (listed first in the bases)."""

    _nightjar: GammaController | None = None
    _memory: SchedulerMemory | None = None
    # Per-request γ below the step's, by request id: applied where the drafts arrive.
    _draft_limits: Mapping[str, int] = {}
    # Draft passes a step runs whatever its γ (runtime.py): vLLM's model drafters run
    # their first pass at γ = 0 too, the V2 runner's draft model drafts Γmax always
    # (docs/POLICIES.md, "Step time is one smooth function").
    _min_draft_passes: int = 0
    # Whether the next step's draft slots are set here, before the drafts exist (vLLM's
    # async scheduling): per-request γ then shortens the slots themselves.
    _slots_before_drafts: bool = False
    # Whether a request aborted during a step may still be in self.requests at its update
    # (a KV or encoder-cache connector delays freeing it): verified_step then reads statuses.
    _finished_kept: bool = False

    @property
    def nightjar(self) -> GammaController | None:
        """The engine's Nightjar controller (None when the plugin is off)."""
        return self._nightjar

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._install_nightjar()

    def schedule(self: Any, *args: Any, **kwargs: Any) -> SchedulerOutput:
        # A step boundary: nothing of the coming step is allocated yet.
        order = self._memory.begin_step() if self._memory is not None else None
        output: SchedulerOutput = super().schedule(*args, **kwargs)  # type: ignore[misc]
        if order is not None:
            setattr(output, ORDER_ATTR, order)  # the worker runs it before the forward
        return output

    def _update_after_schedule(self: Any, scheduler_output: SchedulerOutput) -> None:
        if self._nightjar is not None and scheduler_output.num_scheduled_tokens:
            started = HookTime.now()
            nightjar = self._nightjar
            shape = batch_shape(scheduler_output, self.requests, nightjar.wants_request_ids)
            # No request samples (only partial prefill chunks): nothing drafts, nothing
            # to decide; the controller then forgets the decision this step would verify.
            gamma = nightjar.decide(self._engine_view(shape), started) if shape.drafting else 0
            # A per-request policy's γ below the step's: those drafts are cut to it.
            self._draft_limits = nightjar.request_gammas() if gamma else {}
            if self._memory is not None:
                for directive in self._nightjar.memory_directives():
                    self._memory.offer(directive)
            scheduler_output.num_spec_tokens_to_schedule = gamma
        super()._update_after_schedule(scheduler_output)  # type: ignore[misc]
        if self._slots_before_drafts and self._draft_limits and self._nightjar is not None:
            # vLLM's async scheduler just gave every request the step's γ draft slots (one
            # shared placeholder list): a request with a smaller γ verifies fewer.
            self._nightjar.truncated(*cut_drafts(self.requests, self._draft_limits))

    def update_draft_token_ids(self: Any, draft_token_ids: Any) -> None:
        """Synchronous engines: the drafts arrive here, after the step; cut each to its
        request's γ before the next step schedules them."""
        super().update_draft_token_ids(draft_token_ids)  # type: ignore[misc]
        limits, self._draft_limits = self._draft_limits, {}
        if limits and self._nightjar is not None:
            self._nightjar.truncated(*cut_drafts(self.requests, limits))

    def update_from_output(
        self: Any, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> Any:
        if self._nightjar is None:
            return super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        started = HookTime.now()
        verified = verified_step(
            scheduler_output,
            model_runner_output,
            self.requests,
            self._nightjar.wants_request_ids,
            self._finished_kept,
        )
        hook = started.elapsed()
        outputs = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        self._nightjar.end_step(verified, hook)  # vLLM's own update is not hook time
        if not self.running:
            self._nightjar.idle()
        return outputs

    def shutdown(self: Any) -> None:
        if self._memory is not None:
            self._memory.close()
            self._memory = None
        if self._nightjar is not None:
            self._nightjar.close()
            self._nightjar = None
        super().shutdown()  # type: ignore[misc]

    def _install_nightjar(self: Any) -> None:
        config = PluginConfig.load()
        if not config.active:
            return
        if not config.learner_key:
            config = dataclasses.replace(config, learner_key=default_learner_key(self.vllm_config))
        if vllm_release() not in SUPPORTED:  # also when selected with --scheduler-cls
            log.warning("nightjar: plugin idle: vLLM release not in %s", SUPPORTED)
            return
        spec = self.vllm_config.speculative_config
        table = spec.num_speculative_tokens_per_batch_size if spec is not None else None
        if not self.num_spec_tokens or not table:
            # Without the dynamic-SD table vLLM pads decodes to Γmax and captures CUDA
            # graphs for Γmax only: a per-step γ is not safe there. Stay stock vLLM.
            log.warning(
                "nightjar: plugin idle: needs speculative decoding with "
                "speculative_config.num_speculative_tokens_per_batch_size set"
            )
            return
        speculation = describe(self.vllm_config)
        self._min_draft_passes = speculation.min_draft_passes
        self._slots_before_drafts = isinstance(self, AsyncScheduler)
        connectors = (getattr(self, name, None) for name in ("connector", "ec_connector"))
        self._finished_kept = any(c is not None for c in connectors)
        self._nightjar = GammaController(
            config,
            tuple(tuple(row) for row in table),
            metrics=PluginMetrics.create(),
            runtime=speculation.runtime,
        )
        self._memory = SchedulerMemory.create(config, self.kv_cache_manager, speculation.runtime)
        runtime = speculation.runtime
        log.info(
            "nightjar: γ per step from %s (engine %s, learner key %r, Γmax %d, deadline %.1f "
            "ms; vLLM %s, %s runner, %s scheduling, %s: %d draft passes a step at least; %s)",
            config.sidecar,
            config.engine_id,
            config.learner_key,
            self.num_spec_tokens,
            config.deadline_ms,
            runtime.engine_version,
            runtime.model_runner,
            "async" if runtime.async_scheduling else "sync",
            runtime.method,
            speculation.min_draft_passes,
            request_gammas_note(runtime),
        )

    def _engine_view(self: Any, shape: BatchShape) -> EngineView:
        pool = self.kv_cache_manager.block_pool
        memory = self._memory
        resident = memory is None or memory.agent.draft_resident
        return EngineView(
            batch_size=shape.drafting,
            context_tokens=shape.context_tokens,
            prefill_tokens=shape.prefill_tokens,
            waiting=self.get_request_counts()[1],
            free_kv_blocks=pool.get_num_free_blocks(),
            # The usable pool (the memory agent resizes it); block 0 is vLLM's null block.
            total_kv_blocks=pool.num_gpu_blocks - 1,
            max_gamma=self.num_spec_tokens,
            draft_resident=resident,
            # An offloaded drafter does not run at all (memory.guard_drafter).
            min_draft_passes=self._min_draft_passes if resident else 0,
            request_ids=shape.request_ids,
        )


class NightjarScheduler(_NightjarMixin, Scheduler):  # type: ignore[misc]
    """vLLM's synchronous scheduler (the only one on CPU) with γ from the sidecar, and a
    per-request policy's γ per request: the drafter runs to the step's γ, then each
    request's drafts are cut to its own before the next step schedules them."""


class NightjarAsyncScheduler(_NightjarMixin, AsyncScheduler):  # type: ignore[misc]
    """vLLM's async scheduler (its GPU default) with γ from the sidecar. Step k+1 is
    scheduled before step k's update, so several decisions can be pending; the controller
    keeps them in order. The drafts stay on the device (vLLM never hands them to the
    scheduler): a per-request policy's γ shortens each request's draft slots instead, set
    as the step is scheduled, so the next step verifies only that many of the drafts."""
