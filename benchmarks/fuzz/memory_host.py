"""A memory agent with no engine around it, served on a Unix socket for the fuzzer.

What is real: the agent (memory_agent/agent.py) and its gRPC service, vLLM's own
``BlockPool`` behind the agent's ElasticBlockPool, the worker half (RunnerMemory) over a
torch KV buffer seen through per-layer views, block-table rows, and a torch draft module
whose weights are really offloaded, reloaded and verified. What stands in for the engine:
a thread that reaches a step boundary every few milliseconds, and two requests that hold
KV blocks (so compactions have live blocks to move or to refuse). The KV cache manager and
the model runner are namespaces with the attributes the agent's halves read, built by
tests/rigs/engine_stand_ins.py as for tests/memory_agent/test_memory_agent.py.

    python -m benchmarks.fuzz.memory_host --uds SOCKET [--admin-token-file FILE]
"""

from __future__ import annotations

import argparse
import signal
import threading
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from tests.rigs.engine_stand_ins import kv_cache_manager, model_runner

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
        kv_manager = kv_cache_manager(self.pool, tables, TOKENS)
        page = HEADS * TOKENS * WIDTH
        buffer = torch.randn(LAYERS * BLOCKS * page)
        views = buffer.view(LAYERS, BLOCKS, HEADS, TOKENS, WIDTH)
        draft = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Linear(64, 8))
        rows = np.zeros((4, BLOCKS), dtype=np.int32)
        kv_caches = [views[layer] for layer in range(LAYERS)]
        runner = model_runner(draft, kv_caches, BLOCKS, TOKENS, rows)
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
    from nightjar_common.admin_token import AdminTokenFile

    parser = argparse.ArgumentParser(prog="memory_host", description=__doc__.splitlines()[0])
    parser.add_argument("--uds", required=True, help="Unix socket to serve on")
    parser.add_argument("--admin-token-file", help="admin token for mutating calls")
    args = parser.parse_args(argv)
    token = AdminTokenFile(args.admin_token_file) if args.admin_token_file else None
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
