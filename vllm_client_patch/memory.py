"""Wires the memory agent into vLLM: the worker half into the model runner, the pool half
and the operators' gRPC service into the scheduler.

The worker builds the agent once its KV cache exists (``initialize_kv_cache``: the draft's
bytes and the buffer's block size are known then) and publishes it for the scheduler,
which vLLM constructs afterwards in the same engine-core process. Orders travel to the
worker on the step's ``SchedulerOutput`` (attribute :data:`ORDER_ATTR`) and run at the top
of ``execute_model``, before anything of the step touches the KV cache or the draft.

Only vLLM's in-process (uniproc) executor is supported — the default with one GPU per
engine and on CPU: with worker processes (tensor parallel) the agent's state would have
to come back over the executor's RPC, which is not built; the scheduler then leaves the
agent off and says so.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch

from memory_agent.agent import MemoryAgent
from memory_agent.draft_weights import DraftState, DraftWeights
from memory_agent.elastic_draft import ElasticDraft
from memory_agent.metrics import AgentMetrics
from memory_agent.orders import Action, Order, WorkerOrder
from memory_agent.vmm import ElasticMemory
from nightjar_common.types import EngineRuntime, MemoryDirective
from vllm_client_patch import kv_vmm
from vllm_client_patch.config import PluginConfig
from vllm_client_patch.kv_pool import ElasticBlockPool
from vllm_client_patch.metrics import file_backed
from vllm_client_patch.worker_memory import RunnerMemory, draft_weights, slot_bytes

log = logging.getLogger(__name__)

ORDER_ATTR = "nightjar_memory_order"
_DIRECTIVE_ACTIONS = {
    "offload_draft_expand_kv": Action.OFFLOAD_DRAFT,
    "compact_kv_reload_draft": Action.RELOAD_DRAFT,
}


class _Published:
    """The agent built by this process's worker, awaiting the scheduler."""

    agent: MemoryAgent | None = None
    runner_memory: RunnerMemory | None = None
    # The runner whose KV buffer was sized with room for its draft (slot_bytes).
    slot_runner: Any = None


def published_agent() -> MemoryAgent | None:
    return _Published.agent


def published_runner_memory() -> RunnerMemory | None:
    """The worker's side of the agent (draft weights, KV buffers), for tests and benches."""
    return _Published.runner_memory


