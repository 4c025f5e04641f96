"""The plugin's configuration, from environment variables and an optional TOML file.

Environment (wins over the file):

    NIGHTJAR_SIDECAR        sidecar address, e.g. unix:/run/nightjar/nightjar.sock; unset = off
    NIGHTJAR_ENABLED        0/false turns the plugin off even when a sidecar is set
    NIGHTJAR_ENGINE_ID      engine id: the sidecar's per-engine bookkeeping (default: host name)
    NIGHTJAR_LEARNER_KEY    key the sidecar keeps learned state under, shared by engines
                            running the same model on the same hardware and kept across
                            pod replacements (default: <model>@<device>, see scheduler.py)
    NIGHTJAR_DEADLINE_MS    how long a step may wait for the sidecar (default 2)
    NIGHTJAR_FALLBACK_TABLE JSON [[start_bs, end_bs, γ], ...] used when the sidecar is late
                            or down (default: the engine's dynamic-SD schedule if set,
                            else the client's built-in table)
    NIGHTJAR_STATS_FILE     where the plugin writes its counters as JSON (optional)
    NIGHTJAR_MEMORY_AGENT   1/true runs the memory agent (draft offload/reload, KV
                            expand/compact) in the engine; default off
    NIGHTJAR_MEMORY_SOCKET  Unix socket path of the memory agent's gRPC service (optional)
    NIGHTJAR_MEMORY_SOCKET_MODE  its file mode, octal (default 0660: the engine's user and
                            group may connect)
    NIGHTJAR_MEMORY_VMM     auto/on/off: the KV cache and the draft in virtual memory, so the
                            draft's memory goes under the KV top blocks while offloaded
                            (auto: CUDA engines with cuda-bindings; on: CPU engines too)
    NIGHTJAR_ADMIN_TOKEN_FILE  file holding the token that mutating memory-agent calls
                            must present (optional; as the sidecar's --admin-token-file)
    NIGHTJAR_TLS_CA         PEM CA that signed the sidecar's certificate: TLS to a host:port
                            sidecar (one on another host; the sidecar's --tls-cert)
    NIGHTJAR_TLS_CERT       PEM client certificate, for mutual TLS (the sidecar's
                            --tls-client-ca); needs NIGHTJAR_TLS_KEY
    NIGHTJAR_TLS_KEY        PEM key of NIGHTJAR_TLS_CERT
    NIGHTJAR_TLS_SERVER_NAME  name checked against the sidecar's certificate (default: the
                            host of NIGHTJAR_SIDECAR)
    NIGHTJAR_CONFIG         a TOML file with the same keys, lower-case, in a [plugin] table

Off means stock vLLM: the scheduler subclass then defers to vLLM in every step.

TLS is on when any of NIGHTJAR_TLS_CA/CERT/KEY is set; a unix: sidecar takes none (the
socket's file mode guards it). The TLS files are read at load while the plugin is active, so
a missing or non-PEM file stops the engine at start-up instead of failing every step.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nightjar_common.tls import ClientTls, TlsError, read_pem
from nightjar_common.uds import DEFAULT_MODE, parse_mode
from nightjar_common.validation import MAX_ID_LENGTH

ENV_PREFIX = "NIGHTJAR_"
KEYS = (
    "sidecar",
    "enabled",
    "engine_id",
    "learner_key",
    "deadline_ms",
    "fallback_table",
    "stats_file",
    "memory_agent",
    "memory_socket",
    "memory_socket_mode",
    "memory_vmm",
    "admin_token_file",
    "tls_ca",
    "tls_cert",
    "tls_key",
    "tls_server_name",
)
# The TLS settings that are files, with what each holds (for the error messages).
_TLS_FILES = {"tls_ca": "CA certificate", "tls_cert": "client certificate", "tls_key": "client key"}
_TLS_SETTINGS = (*_TLS_FILES, "tls_server_name")


class PluginConfigError(ValueError):
    """A plugin setting is malformed; the message names the variable."""


@dataclasses.dataclass(frozen=True, slots=True)
class PluginConfig:
    sidecar: str = ""
    enabled: bool = True
    engine_id: str = dataclasses.field(default_factory=socket.gethostname)
    # "" = derived from the engine's model and device when the scheduler starts.
    learner_key: str = ""
    deadline_ms: float = 2.0
    fallback_table: tuple[tuple[int, int, int], ...] | None = None
    stats_file: str = ""
    memory_agent: bool = False
    memory_socket: str = ""
    memory_socket_mode: int = DEFAULT_MODE
    # The KV cache and the draft in virtual memory (docs/MEMORY.md): "auto" = on CUDA
    # engines with cuda-bindings, "on" = also on CPU engines (mmap), "off" = never.
    memory_vmm: str = "auto"
    admin_token_file: str = ""
    # PEM files for TLS to a host:port sidecar ("" = unset); see the module docstring.
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_server_name: str = ""

    @property
    def active(self) -> bool:
        return self.enabled and bool(self.sidecar)

    @property
    def tls(self) -> ClientTls | None:
        """The client's TLS files; None = plaintext (no CA, certificate or key set)."""
        if not (self.tls_ca or self.tls_cert or self.tls_key):
            return None
        return ClientTls(self.tls_ca, self.tls_cert, self.tls_key, self.tls_server_name)

    @classmethod
    def load(cls, environ: Mapping[str, str] | None = None) -> PluginConfig:
        environ = os.environ if environ is None else environ
        raw: dict[str, Any] = {}
        if path := environ.get(ENV_PREFIX + "CONFIG"):
            raw.update(_read_toml(Path(path)))
        for key in KEYS:
            if (value := environ.get(ENV_PREFIX + key.upper())) is not None:
                raw[key] = value
        return cls.from_mapping(raw)

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> PluginConfig:
        unknown = set(raw) - set(KEYS)
        if unknown:
            raise PluginConfigError(f"unknown plugin settings {sorted(unknown)}; known: {KEYS}")
        values: dict[str, Any] = {}
        if "sidecar" in raw:
            values["sidecar"] = _target(raw["sidecar"])
        if "enabled" in raw:
            values["enabled"] = _boolean(raw["enabled"], "NIGHTJAR_ENABLED")
        if "memory_agent" in raw:
            values["memory_agent"] = _boolean(raw["memory_agent"], "NIGHTJAR_MEMORY_AGENT")
        if raw.get("engine_id"):
            values["engine_id"] = str(raw["engine_id"])
        if raw.get("learner_key"):
            values["learner_key"] = _learner_key(raw["learner_key"])
        if "deadline_ms" in raw:
            values["deadline_ms"] = _deadline(raw["deadline_ms"])
        if raw.get("fallback_table"):
            values["fallback_table"] = _table(raw["fallback_table"])
        if "memory_socket_mode" in raw:
            try:
                values["memory_socket_mode"] = parse_mode(raw["memory_socket_mode"])
            except ValueError as exc:
                raise PluginConfigError(f"NIGHTJAR_MEMORY_SOCKET_MODE: {exc}") from None
        if "memory_vmm" in raw:
            values["memory_vmm"] = _vmm_mode(raw["memory_vmm"])
        for key in ("stats_file", "memory_socket", "admin_token_file"):
            if key in raw:
                values[key] = str(raw[key])
        for key in _TLS_SETTINGS:
            if key in raw:
                values[key] = str(raw[key]).strip()  # "" or blanks: unset (Helm's defaults)
        config = cls(**values)
        _check_tls(config)
        return config


