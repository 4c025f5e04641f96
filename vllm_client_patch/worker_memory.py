"""The memory agent's worker half inside vLLM's model runner (the agent's DraftDevice).

Holds the draft model's weights (:class:`DraftWeights`: every parameter and buffer the
draft module registers; on CUDA that is all of them, while vLLM's CPU backend moves
linear-layer weights into oneDNN/sgl-kernel handles PyTorch cannot reach, see
docs/MEMORY.md), the KV buffers behind the runner's per-layer cache views and the
runner's copies of the block tables (the persistent batch's table rows and each cached
request's block ids). While the draft is not resident the drafter is not called at all:
vLLM's draft-model and EAGLE proposers run a first forward pass even at γ = 0 (to keep
their KV in step), which would read the released weights.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from nightjar_kernels.kv_migrate import migrate

from memory_agent import draft_slot
from memory_agent.draft_weights import DraftWeights, ReloadError, Transfer
from memory_agent.elastic_draft import ElasticDraft
from memory_agent.kv_buffers import kv_buffers
from memory_agent.planner import Move

log = logging.getLogger(__name__)


def draft_module(runner: Any) -> torch.nn.Module | None:
    """The drafter's own model (draft model / EAGLE head), None for weightless methods."""
    model = getattr(getattr(runner, "drafter", None), "model", None)
    return model if isinstance(model, torch.nn.Module) else None


def draft_weights(runner: Any) -> DraftWeights | None:
    draft = draft_module(runner)
    return DraftWeights(draft, shared_with=runner.model) if draft is not None else None


def slot_bytes(runner: Any) -> int | None:
    """Bytes to add to the memory vLLM sizes its KV buffer with, so that the buffer can
    hold the draft's weights in its top blocks (draft_slot.py); None when the draft should
    keep its own memory. Whole blocks, never more than the draft's bytes: the draft's
    memory is released before the buffer is allocated, so nothing is over-committed."""
    weights = draft_weights(runner)
    if weights is None:
        return None
    sizes: list[int] = [t.numel() * t.element_size() for t in weights.movable_tensors().values()]
    pages: list[int] = [spec.page_size_bytes for spec in runner.get_kv_cache_spec().values()]
    draft, block = sum(sizes), sum(pages)
    if not draft or not block:
        return None
    limit = math.ceil(draft * (1 + draft_slot.MAX_WASTE) / block) + 1
    if draft_slot.blocks_needed(sizes, pages, limit) is None:
        log.warning(
            "nightjar memory: the draft's largest tensor (%d MiB) does not fit the pages of "
            "%d KV blocks in one layer: the draft keeps its own memory, and the agent "
            "withholds its share of the KV buffer instead (a block-outermost KV layout "
            "would hold it)",
            max(sizes) >> 20,
            limit,
        )
        return None
    return draft // block * block


def _graph_blocker(runner: Any) -> str:
    """Why the draft cannot be offloaded here ("" when it can). CUDA graphs keep the
    addresses of the weights they were captured with; reloaded weights live elsewhere.
    Weights in virtual memory (kv_vmm.py) keep theirs and are never blocked."""
    mode = getattr(getattr(runner, "compilation_config", None), "cudagraph_mode", None)
    uses_graphs = mode is not None and getattr(mode, "name", "NONE") != "NONE"
    if runner.device.type == "cuda" and uses_graphs:
        return (
            "the drafter runs under CUDA graphs, which keep its weights' addresses: "
            "start the engine with enforce_eager to offload the draft"
        )
    return ""


def unmove_step(output: Any, remap: Mapping[int, int]) -> None:
    """After a compaction's copies failed (the agent moves the scheduler's blocks back to
    their old ids at the next boundary): the block ids this step's scheduler output hands
    the worker name the old ids too. A moved block appears there under its new id only as
    a prefix-cache hit on it, or freed by a preemption and handed out again, in this step."""
    if output is None or not remap:
        return
    back = {new: old for old, new in remap.items()}

    def point_back(ids: list[int]) -> None:
        ids[:] = [back.get(block, block) for block in ids]

    for request in output.scheduled_new_reqs:
        for ids in request.block_ids:
            point_back(ids)
    for groups in output.scheduled_cached_reqs.new_block_ids:
        for ids in groups or ():
            point_back(ids)
    if output.new_block_ids_to_zero:
        point_back(output.new_block_ids_to_zero)
    if output.kv_cache_block_copies:
        output.kv_cache_block_copies = [
            copy._replace(
                src_block_id=back.get(copy.src_block_id, copy.src_block_id),
                dst_block_id=back.get(copy.dst_block_id, copy.dst_block_id),
            )
            for copy in output.kv_cache_block_copies
        ]


