"""Draw a Grafana dashboard's panels from a Prometheus, without Grafana (matplotlib).

Every panel of the dashboard JSON is placed on its grid position; each query is run over
the time range (`tools/dashboard/query.py`: `query_range` for graphs, an instant query at
the end for stats and bar gauges) with the template variables substituted, and drawn the
way Grafana would draw it: lines, stacked areas, bars, big numbers with value mappings and
thresholds. A panel whose queries return nothing says "No data". Used for the docs'
screenshot; also handy to look at a Prometheus from a terminal:

    python -m tools.dashboard.render --prometheus http://127.0.0.1:9090 --minutes 30 \\
        --var job=nightjar --out dashboard.png
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from tools.dashboard import panels as dash
from tools.dashboard.query import PrometheusHTTP, PrometheusSource, Series, Window, fetch

DEFAULT_DASHBOARD = Path("deploy/grafana/nightjar.json")

# Grafana's dark theme and classic palette.
BACKGROUND, PANEL, GRID, TEXT, MUTED = "#111217", "#181b1f", "#2c3235", "#ccccdc", "#8e8e8e"
PALETTE = (
    "#73bf69",
    "#f2cc0c",
    "#8ab8ff",
    "#ff780a",
    "#f2495c",
    "#5794f2",
    "#b877d9",
    "#705da0",
    "#37872d",
    "#fade2a",
    "#447ebc",
    "#c15c17",
)
NAMED = {
    "green": "#73bf69",
    "orange": "#ff9830",
    "red": "#f2495c",
    "blue": "#5794f2",
    "yellow": "#fade2a",
    "purple": "#b877d9",
    "text": TEXT,
}
# Grid units in inches: 24 columns across; Grafana's rows are 30 px on a ~1800 px screen.
COLUMN_IN, ROW_IN, DPI = 0.6, 0.3, 100


def render(
    board: dash.Board,
    source: PrometheusSource,
    window: Window,
    values: Mapping[str, str],
    out: Path,
) -> dict[str, int]:
    """Draw every panel into `out` (PNG); returns the number of series drawn per panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = 24 * COLUMN_IN
    height = max(p.grid.y + p.grid.h for p in board.panels) * ROW_IN + 0.7
    fig = plt.figure(figsize=(width, height), facecolor=BACKGROUND)
    fig.text(0.006, 1 - 0.35 / height, board.title, color=TEXT, fontsize=16, va="center")
    span = datetime.fromtimestamp(window.start).strftime("%Y-%m-%d %H:%M:%S")
    fig.text(
        0.994,
        1 - 0.35 / height,
        f"{span} + {(window.end - window.start) / 60:.1f} min",
        color=MUTED,
        fontsize=10,
        va="center",
        ha="right",
    )
    drawn: dict[str, int] = {}

    def box(grid: dash.Grid) -> tuple[float, float, float, float]:
        left = grid.x * COLUMN_IN / width
        top = (grid.y * ROW_IN + 0.7) / height
        return (
            left,
            1 - top - grid.h * ROW_IN / height,
            grid.w * COLUMN_IN / width,
            (grid.h * ROW_IN / height),
        )

    for panel in board.panels:
        x, y, w, h = box(panel.grid)
        if panel.type == "row":
            fig.text(
                x + 0.004,
                y + h / 2,
                panel.title,
                color=TEXT,
                fontsize=13,
                fontweight="bold",
                va="center",
            )
            continue
        pad_x, pad_y = 0.06 / width, 0.06 / height
        frame = fig.add_axes((x + pad_x, y + pad_y, w - 2 * pad_x, h - 2 * pad_y))
        frame.set_facecolor(PANEL)
        frame.set_xticks([])
        frame.set_yticks([])
        for spine in frame.spines.values():
            spine.set_color(GRID)
        title_y = 1 - 0.22 / (h * height)
        frame.text(
            0.012,
            title_y,
            panel.title,
            color=TEXT,
            fontsize=10.5,
            fontweight="bold",
            va="center",
            transform=frame.transAxes,
        )
        series = fetch(source, panel, window, values)
        drawn[panel.title] = len(series)
        if not series:
            frame.text(
                0.5,
                0.45,
                "No data",
                color=MUTED,
                fontsize=12,
                ha="center",
                va="center",
                transform=frame.transAxes,
            )
            continue
        # Left margin for the y labels: numbers on graphs, series names on lanes and bars.
        left_in = 0.55
        if panel.type in ("state-timeline", "bargauge"):
            longest = max(len(s.name) for s in series)
            left_in = min(0.45 * panel.grid.w * COLUMN_IN, 0.15 + 0.068 * longest)
        inner = (
            x + pad_x + left_in / width,
            y + pad_y + 0.5 / height,
            w - 2 * pad_x - (left_in + 0.15) / width,
            h - 2 * pad_y - 0.95 / height,
        )
        if panel.type == "stat":
            _stat(frame, panel, series)
        elif panel.type == "bargauge":
            _bargauge(fig.add_axes(inner), panel, series)
        elif panel.type == "state-timeline":
            _states(fig.add_axes(inner), panel, series, window)
        else:
            _timeseries(fig.add_axes(inner), panel, series, window)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI, facecolor=BACKGROUND)
    plt.close(fig)
    return drawn


