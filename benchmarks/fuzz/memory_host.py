"""A memory agent with no engine around it, served on a Unix socket for the fuzzer.

What is real: the agent (memory_agent/agent.py) and its gRPC service, vLLM's own
``BlockPool`` behind the agent's ElasticBlockPool, the worker half (RunnerMemory) over a
torch KV buffer seen through per-layer views, block-table rows, and a torch draft module
whose weights are really offloaded, reloaded and verified. What stands in for the engine:
a thread that reaches a step boundary every few milliseconds, and two requests that hold
KV blocks (so compactions have live blocks to move or to refuse). The model runner is a
namespace with the attributes RunnerMemory reads, as
tests/memory_agent/test_memory_agent.py builds it.

    python -m benchmarks.fuzz.memory_host --uds SOCKET [--admin-token-file FILE]
"""

from __future__ import annotations

import argparse
import signal
import threading
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

LAYERS, BLOCKS, HEADS, TOKENS, WIDTH = 2, 64, 2, 4, 8
STEP_INTERVAL_S = 0.002


class HostedAgent:
    """The agent, its pool and worker half, stepped by a background thread."""

    def __init__(self) -> None:
        import numpy as np
        import torch
        from vllm.v1.core.block_pool import BlockPool

        from memory_agent.agent import MemoryAgent
        from vllm_client_patch.kv_pool import ElasticBlockPool
        from vllm_client_patch.worker_memory import RunnerMemory

        torch.manual_seed(0)
        self.pool = BlockPool(BLOCKS, enable_caching=True, hash_block_size=TOKENS)
        tables: dict[str, list[Any]] = {}
        manager = SimpleNamespace(req_to_blocks=tables, block_size=TOKENS)
        kv_manager = SimpleNamespace(
            block_pool=self.pool, coordinator=SimpleNamespace(single_type_managers=(manager,))
        )
        page = HEADS * TOKENS * WIDTH
        buffer = torch.randn(LAYERS * BLOCKS * page)
        views = buffer.view(LAYERS, BLOCKS, HEADS, TOKENS, WIDTH)
        draft = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Linear(64, 8))
        rows = np.zeros((4, BLOCKS), dtype=np.int32)
        runner = SimpleNamespace(
            model=torch.nn.Linear(8, 8),
            drafter=SimpleNamespace(model=draft),
            kv_caches=[views[layer] for layer in range(LAYERS)],
            kv_cache_config=SimpleNamespace(
                num_blocks=BLOCKS,
                kv_cache_groups=[SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=TOKENS))],
            ),
            input_batch=SimpleNamespace(
                block_table=SimpleNamespace(
                    block_tables=[
                        SimpleNamespace(block_size=TOKENS, block_table=SimpleNamespace(np=rows))
                    ]
                )
            ),
            requests={},
            device=torch.device("cpu"),
        )
        self.memory = RunnerMemory(runner)
        self.agent = MemoryAgent(BLOCKS, -(-self.memory.draft_bytes // 6), self.memory.draft_bytes)
        self.elastic = ElasticBlockPool(kv_manager, self.agent.kv_blocks)
        for row, (req_id, count) in enumerate((("a", 9), ("b", 7))):
            blocks = self.pool.get_new_blocks(count)
            tables[req_id] = blocks
            ids = [b.block_id for b in blocks]
            rows[row, : len(ids)] = ids
            runner.requests[req_id] = SimpleNamespace(block_ids=(list(ids),), row=row)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._steps, name="step-boundaries", daemon=True)

    def _steps(self) -> None:
        while not self.stop.wait(STEP_INTERVAL_S):
            self.agent.worker_step(self.memory, self.agent.begin_step(self.elastic))


def main(argv: Sequence[str] | None = None) -> int:
    from memory_agent import service
    from nightjar_common.admin_token import read_token

    parser = argparse.ArgumentParser(prog="memory_host", description=__doc__.splitlines()[0])
    parser.add_argument("--uds", required=True, help="Unix socket to serve on")
    parser.add_argument("--admin-token-file", help="admin token for mutating calls")
    args = parser.parse_args(argv)
    token = read_token(args.admin_token_file or "")
    hosted = HostedAgent()
    server = service.serve(hosted.agent, args.uds, admin_token=token)
    hosted.thread.start()
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    done.wait()
    hosted.stop.set()
    server.stop(grace=1.0).wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