def _vmm_mode(value: Any) -> str:
    mode = str(value).strip().lower()
    if mode not in ("auto", "on", "off"):
        raise PluginConfigError(f"NIGHTJAR_MEMORY_VMM must be auto, on or off, got {value!r}")
    return mode


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise PluginConfigError(f"NIGHTJAR_CONFIG {path}: {exc}") from exc
    table = data.get("plugin", {})
    if not isinstance(table, dict):
        raise PluginConfigError(f"NIGHTJAR_CONFIG {path}: [plugin] must be a table")
    return table


def _target(value: Any) -> str:
    """A gRPC target; a bare socket path is the likely mistake (gRPC would resolve it
    as a host name and fail open forever), so it is refused with the fix."""
    target = str(value).strip()
    if target.startswith(("/", ".")):
        raise PluginConfigError(f"NIGHTJAR_SIDECAR {target!r} is a path: write unix:{target}")
    if target in ("unix:", "unix://"):
        raise PluginConfigError("NIGHTJAR_SIDECAR unix: needs a socket path")
    return target


def _check_tls(config: PluginConfig) -> None:
    """Refuse TLS settings that cannot work, at start-up: each would otherwise show only
    as every step falling back (a failed handshake looks like a sidecar that is down)."""
    if bool(config.tls_cert) != bool(config.tls_key):
        given, missing = (
            ("NIGHTJAR_TLS_CERT", "NIGHTJAR_TLS_KEY")
            if config.tls_cert
            else ("NIGHTJAR_TLS_KEY", "NIGHTJAR_TLS_CERT")
        )
        raise PluginConfigError(f"{given} is set without {missing}: mutual TLS needs both")
    if config.tls is None:
        if config.tls_server_name:
            raise PluginConfigError(
                "NIGHTJAR_TLS_SERVER_NAME is set but TLS is off: set NIGHTJAR_TLS_CA "
                "(and NIGHTJAR_TLS_CERT/NIGHTJAR_TLS_KEY for mutual TLS)"
            )
        return
    if config.sidecar.startswith("unix:"):
        names = [f"NIGHTJAR_{key.upper()}" for key in _TLS_SETTINGS if getattr(config, key)]
        raise PluginConfigError(
            f"{', '.join(names)} set with the Unix socket NIGHTJAR_SIDECAR={config.sidecar}: "
            "TLS is for a host:port sidecar (the socket's file mode guards it); unset them"
        )
    if not config.active:
        return  # the plugin is off: its files are not needed (NIGHTJAR_ENABLED=0 kill switch)
    for key, what in _TLS_FILES.items():
        if path := getattr(config, key):
            _check_pem(path, f"NIGHTJAR_{key.upper()}", what)


