"""Stand-ins for the vLLM objects the memory agent's two halves read, without an engine: a
KV cache manager of one KV group (scheduler side, for ElasticBlockPool) and a model runner
(worker side, for RunnerMemory). They are namespaces with just the attributes those read,
around the real objects the caller made (vLLM's BlockPool, torch tensors and modules), so
that the agent's tests and the fuzzer's agent host wire the agent the same way."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


def kv_cache_manager(pool: Any, tables: dict[str, list[Any]], block_size: int) -> SimpleNamespace:
    """vLLM's KV cache manager as ElasticBlockPool reads it: the block `pool`, and one KV
    group whose requests hold the blocks of `tables` (request id → blocks, read live)."""
    group = SimpleNamespace(req_to_blocks=tables, block_size=block_size)
    return SimpleNamespace(
        block_pool=pool, coordinator=SimpleNamespace(single_type_managers=(group,))
    )


def model_runner(
    draft: Any, kv_caches: list[Any], num_blocks: int, block_size: int, block_rows: Any
) -> SimpleNamespace:
    """A CPU model runner as RunnerMemory reads it: a small target model, the drafter's
    `draft` module, the per-layer KV cache views, one KV group of `num_blocks` blocks of
    `block_size` tokens, and its block-table rows (an int32 array, a row per request);
    requests join it in `requests`, id → SimpleNamespace(block_ids, row)."""
    import torch

    table = SimpleNamespace(block_size=block_size, block_table=SimpleNamespace(np=block_rows))
    return SimpleNamespace(
        model=torch.nn.Linear(8, 8),
        drafter=SimpleNamespace(model=draft),
        kv_caches=kv_caches,
        kv_cache_config=SimpleNamespace(
            num_blocks=num_blocks,
            kv_cache_groups=[SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=block_size))],
        ),
        input_batch=SimpleNamespace(block_table=SimpleNamespace(block_tables=[table])),
        requests={},
        device=torch.device("cpu"),
    )
