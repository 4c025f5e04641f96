"""The plugin's vLLM-free parts: configuration, and the controller against a real sidecar."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from nightjar_proto.v1 import admin_pb2

from nightjar_common.client import ClientConfig, NightjarClient
from nightjar_common.tables import TableStep
from nightjar_common.types import GammaTable, RequestSignals, StepContext
from vllm_client_patch.config import PluginConfig, PluginConfigError
from vllm_client_patch.controller import GammaController, HookTime
from vllm_client_patch.step_journal import EngineView, StepContexts, VerifiedStep


def test_config_from_environment_and_toml(tmp_path: Path) -> None:
    assert not PluginConfig.load({}).active  # no sidecar: stock vLLM
    toml = tmp_path / "nightjar.toml"
    toml.write_text(
        '[plugin]\nsidecar = "unix:/run/nj.sock"\ndeadline_ms = 5\n'
        "fallback_table = [[1, 4, 3], [5, 64, 0]]\n"
    )
    config = PluginConfig.load({"NIGHTJAR_CONFIG": str(toml), "NIGHTJAR_ENGINE_ID": "pod-7"})
    assert config.active and config.sidecar == "unix:/run/nj.sock"
    assert (config.engine_id, config.deadline_ms) == ("pod-7", 5.0)
    assert config.fallback_table == ((1, 4, 3), (5, 64, 0))
    # The environment wins over the file; NIGHTJAR_ENABLED=0 turns it off.
    env = {"NIGHTJAR_CONFIG": str(toml), "NIGHTJAR_DEADLINE_MS": "1.5", "NIGHTJAR_ENABLED": "0"}
    config = PluginConfig.load(env)
    assert config.deadline_ms == 1.5 and not config.active
    assert not config.memory_agent  # the memory agent is opt-in
    env = {"NIGHTJAR_MEMORY_AGENT": "true", "NIGHTJAR_MEMORY_SOCKET": "/run/nj-memory.sock"}
    config = PluginConfig.load(env)
    assert config.memory_agent and config.memory_socket == "/run/nj-memory.sock"
    # No learner key: the scheduler derives one from the model and device.
    assert PluginConfig.load({}).learner_key == ""
    toml.write_text('[plugin]\nlearner_key = "llama@h100"\n')
    assert PluginConfig.load({"NIGHTJAR_CONFIG": str(toml)}).learner_key == "llama@h100"
    env = {"NIGHTJAR_CONFIG": str(toml), "NIGHTJAR_LEARNER_KEY": " Qwen3-8B@L4 "}
    assert PluginConfig.load(env).learner_key == "Qwen3-8B@L4"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"NIGHTJAR_DEADLINE_MS": "fast"}, "NIGHTJAR_DEADLINE_MS must be a number"),
        ({"NIGHTJAR_DEADLINE_MS": "0"}, "NIGHTJAR_DEADLINE_MS must be in"),
        ({"NIGHTJAR_ENABLED": "maybe"}, "NIGHTJAR_ENABLED must be a boolean"),
        ({"NIGHTJAR_MEMORY_AGENT": "sure"}, "NIGHTJAR_MEMORY_AGENT must be a boolean"),
        ({"NIGHTJAR_FALLBACK_TABLE": "[[1, 2]]"}, "NIGHTJAR_FALLBACK_TABLE must be JSON"),
        ({"NIGHTJAR_FALLBACK_TABLE": "[[4, 2, 1]]"}, "start_bs <= end_bs"),
        ({"NIGHTJAR_CONFIG": "/nonexistent/nightjar.toml"}, "NIGHTJAR_CONFIG"),
        ({"NIGHTJAR_SIDECAR": "/run/nj.sock"}, "is a path: write unix:/run/nj.sock"),
        ({"NIGHTJAR_SIDECAR": "unix:"}, "needs a socket path"),
        ({"NIGHTJAR_LEARNER_KEY": "k" * 257}, "NIGHTJAR_LEARNER_KEY is longer than 256"),
    ],
)
def test_bad_settings_name_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(PluginConfigError, match=message):
        PluginConfig.load(env)


def test_unknown_toml_key_is_rejected(tmp_path: Path) -> None:
    toml = tmp_path / "nightjar.toml"
    toml.write_text('[plugin]\nsidecar = "unix:x"\ndeadline = 5\n')
    with pytest.raises(PluginConfigError, match="unknown plugin settings"):
        PluginConfig.load({"NIGHTJAR_CONFIG": str(toml)})


def view(batch: int) -> EngineView:
    return EngineView(
        batch_size=batch, waiting=0, free_kv_blocks=900, total_kv_blocks=1000, max_gamma=3
    )


def wait_for(condition: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert condition()


def static_sidecar_logging(make_server: Any, tmp_path: Path) -> tuple[Any, Path]:
    """A sidecar answering γ = 2, with a decision log; the server and the log's path."""
    log = tmp_path / "decisions.jsonl"
    server = make_server(
        "--policy", "static", "--params", '{"gamma": 2}', "--decision-log", str(log)
    )
    return server, log


