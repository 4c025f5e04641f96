"""Run a Grafana dashboard's queries against a Prometheus, without Grafana.

The Prometheus HTTP API (`PrometheusHTTP`, or any `PrometheusSource`), the time range a
dashboard shows with Grafana's built-in variables for it (`Window`), and a panel's series
(`fetch`): range queries for graphs, one instant value for stats and bar gauges, template
variables substituted. `tools/dashboard/render.py` draws what this returns.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from tools.dashboard import panels as dash

RANGE_PANELS = ("timeseries", "state-timeline")


class PrometheusSource(Protocol):
    """What the renderer needs from Prometheus (the HTTP API's `data.result` lists)."""

    def query_range(
        self, promql: str, start: float, end: float, step: float = 1.0
    ) -> list[dict[str, Any]]: ...

    def query(self, promql: str, at: float | None = None) -> list[dict[str, Any]]: ...


class PrometheusQueryError(ValueError):
    """Prometheus answered an API call with an error (e.g. PromQL it cannot parse)."""


class PrometheusHTTP:
    """A Prometheus server's HTTP API (GET /api/v1/<path>), e.g. query and query_range."""

    def __init__(self, url: str, timeout_s: float = 30.0) -> None:
        self.url, self.timeout_s = url.rstrip("/"), timeout_s

    def api(self, path: str, **params: Any) -> Any:
        """GET /api/v1/<path>; the `data` of a successful answer, PrometheusQueryError
        otherwise."""
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        url = f"{self.url}/api/v1/{path}" + (f"?{query}" if query else "")
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as reply:
                body = json.load(reply)
        except urllib.error.HTTPError as exc:  # bad PromQL: 400 with the reason in the body
            body = json.loads(exc.read() or b"{}")
        if body.get("status") != "success":
            raise PrometheusQueryError(
                f"{path} {params}: {body.get('errorType')}: {body.get('error', body)}"
            )
        return body["data"]

    def query_range(
        self, promql: str, start: float, end: float, step: float = 1.0
    ) -> list[dict[str, Any]]:
        """Range query: [{"metric": {labels}, "values": [[ts, "v"], ...]}, ...]."""
        result: list[dict[str, Any]] = self.api(
            "query_range", query=promql, start=start, end=end, step=step
        )["result"]
        return result

    def query(self, promql: str, at: float | None = None) -> list[dict[str, Any]]:
        """Instant query: [{"metric": {labels}, "value": [ts, "v"]}, ...] (vectors), or
        one [{"metric": {}, "value": [ts, "v"]}] for a scalar."""
        data = self.api("query", query=promql, time=at)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        result: list[dict[str, Any]] = data["result"]
        return result


@dataclass(frozen=True, slots=True)
class Series:
    name: str
    times: list[float]
    values: list[float]


@dataclass(frozen=True, slots=True)
class Window:
    """The time range the dashboard shows and Grafana's built-in variables for it."""

    start: float
    end: float
    step_s: float
    scrape_interval_s: float

    def minutes(self) -> Any:
        """The query steps, in minutes from the start (the plots' x axis)."""
        import numpy as np

        return np.arange(0.0, self.end - self.start + self.step_s / 2, self.step_s) / 60

    def on_grid(self, item: Series) -> Any:
        """A series' values at the query steps, NaN where it has none."""
        import numpy as np

        column = np.full(len(self.minutes()), np.nan)
        index = np.rint((np.asarray(item.times) - self.start) / self.step_s).astype(int)
        keep = (index >= 0) & (index < len(column))
        column[index[keep]] = np.asarray(item.values)[keep]
        return column

    def builtins(self) -> dict[str, str]:
        rate = dash.rate_interval(self.step_s, self.scrape_interval_s)
        return {
            "__rate_interval": f"{math.ceil(rate)}s",
            "__interval": f"{math.ceil(self.step_s)}s",
            "__range": f"{math.ceil(self.end - self.start)}s",
        }


def fetch(
    source: PrometheusSource, panel: dash.Panel, window: Window, values: Mapping[str, str]
) -> list[Series]:
    """The panel's series: range queries for graphs, one instant value otherwise."""
    variables = {**window.builtins(), **values}
    series: list[Series] = []
    for target in panel.targets:
        expr = dash.expand(target.expr, variables)
        if panel.type in RANGE_PANELS and not target.instant:
            result = source.query_range(expr, window.start, window.end, window.step_s)
            for item in result:
                points = [(float(t), float(v)) for t, v in item["values"]]
                series.append(
                    Series(
                        dash.legend(target.legend, item["metric"]) or expr,
                        [t for t, _ in points],
                        [v for _, v in points],
                    )
                )
        else:
            for item in source.query(expr, window.end):
                t, v = item["value"]
                name = dash.legend(target.legend, item["metric"]) or expr
                series.append(Series(name, [float(t)], [float(v)]))
    return series
