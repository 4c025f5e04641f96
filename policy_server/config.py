"""Server configuration: a TOML file, overridden by command-line flags."""

from __future__ import annotations

import dataclasses
import ipaddress
import tomllib
from pathlib import Path
from typing import Any

from nightjar_common.errors import ConfigError
from nightjar_common.uds import parse_mode
from policy_server.policies import DEFAULT_POLICY
from policy_server.snapshot import MAX_BYTES

# What an admin message carries beside a state of snapshot size: GetState's engine ids,
# runtimes and memory states (a few hundred bytes an engine), Restore's other fields.
ADMIN_ENVELOPE_BYTES = 8 << 20


def admin_message_bytes(snapshot_max_bytes: int = MAX_BYTES) -> int:
    """The largest admin message (GetState's reply, Restore's request) for a sidecar whose
    snapshots may take ``snapshot_max_bytes``: any state it can snapshot fits. The server
    refuses larger ones naming this; nightjarctl accepts up to the bound of any sidecar
    (the default, snapshot.MAX_BYTES)."""
    return snapshot_max_bytes + ADMIN_ENVELOPE_BYTES


# Engines' StepStreams open at once (each holds ~31 KB): twice the engine bound, since a
# reconnecting engine's old stream may stay open until its connection is seen closed.
DEFAULT_MAX_STREAMS = 2048
# Bytes one stream may hold read ahead of its answers (at least one request is read):
# an engine sends its next request after its previous reply, so a few KB are queued.
DEFAULT_MAX_STREAM_QUEUE_BYTES = 1 << 20
# A stream that sends nothing this long is closed. An engine sends at least a table
# request every few dozen steps, so only an idle engine or an abandoned stream gets there.
DEFAULT_STREAM_IDLE_TIMEOUT_S = 300.0
# A day: an abandoned stream is freed eventually whatever the setting.
MAX_STREAM_IDLE_TIMEOUT_S = 86400.0
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_FORMATS = ("text", "json")
# Settings that are tables: merged key by key (ServerConfig.merged).
DICT_SETTINGS = ("params", "memory", "fleet")


