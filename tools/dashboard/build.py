"""The Grafana dashboard `deploy/grafana/nightjar.json`, built with grafana-foundation-sdk.

`make dashboard` writes it; `--check` (run by the test suite) fails when the committed
JSON is not what this module builds. Queries follow the metric names of
`policy_server/metrics.py` (sidecar) and the plugin's and memory agent's metrics in
vLLM's `/metrics` (engine). Two selectors scope every query: `$job`/`$instance` pick
sidecars, `$engine_job`/`$engine` pick vLLM engines; `$datasource` picks the Prometheus.

Longer than most modules, it is one thing: the dashboard's declarative panel list, row by
row, in the PromQL and panel vocabulary of `tools/dashboard/builders.py`.

    python -m tools.dashboard.build [--out deploy/grafana/nightjar.json] [--check]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from grafana_foundation_sdk.builders import bargauge, stat, statetimeline, timeseries
from grafana_foundation_sdk.builders.common import ReduceDataOptions
from grafana_foundation_sdk.builders.dashboard import (
    Dashboard,
    DatasourceVariable,
    QueryVariable,
    Row,
)
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import (
    BarGaugeDisplayMode,
    BigValueTextMode,
    VizOrientation,
)
from grafana_foundation_sdk.models.dashboard import Panel as DashboardPanel
from grafana_foundation_sdk.models.dashboard import (
    VariableModel,
    VariableOption,
    VariableRefresh,
    VariableSort,
)

from tools.dashboard.builders import (
    DATASOURCE,
    ENGINE,
    RANGE,
    RATE,
    SIDECAR,
    graph,
    latency_targets,
    mean,
    series,
    single,
    states,
    summed,
    target,
    targets,
    thresholds,
)

DEFAULT_OUT = Path("deploy/grafana/nightjar.json")
UID = "nightjar-sidecar"

POLICY_INFO = f"max by (name, version) ({series('nightjar_policy_info', SIDECAR)})"
# The counter's series appear with the first defect: a named zero line until then, so that
# the panel says "none" rather than "no data".
POLICY_DEFECTS = (
    f"{summed('increase', 'nightjar_policy_defects_total', SIDECAR, 'policy, kind')}"
    ' or on () label_replace(vector(0), "policy", "no defects", "", "")'
)
# The timestamp is 0 until a sidecar's first snapshot: no age rather than 56 years.
SNAPSHOT_AGE = (
    f"time() - ({series('nightjar_snapshot_last_success_timestamp_seconds', SIDECAR)} > 0)"
)


def overview() -> list[stat.Panel | timeseries.Panel | statetimeline.Panel]:
    # A sidecar that is down has no nightjar_serving sample: count it as not serving.
    serving = (
        f"min({series('nightjar_serving', SIDECAR)}"
        f" or on (job, instance) ({series('up', SIDECAR)} * 0))"
    )
    fallback_steps = series("nightjar_plugin_decisions_total", ENGINE, 'source="fallback"')
    fallback_share = (
        f"sum(rate({fallback_steps}[{RATE}]))"
        f" / {summed('rate', 'nightjar_plugin_decisions_total', ENGINE)}"
    )
    return [
        single(
            "Serving",
            "SERVING when every selected sidecar is up and reports gRPC health SERVING "
            "(a policy is loaded); NOT SERVING if any is down or not serving.",
            target(serving, "serving"),
            mapping={"1": ("SERVING", "green"), "0": ("NOT SERVING", "red")},
        ),
        single(
            "Active policy",
            "The policy the sidecars run and its version (nightjar_policy_info).",
            target(POLICY_INFO, "{{name}} {{version}}"),
            width=6,
            text_mode=BigValueTextMode.NAME,
        ),
        single(
            "Decisions / s",
            "γ decisions the sidecars serve per second.",
            target(summed("rate", "nightjar_decisions_total", SIDECAR), "decisions/s"),
            unit="ops",
        ),
        single(
            "Engines",
            "Engines that asked the sidecars for a decision in the last 5 minutes.",
            target(f"sum({series('nightjar_engines', SIDECAR)})", "engines"),
            width=3,
        ),
        single(
            "Snapshot age",
            "Time since the oldest selected sidecar last wrote its learned state to disk. "
            "Snapshots run every 30 s by default and on SIGTERM.",
            target(f"max({SNAPSHOT_AGE})", "age"),
            unit="s",
            colours=thresholds((None, "green"), (120, "orange"), (600, "red")),
        ),
        single(
            "Fallback share",
            "Share of the engines' steps decided without the sidecar (local fallback "
            "table): it rises when the sidecar is slow or down.",
            target(fallback_share, "fallback"),
            unit="percentunit",
            width=3,
            colours=thresholds((None, "green"), (0.01, "orange"), (0.1, "red")),
        ),
        states(
            "Sidecar up and serving",
            "Per sidecar: scraped (up) and gRPC health SERVING (a policy is loaded).",
            targets(
                (series("up", SIDECAR), "up {{instance}}"),
                (series("nightjar_serving", SIDECAR), "serving {{instance}}"),
            ),
            mapping={"1": ("yes", "green"), "0": ("no", "red")},
            width=12,
            height=6,
        ),
        graph(
            "Decisions and reports",
            "Decisions served and step outcomes received (applied, or stale: the outcome "
            "arrived after its decision left the pending table).",
            targets(
                (summed("rate", "nightjar_decisions_total", SIDECAR), "decisions"),
                (summed("rate", "nightjar_reports_total", SIDECAR, "result"), "reports {{result}}"),
            ),
            unit="ops",
            width=12,
            height=6,
        ),
    ]


def gamma_row() -> list[timeseries.Panel | bargauge.Panel]:
    by_bucket = (
        bargauge.Panel()
        .title("Mean γ by batch size (time range)")
        .description(
            "Average γ the sidecars chose for each decode-batch bucket over the dashboard's "
            "time range: speculation should pay at small batches and stop at large ones."
        )
        .datasource(DATASOURCE)
        .with_target(
            target(
                mean("nightjar_gamma_chosen", SIDECAR, "batch_bucket", RANGE),
                "B {{batch_bucket}}",
                instant=True,
            )
        )
        .span(8)
        .height(8)
        .min(0)
        .decimals(2)
        .orientation(VizOrientation.HORIZONTAL)
        .display_mode(BarGaugeDisplayMode.GRADIENT)
        .reduce_options(ReduceDataOptions().calcs(["lastNotNull"]))
        .thresholds(thresholds((None, "blue")))
    )
    return [
        graph(
            "γ chosen",
            "Decisions per second by the γ chosen (stacked): the draft length mix over time.",
            targets((summed("rate", "nightjar_decisions_total", SIDECAR, "gamma"), "γ={{gamma}}")),
            unit="ops",
            stacked=True,
        ),
        graph(
            "Mean γ by batch size",
            "Average γ chosen per decode-batch bucket (rate of nightjar_gamma_chosen's sum "
            "over its count).",
            targets((mean("nightjar_gamma_chosen", SIDECAR, "batch_bucket"), "B {{batch_bucket}}")),
        ),
        by_bucket,
        graph(
            "Decisions by bin type",
            "explore: the bandit tries an arm; exploit: it plays its best; fixed: a "
            "non-learning policy (static γ = 0 and off included); forced: γ = 0 because no "
            "γ > 0 could run: the draft not resident, or the engine's max_gamma is 0.",
            targets(
                (summed("rate", "nightjar_decisions_total", SIDECAR, "bin_type"), "{{bin_type}}")
            ),
            unit="ops",
            stacked=True,
        ),
        graph(
            "Mean γ: chosen by the sidecar and run by the engines",
            "What the sidecars chose against what the engines actually ran (the plugin's "
            "γ histogram includes fallback and forced steps).",
            targets(
                (mean("nightjar_gamma_chosen", SIDECAR), "chosen (sidecar)"),
                (mean("nightjar_plugin_gamma", ENGINE, "instance"), "run {{instance}}"),
            ),
        ),
        graph(
            "Drafts cut to a request's γ (engine)",
            "Per-sequence γ (goodput with per_request on, dsde): draft tokens the engines' "
            "schedulers cut to their request's own γ below the step's, and the requests "
            "cut, per second. None under a batch-γ policy.",
            targets(
                (summed("rate", "nightjar_plugin_truncated_drafts_total", ENGINE), "tokens"),
                (summed("rate", "nightjar_plugin_truncated_requests_total", ENGINE), "requests"),
            ),
            unit="ops",
        ),
    ]


def goodput_row() -> list[timeseries.Panel]:
    return [
        graph(
            "Goodput by γ",
            "Mean goodput (generated tokens per second of step time) of reported steps, "
            "per γ: the reward the policy learns from.",
            targets((mean("nightjar_goodput_tokens_per_second", SIDECAR, "gamma"), "γ={{gamma}}")),
        ),
        graph(
            "Acceptance by γ",
            "Mean accepted / drafted tokens of reported steps, per γ.",
            targets((mean("nightjar_acceptance_ratio", SIDECAR, "gamma"), "γ={{gamma}}")),
            unit="percentunit",
            maximum=1.0,
        ),
        graph(
            "Step duration",
            "Engine step wall time as reported with the outcomes.",
            latency_targets("nightjar_step_duration_seconds", SIDECAR),
            unit="s",
        ),
    ]


def latency_row() -> list[timeseries.Panel]:
    return [
        graph(
            "Decision latency (sidecar)",
            "Time to compute one decision inside the sidecar.",
            latency_targets("nightjar_decision_latency_seconds", SIDECAR),
            unit="s",
        ),
        graph(
            "Plugin hook time (engine)",
            "Time the plugin adds to each engine step (ask, wait up to the deadline, "
            "report): what speculation control costs the engine.",
            latency_targets("nightjar_plugin_hook_seconds", ENGINE),
            unit="s",
        ),
        graph(
            "Fallbacks by reason (engine)",
            "Steps the engines decided from their local table, by why the sidecar's "
            "answer was not used: deadline (too slow), disconnected or unavailable (down), "
            "rejected (bad step context).",
            targets(
                (summed("rate", "nightjar_plugin_fallbacks_total", ENGINE, "reason"), "{{reason}}")
            ),
            unit="ops",
            stacked=True,
        ),
        graph(
            "Engine decisions by source",
            "Where each engine step's γ came from: sidecar, fallback table, or forced "
            "by the engine (e.g. draft not resident).",
            targets(
                (summed("rate", "nightjar_plugin_decisions_total", ENGINE, "source"), "{{source}}")
            ),
            unit="ops",
            width=12,
            stacked=True,
        ),
        graph(
            "Table misses (engine)",
            "Steps the held decision table could not answer: the engine asked the sidecar "
            "and waited, at most its deadline.",
            targets((summed("rate", "nightjar_plugin_table_misses_total", ENGINE), "misses")),
            unit="ops",
            width=12,
        ),
    ]


def memory_row() -> list[timeseries.Panel | statetimeline.Panel]:
    draft_state = f"max by (engine, state) ({series('nightjar_memory_draft_state', SIDECAR)}) > 0"
    return [
        states(
            "Draft state (sidecar view)",
            "The draft model's state per engine as the sidecar's memory controller sees "
            "it: resident, offloading, offloaded, reloading (one lane per state).",
            targets((draft_state, "{{engine}} {{state}}")),
        ),
        states(
            "Draft resident (memory agent)",
            "Whether the draft's weights are on the device, per engine (memory agent).",
            targets((series("nightjar_memory_agent_draft_resident", ENGINE), "{{instance}}")),
            mapping={"1": ("resident", "green"), "0": ("offloaded", "orange")},
        ),
        graph(
            "Memory directives (sidecar)",
            "Offload-draft/expand-KV and compact-KV/reload-draft orders the sidecar sent.",
            targets(
                (
                    summed("increase", "nightjar_memory_directives_total", SIDECAR, "action"),
                    "{{action}}",
                )
            ),
            bars=True,
        ),
        graph(
            "Memory orders (memory agent)",
            "Orders the memory agents carried out, by action and result.",
            targets(
                (
                    summed(
                        "increase", "nightjar_memory_agent_orders_total", ENGINE, "action, result"
                    ),
                    "{{action}} {{result}}",
                )
            ),
            width=12,
            bars=True,
        ),
        graph(
            "Memory order time (memory agent)",
            "How long an order holds the engine at a step boundary.",
            latency_targets("nightjar_memory_agent_order_seconds", ENGINE),
            unit="s",
            width=12,
        ),
    ]


def policy_row() -> list[timeseries.Panel | statetimeline.Panel]:
    return [
        states(
            "Policy version",
            "The active policy and version over time (one lane per version): a new lane "
            "starts at a swap, a parameter change, a restore or a reset.",
            targets((POLICY_INFO, "{{name}} {{version}}")),
        ),
        graph(
            "Policy swaps",
            "Policy activations (swap, set-params, restore, reset) by result; a failed "
            "swap keeps the old policy.",
            targets(
                (summed("increase", "nightjar_policy_swaps_total", SIDECAR, "result"), "{{result}}")
            ),
            bars=True,
        ),
        graph(
            "Policy defects",
            "Policy answers the sidecar corrected, by policy and kind (gamma_clamped: a γ "
            "the engine cannot run, clamped). Zero unless a policy is defective; the "
            "NightjarPolicyDefect alert fires on any.",
            targets((POLICY_DEFECTS, "{{policy}} {{kind}}")),
            bars=True,
        ),
        graph(
            "Snapshots",
            "Learned-state snapshots written per second, by result (ok, failed).",
            targets((summed("rate", "nightjar_snapshots_total", SIDECAR, "result"), "{{result}}")),
            unit="ops",
            width=12,
        ),
        graph(
            "Snapshot age per sidecar",
            "Time since each sidecar last wrote its learned state: it should saw-tooth "
            "at the snapshot interval; a steady climb means snapshots fail.",
            targets((SNAPSHOT_AGE, "{{instance}}")),
            unit="s",
            width=12,
        ),
        graph(
            "Rejected requests",
            "Requests refused with a gRPC error, by method and status code: a client "
            "sending bad input, or an admin call without the token.",
            targets(
                (
                    summed("rate", "nightjar_invalid_requests_total", SIDECAR, "method, code"),
                    "{{method}} {{code}}",
                )
            ),
            unit="ops",
            width=12,
        ),
        graph(
            "Expired decisions",
            "Decisions dropped from the pending table without an outcome (an engine "
            "that stopped reporting, or reports that arrive too late).",
            targets((summed("rate", "nightjar_decisions_expired_total", SIDECAR), "expired")),
            unit="ops",
            width=12,
        ),
    ]


def variables() -> list[cogbuilder.Builder[VariableModel]]:
    def query(name: str, label: str, expr: str) -> QueryVariable:
        return (
            QueryVariable(name)
            .label(label)
            .datasource(DATASOURCE)
            .query(expr)
            .definition(expr)
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(VariableSort.ALPHABETICAL_ASC)
            .multi(True)
            .include_all(True)
            # All = any value, also series without the label; selected when opened.
            .all_value(".*")
            .current(VariableOption(selected=True, text=["All"], value=["$__all"]))
        )

    return [
        DatasourceVariable("datasource").label("Prometheus").type("prometheus"),
        query("job", "Sidecar job", "label_values(nightjar_policy_info, job)"),
        query("instance", "Sidecar", 'label_values(nightjar_policy_info{job=~"$job"}, instance)'),
        query("engine_job", "Engine job", "label_values(nightjar_plugin_decisions_total, job)"),
        query(
            "engine",
            "Engine",
            'label_values(nightjar_plugin_decisions_total{job=~"$engine_job"}, instance)',
        ),
    ]


def build() -> Dashboard:
    board = (
        Dashboard("Nightjar: speculative decoding control")
        .uid(UID)
        .description(
            "γ decisions, goodput, fallbacks, latency, draft memory and policy state of "
            "the Nightjar sidecars and the vLLM engines they steer."
        )
        .tags(["nightjar", "vllm", "speculative-decoding"])
        .time("now-1h", "now")
        .refresh("30s")
        .timezone("browser")
        .editable()
        .variables(variables())
    )
    rows: list[tuple[str, Sequence[cogbuilder.Builder[DashboardPanel]]]] = [
        ("Overview", overview()),
        ("γ (draft length)", gamma_row()),
        ("Goodput and acceptance", goodput_row()),
        ("Latency and fallbacks", latency_row()),
        ("Draft memory", memory_row()),
        ("Policy and state", policy_row()),
    ]
    for title, panels in rows:
        board = board.with_row(Row(title))
        for panel in panels:
            board = board.with_panel(panel)
    return board


def render() -> str:
    """The dashboard's JSON text, stable across runs (sorted keys, panel ids in order)."""
    model = build().build()
    for number, panel in enumerate(model.panels or [], start=1):
        panel.id_val = number
    return JSONEncoder(sort_keys=True, indent=2).encode(model) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--check", action="store_true", help="fail if --out differs from what is built"
    )
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is out of date: run `make dashboard`", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
