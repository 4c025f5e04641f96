"""`nightjar-server`: run the Nightjar policy sidecar."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nightjar_common import tls, uds
from nightjar_common.admin_token import AdminTokenFile
from nightjar_common.errors import ConfigError, NightjarError
from nightjar_common.json_input import JsonError, load_json
from nightjar_common.validation import Limits
from policy_server import (
    __version__,
    blas_threads,
    fleet_link,
    gc_pauses,
    native_log,
    snapshot,
    startup,
)
from policy_server.config import LOG_FORMATS, LOG_LEVELS, ServerConfig
from policy_server.decision_log import DecisionLog
from policy_server.engines import Bounds
from policy_server.grpc_server import StreamLimits, build_server
from policy_server.memory import MemoryController, MemoryParams
from policy_server.metrics import Metrics
from policy_server.policies import DEFAULT_POLICY
from policy_server.policies.base import PolicyError, parse_params
from policy_server.service import DecisionService

log = logging.getLogger("nightjar.server")


# Flags that override the config file's setting of the same name.
FLAG_SETTINGS = (
    "uds",
    "uds_mode",
    "port",
    "host",
    "metrics_port",
    "metrics_host",
    "policy",
    "state_dir",
    "snapshot_interval_s",
    "admin_token_file",
    "decision_log",
    "decision_log_max_bytes",
    "decision_log_backups",
    "max_streams",
    "stream_idle_timeout_s",
    "log_level",
    "log_format",
    "tls_cert",
    "tls_key",
    "tls_client_ca",
)
# On/off flags that override the config file's setting of the same name.
SWITCH_SETTINGS = ("force_uds_mode",)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="nightjar-server", description=__doc__)
    p.add_argument("--config", help="TOML configuration file (flags override it)")
    p.add_argument("--uds", help="listen on this Unix socket path")
    p.add_argument(
        "--uds-mode",
        help="the socket's file mode, octal (default 0660: owner "
        "and group may connect; run the engine in the socket's group); a mode that lets "
        "every local user connect (o+w) is refused unless --force-uds-mode",
    )
    p.add_argument(
        "--force-uds-mode",
        action="store_true",
        default=None,
        help="accept a world-writable --uds-mode (any local user may then steer the engine)",
    )
    p.add_argument("--port", type=int, help="listen on this TCP port (0 = any free port)")
    p.add_argument(
        "--host",
        "--bind",
        dest="host",
        help="TCP bind address (default "
        "127.0.0.1: this host only; e.g. 0.0.0.0 to accept others, with TLS)",
    )
    p.add_argument("--tls-cert", help="PEM certificate chain: serve TLS on the TCP port")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument(
        "--tls-client-ca",
        help="PEM CA that clients' certificates must chain to "
        "(mutual TLS: clients without one are refused)",
    )
    p.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port")
    p.add_argument("--metrics-host", help="metrics bind address (default 127.0.0.1)")
    p.add_argument(
        "--policy",
        help=f"policy to start with (default {DEFAULT_POLICY}); wins over a snapshot's",
    )
    p.add_argument(
        "--params",
        help="policy parameters as a JSON object, over the config file's, key by key; "
        "each wins over a snapshot's",
    )
    p.add_argument(
        "--memory",
        help="elastic-memory controller settings as a JSON object, "
        'e.g. {"enabled": true, "draft_blocks": 1000} (default off)',
    )
    fleet_link.add_arguments(p)
    p.add_argument("--state-dir", help="directory for learned-state snapshots")
    p.add_argument(
        "--snapshot-interval-s",
        "--snapshot-interval",  # its earlier name, kept for existing command lines
        type=float,
        dest="snapshot_interval_s",
        help="seconds between periodic snapshots (default 30)",
    )
    p.add_argument("--admin-token-file", help="file with the admin token for mutating calls")
    p.add_argument(
        "--decision-log",
        help="write a JSON-lines decision log to this path (best on a volume of its own: "
        "it grows to (backups + 1) x max bytes)",
    )
    p.add_argument(
        "--decision-log-max-bytes",
        type=int,
        help="rotate the decision log at this size (default 67108864, 64 MiB)",
    )
    p.add_argument(
        "--decision-log-backups",
        type=int,
        help="rotated decision-log files kept, PATH.1 ... PATH.N (default 5, at least 1)",
    )
    p.add_argument(
        "--max-streams",
        type=int,
        help="engines' streams open at once; one more is refused (default 2048)",
    )
    p.add_argument(
        "--stream-idle-timeout-s",
        type=float,
        dest="stream_idle_timeout_s",
        help="close a stream that sends nothing for this long; the plugin reopens it (default 300)",
    )
    p.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        help="the server's own log level (default INFO)",
    )
    p.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        help="the server's own log: text lines (default) or JSON objects",
    )
    p.add_argument("--version", action="version", version=f"nightjar-server {__version__}")
    return p.parse_args(argv)


def load_config(args: argparse.Namespace) -> ServerConfig:
    config = ServerConfig.from_file(args.config) if args.config else ServerConfig()
    overrides: dict[str, Any] = {}
    for name in (*FLAG_SETTINGS, *SWITCH_SETTINGS):
        value = getattr(args, name)
        if value is not None:
            overrides[name] = value
    for flag in ("params", "memory"):
        raw = getattr(args, flag)
        if raw is not None:
            try:
                overrides[flag] = load_json(raw)
            except JsonError as exc:
                raise ConfigError(f"--{flag} is not valid JSON: {exc}") from exc
    fleet = fleet_link.settings_from_args(args)
    if fleet:
        overrides["fleet"] = fleet
    config = config.merged(overrides, origin="command line")
    try:
        fleet_link.FleetOptions.parse(config.fleet)
    except fleet_link.FleetConfigError as exc:
        raise ConfigError(f"fleet: {exc}") from exc
    config.validate()
    return config


def configure_logging(level: str, log_format: str) -> None:
    """The server's own log on stderr, as text lines or one JSON object a line."""
    if log_format == "json":
        native_log.route_native_stderr()  # gRPC's own lines become JSON records too
    handler = logging.StreamHandler()
    if log_format == "json":
        from pythonjsonlogger.json import JsonFormatter

        handler.setFormatter(
            JsonFormatter(
                "{levelname}{name}{message}",
                style="{",
                timestamp="time",
                rename_fields={"levelname": "level", "name": "logger"},
            )
        )
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = load_config(args)
        token = AdminTokenFile(config.admin_token_file) if config.admin_token_file else None
        credentials = (
            tls.server_credentials(
                tls.ServerTls(config.tls_cert, config.tls_key, config.tls_client_ca)
            )
            if config.tls_cert
            else None
        )
    except (ConfigError, tls.TlsError) as exc:
        print(f"nightjar-server: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_level, config.log_format)
    log.info(
        "BLAS held to %d thread (had: %s)",
        blas_threads.BLAS_THREADS,
        ", ".join(blas_threads.limit_blas_threads()) or "none loaded",
    )
    if token is None:
        log.warning("no --admin-token-file: mutating admin calls are not authenticated")
    if config.port is not None and credentials is None and not config.tcp_is_loopback:
        log.warning(
            "TCP port on %s without TLS: decisions and the admin token travel in the clear; "
            "give --tls-cert/--tls-key (and --tls-client-ca)",
            config.host,
        )

    if config.uds and config.uds_mode & 0o002:
        log.warning(
            "socket %s is world-writable (mode %04o, forced): every local user may steer "
            "the engine",
            config.uds,
            config.uds_mode,
        )
    metrics = Metrics()
    decision_log = None
    if config.decision_log:
        _warn_if_in_state_dir(config)
        try:
            decision_log = DecisionLog(
                config.decision_log,
                max_bytes=config.decision_log_max_bytes,
                backup_count=config.decision_log_backups,
                on_drop=metrics.decision_log_dropped.inc,
            )
        except OSError as exc:
            print(
                f"nightjar-server: cannot write the decision log {config.decision_log}: "
                f"{exc.strerror or exc}: give --decision-log a writable path",
                file=sys.stderr,
            )
            return 2
    try:
        memory = MemoryController(parse_params(MemoryParams, config.memory, "memory"))
    except PolicyError as exc:
        print(f"nightjar-server: bad memory settings: {exc}", file=sys.stderr)
        return 2
    try:
        service = DecisionService(
            config.policy,
            config.params,
            memory=memory,
            limits=Limits(max_batch_size=config.max_batch_size),
            bounds=Bounds(
                config.max_engines,
                config.max_learner_keys,
                config.max_pending_per_engine,
                max_pending_bytes_per_engine=config.max_pending_bytes_per_engine,
                max_pending_bytes=config.max_pending_bytes,
                max_table_bytes_per_engine=config.max_table_bytes_per_engine,
            ),
            metrics=metrics,
            decision_log=decision_log,
            state_dir=config.state_dir or None,
            snapshot_max_bytes=config.snapshot_max_bytes,
        )
    except NightjarError as exc:
        print(f"nightjar-server: cannot start policy {config.policy!r}: {exc}", file=sys.stderr)
        return 2
    state_dir = Path(config.state_dir) if config.state_dir else None
    if state_dir is not None:
        for leftover in snapshot.remove_leftovers(state_dir):
            log.info("removed %s, left by a snapshot writer that did not finish", leftover)
    startup.start(service, state_dir, startup.Configured.of(config))

    tcp = f"{config.host}:{config.port}" if config.port is not None else None
    stop_metrics = None
    try:
        if config.metrics_port is not None:
            # Before gRPC: a port in use then leaves no socket behind.
            metrics_port, stop_metrics = _serve_metrics(metrics, config)
        if config.uds:
            uds.claim(config.uds, make_parent=False)  # never take a live server's path over
        running = build_server(
            service,
            uds_path=config.uds or None,
            tcp_address=tcp,
            admin_token=token,
            max_workers=config.max_workers,
            uds_mode=config.uds_mode,
            tls=credentials,
            max_receive_bytes=config.max_receive_bytes,
            streams=StreamLimits(
                config.max_streams, config.stream_idle_timeout_s, config.max_stream_queue_bytes
            ),
        )
    except (uds.SocketPathError, RuntimeError, OSError) as exc:
        # RuntimeError: gRPC could not bind (a TCP port in use).
        print(f"nightjar-server: cannot listen: {exc}", file=sys.stderr)
        if stop_metrics is not None:
            stop_metrics()
        return 1
    if config.metrics_port is not None:
        log.info("metrics on http://%s:%d/metrics", config.metrics_host, metrics_port)
    if config.uds:
        log.info(
            "socket %s has mode %04o (connecting needs write access)", config.uds, config.uds_mode
        )
    tcp_security = (
        ""
        if credentials is None
        else (" (TCP with mutual TLS)" if config.tls_client_ca else " (TCP with TLS)")
    )
    log.info(
        "nightjar-server %s listening on %s%s with policy %s (%s)",
        __version__,
        ", ".join(running.addresses),
        tcp_security,
        service.active.name,
        service.active.version,
    )

    # After the listeners: the first round's merge warms learners before engines ask.
    fleet = fleet_link.start(service, config.fleet, metrics)
    # Started: what the process holds now lives as long as it does; no collection scans
    # it again while engines wait (gc_pauses.py).
    log.info("froze %d objects of the started sidecar", gc_pauses.freeze_started_heap())
    stopping = threading.Event()

    def request_stop(signum: int, _frame: object) -> None:
        log.info("signal %d: shutting down", signum)
        stopping.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)

    while not stopping.wait(config.snapshot_interval_s if config.state_dir else 3600):
        _snapshot(service)

    running.set_serving(False)
    running.server.stop(grace=2).wait()
    if fleet is not None:
        fleet.stop()
    if config.state_dir:
        _snapshot(service)
    if decision_log is not None:
        decision_log.close()
    if stop_metrics is not None:
        stop_metrics()
    if config.uds:
        Path(config.uds).unlink(missing_ok=True)
    log.info("stopped")
    return 0


