"""Read a Grafana dashboard's JSON: panels in grid order, their queries, template variables.

The renderer and the tests look at the committed `deploy/grafana/nightjar.json`, not at the
builder, so what they check is what an operator imports. Only stdlib: no Grafana SDK needed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# $name, ${name} and ${name:format}, [[name]]: Grafana's template-variable syntaxes.
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)")
_LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")


@dataclass(frozen=True, slots=True)
class Target:
    ref: str
    expr: str
    legend: str
    instant: bool


@dataclass(frozen=True, slots=True)
class Grid:
    x: int
    y: int
    w: int
    h: int


@dataclass(frozen=True, slots=True)
class Panel:
    id: int
    type: str  # "row", "timeseries", "stat", "bargauge"
    title: str
    description: str
    grid: Grid
    targets: tuple[Target, ...] = ()
    unit: str = "short"
    minimum: float | None = None
    maximum: float | None = None
    decimals: int | None = None
    stacked: bool = False
    draw_style: str = "line"
    step_lines: bool = False
    # Stat value mappings: value text → (display text, colour).
    mappings: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    # Stat thresholds: (lower bound or None for the base, colour), ascending.
    thresholds: tuple[tuple[float | None, str], ...] = ()
    text_mode: str = "value"


@dataclass(frozen=True, slots=True)
class Variable:
    name: str
    type: str
    query: str


@dataclass(frozen=True, slots=True)
class Board:
    title: str
    uid: str
    panels: tuple[Panel, ...]
    variables: tuple[Variable, ...]

    @property
    def queries(self) -> list[tuple[Panel, Target]]:
        return [(panel, target) for panel in self.panels for target in panel.targets]


def load(path: Path) -> Board:
    raw: dict[str, Any] = json.loads(Path(path).read_text())
    panels = sorted((_panel(p) for p in raw.get("panels", [])), key=lambda p: (p.grid.y, p.grid.x))
    variables = tuple(
        Variable(v["name"], v["type"], _query_text(v.get("query", "")))
        for v in raw.get("templating", {}).get("list", [])
    )
    return Board(raw.get("title", ""), raw.get("uid", ""), tuple(panels), variables)


def expand(text: str, values: Mapping[str, str]) -> str:
    """Substitute template variables; a variable without a value is an error, not a blank."""

    def value(match: re.Match[str]) -> str:
        name = next(g for g in match.groups() if g)
        if name not in values:
            raise KeyError(f"no value for template variable ${name} in {text!r}")
        return values[name]

    return _VARIABLE.sub(value, text)


def legend(template: str, labels: Mapping[str, str]) -> str:
    """Grafana's legend format: {{label}} → the series' label value."""
    return _LEGEND_LABEL.sub(lambda m: labels.get(m.group(1), ""), template).strip()


def rate_interval(step_s: float, scrape_interval_s: float) -> float:
    """Grafana's $__rate_interval: max($__interval + scrape interval, 4 × scrape interval)."""
    return max(step_s + scrape_interval_s, 4 * scrape_interval_s)


def _panel(raw: Mapping[str, Any]) -> Panel:
    grid = raw.get("gridPos", {})
    defaults = raw.get("fieldConfig", {}).get("defaults", {})
    custom = defaults.get("custom", {})
    mappings: dict[str, tuple[str, str]] = {}
    for mapping in defaults.get("mappings", []):
        for key, result in mapping.get("options", {}).items():
            mappings[key] = (result.get("text", key), result.get("color", ""))
    steps = defaults.get("thresholds", {}).get("steps", [])
    return Panel(
        id=int(raw.get("id", 0)),
        type=raw["type"],
        title=raw.get("title", ""),
        description=raw.get("description", ""),
        grid=Grid(grid.get("x", 0), grid.get("y", 0), grid.get("w", 12), grid.get("h", 8)),
        targets=tuple(
            Target(
                t.get("refId", ""),
                t["expr"],
                t.get("legendFormat", ""),
                bool(t.get("instant", False)) and not t.get("range", False),
            )
            for t in raw.get("targets", [])
        ),
        unit=defaults.get("unit", "short"),
        minimum=defaults.get("min"),
        maximum=defaults.get("max"),
        decimals=defaults.get("decimals"),
        stacked=custom.get("stacking", {}).get("mode", "none") != "none",
        draw_style=custom.get("drawStyle", "line"),
        step_lines=custom.get("lineInterpolation") == "stepAfter",
        mappings=mappings,
        thresholds=tuple((s.get("value"), s.get("color", "")) for s in steps),
        text_mode=raw.get("options", {}).get("textMode", "value"),
    )


def _query_text(query: str | Mapping[str, Any]) -> str:
    return query if isinstance(query, str) else str(query.get("query", ""))
