"""A real Prometheus server for tests (Debian's `prometheus`, installed by `make test`).

    with PrometheusRig(tmp_path, {"nightjar-sidecar": ["127.0.0.1:9464"]}) as prom:
        prom.wait_for('nightjar_serving == 1')
        prom.query('sum(rate(nightjar_decisions_total[30s]))')

It writes a configuration with the given scrape jobs (1 s scrape and rule evaluation by
default, so a test sees data within a few seconds), starts `prometheus` on a free
loopback port with its storage in the work directory, waits until it is ready and talks
to it over its HTTP API. Jobs can be replaced while it runs (:meth:`set_jobs`). A missing
binary is an error, never a skip: the tests need the real thing.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from tools.dashboard.query import PrometheusHTTP

Jobs = Mapping[str, Sequence[str]]


class PrometheusError(RuntimeError):
    """Prometheus failed to start, or answered a query with an error."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrometheusRig(PrometheusHTTP):
    """One `prometheus` process; use as a context manager or call start()/stop(). Its
    HTTP API (api, query, query_range) is the dashboard renderer's client."""

    def __init__(
        self,
        workdir: Path,
        jobs: Jobs | Sequence[str] = (),
        *,
        rule_files: Sequence[Path] = (),
        scrape_interval_s: float = 1.0,
        evaluation_interval_s: float | None = None,
        binary: str = "prometheus",
    ) -> None:
        self.workdir = Path(workdir)
        self.jobs: dict[str, list[str]] = _as_jobs(jobs)
        self.rule_files = [Path(p).resolve() for p in rule_files]
        self.scrape_interval_s = scrape_interval_s
        self.evaluation_interval_s = evaluation_interval_s or scrape_interval_s
        self.binary = binary
        self.port = 0
        # PrometheusHTTP's client settings; the URL is known once started.
        super().__init__(url="", timeout_s=10.0)
        self.proc: subprocess.Popen[bytes] | None = None
        self.config_path = self.workdir / "prometheus.yml"
        self.log_path = self.workdir / "prometheus.log"

    # -- life cycle ---------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> PrometheusRig:
        path = shutil.which(self.binary)
        if path is None:
            raise PrometheusError(
                f"{self.binary!r} is not installed: `make test` installs Debian's prometheus"
            )
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._write_config()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    path,
                    f"--config.file={self.config_path}",
                    f"--storage.tsdb.path={self.workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--web.enable-lifecycle",  # POST /-/reload after set_jobs()
                    "--storage.tsdb.retention.time=1h",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PrometheusError(f"prometheus exited at start:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as reply:
                    if reply.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise PrometheusError(f"prometheus not ready after {timeout:.0f} s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None

    def __enter__(self) -> PrometheusRig:
        return self.start() if self.proc is None else self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def set_jobs(self, jobs: Jobs | Sequence[str]) -> None:
        """Replace the scrape jobs of the running server (config rewritten and reloaded)."""
        self.jobs = _as_jobs(jobs)
        self._write_config()
        self._post("/-/reload")

    def _write_config(self) -> None:
        config: dict[str, Any] = {
            "global": {
                "scrape_interval": _duration(self.scrape_interval_s),
                "scrape_timeout": _duration(self.scrape_interval_s),
                "evaluation_interval": _duration(self.evaluation_interval_s),
            },
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": list(targets)}]}
                for job, targets in self.jobs.items()
            ],
        }
        if self.rule_files:
            config["rule_files"] = [str(p) for p in self.rule_files]
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))

    # -- HTTP API -----------------------------------------------------------------------

    def values(self, promql: str) -> dict[tuple[tuple[str, str], ...], float]:
        """An instant query as {sorted label items: value}."""
        return {
            tuple(sorted(r["metric"].items())): float(r["value"][1]) for r in self.query(promql)
        }

    def wait_for(
        self,
        promql: str,
        timeout: float = 30.0,
        until: Callable[[list[dict[str, Any]]], bool] = bool,
    ) -> list[dict[str, Any]]:
        """Poll an instant query until ``until(result)`` holds (default: any data)."""
        deadline = time.monotonic() + timeout
        result: list[dict[str, Any]] = []
        while True:
            result = self.query(promql)
            if until(result):
                return result
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{promql!r} did not return the expected data in {timeout:.0f} s; "
                    f"last result {result}; targets {self.targets()}"
                )
            time.sleep(0.25)

    def targets(self) -> list[dict[str, Any]]:
        """Active scrape targets with their health and last error."""
        return [
            {k: t.get(k) for k in ("scrapePool", "scrapeUrl", "health", "lastError")}
            for t in self.api("targets")["activeTargets"]
        ]

    def alerts(self) -> list[dict[str, Any]]:
        """Pending and firing alerts: [{"labels", "annotations", "state", ...}]."""
        alerts: list[dict[str, Any]] = self.api("alerts")["alerts"]
        return alerts

    def rule_groups(self) -> list[dict[str, Any]]:
        groups: list[dict[str, Any]] = self.api("rules")["groups"]
        return groups

    def _post(self, path: str) -> None:
        request = urllib.request.Request(f"{self.url}{path}", method="POST")
        with urllib.request.urlopen(request, timeout=10) as reply:
            if reply.status != 200:
                raise PrometheusError(f"POST {path}: HTTP {reply.status}")


def _as_jobs(jobs: Jobs | Sequence[str]) -> dict[str, list[str]]:
    if isinstance(jobs, Mapping):
        return {job: list(targets) for job, targets in jobs.items()}
    return {"nightjar": list(jobs)} if jobs else {}


def _duration(seconds: float) -> str:
    return f"{round(seconds * 1000)}ms"
