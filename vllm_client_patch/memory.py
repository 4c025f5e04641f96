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

import logging
from typing import Any

from memory_agent.agent import Action, MemoryAgent, Order, WorkerOrder
from memory_agent.vllm_pool import ElasticBlockPool
from memory_agent.vllm_worker import RunnerMemory
from policy_server.types import MemoryDirective
from vllm_client_patch.config import PluginConfig

log = logging.getLogger(__name__)

ORDER_ATTR = "nightjar_memory_order"
_DIRECTIVE_ACTIONS = {"offload_draft_expand_kv": Action.OFFLOAD_DRAFT,
                      "compact_kv_reload_draft": Action.RELOAD_DRAFT}  # fmt: skip


class _Published:
    """The agent built by this process's worker, awaiting the scheduler."""

    agent: MemoryAgent | None = None
    runner_memory: RunnerMemory | None = None


def published_agent() -> MemoryAgent | None:
    return _Published.agent


def install_worker_hooks() -> None:
    """Patch vLLM's model runner (idempotent; CPUModelRunner inherits both methods)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner.execute_model, "__nightjar__", False):
        return
    initialize, execute = GPUModelRunner.initialize_kv_cache, GPUModelRunner.execute_model

    def initialize_kv_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = initialize(self, *args, **kwargs)
        if not kwargs.get("is_profiling", len(args) > 1 and args[1]):
            try:
                _attach(self)
            except Exception:  # an engine we cannot manage still serves, without the agent
                _Published.agent = _Published.runner_memory = None
                log.exception("nightjar memory: agent off: cannot manage this engine's memory")
        return result

    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        agent, memory = _Published.agent, _Published.runner_memory
        if agent is not None and memory is not None and memory.runner is self:
            agent.worker_step(memory, getattr(scheduler_output, ORDER_ATTR, None))
        return execute(self, scheduler_output, *args, **kwargs)

    for patched in (initialize_kv_cache, execute_model):
        patched.__nightjar__ = True  # type: ignore[attr-defined]
    GPUModelRunner.initialize_kv_cache = initialize_kv_cache
    GPUModelRunner.execute_model = execute_model


def _attach(runner: Any) -> None:
    if not PluginConfig.load().memory_agent:
        _Published.agent = _Published.runner_memory = None
        return
    memory = RunnerMemory(runner)
    agent = MemoryAgent(memory.num_blocks, memory.block_bytes, memory.draft_bytes,
                        compaction_supported=memory.can_compact,
                        offload_blocker=memory.offload_blocker)  # fmt: skip
    if memory.offload_blocker:
        log.warning("nightjar memory: draft offload off: %s", memory.offload_blocker)
    if memory.weights is not None:
        memory.guard_drafter(lambda: agent.draft_resident)
    _Published.agent, _Published.runner_memory = agent, memory
    log.info("nightjar memory: agent ready: KV buffer %d blocks of %d KiB, draft %d MiB = %d "
             "blocks, usable pool %d blocks", memory.num_blocks, memory.block_bytes >> 10,
             memory.draft_bytes >> 20, agent.draft_blocks, agent.kv_blocks)  # fmt: skip


class SchedulerMemory:
    """The scheduler's side: the agent, its view of vLLM's pool, the operators' service."""

    def __init__(self, agent: MemoryAgent, kv_cache_manager: Any, config: PluginConfig) -> None:
        self.agent = agent
        self.pool = ElasticBlockPool(kv_cache_manager, agent.kv_blocks)
        self.server: Any = None
        if config.memory_socket:
            from memory_agent.service import serve
            from policy_server.cli import read_token

            self.server = serve(agent, config.memory_socket, read_token(config.admin_token_file))

    @classmethod
    def create(cls, config: PluginConfig, kv_cache_manager: Any) -> SchedulerMemory | None:
        if not config.memory_agent:
            return None
        agent = published_agent()
        if agent is None:
            log.warning("nightjar memory: agent off: the model runner is not in this process "
                        "(needs vLLM's uniproc executor and the V1 model runner)")  # fmt: skip
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