def install_worker_hooks() -> None:
    """Patch vLLM's workers and model runner (idempotent; CPUModelRunner inherits the
    runner's methods, CPUWorker sizes its KV cache its own way)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner.execute_model, "__nightjar__", False):
        return
    initialize, execute = GPUModelRunner.initialize_kv_cache, GPUModelRunner.execute_model

    def initialize_kv_cache(
        self: Any,
        kv_cache_config: Any,
        is_profiling: bool = False,
        kv_cache_allocation_context: AbstractContextManager[Any] | None = None,
    ) -> Any:
        if is_profiling or not PluginConfig.load().memory_agent:
            return initialize(self, kv_cache_config, is_profiling, kv_cache_allocation_context)
        elastic = ElasticSetup.prepare(self, kv_cache_config)
        evicted = _evict_draft(self) if elastic is None else None
        context = kv_cache_allocation_context
        if elastic is not None:
            context = _chained(context, elastic.allocation)
        result = initialize(self, kv_cache_config, False, context)
        try:
            _attach(self, evicted, elastic.finish(self) if elastic is not None else None)
        except Exception:  # an engine we cannot manage still serves, without the agent
            _Published.agent = _Published.runner_memory = None
            weights = evicted or (elastic.weights if elastic is not None else None)
            if weights is not None and weights.state is DraftState.OFFLOADED:
                weights.restore()
            log.exception("nightjar memory: agent off: cannot manage this engine's memory")
        return result

    for worker_class in _worker_classes():
        _size_for_draft(worker_class)

    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        agent, memory = _Published.agent, _Published.runner_memory
        if agent is not None and memory is not None and memory.runner is self:
            # Never raises: a failed order is undone and fails (agent.py), the step runs.
            memory.step_output = scheduler_output
            try:
                agent.worker_step(memory, getattr(scheduler_output, ORDER_ATTR, None))
            finally:
                memory.step_output = None
        return execute(self, scheduler_output, *args, **kwargs)

    patched: Any
    for patched, stock in ((initialize_kv_cache, initialize), (execute_model, execute)):
        patched.__nightjar__ = True
        patched.__wrapped__ = stock  # inspect.unwrap finds vLLM's own
    GPUModelRunner.initialize_kv_cache = initialize_kv_cache
    GPUModelRunner.execute_model = execute_model


def _worker_classes() -> tuple[type, ...]:
    """The worker classes of this platform. vLLM's CPU worker module replaces torch's CUDA
    streams, events and memory queries with CPU stand-ins when imported (its
    ``cpu/shm.py``): it is imported on a CPU platform only, or it would break a GPU engine."""
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu_worker import Worker

    if not current_platform.is_cpu():
        return (Worker,)
    from vllm.v1.worker.cpu_worker import CPUWorker

    return (Worker, CPUWorker)


@contextlib.contextmanager
def _chained(
    outer: AbstractContextManager[Any] | None, inner: AbstractContextManager[Any]
) -> Iterator[None]:
    with outer if outer is not None else contextlib.nullcontext(), inner:
        yield


def _vmm_wanted(runner: Any) -> bool:
    """Whether this engine's KV cache and draft go in virtual memory (NIGHTJAR_MEMORY_VMM:
    auto on CUDA engines that can, on for CPU engines too)."""
    mode = PluginConfig.load().memory_vmm
    if mode == "off" or (mode == "auto" and runner.device.type != "cuda"):
        return False
    why = kv_vmm.available(runner.device)
    if why:
        log.warning("nightjar memory: the KV cache stays out of virtual memory: %s", why)
    return not why and draft_weights(runner) is not None


class ElasticSetup:
    """The draft evicted to the host while vLLM allocates its KV buffer in an elastic
    memory (created by the allocation itself); :meth:`finish` settles the draft there."""

    def __init__(self, weights: DraftWeights, allocation: kv_vmm.KVAllocation) -> None:
        self.weights = weights
        self.allocation = allocation

    @classmethod
    def prepare(cls, runner: Any, kv_cache_config: Any) -> ElasticSetup | None:
        if not _vmm_wanted(runner):
            return None
        weights = draft_weights(runner)
        assert weights is not None
        driver = kv_vmm.make_driver(runner.device)
        plan = kv_vmm.plan_for(kv_cache_config, weights, driver)
        if plan is None:
            log.warning(
                "nightjar memory: the KV cache stays out of virtual memory: its placement is "
                "not covered or the draft is too small to free a granule in every layer"
            )
            return None
        weights.offload()
        if runner.device.type == "cuda":
            torch.cuda.empty_cache()
        size = kv_cache_config.kv_cache_tensors[0].size
        return cls(weights, kv_vmm.KVAllocation(size, lambda: ElasticMemory(driver, plan)))

    def finish(self, runner: Any) -> ElasticDraft:
        memory = self.allocation.memory
        if memory is None or not kv_vmm.inside(memory, list(runner.kv_caches)):
            if memory is not None:
                memory.close()  # vLLM kept a buffer of its own: nothing views this one
            raise RuntimeError("vLLM did not allocate its KV cache in the elastic memory")
        return ElasticDraft(self.weights, memory)


def _size_for_draft(worker_class: type) -> None:
    """vLLM sizes the KV buffer from the memory its worker reports: report the draft's
    share too, so the buffer can take the draft's weights in its top blocks (draft slot)
    or the draft's memory under them (virtual memory)."""
    determine = vars(worker_class).get("determine_available_memory")
    if determine is None or getattr(determine, "__nightjar__", False):
        return  # inherited (its base is patched) or patched already

    def determine_available_memory(self: Any) -> int:
        available: int = determine(self)
        runner = self.model_runner
        if PluginConfig.load().memory_agent and _vmm_wanted(runner):
            weights = draft_weights(runner)
            assert weights is not None
            pages = [spec.page_size_bytes for spec in runner.get_kv_cache_spec().values()]
            granule = kv_vmm.make_driver(runner.device).granularity
            gained = kv_vmm.sizing_bytes(weights, pages, available, granule)
            _Published.slot_runner = None
            log.info(
                "nightjar memory: KV cache sized %d MiB larger: the draft's memory will "
                "back its top blocks while the draft is offloaded",
                gained >> 20,
            )
            return available + gained
        extra = slot_bytes(runner) if PluginConfig.load().memory_agent else None
        _Published.slot_runner = self.model_runner if extra is not None else None
        if extra is None:
            return available
        log.info(
            "nightjar memory: KV cache sized %d MiB larger: the draft's weights will "
            "live in its top blocks",
            extra >> 20,
        )
        return available + extra

    determine_available_memory.__nightjar__ = True  # type: ignore[attr-defined]
    determine_available_memory.__wrapped__ = determine  # type: ignore[attr-defined]
    worker_class.determine_available_memory = determine_available_memory  # type: ignore[attr-defined]