def run_with_one_bad_outcome(controller: GammaController) -> None:
    """40 steps at batch 4, then idle; the 11th verifies 3 accepted of γ = 2 drafts."""
    wait_for(lambda: controller.client.connected)
    good = VerifiedStep(8, 4, 12, (1, 1, 1, 1))
    bad = VerifiedStep(8, 4, 12, (3, 0, 1, 0))
    for k in range(40):
        controller.decide(view(4))
        controller.end_step(bad if k == 10 else good if k else VerifiedStep(0, 0, 4))
    controller.idle()


def test_each_decision_is_reported_with_the_step_that_verified_it(
    make_server: Any, tmp_path: Path
) -> None:
    server, log = static_sidecar_logging(make_server, tmp_path)
    stats_file = tmp_path / "plugin.json"
    config = PluginConfig(
        sidecar=server.target,
        engine_id="ctl",
        deadline_ms=200,
        stats_file=str(stats_file),
        learner_key="tiny@cpu",
    )
    controller = GammaController(config)
    wait_for(lambda: controller.client.connected)
    verified = [VerifiedStep(0, 0, 4), VerifiedStep(8, 5, 9), VerifiedStep(8, 2, 6)]
    for k, step in enumerate(verified):  # three steps at batch 4, each verifying γ = 2
        assert controller.decide(dataclasses.replace(view(4), prefill_tokens=10 * (k + 1))) == 2
        controller.end_step(step)
    # The batch jumped by 8: a table covers at least 8 sizes above the batch.
    assert controller.decide(dataclasses.replace(view(12), prefill_tokens=40)) == 2
    controller.end_step(VerifiedStep(6, 6, 9))
    controller.idle()  # the last decision is dropped, the queued outcome sent
    stats = controller.stats()
    assert stats["sidecar_decisions"] == 4 and stats["fallbacks_total"] == 0
    assert not stats["request_signals"]  # a batch policy: no per-request signals sent
    assert stats["table_misses"] == {"no_table": 1}  # only the first step had no table
    # The hook's CPU split: the first step asked, the rest the held table answered; three
    # steps at batch 4, one at 12.
    by_path, by_batch = stats["hook_cpu_us_by_path"], stats["hook_cpu_us_by_batch"]
    assert (by_path["asked"]["n"], by_path["table"]["n"]) == (1, 3)
    assert [by_batch[r]["n"] for r in ("1-8", "9-32", "33+")] == [3, 1, 0]
    assert stats["reported"] == 3 and stats["drafted_tokens"] == 22
    wait_for(lambda: log.exists() and log.read_text().count('"kind":"outcome"') == 3)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    decided = {r["decision_id"]: r for r in records if r["kind"] == "decision"}
    outcomes = [r["outcome"] for r in records if r["kind"] == "outcome"]
    # Outcome k carries what step k+1 verified, for decision k's context.
    assert [o["drafted_tokens"] for o in outcomes] == [8, 8, 6]
    assert [o["generated_tokens"] for o in outcomes] == [9, 6, 9]
    # ... and the prefill that shared step k+1, whose time it reports.
    assert [o["prefill_tokens"] for o in outcomes] == [20, 30, 40]
    # ... and the γ its drafter ran: the decision of step k+1 (None would mean "as gamma").
    assert [o["draft_gamma"] for o in outcomes] == [2, 2, 2]
    contexts = [decided[o["decision_id"]]["context"] for o in outcomes]
    assert [c["batch_size"] for c in contexts] == [4, 4, 4]
    # Each step's own context, also where it was built off the engine's thread (a step
    # the held table answered is settled from the controller's journal).
    assert [(c["step_index"], c.get("previous_gamma")) for c in contexts] == [
        (0, None),
        (1, 2),
        (2, 2),
    ]
    assert {r["context"]["learner_key"] for r in decided.values()} == {"tiny@cpu"}
    controller.close()
    written = json.loads(stats_file.read_text())
    assert written["engine_id"] == "ctl" and written["reported"] == 3