def format_value(value: float, unit: str, decimals: int | None = None) -> str:
    if math.isnan(value):
        return "NaN"
    if unit == "percentunit":
        return f"{value * 100:.{1 if decimals is None else decimals}f}%"
    if unit == "s":
        for scale, suffix in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
            if abs(value) >= scale or scale == 1e-6:
                return f"{value / scale:.3g} {suffix}"
    text = f"{value:.{decimals}f}" if decimals is not None else f"{value:.3g}"
    return text + (" /s" if unit == "ops" else "")


def _colour(name: str) -> str:
    return NAMED.get(name, name) or TEXT


def _stat(frame: Any, panel: dash.Panel, series: list[Series]) -> None:
    shown = series[:3]
    for i, item in enumerate(shown):
        value = item.values[-1]
        key = f"{value:g}"
        if key in panel.mappings:
            text, colour = panel.mappings[key][0], _colour(panel.mappings[key][1])
        else:
            text = item.name if panel.text_mode == "name" else format_value(value, panel.unit)
            colour = TEXT
            for bound, named in panel.thresholds:
                if bound is None or value >= bound:
                    colour = _colour(named)
        size = 20 if len(text) < 12 else 14 if len(text) < 22 else 11
        frame.text(
            0.5,
            0.42 - i * 0.22 + (len(shown) - 1) * 0.11,
            text,
            color=colour,
            fontsize=size,
            fontweight="bold",
            ha="center",
            va="center",
            transform=frame.transAxes,
        )


def _natural(name: str) -> tuple[float, str]:
    number = re.search(r"\d+(\.\d+)?", name)
    return (float(number.group()) if number else math.inf, name)


def _bargauge(ax: Any, panel: dash.Panel, series: list[Series]) -> None:
    ordered = sorted(series, key=lambda s: _natural(s.name))
    names = [s.name for s in ordered]
    values = [0.0 if math.isnan(s.values[-1]) else s.values[-1] for s in ordered]
    _style(ax)
    ax.barh(range(len(values)), values, color=PALETTE[5], height=0.7)
    ax.set_yticks(range(len(values)), names, fontsize=8, color=TEXT)
    ax.invert_yaxis()
    top = max(values, default=0.0) or 1.0
    ax.set_xlim(0, top * 1.2)
    for i, value in enumerate(values):
        ax.text(
            value + top * 0.02,
            i,
            format_value(value, panel.unit, panel.decimals),
            color=TEXT,
            fontsize=8,
            va="center",
        )


