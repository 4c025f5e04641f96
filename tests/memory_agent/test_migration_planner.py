"""KV migration planner: property tests over random block tables, chains and cycles."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memory_agent.planner import (
    MigrationPlan,
    PlanError,
    execute,
    free_list,
    live_blocks,
    order_moves,
    plan_compaction,
)


@st.composite
def tables_and_k(draw: st.DrawFn) -> tuple[dict[str, list[int]], int, int]:
    num_blocks = draw(st.integers(8, 200))
    ids = draw(st.lists(st.integers(1, num_blocks - 1), unique=True, max_size=num_blocks - 1))
    # Split the live ids into per-request tables (a request holds several blocks).
    cuts = sorted(draw(st.lists(st.integers(0, len(ids)), max_size=8)))
    tables, start = {}, 0
    for n, cut in enumerate([*cuts, len(ids)]):
        tables[f"r{n}"], start = ids[start:cut], cut
    k_new = draw(st.integers(1, num_blocks))
    return tables, k_new, num_blocks


@settings(max_examples=300, deadline=None)
@given(tables_and_k())
def test_compaction_moves_every_live_block_below_k_new(case) -> None:
    tables, k_new, num_blocks = case
    live = live_blocks(tables)
    data = {b: f"kv{b}" for b in range(num_blocks)}  # what each block holds
    try:
        plan = plan_compaction(tables, k_new)
    except PlanError:
        assert len(live) > k_new - 1  # block 0 is reserved
        return
    after = execute(data, plan)
    new_tables = plan.remap(tables)
    for req, table in tables.items():
        # Same contents, in the same order, now all below K_new.
        assert [after[b] for b in new_tables[req]] == [data[b] for b in table]
        assert all(b < k_new for b in new_tables[req])
    assert 0 not in plan.mapping.values()
    assert len(set(plan.mapping.values())) == len(plan.mapping)
    free = free_list(k_new, new_tables)
    assert sorted(free + sorted(live_blocks(new_tables))) == list(range(1, k_new))


@st.composite
def injective_mappings(draw: st.DrawFn) -> dict[int, int]:
    blocks = draw(st.lists(st.integers(0, 60), unique=True, min_size=1, max_size=40))
    targets = draw(st.permutations(blocks))
    extra = draw(st.lists(st.integers(61, 90), unique=True, max_size=10))
    mapping = dict(zip(blocks, targets, strict=True))  # permutations: chains and cycles
    spare = [b for b in range(61, 91) if b not in extra]
    mapping.update(zip(extra, spare[: len(extra)], strict=False))  # plus chains off the set
    return mapping


@settings(max_examples=300, deadline=None)
@given(injective_mappings())
def test_ordered_moves_realise_any_mapping_without_losing_data(mapping) -> None:
    scratch = 1000
    plan = order_moves(mapping, scratch)
    data = {b: f"kv{b}" for b in range(92)}
    after = execute(data, plan)
    for src, dst in mapping.items():
        assert after[dst] == data[src]
    untouched = set(range(92)) - set(mapping.values())
    assert all(after[b] == data[b] for b in untouched - set(mapping))
    for wave in plan.waves:  # parallel-safe: nothing a wave writes is read in it
        sources, dests = {s for s, _ in wave}, [d for _, d in wave]
        assert not sources & set(dests) and len(dests) == len(set(dests))


def test_a_cycle_goes_through_the_scratch_block() -> None:
    plan = order_moves({1: 2, 2: 3, 3: 1, 7: 8}, scratch=99)
    assert plan.scratch == 99
    assert plan.waves[0] == [(7, 8)] or (1, 99) in plan.waves[0]
    assert execute({1: "a", 2: "b", 3: "c", 7: "x", 8: "y", 99: None}, plan) == {
        1: "c",
        2: "a",
        3: "b",
        7: "x",
        8: "x",
        99: "a",
    }
    assert order_moves({4: 5, 5: 6}, scratch=99).scratch is None  # a chain needs none


def test_errors_name_what_does_not_fit() -> None:
    tables = {"a": [1, 2, 9], "b": [10, 11]}
    with pytest.raises(PlanError, match="5 live blocks do not fit below K_new = 5"):
        plan_compaction(tables, 5)
    with pytest.raises(PlanError, match="same destination"):
        order_moves({1: 3, 2: 3}, scratch=9)
    with pytest.raises(PlanError, match="scratch block 3"):
        order_moves({1: 3}, scratch=3)
    plan = plan_compaction(tables, 6)
    assert isinstance(plan, MigrationPlan) and plan.mapping == {9: 3, 10: 4, 11: 5}
    # Blocks held only by a reference count (prefix cache) are live too.
    with pytest.raises(PlanError):
        plan_compaction(tables, 6, ref_counts={4: 1})