def test_a_malformed_outcome_in_a_report_batch_loses_nothing_else(
    make_server: Any, tmp_path: Path
) -> None:
    """A bad outcome (per-request accepts above the γ that ran) rides in a batch with the
    steps around it: it alone is skipped (and said so in the reply), the rest of the
    batch applied."""
    server, log = static_sidecar_logging(make_server, tmp_path)
    config = PluginConfig(sidecar=server.target, engine_id="ctl", deadline_ms=500)
    controller = GammaController(config)
    run_with_one_bad_outcome(controller)
    stats = controller.stats()
    assert stats["fallbacks_total"] == 0
    # 39 outcomes (the last decision is dropped at idle), all applied but the bad one.
    wait_for(lambda: log.read_text().count('"kind":"outcome"') == 38)
    assert server.state()["reports"] == 38
    wait_for(lambda: controller.stats()["rejected_reports"] == 1)
    controller.close()


def test_the_first_step_after_an_idle_gap_finds_its_table(make_server: Any, tmp_path: Path) -> None:
    server = make_server("--policy", "static", "--params", '{"gamma": 2}')
    config = PluginConfig(sidecar=server.target, engine_id="idler", deadline_ms=500)
    controller = GammaController(config)
    wait_for(lambda: controller.client.connected)
    for joining in (1, 3, 1):  # a lone request, then three together, then one again
        assert controller.decide(view(joining)) == 2
        controller.end_step(VerifiedStep(0, 0, joining))
        assert controller.decide(view(joining)) == 2
        controller.end_step(VerifiedStep(2 * joining, joining, 2 * joining))
        controller.idle()  # every request finished
    # Only the very first step had no table (a blocking round trip); after each idle gap
    # the first step's table was there, for one request or three.
    stats = controller.stats()
    assert stats["table_misses"] == {"no_table": 1} and stats["sidecar_decisions"] == 6
    controller.close()


