"""The vocabulary `tools/dashboard/build.py` writes the Grafana dashboard in.

PromQL (a series under a selector, summed rates and increases, a histogram's mean and
quantiles) and the panels (graphs, state timelines, stats) with the house style, over
grafana-foundation-sdk. Every query reads the `$datasource` Prometheus; `SIDECAR` and
`ENGINE` are the selectors that scope a query to the chosen sidecars or vLLM engines.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import stat, statetimeline, timeseries
from grafana_foundation_sdk.builders.common import (
    ReduceDataOptions,
    StackingConfig,
    VizLegendOptions,
)
from grafana_foundation_sdk.builders.dashboard import FieldColor, ThresholdsConfig
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog import variants as cogvariants
from grafana_foundation_sdk.models.common import (
    BigValueColorMode,
    BigValueGraphMode,
    BigValueTextMode,
    DataSourceRef,
    GraphDrawStyle,
    LegendDisplayMode,
    LegendPlacement,
    StackingMode,
    VisibilityMode,
)
from grafana_foundation_sdk.models.dashboard import (
    FieldColorModeId,
    Threshold,
    ThresholdsMode,
    ValueMap,
    ValueMapping,
    ValueMappingResult,
)

DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
SIDECAR = 'job=~"$job", instance=~"$instance"'
ENGINE = 'job=~"$engine_job", instance=~"$engine"'
RATE = "$__rate_interval"
RANGE = "$__range"

Query = cogbuilder.Builder[cogvariants.Dataquery]


def series(metric: str, selector: str, *matchers: str) -> str:
    return metric + "{" + ", ".join((selector, *matchers)) + "}"


def summed(fn: str, metric: str, selector: str, by: str = "", window: str = RATE) -> str:
    """`sum [by (labels)] (fn(metric{selector}[window]))`, fn = rate or increase."""
    group = f" by ({by})" if by else ""
    return f"sum{group} ({fn}({series(metric, selector)}[{window}]))"


def mean(histogram: str, selector: str, by: str = "", window: str = RATE) -> str:
    """Mean observation of a histogram over `window`: its _sum's rate over its _count's."""
    fn = "increase" if window == RANGE else "rate"
    return (
        f"{summed(fn, histogram + '_sum', selector, by, window)}"
        f" / {summed(fn, histogram + '_count', selector, by, window)}"
    )


def quantile(q: float, histogram: str, selector: str) -> str:
    return f"histogram_quantile({q}, {summed('rate', histogram + '_bucket', selector, 'le')})"


def target(expr: str, legend: str, ref: str = "A", instant: bool = False) -> Query:
    query = Dataquery().expr(expr).legend_format(legend).ref_id(ref)
    return query.instant() if instant else query.range()


def targets(*pairs: tuple[str, str]) -> list[Query]:
    """Range queries (expr, legend) with ref ids A, B, …"""
    return [target(expr, legend, chr(ord("A") + i)) for i, (expr, legend) in enumerate(pairs)]


def latency_targets(histogram: str, selector: str) -> list[Query]:
    return targets(
        (quantile(0.5, histogram, selector), "p50"),
        (quantile(0.99, histogram, selector), "p99"),
    )


def graph(
    title: str,
    description: str,
    queries: list[Query],
    *,
    unit: str = "short",
    width: int = 8,
    height: int = 8,
    stacked: bool = False,
    bars: bool = False,
    minimum: float | None = 0.0,
    maximum: float | None = None,
) -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .targets(queries)
        .unit(unit)
        .span(width)
        .height(height)
        .fill_opacity(60 if stacked or bars else 10)
        .legend(
            VizLegendOptions()
            .show_legend(True)
            .display_mode(LegendDisplayMode.LIST)
            .placement(LegendPlacement.BOTTOM)
        )
    )
    if minimum is not None:
        panel = panel.min(minimum)
    if maximum is not None:
        panel = panel.max(maximum)
    if stacked:
        panel = panel.stacking(StackingConfig().mode(StackingMode.NORMAL))
    if bars:
        panel = panel.draw_style(GraphDrawStyle.BARS)
    return panel


def thresholds(*steps: tuple[float | None, str]) -> ThresholdsConfig:
    return (
        ThresholdsConfig()
        .mode(ThresholdsMode.ABSOLUTE)
        .steps([Threshold(value=value, color=color) for value, color in steps])
    )


def value_map(mapping: dict[str, tuple[str, str]]) -> list[ValueMapping]:
    """Value → (display text, colour) for stats and state timelines."""
    options = {
        value: ValueMappingResult(text=text, color=color, index=index)
        for index, (value, (text, color)) in enumerate(mapping.items())
    }
    return [ValueMap(options=options)]


def states(
    title: str,
    description: str,
    queries: list[Query],
    *,
    mapping: dict[str, tuple[str, str]] | None = None,
    width: int = 8,
    height: int = 8,
) -> statetimeline.Panel:
    """A state timeline: one lane per series; coloured by `mapping`, else by series."""
    panel = (
        statetimeline.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .targets(queries)
        .span(width)
        .height(height)
        .show_value(VisibilityMode.AUTO)
        .merge_values(True)
        .fill_opacity(80)
        .legend(VizLegendOptions().show_legend(False))
    )
    if mapping:
        return panel.mappings(value_map(mapping)).color_scheme(
            FieldColor().mode(FieldColorModeId.THRESHOLDS)
        )
    return panel.color_scheme(FieldColor().mode(FieldColorModeId.PALETTE_CLASSIC))


def single(
    title: str,
    description: str,
    query: Query,
    *,
    unit: str = "short",
    width: int = 4,
    text_mode: BigValueTextMode = BigValueTextMode.VALUE,
    colours: ThresholdsConfig | None = None,
    mapping: dict[str, tuple[str, str]] | None = None,
) -> stat.Panel:
    panel = (
        stat.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .with_target(query)
        .unit(unit)
        .span(width)
        .height(4)
        .text_mode(text_mode)
        .graph_mode(BigValueGraphMode.NONE)
        .color_mode(BigValueColorMode.VALUE if colours or mapping else BigValueColorMode.NONE)
        .reduce_options(ReduceDataOptions().calcs(["lastNotNull"]))
        .thresholds(colours or thresholds((None, "text")))
    )
    if mapping:
        panel = panel.mappings(value_map(mapping))
    return panel