def _evict_draft(runner: Any) -> DraftWeights | None:
    """Before the KV buffer is allocated: offload the draft whose memory was counted in
    it, and release that memory (it will live in the buffer's top blocks)."""
    if _Published.slot_runner is not runner:
        return None
    weights = draft_weights(runner)
    if weights is None:
        return None
    weights.offload()
    if runner.device.type == "cuda":
        torch.cuda.empty_cache()
    return weights


def _attach(runner: Any, evicted: DraftWeights | None, elastic: ElasticDraft | None) -> None:
    memory = RunnerMemory(runner, evicted, elastic)
    agent = MemoryAgent(
        memory.num_blocks,
        memory.block_bytes,
        memory.draft_bytes,
        compaction_supported=memory.can_compact,
        offload_blocker=memory.offload_blocker,
        draft_blocks=memory.slot_blocks,
    )
    if memory.offload_blocker:
        log.warning("nightjar memory: draft offload off: %s", memory.offload_blocker)
    if memory.weights is not None:
        memory.guard_drafter(lambda: agent.draft_resident)
    _Published.agent, _Published.runner_memory = agent, memory
    log.info(
        "nightjar memory: agent ready: KV buffer %d blocks of %d KiB, draft %d KiB = %d "
        "blocks (%s), usable pool %d blocks",
        memory.num_blocks,
        memory.block_bytes >> 10,
        memory.draft_bytes >> 10,
        agent.draft_blocks,
        "its memory under the top blocks while offloaded: virtual memory"
        if elastic is not None
        else "in the buffer's top blocks"
        if memory.slot_blocks
        else "own memory",
        agent.kv_blocks,
    )


class SchedulerMemory:
    """The scheduler's side: the agent, its view of vLLM's pool, the operators' service."""

    def __init__(self, agent: MemoryAgent, kv_cache_manager: Any, config: PluginConfig) -> None:
        self.agent = agent
        agent.attach_metrics(file_backed(AgentMetrics))  # in vLLM's /metrics (metrics.py)
        self.pool = ElasticBlockPool(kv_cache_manager, agent.kv_blocks)
        self.server: Any = None
        if config.memory_socket:
            from memory_agent.service import serve
            from nightjar_common.admin_token import AdminTokenFile

            # Re-read when the file changes: a rotated token works without a restart.
            path = config.admin_token_file
            token = AdminTokenFile(path) if path else None
            self.server = serve(agent, config.memory_socket, token, config.memory_socket_mode)

    @classmethod
    def create(
        cls, config: PluginConfig, kv_cache_manager: Any, runtime: EngineRuntime
    ) -> SchedulerMemory | None:
        if not config.memory_agent:
            return None
        if runtime.model_runner == "v2":
            log.warning(
                "nightjar memory: agent off: vLLM's V2 model runner (its CUDA default since "
                "0.33) is not wired to the memory agent (draft offload/reload, KV growth and "
                "compaction); start the engine with VLLM_USE_V2_MODEL_RUNNER=0 to run it. "
                "γ per step and per request work on both runners"
            )
            return None
        agent = published_agent()
        if agent is None:
            log.warning(
                "nightjar memory: agent off: the model runner is not in this process "
                "(needs vLLM's uniproc executor and the V1 model runner)"
            )
            return None
        return cls(agent, kv_cache_manager, config)

    def begin_step(self) -> WorkerOrder | None:
        return self.agent.begin_step(self.pool)

    def offer(self, directive: MemoryDirective) -> None:
        """A directive from the sidecar: the agent carries it out at a coming boundary."""
        action = _DIRECTIVE_ACTIONS.get(directive.action)
        if action is not None:
            self.agent.offer_directive(Order(action, source="sidecar", reason=directive.reason))

    def close(self) -> None:
        if self.server is not None:
            self.server.stop(grace=1).wait()
            self.server = None