def test_a_policy_swapped_in_while_the_engine_idles_decides_its_next_step(
    make_server: Any, tmp_path: Path
) -> None:
    server, log = static_sidecar_logging(make_server, tmp_path)
    config = PluginConfig(sidecar=server.target, engine_id="idler", deadline_ms=500)
    controller = GammaController(config)
    wait_for(lambda: controller.client.connected)
    assert controller.decide(view(2)) == 2
    controller.end_step(VerifiedStep(0, 0, 2))
    # The sidecar confirms policy notices after the stream's first request.
    wait_for(lambda: controller.client.stats.policy_notices >= 1)
    controller.idle()  # asks ahead for the step that ends the idle time (static γ = 2)
    # Let its table arrive first (decided by static γ = 2); had the swap come first the
    # table would be `off`'s.
    time.sleep(0.3)
    notices = controller.client.stats.policy_notices
    reply = server.admin.SwapPolicy(
        admin_pb2.SwapPolicyRequest(name="off"), metadata=server.auth, timeout=5
    )
    wait_for(lambda: controller.client.stats.policy_notices == notices + 1)
    # The table kept from before the swap was dropped and asked for again on the notice:
    # `off` decides the step, and its table is there when the engine wakes.
    time.sleep(0.3)
    assert controller.decide(view(1)) == 0
    stats = controller.stats()
    # Only the first step missed: the notice's table came before the step after the swap.
    assert stats["table_misses"] == {"no_table": 1} and stats["tables"] >= 2
    assert stats["sidecar_decisions"] == 2 and stats["fallbacks_total"] == 0
    controller.end_step(VerifiedStep(0, 0, 1))
    controller.idle()  # names the decision it ran to the sidecar, which logs it
    wait_for(lambda: log.read_text().count(reply.policy_version) >= 1)
    controller.close()
    versions = [json.loads(line).get("policy_version") for line in log.read_text().splitlines()]
    assert versions[-1] == reply.policy_version


def test_a_step_run_without_the_draft_is_reported_at_the_gamma_it_ran(
    make_server: Any, tmp_path: Path
) -> None:
    """The held table says γ = 2, but with the draft offloaded the engine runs γ = 0: the
    step is reported at 0 (the sidecar refuses a γ > 0 run without the draft), so nothing
    the engine reports is skipped."""
    server, _ = static_sidecar_logging(make_server, tmp_path)
    controller = GammaController(
        PluginConfig(sidecar=server.target, engine_id="away", deadline_ms=500)
    )
    wait_for(lambda: controller.client.connected)
    assert controller.decide(view(4)) == 2
    controller.end_step(VerifiedStep(0, 0, 4))
    assert controller.decide(dataclasses.replace(view(4), draft_resident=False)) == 0
    controller.end_step(VerifiedStep(8, 4, 12))
    assert controller.decide(view(4)) == 2
    controller.end_step(VerifiedStep(0, 0, 4))
    controller.idle()
    wait_for(lambda: server.state()["reports"] == 2)
    stats = controller.stats()
    assert stats["sources"] == {"sidecar": 2, "forced": 1}
    assert stats["rejected_reports"] == 0
    controller.close()


def test_fails_open_to_the_fallback_table_without_a_sidecar(tmp_path: Path) -> None:
    config = PluginConfig(sidecar=f"unix:{tmp_path}/none.sock", engine_id="alone")
    controller = GammaController(config, fallback_table=((1, 2, 3), (3, 64, 1)))
    assert [controller.decide(view(b)) for b in (1, 2, 8)] == [3, 3, 1]
    # With the draft offloaded the table's γ = 3 is not run: there is no drafter.
    away = dataclasses.replace(view(1), draft_resident=False)
    assert controller.decide(away) == 0 and controller._previous_gamma == 0
    controller.end_step(VerifiedStep(3, 1, 2))
    stats = controller.stats()
    assert stats["fallbacks_total"] == 4 and stats["reported"] == 0
    controller.close()


def test_hook_time_tells_waiting_from_working(tmp_path: Path) -> None:
    """The hook's wall time counts the caller's part and the controller's; its CPU time
    (the engine thread's) leaves out time spent waiting, here a sleep in the caller's part
    of each hook, and keeps busy work."""
    config = PluginConfig(sidecar=f"unix:{tmp_path}/none.sock", engine_id="timed")
    controller = GammaController(config, fallback_table=((1, 64, 1),))
    for _ in range(3):
        started = HookTime.now()
        time.sleep(0.02)  # waiting: wall time, no CPU time
        controller.decide(view(4), started)
        busy = HookTime.now()
        while time.thread_time() - busy.cpu < 0.005:  # working: both
            pass
        controller.end_step(VerifiedStep(4, 2, 6), busy.elapsed())
    stats = controller.stats()
    wall, cpu = stats["hook_us"], stats["hook_cpu_us"]
    assert wall["n"] == cpu["n"] == 3
    assert wall["p50"] >= 24_000 and 4_500 <= cpu["p50"] <= 15_000, (wall, cpu)
    controller.close()