def _check_pem(path: str, name: str, what: str) -> None:
    # Now rather than when gRPC's loader fails later, per connection and quietly.
    try:
        read_pem(path, what)
    except TlsError as exc:
        raise PluginConfigError(f"{name}: {exc}") from None


def _learner_key(value: Any) -> str:
    key = str(value).strip()
    if len(key) > MAX_ID_LENGTH:
        raise PluginConfigError(f"NIGHTJAR_LEARNER_KEY is longer than {MAX_ID_LENGTH} characters")
    return key


def _boolean(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise PluginConfigError(f"{name} must be a boolean, got {value!r}")


def _deadline(value: Any) -> float:
    try:
        deadline = float(value)
    except (TypeError, ValueError):
        raise PluginConfigError(f"NIGHTJAR_DEADLINE_MS must be a number, got {value!r}") from None
    if not 0 < deadline <= 1000:
        raise PluginConfigError(f"NIGHTJAR_DEADLINE_MS must be in (0, 1000], got {deadline}")
    return deadline


def _table(value: Any) -> tuple[tuple[int, int, int], ...]:
    try:
        rows = json.loads(value) if isinstance(value, str) else value
        table = tuple((int(a), int(b), int(g)) for a, b, g in rows)
    except (TypeError, ValueError) as exc:
        raise PluginConfigError(
            f"NIGHTJAR_FALLBACK_TABLE must be JSON [[start_bs, end_bs, gamma], ...]: {exc}"
        ) from None
    if not table or any(a < 1 or b < a or g < 0 for a, b, g in table):
        raise PluginConfigError(
            f"NIGHTJAR_FALLBACK_TABLE rows need 1 <= start_bs <= end_bs and gamma >= 0: {value!r}"
        )
    return table
