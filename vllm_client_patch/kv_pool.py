"""vLLM's scheduler-side KV block pool, grown and shrunk in place (the agent's KVPool).

vLLM (0.32/0.33) sizes its KV buffer once, at start-up, and has no runtime resize
(``GPUModelRunner.initialize_kv_cache`` allocates it from ``KVCacheConfig.num_blocks``).
The agent therefore runs the pool *logically* inside that buffer: only ids below the
usable size are ever in the free queue. Growing appends the ids above it to the free
queue; shrinking moves every live block above the new size to a free id below it — the
``KVCacheBlock`` objects in every request's block table are swapped for their new homes,
reference counts and prefix-cache hashes carried over — and withdraws the ids above the
size from the free queue. The copies of the block contents are the worker's half
(vllm_worker.py), in the same step, before its forward.
"""

from __future__ import annotations

from typing import Any

from memory_agent.planner import MigrationPlan, PlanError, plan_compaction


def _in_free_queue(block: Any) -> bool:
    # vLLM's free queue is a doubly linked list with sentinels: members have both links.
    return block.prev_free_block is not None and block.next_free_block is not None


class ElasticBlockPool:
    """The usable part (ids < :attr:`usable`) of one vLLM ``BlockPool``."""

    def __init__(self, kv_cache_manager: Any, usable: int) -> None:
        self.pool = kv_cache_manager.block_pool
        self.managers = kv_cache_manager.coordinator.single_type_managers
        self.capacity: int = len(self.pool.blocks)
        self.usable = self.capacity
        self.resize(usable)

    def free_blocks(self) -> int:
        return int(self.pool.get_num_free_blocks())

    def resize(self, num_blocks: int) -> MigrationPlan:
        if not 2 <= num_blocks <= self.capacity:
            raise PlanError(f"pool size must be in [2, {self.capacity}], got {num_blocks}")
        if num_blocks >= self.usable:
            grown = self.pool.blocks[self.usable : num_blocks]
            self.pool.free_block_queue.append_n(grown)
            self._set_usable(num_blocks)
            return MigrationPlan({}, [])
        plan = self._plan(num_blocks)
        self._apply(plan)
        for block in self.pool.blocks[num_blocks : self.usable]:
            if _in_free_queue(block):
                self.pool.free_block_queue.remove(block)
                self.pool._maybe_evict_cached_block(block)
        self._set_usable(num_blocks)
        return plan

    def restore(self, plan: MigrationPlan, num_blocks: int) -> None:
        """Undo a shrink by ``plan`` whose copies did not run (the worker's block tables
        still name the old ids, whose contents are intact): every moved block goes back to
        its old id with its reference count and prefix-cache entries, and the pool grows
        back to ``num_blocks``."""
        pool, blocks = self.pool, self.pool.blocks
        back = {dst: src for src, dst in plan.mapping.items()}
        for dst, src in back.items():
            moved, home = blocks[dst], blocks[src]
            if moved.ref_cnt == 0:
                # Freed since (its request finished): it holds no copy, so it must not stay a
                # prefix-cache entry; it is free already and its old home becomes free below.
                pool._maybe_evict_cached_block(moved)
                continue
            home.ref_cnt, moved.ref_cnt = moved.ref_cnt, 0
            if moved.block_hash is not None:
                pool.move_block_hashes(moved, home)
            pool.free_block_queue.append(moved)
        for manager in self.managers:
            for table in manager.req_to_blocks.values():
                for i, block in enumerate(table):
                    if block.block_id in back and not block.is_null:
                        table[i] = blocks[back[block.block_id]]
        # The ids above the shrunk size that hold nothing (a restored block's home is live).
        grown = [block for block in blocks[self.usable : num_blocks] if block.ref_cnt == 0]
        pool.free_block_queue.append_n(grown)
        self._set_usable(num_blocks)

    def _set_usable(self, num_blocks: int) -> None:
        # vLLM reads the pool's size from num_gpu_blocks (KV usage, prefix-cache reset's
        # "all blocks free" check, admission sentinels): it is the usable size; ``blocks``
        # keeps every block of the buffer.
        self.usable = self.pool.num_gpu_blocks = num_blocks

    def _tables(self) -> dict[str, list[int]]:
        return {
            f"{group}:{req_id}": [block.block_id for block in blocks]
            for group, manager in enumerate(self.managers)
            for req_id, blocks in manager.req_to_blocks.items()
        }

    def _plan(self, num_blocks: int) -> MigrationPlan:
        if getattr(self.pool, "_reuse_watchers", None):
            raise PlanError("blocks are pinned for a KV transfer; retry when it has finished")
        tables = self._tables()
        ref_counts = {b.block_id: b.ref_cnt for b in self.pool.blocks[1:] if b.ref_cnt > 0}
        plan = plan_compaction(tables, num_blocks, ref_counts)
        in_tables = {block for table in tables.values() for block in table}
        orphans = sorted(set(plan.mapping) - in_tables)
        if orphans:
            # Held by something other than a request (a KV connector): we cannot re-point it.
            raise PlanError(f"blocks {orphans[:5]} are held outside the block tables")
        return plan

    def _apply(self, plan: MigrationPlan) -> None:
        pool, blocks = self.pool, self.pool.blocks
        for src, dst in plan.mapping.items():
            old, new = blocks[src], blocks[dst]
            pool.free_block_queue.remove(new)
            pool._maybe_evict_cached_block(new)  # a free block may still be a cache entry
            new.ref_cnt, old.ref_cnt = old.ref_cnt, 0
            if old.block_hash is not None:
                pool.move_block_hashes(old, new)
        mapping = plan.mapping
        for manager in self.managers:
            for table in manager.req_to_blocks.values():
                for i, block in enumerate(table):
                    if block.block_id in mapping and not block.is_null:
                        table[i] = blocks[mapping[block.block_id]]