def test_tiny_models_acceptance_preview() -> None:
    from tests.rigs.tiny_models import acceptance_rate

    assert acceptance_rate([[True] * 32], 4) == 1.0  # the target as its own draft
    assert acceptance_rate([[False] * 8], 3) == 0.0
    # γ=3 over agree/disagree T F T T T F: accept 1 of 3, then 3 of 3.
    assert acceptance_rate([[True, False, True, True, True, False]], 3) == 4 / 6


def test_a_per_request_policy_gets_request_signals_and_sets_request_gammas(
    make_server: Any,
) -> None:
    """Under dsde the controller names the batch's requests once the sidecar says the
    policy reads them: contexts carry each request's last accepted drafts, outcomes their
    ids, and a request whose acceptance swings gets a γ below the batch's cap (the
    scheduler cuts its drafts to it). Batch policies get none of it."""
    server = make_server(
        "--policy", "dsde", "--params", '{"gamma_max": 3, "calibration_steps": 2, "sl_min": 1}'
    )
    config = PluginConfig(sidecar=server.target, engine_id="seq", deadline_ms=200)
    controller = GammaController(config)
    wait_for(lambda: controller.client.connected)
    ids = ("steady", "erratic")
    batch = dataclasses.replace(view(2), request_ids=ids)
    limits: list[dict[str, int]] = []
    verifying = 0  # γ of the decision the next step verifies
    for step in range(400):  # until the sidecar's histories set a limit (tables refreshed)
        gamma = controller.decide(batch)
        limits.append(controller.request_gammas())
        erratic = verifying if step % 2 else 0
        accepts = (verifying, erratic) if verifying else ()
        controller.end_step(
            VerifiedStep(
                2 * verifying, sum(accepts), 2 + sum(accepts), accepts, ids if verifying else ()
            )
        )
        verifying = gamma
        if step >= 40 and any(limits):
            break
        time.sleep(0.002)
    controller.idle()
    assert controller.wants_request_ids and controller.stats()["request_signals"]
    assert any(limit.get("erratic", 9) < 3 for limit in limits)
    assert all("steady" not in limit for limit in limits)
    state = json.loads(server.admin.GetState(admin_pb2.GetStateRequest(), timeout=5).state_json)
    assert set(state["engines"]["seq"]["requests"]) == set(ids), state
    assert controller.stats()["fallbacks_total"] == 0
    controller.close()


class _RecordingClient(NightjarClient):
    """The real client, without a sidecar: records each step reported as run."""

    def __init__(self, config: ClientConfig) -> None:
        super().__init__(config)
        self.ran_contexts: list[StepContext] = []

    def ran(self, step: TableStep, ctx: StepContext, gamma: int | None = None) -> None:
        self.ran_contexts.append(ctx)
        super().ran(step, ctx, gamma)