def _warn_if_in_state_dir(config: ServerConfig) -> None:
    """The decision log grows to (backups + 1) x max bytes: on the snapshots' volume it can
    fill it, and snapshots then fail."""
    if not config.state_dir:
        return
    log_dir = Path(config.decision_log).resolve().parent
    if log_dir.is_relative_to(Path(config.state_dir).resolve()):
        log.warning(
            "the decision log %s is inside --state-dir %s: rotated, it takes up to %d bytes "
            "there and can leave snapshots no room; give it a volume of its own",
            config.decision_log,
            config.state_dir,
            (config.decision_log_backups + 1) * config.decision_log_max_bytes,
        )


def _serve_metrics(metrics: Metrics, config: ServerConfig) -> tuple[int, Callable[[], None]]:
    """The /metrics endpoint, or an OSError whose message names the flag to change."""
    assert config.metrics_port is not None
    try:
        return metrics.serve_http(config.metrics_port, config.metrics_host)
    except OSError as exc:
        raise OSError(
            f"metrics on {config.metrics_host}:{config.metrics_port}: "
            f"{exc.strerror or exc}: give another --metrics-port (0 picks a free one) or "
            "stop what holds it"
        ) from None


def _snapshot(service: DecisionService) -> None:
    """A periodic or final snapshot; a failure is logged and counted, never fatal: the
    sidecar goes on deciding with what it holds."""
    try:
        path = service.write_snapshot()
        log.debug("snapshot written to %s", path)
    except NightjarError as exc:  # counted by write_snapshot
        log.error("snapshot failed: %s", exc)
    except Exception:  # a defect (e.g. a policy's state() raising): never end the process
        service.metrics.snapshots.labels("failed").inc()
        log.exception("snapshot failed")


if __name__ == "__main__":
    sys.exit(main())
