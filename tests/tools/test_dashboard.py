"""The Grafana dashboard: built by the SDK, committed as built, its queries run on Prometheus."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.policy_server.test_prometheus import vllm_server  # noqa: F401 (fixture: vllm serve + a sidecar)
from tools.dashboard import panels, query, render

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "nightjar.json"


def test_committed_dashboard_is_what_the_builder_builds() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tools.dashboard.build", "--check", "--out", str(DASHBOARD)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr


def test_check_fails_on_a_stale_file(tmp_path: Path) -> None:
    stale = tmp_path / "nightjar.json"
    board: dict[str, Any] = json.loads(DASHBOARD.read_text())
    board["title"] = "edited by hand"
    stale.write_text(json.dumps(board, indent=2, sort_keys=True) + "\n")
    result = subprocess.run(
        [sys.executable, "-m", "tools.dashboard.build", "--check", "--out", str(stale)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 1
    assert "make dashboard" in result.stderr


def test_the_bin_type_panel_says_what_forced_and_fixed_cover() -> None:
    """A configured γ = 0 (static γ = 0, as off) decides bin_type "fixed"; "forced" is
    γ = 0 that no γ > 0 could replace (the draft not resident); the panel says both."""
    from nightjar_common.types import BinType, StepContext
    from policy_server.service import DecisionService

    ctx = StepContext("e", batch_size=2)
    for name, params in (("static", {"gamma": 0}), ("off", {})):
        assert DecisionService(name, params).run_step(ctx).table.reason is BinType.FIXED
    away = StepContext("e", batch_size=2, draft_resident=False)
    assert DecisionService("static", {"gamma": 2}).run_step(away).table.reason is BinType.FORCED
    board: dict[str, Any] = json.loads(DASHBOARD.read_text())
    panel = next(p for p in board["panels"] if p.get("title") == "Decisions by bin type")
    assert "static γ = 0" in panel["description"] and "not resident" in panel["description"]


def test_template_variables_are_substituted_in_every_grafana_syntax() -> None:
    values = {"job": "a|b", "__rate_interval": "4s"}
    assert (
        panels.expand('rate(x{job=~"$job"}[$__rate_interval]) + y{job=~"${job}"} + [[job]]', values)
        == 'rate(x{job=~"a|b"}[4s]) + y{job=~"a|b"} + a|b'
    )
    with pytest.raises(KeyError, match=r"\$instance"):
        panels.expand('up{instance=~"$instance"}', values)
    assert panels.legend("{{name}} {{ version }}", {"name": "nightjar", "version": "r2"}) == (
        "nightjar r2"
    )
    # Grafana's $__rate_interval: at least four scrapes, and one step more than a scrape.
    assert panels.rate_interval(step_s=1, scrape_interval_s=15) == 60
    assert panels.rate_interval(step_s=120, scrape_interval_s=15) == 135


# -- the queries against a real Prometheus scraping a driven sidecar ---------------------------

DRIVE_SECONDS = 24.0


@dataclasses.dataclass(frozen=True)
class Run:
    prom: Any
    summary: Any
    board: panels.Board
    window: query.Window
    values: dict[str, str]

    def expand(self, expr: str) -> str:
        return panels.expand(expr, {**self.window.builtins(), **self.values})


@pytest.fixture(scope="module")
def run(make_server_module: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    from tests.rigs.prometheus import PrometheusRig
    from tools.dashboard.screenshot import SIDECAR_ARGS, SIDECAR_JOB, reject_one, standard_run

    server = make_server_module(*SIDECAR_ARGS)
    jobs = {SIDECAR_JOB: [f"127.0.0.1:{server.metrics_port}"]}
    with PrometheusRig(tmp_path_factory.mktemp("prometheus"), jobs) as prom:
        prom.wait_for(f'up{{job="{SIDECAR_JOB}"}} == 1')
        assert reject_one(server.target) == "rejected"
        summary = standard_run(server.target, server.auth, DRIVE_SECONDS, steps_per_second=60)
        time.sleep(3 * prom.scrape_interval_s)  # the last samples scraped
        window = query.Window(summary.start, summary.end, 1.0, prom.scrape_interval_s)
        values = {"job": SIDECAR_JOB, "instance": ".*", "engine_job": ".*", "engine": ".*"}
        yield Run(prom, summary, panels.load(DASHBOARD), window, values)


def test_every_panel_query_is_accepted_by_prometheus(run: Run) -> None:
    """All of them, the engine side's included: bad PromQL is a 400 with the reason."""
    rejected = []
    for panel, target in run.board.queries:
        try:
            run.prom.query(run.expand(target.expr), at=run.window.end)
        except Exception as exc:
            rejected.append(f"{panel.title} [{target.ref}]: {exc}")
    assert not rejected, "\n".join(rejected)
    assert len(run.board.queries) >= 30
    titles = [p.title for p in run.board.panels]
    assert len(titles) == len(set(titles)), "panel titles name panels in docs and tests"