@dataclasses.dataclass(slots=True)
class ServerConfig:
    # Listening: a Unix socket and/or a TCP port (on `host`, loopback by default: another
    # host reaches the port only when `host` is set to widen it, best with TLS below).
    uds: str = ""
    # The socket's file mode: group-writable so an engine in the same group can connect.
    uds_mode: int = 0o660
    # A world-writable mode lets every local user steer the engine: refused unless forced.
    force_uds_mode: bool = False
    port: int | None = None
    host: str = "127.0.0.1"
    # TLS on the TCP port: the server's PEM certificate chain and key; with `tls_client_ca`
    # clients must present a certificate signed by that CA (mutual TLS).
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    # Prometheus /metrics over HTTP (None = off).
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    # Policy at start and its parameters: what is set here (or by flags) wins over a
    # snapshot in state_dir, which keeps the rest (policy_server/startup.py).
    policy: str = DEFAULT_POLICY
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Elastic memory controller (policy_server/memory.py MemoryParams; {} = off).
    memory: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Fleet learning through Redis (policy_server/fleet_link.py FleetOptions; {} = off).
    fleet: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Learned-state snapshots ("" = none) and their period.
    state_dir: str = ""
    snapshot_interval_s: float = 30.0
    # The most a snapshot may take (bytes): the writer trims, or refuses, past it; at most
    # what a start reads (snapshot.MAX_BYTES), so that what is written is readable.
    snapshot_max_bytes: int = MAX_BYTES
    # File holding the admin token ("" = admin calls unauthenticated).
    admin_token_file: str = ""
    # Decision log (JSON lines; "" = off), rotated by size.
    decision_log: str = ""
    decision_log_max_bytes: int = 64 << 20
    decision_log_backups: int = 5
    # Input bounds and server threads.
    max_batch_size: int = 65536
    max_workers: int = 16
    # What clients can make the server hold (docs/OPERATIONS.md, "Bounded memory"): past
    # each bound the least recently used entry is evicted and counted.
    max_engines: int = 1024
    max_learner_keys: int = 256
    max_pending_per_engine: int = 64
    # Byte budgets (estimated: counts and lengths), docs/OPERATIONS.md "Bounded memory":
    # the contexts of an engine's pending decisions, of all engines', an engine's kept
    # decision tables, and what one stream reads ahead of its answers.
    max_pending_bytes_per_engine: int = 32 << 20
    max_pending_bytes: int = 512 << 20
    max_table_bytes_per_engine: int = 1 << 20
    max_stream_queue_bytes: int = DEFAULT_MAX_STREAM_QUEUE_BYTES
    # Largest request (bytes) of every method but Restore (whose bound follows
    # snapshot_max_bytes, admin_message_bytes): larger ones get RESOURCE_EXHAUSTED unread.
    max_receive_bytes: int = 4 << 20
    # Engines' StepStreams open at once; one more is refused with RESOURCE_EXHAUSTED.
    max_streams: int = DEFAULT_MAX_STREAMS
    # A stream that sends nothing for this long (s) is closed with UNAVAILABLE ("idle");
    # the plugin opens a new one by itself.
    stream_idle_timeout_s: float = DEFAULT_STREAM_IDLE_TIMEOUT_S
    log_level: str = "INFO"
    # The server's own log on stderr: "text" lines or "json" objects, one a line.
    log_format: str = "text"
    # Not a setting: where each setting that was given came from (the file's path or
    # "command line"), policy parameters as "params.NAME".
    origins: dict[str, str] = dataclasses.field(default_factory=dict, metadata={"internal": True})

    @classmethod
    def from_file(cls, path: str | Path) -> ServerConfig:
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config {path}: {exc}") from exc
        return cls().merged(data, origin=str(path))

    def merged(self, values: dict[str, Any], origin: str) -> ServerConfig:
        """These settings over ours. ``params`` and ``memory`` merge key by key (a flag
        changes one parameter of the file's, not all), except that parameters given for
        another policy than the one ``values`` names are dropped."""
        known = {f.name for f in dataclasses.fields(self) if not f.metadata.get("internal")}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"{origin}: unknown setting(s) {unknown}; known: {sorted(known)}")
        origins = dict(self.origins)
        base = {"params": self.params, "memory": self.memory, "fleet": self.fleet}
        if values.get("policy", self.policy) != self.policy:
            # The parameters set so far were for the other policy.
            base["params"] = {}
            origins = {k: v for k, v in origins.items() if not k.startswith("params.")}
        changes = dict(values)
        for name, value in values.items():
            if name not in DICT_SETTINGS:
                origins[name] = origin
                continue
            if not isinstance(value, dict):
                raise ConfigError(f"{origin}: {name} must be a table (a JSON object)")
            changes[name] = {**base[name], **value}
            origins.update({f"{name}.{key}": origin for key in value})
        changes.setdefault("params", base["params"])
        changes["origins"] = origins
        return dataclasses.replace(self, **changes)

    def origin(self, name: str) -> str | None:
        """Where setting ``name`` (``params.KEY`` for a policy parameter) was given; None
        when it has its default."""
        return self.origins.get(name)

    def validate(self) -> None:
        if not self.uds and self.port is None:
            raise ConfigError("nothing to listen on: give --uds PATH and/or --port N")
        for name in ("port", "metrics_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 65535:
                raise ConfigError(f"{name} must be in 0..65535, got {value}")
        try:
            self.uds_mode = parse_mode(self.uds_mode)
        except ValueError as exc:
            raise ConfigError(f"uds_mode: {exc}") from None
        if self.uds_mode & 0o002 and not self.force_uds_mode:
            raise ConfigError(
                f"uds_mode {self.uds_mode:04o} lets every local user connect and steer the "
                "engine: use 0660 and run the engine in the socket's group, or add "
                "--force-uds-mode (force_uds_mode = true) to accept it"
            )
        if str(self.log_level).upper() not in LOG_LEVELS:
            raise ConfigError(
                f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}"
            )
        if self.log_format not in LOG_FORMATS:
            raise ConfigError(
                f"log_format must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}"
            )
        if self.decision_log_max_bytes <= 0 or self.decision_log_backups < 1:
            raise ConfigError("decision_log_max_bytes must be > 0 and decision_log_backups >= 1")
        for name in (
            "max_engines",
            "max_learner_keys",
            "max_pending_per_engine",
            "max_pending_bytes_per_engine",
            "max_pending_bytes",
            "max_table_bytes_per_engine",
            "max_stream_queue_bytes",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 1024 <= self.max_receive_bytes <= 1 << 30:
            raise ConfigError(f"max_receive_bytes must be in 1024..{1 << 30}")
        if self.max_streams < 1:
            raise ConfigError(f"max_streams must be >= 1, got {self.max_streams}")
        if not 0 < self.stream_idle_timeout_s <= MAX_STREAM_IDLE_TIMEOUT_S:
            raise ConfigError(
                f"stream_idle_timeout_s must be in (0, {MAX_STREAM_IDLE_TIMEOUT_S:g}], "
                f"got {self.stream_idle_timeout_s}"
            )
        if self.snapshot_interval_s <= 0:
            raise ConfigError("snapshot_interval_s must be > 0")
        if not 1024 <= self.snapshot_max_bytes <= MAX_BYTES:
            raise ConfigError(
                f"snapshot_max_bytes must be in 1024..{MAX_BYTES} (what a start reads)"
            )
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("TLS needs both tls_cert and tls_key (--tls-cert, --tls-key)")
        if self.tls_client_ca and not self.tls_cert:
            raise ConfigError("tls_client_ca (mutual TLS) needs tls_cert and tls_key as well")
        if self.tls_cert and self.port is None:
            raise ConfigError("TLS applies to the TCP listener: give --port as well")

    @property
    def tcp_is_loopback(self) -> bool:
        """Whether the TCP port is reachable from this host only."""
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host.strip("[]")).is_loopback
        except ValueError:
            return False  # a host name: it may resolve to anything
