"""KV block migration plans: which block moves where, and in what order.

Contracting the KV pool to K_new blocks means every live block with id ≥ K_new must
move to a free id < K_new, and every block table must then name the new ids. The copy
itself (kernels/) runs many moves at once, so a plan is executed in *waves*: within a
wave no block is both read and written, and a block is never overwritten before every
move that reads it has run. General mappings (chains a→b→c, cycles a→b→a) are ordered
topologically; each cycle is broken by parking one block in a scratch block.

Pure Python; nothing here touches a device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

Move = tuple[int, int]  # (source block id, destination block id)


class PlanError(ValueError):
    """The requested migration is impossible (it names the numbers that do not fit)."""


@dataclasses.dataclass(frozen=True, slots=True)
class MigrationPlan:
    # Final location of every block that changes place: old id -> new id.
    mapping: dict[int, int]
    # Copies grouped into waves; waves run in order, the copies of a wave in parallel.
    waves: list[list[Move]]
    # The block used to break cycles (None when the mapping had none).
    scratch: int | None = None

    @property
    def moves(self) -> list[Move]:
        return [move for wave in self.waves for move in wave]

    def remap(self, block_tables: Mapping[str, Sequence[int]]) -> dict[str, list[int]]:
        """Block tables after the migration."""
        return {
            req: [self.mapping.get(block, block) for block in table]
            for req, table in block_tables.items()
        }


def live_blocks(
    block_tables: Mapping[str, Sequence[int]], ref_counts: Mapping[int, int] | None = None
) -> set[int]:
    """Blocks some request's table names, plus any with a positive reference count
    (e.g. prefix-cached blocks held by no running request)."""
    live = {block for table in block_tables.values() for block in table}
    if ref_counts:
        live |= {block for block, count in ref_counts.items() if count > 0}
    return live


def plan_compaction(
    block_tables: Mapping[str, Sequence[int]],
    k_new: int,
    ref_counts: Mapping[int, int] | None = None,
    reserved: Iterable[int] = (0,),
) -> MigrationPlan:
    """Move every live block ≥ k_new into free ids < k_new (lowest ids first).

    ``reserved`` ids are never used as destinations (vLLM's block 0 is its null block).
    """
    if k_new <= 0:
        raise PlanError(f"K_new must be positive, got {k_new}")
    live = live_blocks(block_tables, ref_counts)
    reserved_ids = set(reserved)
    movers = sorted(block for block in live if block >= k_new)
    free = [b for b in range(k_new) if b not in live and b not in reserved_ids]
    if len(movers) > len(free):
        kept = sum(1 for b in live if b < k_new)
        raise PlanError(
            f"{len(live)} live blocks do not fit below K_new = {k_new}: {kept} already there, "
            f"{len(movers)} to move, {len(free)} free ids (reserved {sorted(reserved_ids)})"
        )
    mapping = dict(zip(movers, free, strict=False))
    # Sources (≥ k_new) and destinations (< k_new, free) are disjoint: one wave.
    return MigrationPlan(mapping, [sorted(mapping.items())] if mapping else [], None)


def order_moves(mapping: Mapping[int, int], scratch: int) -> MigrationPlan:
    """Waves that realise an arbitrary injective mapping without losing data.

    A block is written only once the move reading it has run; blocks on a cycle are
    rotated through ``scratch``, which must not be a source or destination. Linear in
    the number of moves; a chain or cycle of length L takes L waves.
    """
    moves = {src: dst for src, dst in mapping.items() if src != dst}
    if len(set(moves.values())) != len(moves):
        raise PlanError("two blocks map to the same destination")
    if scratch in moves or scratch in moves.values():
        raise PlanError(f"scratch block {scratch} is part of the mapping")
    # writer[b] = the move that writes into block b; it waits until b has been read.
    writer = {dst: src for src, dst in moves.items()}
    ready = sorted(src for src, dst in moves.items() if dst not in moves)
    by_id, cursor = sorted(moves), 0
    waves: list[list[Move]] = []
    used_scratch = False
    while moves:
        if not ready:
            # Only cycles remain: park one block in scratch; the move writing into it
            # can then run, and the cycle unrolls as a chain ending at scratch.
            while by_id[cursor] not in moves:
                cursor += 1
            src = by_id[cursor]
            assert scratch not in moves, "scratch still holds a parked block"
            waves.append([(src, scratch)])
            dst = moves.pop(src)
            moves[scratch], writer[dst] = dst, scratch
            ready = [writer.pop(src)]
            used_scratch = True
            continue
        wave = [(src, moves.pop(src)) for src in ready]
        waves.append(wave)
        # A block just read may now be overwritten by the move that writes into it.
        ready = sorted(w for src, _ in wave if (w := writer.pop(src, None)) is not None)
    return MigrationPlan(dict(mapping), waves, scratch if used_scratch else None)


def execute(data: dict[int, object], plan: MigrationPlan) -> dict[int, object]:
    """Apply a plan to a block-id → contents map, wave by wave (the reference semantics).

    Within a wave every copy reads the state before the wave, as parallel copies do.
    """
    state = dict(data)
    for wave in plan.waves:
        snapshot = {src: state[src] for src, _ in wave}
        for src, dst in wave:
            state[dst] = snapshot[src]
    return state


def free_list(
    num_blocks: int,
    block_tables: Mapping[str, Sequence[int]],
    ref_counts: Mapping[int, int] | None = None,
    reserved: Iterable[int] = (0,),
) -> list[int]:
    """Ids < num_blocks that nothing uses, in ascending order."""
    used = live_blocks(block_tables, ref_counts) | set(reserved)
    return [b for b in range(num_blocks) if b not in used]