def _timeseries(ax: Any, panel: dash.Panel, series: list[Series], window: Window) -> None:
    import numpy as np
    from matplotlib import ticker

    _style(ax)
    minutes = window.minutes()
    columns = [window.on_grid(item) for item in series]
    colours = [PALETTE[i % len(PALETTE)] for i in range(len(series))]
    if panel.stacked:
        ax.stackplot(
            minutes,
            *[np.nan_to_num(c) for c in columns],
            colors=colours,
            labels=[s.name for s in series],
            alpha=0.75,
            linewidth=0,
        )
    elif panel.draw_style == "bars":
        bottom = np.zeros(len(minutes))
        for item, column, colour in zip(series, columns, colours, strict=True):
            height = np.nan_to_num(column)
            ax.bar(
                minutes,
                height,
                bottom=bottom,
                width=window.step_s / 60,
                color=colour,
                label=item.name,
                align="edge",
            )
            bottom = bottom + height
    else:
        style = "steps-post" if panel.step_lines else "default"
        for item, column, colour in zip(series, columns, colours, strict=True):
            ax.plot(minutes, column, color=colour, linewidth=1.4, label=item.name, drawstyle=style)
    if panel.minimum is not None:
        ax.set_ylim(bottom=panel.minimum)
    if panel.maximum is not None:
        ax.set_ylim(top=panel.maximum)
    _time_axis(ax, window)
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: format_value(v, panel.unit)))
    ax.legend(
        loc="upper left",
        fontsize=7,
        ncol=min(4, len(series)),
        frameon=False,
        labelcolor=TEXT,
        handlelength=1.2,
        borderaxespad=0.1,
        columnspacing=1.0,
    )


def _states(ax: Any, panel: dash.Panel, series: list[Series], window: Window) -> None:
    """One lane per series; runs of equal values drawn as bars, labelled by the mapping."""
    _style(ax)
    ax.grid(False)
    minutes = window.minutes()
    step = window.step_s / 60
    for lane, item in enumerate(series):
        column = window.on_grid(item)
        start = 0
        for i in range(1, len(column) + 1):
            if i < len(column) and (
                column[i] == column[start] or (math.isnan(column[i]) and math.isnan(column[start]))
            ):
                continue
            value = column[start]
            if not math.isnan(value):
                key = f"{value:g}"
                text, named = panel.mappings.get(key, (key, ""))
                colour = _colour(named) if named else PALETTE[lane % len(PALETTE)]
                left, width = minutes[start], (i - start) * step
                ax.barh(lane, width, left=left, height=0.8, color=colour, alpha=0.85)
                if panel.mappings and width > 0.12 * (minutes[-1] - minutes[0] + step):
                    ax.text(
                        left + width / 2,
                        lane,
                        text,
                        color=BACKGROUND,
                        fontsize=8,
                        ha="center",
                        va="center",
                        fontweight="bold",
                    )
            start = i
    ax.set_yticks(range(len(series)), [s.name for s in series], fontsize=8, color=TEXT)
    ax.set_ylim(len(series) - 0.5, -0.5)
    _time_axis(ax, window)


def _time_axis(ax: Any, window: Window) -> None:
    from matplotlib import ticker

    ax.set_xlim(0, (window.end - window.start) / 60)
    ax.xaxis.set_major_locator(ticker.MaxNLocator(5))
    ax.xaxis.set_major_formatter(
        ticker.FuncFormatter(
            lambda v, _: datetime.fromtimestamp(window.start + v * 60).strftime("%H:%M:%S")
        )
    )


def _style(ax: Any) -> None:
    ax.set_facecolor(PANEL)
    ax.tick_params(colors=MUTED, labelsize=7.5, length=0)
    ax.grid(True, color=GRID, linewidth=0.6)
    ax.set_axisbelow(True)
    for spine in ax.spines.values():
        spine.set_visible(False)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prometheus", required=True, help="base URL of the Prometheus")
    parser.add_argument("--dashboard", type=Path, default=DEFAULT_DASHBOARD)
    parser.add_argument("--minutes", type=float, default=30.0, help="time range up to now")
    parser.add_argument("--step", type=float, default=0.0, help="seconds; 0 = range / 240")
    parser.add_argument("--scrape-interval", type=float, default=15.0, help="seconds")
    parser.add_argument(
        "--var",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="template variable value (regex); default .* for each",
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    board = dash.load(args.dashboard)
    values = {v.name: ".*" for v in board.variables if v.type == "query"}
    for item in args.var:
        name, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--var {item!r}: expected NAME=VALUE")
        values[name] = value
    end = time.time()
    start = end - args.minutes * 60
    window = Window(start, end, args.step or (end - start) / 240, args.scrape_interval)
    drawn = render(board, PrometheusHTTP(args.prometheus), window, values, args.out)
    empty = [title for title, n in drawn.items() if n == 0]
    print(f"wrote {args.out}: {len(drawn)} panels, {len(empty)} without data")
    return 0


if __name__ == "__main__":
    sys.exit(main())