class RunnerMemory:
    def __init__(
        self, runner: Any, evicted: DraftWeights | None = None, elastic: ElasticDraft | None = None
    ) -> None:
        """``evicted``: the draft's weights, offloaded before the KV buffer was allocated
        with room for them (:func:`slot_bytes`); they are settled in its top blocks.
        ``elastic``: the draft and the KV buffer in virtual memory (kv_vmm.py) instead."""
        self.runner = runner
        self.elastic = elastic
        # The scheduler's output of the step being run (the execute_model hook sets it):
        # the block ids it hands the worker, which a failed compaction points back.
        self.step_output: Any = None
        self.weights = elastic.weights if elastic is not None else evicted or draft_weights(runner)
        self.buffers = kv_buffers(list(runner.kv_caches))
        config = runner.kv_cache_config
        self.num_blocks: int = config.num_blocks
        storages = {
            (v.device, v.untyped_storage().data_ptr()): v.untyped_storage().nbytes()
            for v in runner.kv_caches
        }
        self.block_bytes = max(1, sum(storages.values()) // self.num_blocks)
        # Blocks on top of the buffer the draft's weights live in (None: their own memory).
        self.slot_blocks: int | None = None
        if elastic is not None:
            self.slot_blocks = elastic.memory.plan.top_blocks
        elif evicted is not None:
            self.slot_blocks = self._settle(evicted)
        draft = draft_module(runner)
        # Worker block tables index kernel blocks; compaction needs them to be the
        # scheduler's blocks (true unless a backend splits blocks, e.g. hybrid models).
        group_sizes = [group.kv_cache_spec.block_size for group in config.kv_cache_groups]
        table_sizes = [table.block_size for table in runner.input_batch.block_table.block_tables]
        self.can_compact = group_sizes == table_sizes
        self.backend = ""
        # Settled weights keep their addresses through offload and reload; others do not.
        self.offload_blocker = (
            _graph_blocker(runner) if self.weights is not None and self.slot_blocks is None else ""
        )
        # vLLM's CPU backend packs linear weights into oneDNN / sgl-kernel handles and
        # leaves an empty tensor in the module: those bytes are out of PyTorch's reach.
        self.packed_tensors = sum(
            1
            for module in (draft.modules() if draft is not None else ())
            if hasattr(module, "cpu_linear")
            and getattr(module, "weight", None) is not None
            and module.weight.numel() == 0
        )
        if self.packed_tensors:
            log.warning(
                "nightjar memory: %d of the draft's linear layers keep their weights packed "
                "by vLLM's CPU backend outside PyTorch; offloading moves the other %d KiB only",
                self.packed_tensors,
                self.draft_bytes >> 10,
            )

    def _settle(self, weights: DraftWeights) -> int | None:
        # Pack into as few top blocks as hold everything (worth_it: as planned at sizing).
        limit = math.ceil(self.num_blocks / 2)
        homed = draft_slot.home_views(weights.host_tensors(), self.buffers, self.num_blocks, limit)
        if homed is not None:
            blocks, views = homed
            try:
                weights.settle(views)
                return blocks
            except ReloadError:
                log.exception("nightjar memory: the draft did not verify in the KV buffer")
        log.warning(
            "nightjar memory: the draft's weights do not fit the KV buffer's top "
            "blocks; they go back to memory of their own"
        )
        weights.restore()
        return None

    @property
    def draft_bytes(self) -> int:
        return self.weights.nbytes if self.weights is not None else 0

    @property
    def _draft(self) -> DraftWeights | ElasticDraft:
        mover = self.elastic or self.weights
        assert mover is not None
        return mover

    def offload_draft(self) -> Transfer:
        return self._draft.offload()

    def start_reload(self) -> Transfer:
        return self._draft.start_reload()

    @property
    def reload_is_async(self) -> bool:
        return bool(torch.cuda.is_available() and self.runner.device.type == "cuda")

    def finish_reload(self) -> Transfer:
        return self._draft.finish_reload()

    def abandon_reload(self) -> None:
        self._draft.abandon_reload()

    def migrate(self, waves: tuple[tuple[Move, ...], ...], remap: Mapping[int, int]) -> None:
        if not self.can_compact:
            raise RuntimeError("KV compaction with split kernel blocks is not supported")
        # Copies first: a failed one leaves the tables naming the sources, which a
        # compaction never overwrites (they lie above the new size, the targets below).
        try:
            for flat, layout in self.buffers:
                self.backend = migrate(flat, layout, waves)
        except BaseException:
            unmove_step(self.step_output, remap)
            raise
        lookup = np.arange(self.num_blocks, dtype=np.int64)
        lookup[np.fromiter(remap.keys(), dtype=np.int64)] = np.fromiter(remap.values(), np.int64)
        tables = [
            table.block_table.np for table in self.runner.input_batch.block_table.block_tables
        ]
        ids = [ids for state in self.runner.requests.values() for ids in state.block_ids]
        # Every new table computed before any is written: they change together or not at all.
        new_rows = [lookup[rows] for rows in tables]
        new_ids = [lookup[np.asarray(row, dtype=np.int64)].tolist() for row in ids]
        for rows, new in zip(tables, new_rows, strict=True):
            rows[:] = new
        for row, new_row in zip(ids, new_ids, strict=True):
            row[:] = new_row

    def guard_drafter(self, allowed: Callable[[], bool]) -> None:
        """Skip the drafter while ``allowed()`` is false (no drafts: a [batch, 0] tensor)."""
        drafter = self.runner.drafter
        propose = drafter.propose
        device = self.runner.device

        def guarded_propose(*args: Any, **kwargs: Any) -> Any:
            if allowed():
                return propose(*args, **kwargs)
            batch = kwargs["common_attn_metadata"].batch_size()
            return torch.empty(batch, 0, dtype=torch.int64, device=device)

        drafter.propose = guarded_propose