def test_a_table_step_builds_no_context_on_the_engines_thread_even_per_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A per-request policy's steps answered by the held table: the engine's thread builds
    no context and no request signals; the thread that settles the journal builds them,
    each request with its accepts in the step verified before (as they were built on the
    engine's thread before)."""
    built_on: list[int] = []
    build = StepContexts.build

    def recording_build(self: StepContexts, *args: Any, **kwargs: Any) -> StepContext:
        built_on.append(threading.get_ident())
        return build(self, *args, **kwargs)

    monkeypatch.setattr(StepContexts, "build", recording_build)
    config = PluginConfig(sidecar=f"unix:{tmp_path}/none.sock", engine_id="named")
    controller = GammaController(config, client_factory=_RecordingClient)
    client = controller.client
    assert isinstance(client, _RecordingClient)
    table = GammaTable(
        "t1",
        "p",
        "v1",
        1,
        (2,) * 8,
        (False,) * 8,
        False,
        0,
        100,
        60_000.0,
        reads_request_signals=True,
    )
    client._tables.install(table, seq=1)
    first = dataclasses.replace(view(2), request_ids=())
    assert controller.decide(first) == 2 and controller.wants_request_ids
    controller.end_step(VerifiedStep(0, 0, 2))
    named = dataclasses.replace(view(3), request_ids=("a", "b", "c"))
    assert controller.decide(named) == 2
    controller.end_step(VerifiedStep(6, 3, 9, (1, 2), ("a", "b")))
    assert controller.decide(named) == 2
    assert threading.get_ident() not in built_on  # nothing built on the engine's thread
    settler = threading.Thread(target=controller.settle)
    settler.start()
    settler.join()
    assert [ctx.requests for ctx in client.ran_contexts] == [
        (),  # the policy's first answer said it reads them: from the next step on
        (RequestSignals("a"), RequestSignals("b"), RequestSignals("c")),
        (
            RequestSignals("a", recent_accepts=(1,)),
            RequestSignals("b", recent_accepts=(2,)),
            RequestSignals("c"),
        ),
    ]
    assert [ctx.step_index for ctx in client.ran_contexts] == [0, 1, 2]
    assert [ctx.previous_gamma for ctx in client.ran_contexts] == [None, 2, 2]
    with pytest.raises(ValueError, match="as many requests"):
        controller.end_step(VerifiedStep(2, 1, 3, (1,), ("a", "b")))
    controller.close()


def test_a_step_the_table_cannot_answer_builds_its_context_off_the_engines_thread(
    make_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A miss (no table yet, then a batch past the held table's edge) is asked of the
    sidecar: the client's sender thread builds the step's context for the request while
    the engine's thread waits; the sidecar decides that context, and the step is reported
    with it, built by the thread that settles the journal."""
    server, log = static_sidecar_logging(make_server, tmp_path)
    built_on: list[int] = []
    build = StepContexts.build

    def recording_build(self: StepContexts, *args: Any, **kwargs: Any) -> StepContext:
        built_on.append(threading.get_ident())
        return build(self, *args, **kwargs)

    config = PluginConfig(sidecar=server.target, engine_id="missing", deadline_ms=500)
    controller = GammaController(config, client_factory=_RecordingClient)
    client = controller.client
    assert isinstance(client, _RecordingClient)
    wait_for(lambda: client.connected)
    monkeypatch.setattr(StepContexts, "build", recording_build)
    engine = threading.get_ident()
    assert controller.decide(view(4)) == 2  # no table held: asked
    controller.end_step(VerifiedStep(0, 0, 4))
    assert controller.decide(view(40)) == 2  # past the held table's edge: asked again
    assert engine not in built_on and built_on  # built, and not by the engine's thread
    stats = controller.stats()
    assert stats["fallbacks_total"] == 0 and stats["sidecar_decisions"] == 2
    assert stats["table_misses"] == {"no_table": 1, "batch_size": 1}
    assert stats["hook_cpu_us_by_path"]["asked"]["n"] == 1  # the ended step's decision
    settler = threading.Thread(target=controller.settle)
    settler.start()
    settler.join()
    ran = client.ran_contexts
    assert [(c.batch_size, c.step_index, c.previous_gamma) for c in ran] == [
        (4, 0, None),
        (40, 1, 2),
    ]
    wait_for(lambda: log.exists() and log.read_text().count('"kind":"decision"') >= 2)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    decided = [r["context"]["batch_size"] for r in records if r.get("kind") == "decision"]
    assert decided[:2] == [4, 40]  # the sidecar decided the contexts the sender built
    controller.close()
