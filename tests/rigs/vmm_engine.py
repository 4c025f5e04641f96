"""A memory agent over the host's real virtual memory, wired as the plugin wires it in
vLLM (vllm_client_patch/memory.py), without an engine: the draft's weights and the KV
cache in an :class:`ElasticMemory` of the host driver (mmap + memfd) — one that fails a
chosen map call (failing_driver.py) — vLLM's own ``BlockPool`` behind the agent's
ElasticBlockPool, and the worker's block-table rows and request states.

The memory agent's tests and `make fuzz`'s failing-driver class use it. Requests are
stand-ins that hold blocks: each block is written with fresh KV when allocated, and
:meth:`VmmEngine.problems` says which no longer read back what was written (through the
worker's tables, which must name the scheduler's)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from vllm.v1.core.block_pool import BlockPool

from memory_agent.agent import MemoryAgent
from memory_agent.draft_weights import DraftWeights
from memory_agent.elastic_draft import ElasticDraft, draft_range_bytes
from memory_agent.orders import Order
from memory_agent.vmm import ElasticMemory
from memory_agent.vmm_plan import KVGeometry, plan_elastic
from tests.rigs.engine_stand_ins import kv_cache_manager, model_runner
from tests.rigs.failing_driver import FailingDriver
from vllm_client_patch.kv_pool import ElasticBlockPool
from vllm_client_patch.worker_memory import RunnerMemory

# A layer-outermost KV buffer of 64 blocks a layer; one host page (the 4 KiB granule)
# holds 16 blocks: the draft's memory backs the top granule of each layer when offloaded.
GRANULE = 4096
LAYERS, BLOCKS, HEADS, TOKENS, WIDTH = 2, 64, 2, 4, 8
PAGE = HEADS * TOKENS * WIDTH  # float32 elements: 256 bytes a page
ROWS = 64  # the worker's block-table rows: one per request


class VmmEngine:
    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.driver = FailingDriver(GRANULE)
        page_bytes = PAGE * 4
        geometry = KVGeometry.strided(
            LAYERS * BLOCKS * page_bytes,
            BLOCKS,
            LAYERS,
            BLOCKS * page_bytes,
            page_bytes,
            page_bytes,
        )
        self.draft = torch.nn.Sequential(torch.nn.Linear(8, 128), torch.nn.Linear(128, 8))
        weights = DraftWeights(self.draft)
        plan = plan_elastic(geometry, GRANULE, draft_range_bytes(weights))
        self.memory = ElasticMemory(self.driver, plan)
        elastic = ElasticDraft(weights, self.memory)
        self.kv = self.memory.kv_tensor()[: geometry.nbytes].view(torch.float32)
        views = self.kv.view(LAYERS, BLOCKS, HEADS, TOKENS, WIDTH)
        self.pool = BlockPool(BLOCKS, enable_caching=True, hash_block_size=TOKENS)
        self.tables: dict[str, list[Any]] = {}
        self.rows = np.zeros((ROWS, BLOCKS), dtype=np.int32)
        self.free_rows = list(range(ROWS))  # the worker's table rows no request holds
        kv_caches = [views[layer] for layer in range(LAYERS)]
        self.runner = model_runner(self.draft, kv_caches, BLOCKS, TOKENS, self.rows)
        self.device = RunnerMemory(self.runner, elastic=elastic)
        self.agent = MemoryAgent(
            BLOCKS,
            self.device.block_bytes,
            self.device.draft_bytes,
            draft_blocks=self.device.slot_blocks,
        )
        manager = kv_cache_manager(self.pool, self.tables, TOKENS)
        self.elastic = ElasticBlockPool(manager, self.agent.kv_blocks)
        # Request -> what its blocks hold, by position in its table (blocks move).
        self.written: dict[str, list[torch.Tensor]] = {}
        self.draft_bytes = self.draft_state()

    def close(self) -> None:
        self.memory.close()

    def pages(self) -> torch.Tensor:
        return self.kv.view(LAYERS, BLOCKS, PAGE)

    def draft_state(self) -> list[bytes]:
        """The draft's parameters, byte for byte."""
        return [
            p.detach().contiguous().view(torch.uint8).numpy().tobytes()
            for p in self.draft.parameters()
        ]

    def step(self) -> None:
        """A step boundary: the pool half, then the worker half (which never raises)."""
        self.agent.worker_step(self.device, self.agent.begin_step(self.elastic))

    def run(self, order: Order) -> Any:
        """Submit ``order`` and reach boundaries until it ends (an order owing the pool a
        step ends at the second); its error, None when it succeeded."""
        ticket = self.agent.submit(order)
        for _ in range(2):
            self.step()
            if ticket.done.is_set():
                break
        if not ticket.done.is_set():
            raise AssertionError(f"{order.action} did not end within two step boundaries")
        return ticket.error

    def add_request(self, req_id: str, blocks: int) -> None:
        """A request holding ``blocks`` new blocks, each written with fresh KV."""
        new = self.pool.get_new_blocks(blocks)
        self.tables[req_id] = new
        row = self.free_rows.pop(0)
        ids = [b.block_id for b in new]
        self.rows[row, : len(ids)] = ids
        self.runner.requests[req_id] = SimpleNamespace(block_ids=(list(ids),), row=row)
        pages = self.pages()
        for block in ids:
            pages[:, block] = torch.randn(LAYERS, PAGE)
        self.written[req_id] = [pages[:, block].clone() for block in ids]

    def finish(self, req_id: str) -> None:
        """The request ends: its blocks go back to the pool (vLLM frees tail first)."""
        self.pool.free_blocks(reversed(self.tables.pop(req_id)))
        state = self.runner.requests.pop(req_id)
        self.rows[state.row] = 0
        self.free_rows.append(state.row)
        del self.written[req_id]

    def fill(self, prefix: str, per_request: int = 8) -> None:
        """Requests over every free block of the pool, as a loaded engine holds them."""
        free = self.elastic.free_blocks()
        for index in range(0, free, per_request):
            self.add_request(f"{prefix}{index}", min(per_request, free - index))

    def problems(self) -> list[str]:
        """What is wrong with the KV cache now: worker tables that do not name the
        scheduler's blocks, blocks that do not read back what was written there."""
        pages = self.pages()
        found = []
        for req, blocks in self.tables.items():
            state = self.runner.requests[req]
            ids = [b.block_id for b in blocks]
            if state.block_ids != (ids,) or list(self.rows[state.row, : len(ids)]) != ids:
                found.append(f"{req}: worker tables {state.block_ids} != scheduler's {ids}")
                continue
            for index, (block, before) in enumerate(zip(ids, self.written[req], strict=True)):
                if not torch.equal(pages[:, block], before):
                    found.append(f"{req}[{index}] (block {block}) lost its KV")
        return found