def test_template_variables_resolve_to_the_scraped_targets(run: Run) -> None:
    """label_values(metric{…}, label), as Grafana asks it: /api/v1/label/<label>/values."""
    found = {}
    for variable in run.board.variables:
        if variable.type != "query":
            continue
        match = re.fullmatch(r"label_values\((.+), (\w+)\)", variable.query)
        assert match, variable.query
        series, label = match.groups()
        found[variable.name] = run.prom.api(
            f"label/{label}/values", **{"match[]": run.expand(series)}
        )
    assert found["job"] == [run.values["job"]]
    assert len(found["instance"]) == 1 and found["instance"][0].startswith("127.0.0.1:")
    # No engine in this run: the engine variables are valid queries with no values.
    assert found["engine_job"] == [] and found["engine"] == []


def sidecar_panels(board: panels.Board) -> list[panels.Panel]:
    return [p for p in board.panels if p.targets and all("$job" in t.expr for t in p.targets)]


def test_every_sidecar_panel_returns_data(run: Run) -> None:
    drawn = {}
    for panel in sidecar_panels(run.board):
        series = query.fetch(run.prom, panel, run.window, run.values)
        drawn[panel.title] = sum(1 for s in series if any(math.isfinite(v) for v in s.values))
    empty = [title for title, n in drawn.items() if n == 0]
    assert not empty, f"panels without data after the driven run: {empty}"
    assert len(drawn) >= 20


def series_of(run: Run, title: str) -> dict[str, list[float]]:
    (panel,) = [p for p in run.board.panels if p.title == title]
    return {s.name: s.values for s in query.fetch(run.prom, panel, run.window, run.values)}


def test_the_panels_show_what_the_run_did(run: Run) -> None:
    summary = run.summary
    # The sidecar decided the run (a busy test machine may push a step past the deadline).
    assert summary.sidecar_decisions >= 0.98 * summary.steps
    # Every bin type the run produced is a series of its panel.
    by_bin = series_of(run, "Decisions by bin type")
    assert set(by_bin) == set(summary.bin_types) == {"explore", "exploit", "fixed", "forced"}
    # Speculation pays at small batches and hurts at large ones in the step model: the
    # learned γ falls with the batch size. (Not against a fixed bound: the time range
    # includes the static γ = 2 phase, and where the swap lands moves the large bucket's
    # mean around 1.5 on a busy machine.)
    by_bucket = {k: v[-1] for k, v in series_of(run, "Mean γ by batch size (time range)").items()}
    assert by_bucket["B 1"] > by_bucket["B 256+"], by_bucket
    # The initial policy, the static one swapped in, and Nightjar again.
    versions = series_of(run, "Policy version")
    assert len(versions) == 3 and sum(name.startswith("static ") for name in versions) == 1
    swaps = series_of(run, "Policy swaps")
    assert max(swaps["failed"]) >= 1 and max(swaps["ok"]) >= 1
    # No policy of the run is defective: the panel says so with its named zero line.
    defects = series_of(run, "Policy defects")
    assert list(defects) == ["no defects"] and set(defects["no defects"]) == {0.0}
    rejected = series_of(run, "Rejected requests")
    assert {"StepStream INVALID_ARGUMENT", "SwapPolicy UNAUTHENTICATED"} <= set(rejected)
    # The memory controller offloaded the draft at large batches and took it back.
    assert "offload_draft_expand_kv" in summary.memory_orders
    assert {"offload_draft_expand_kv", "compact_kv_reload_draft"} <= set(
        series_of(run, "Memory directives (sidecar)")
    )
    assert series_of(run, "Serving")["serving"] == [1.0]
    (age,) = series_of(run, "Snapshot age").values()
    assert 0 <= age[-1] < 5  # snapshots every 2 s in this run


def test_renderer_draws_the_dashboard(run: Run, tmp_path: Path) -> None:
    out = tmp_path / "dashboard.png"
    drawn = render.render(run.board, run.prom, run.window, run.values, out)
    graphs = [p for p in run.board.panels if p.type != "row"]
    assert set(drawn) == {p.title for p in graphs}
    assert all(drawn[p.title] > 0 for p in sidecar_panels(run.board))
    from matplotlib import image

    height, width, _ = image.imread(out).shape
    assert width == round(24 * render.COLUMN_IN * render.DPI)
    assert height > width


# -- the engine's panels, from a real `vllm serve` with the plugin -----------------------------


def engine_panels(board: panels.Board) -> list[panels.Panel]:
    return [
        p for p in board.panels if p.targets and all("$engine_job" in t.expr for t in p.targets)
    ]


@pytest.mark.slow
def test_engine_panels_return_data_from_a_live_vllm(
    vllm_server: dict[str, Any],  # noqa: F811 (the fixture of tests/policy_server/test_prometheus.py)
    make_prometheus: Any,
) -> None:
    """Completions through a vLLM OpenAI server whose plugin asks the sidecar, which is
    stopped for a few seconds midway: the engine falls back, then reconnects."""
    from tools.dashboard.screenshot import ENGINE_JOB, SIDECAR_JOB, serve_load

    sidecar = vllm_server["sidecar"]
    prom = make_prometheus(
        {
            SIDECAR_JOB: [f"127.0.0.1:{sidecar.metrics_port}"],
            ENGINE_JOB: [f"127.0.0.1:{vllm_server['port']}"],
        }
    )
    stop = threading.Event()
    start = time.time()
    load = serve_load(vllm_server["base"], stop, concurrency=2)
    try:
        prom.wait_for('nightjar_plugin_decisions_total{source="sidecar"} > 0', timeout=60)
        sidecar.terminate()
        prom.wait_for(f'nightjar_plugin_fallbacks_total{{job="{ENGINE_JOB}"}} > 0', timeout=60)
        sidecar.start()
        prom.wait_for(
            'increase(nightjar_plugin_decisions_total{source="sidecar"}[3s]) > 0', timeout=60
        )
    finally:
        stop.set()
        for thread in load:
            thread.join(timeout=130)
    time.sleep(3 * prom.scrape_interval_s)
    board = panels.load(DASHBOARD)
    window = query.Window(start, time.time(), 1.0, prom.scrape_interval_s)
    values = {"job": SIDECAR_JOB, "instance": ".*", "engine_job": ENGINE_JOB, "engine": ".*"}
    # The memory agent does not run under `vllm serve` on CPU (the model runs in a worker
    # process of its own, docs/MEMORY.md): its panels are checked for valid PromQL only.
    checked = [p for p in engine_panels(board) if "memory agent" not in p.title]
    assert len(checked) >= 5
    found: dict[str, dict[str, list[float]]] = {}
    for panel in checked:
        series = query.fetch(prom, panel, window, values)
        found[panel.title] = {s.name: [v for v in s.values if math.isfinite(v)] for s in series}
    assert not [title for title, series in found.items() if not any(series.values())], found
    # The restart is in the engine's panels: fallbacks by reason, and by source.
    fallbacks = found["Fallbacks by reason (engine)"]
    assert max(max(fallbacks.get(r, [0.0])) for r in ("disconnected", "unavailable")) > 0
    assert max(found["Engine decisions by source"]["fallback"]) > 0
    assert max(found["Engine decisions by source"]["sidecar"]) > 0
    hook = found["Plugin hook time (engine)"]
    assert 0 < max(hook["p50"]) <= max(hook["p99"]) < 1.0
