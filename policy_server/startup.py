"""The policy a sidecar starts with: the configured one, with its last snapshot's learned
state where that fits.

Per parameter, what the operator set (config file, then flags) wins over the snapshot's
value (a change made at run time with ``nightjarctl set-params``), which wins over the
policy's default; so a changed chart or overlay takes effect on a persistent state volume.
The snapshot's learned state is kept when it fits the resulting parameters, dropped with a
WARNING naming why when it does not (e.g. learned with another ``gamma_max``). A snapshot
of another policy than the one configured is not restored. With nothing configured the
snapshot's policy and parameters are taken whole. One INFO line says where each
parameter came from (:func:`log_sources`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nightjar_common.errors import FailedPreconditionError
from policy_server import snapshot
from policy_server.config import ServerConfig
from policy_server.policies import (
    REGISTRY,
    PolicyError,
    UnknownPolicyError,
    create_policy,
    learned_state,
)
from policy_server.service import DecisionService

log = logging.getLogger("nightjar.server")

POLICIES_LOGGER = "policy_server.policies"
SNAPSHOT = "snapshot"
DEFAULT = "default"


@dataclasses.dataclass(frozen=True, slots=True)
class Configured:
    """The policy and parameters the operator set, each with where it was set."""

    policy: str
    # Where the policy was named; None: the default policy.
    policy_origin: str | None = None
    # Parameter -> (value, where it was set).
    params: Mapping[str, tuple[Any, str]] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, config: ServerConfig) -> Configured:
        params = {key: (v, config.origins[f"params.{key}"]) for key, v in config.params.items()}
        return cls(config.policy, config.origins.get("policy"), params)

    @property
    def pins_policy(self) -> bool:
        """Whether the operator chose the policy: named it, or set parameters for it."""
        return self.policy_origin is not None or bool(self.params)

    def values(self) -> dict[str, Any]:
        return {key: value for key, (value, _) in self.params.items()}


def start(service: DecisionService, state_dir: Path | None, configured: Configured) -> None:
    """Restore what fits of the snapshot in ``state_dir`` (if any) and log where the active
    parameters came from."""
    saved = restore(service, state_dir, configured) if state_dir is not None else None
    log_sources(service, configured, saved)


def restore(
    service: DecisionService, state_dir: Path, configured: Configured
) -> Mapping[str, Any] | None:
    """Bring back the last snapshot's policy, parameters and learned state as far as they
    agree with ``configured``; the snapshot's parameters when its policy was taken, else
    None. A snapshot that cannot be read is logged, moved aside, and we start fresh."""
    path = state_dir / snapshot.SNAPSHOT_NAME
    if not path.exists():
        log.info("no snapshot in %s; starting with fresh state", state_dir)
        return None
    try:
        document = snapshot.read(path)
        return _restore(service, document, configured, path)
    except Exception as exc:  # whatever is wrong with it: a crash here would crash-loop
        _move_aside(path, exc)
        return None


def _move_aside(path: Path, reason: Exception) -> None:
    """Log an unusable snapshot and move it aside, so that the next start does not read it
    again; the server starts fresh either way (restore_document changed nothing)."""
    try:
        moved = snapshot.quarantine(path)
    except OSError as exc:
        log.error(
            "snapshot %s is unusable (%s); cannot move it aside (%s), starting fresh",
            path,
            reason,
            exc,
        )
        return
    log.error("snapshot %s is unusable (%s); moved to %s, starting fresh", path, reason, moved)


def _restore(
    service: DecisionService, document: dict[str, Any], configured: Configured, path: Path
) -> Mapping[str, Any] | None:
    saved = document["policy"]
    if configured.pins_policy and saved["name"] != configured.policy:
        log.warning(
            "snapshot %s holds policy %r, but %r is configured (%s): starting %r with fresh "
            "state, the snapshot's learned state is not used",
            path,
            saved["name"],
            configured.policy,
            _configured_where(configured),
            configured.policy,
        )
        return None
    params = {**saved["params"], **configured.values()}
    merged = {**document, "policy": {**saved, "params": params}}
    try:
        active = service.restore_document(merged, from_client=False)
    except FailedPreconditionError as exc:
        overridden = [k for k, (v, _) in configured.params.items() if saved["params"].get(k) != v]
        if not overridden or not _fits(saved):
            raise  # the snapshot is unusable with its own parameters too
        log.warning(
            "learned state in %s dropped: the configured parameters %s differ from the "
            "snapshot's and its state does not fit them (%s); starting %s with fresh state",
            path,
            ", ".join(_with_origin(key, configured.params[key]) for key in overridden),
            exc,
            saved["name"],
        )
        service.restore_document(merged, from_client=False, keep_state=False)
        return dict(saved["params"])
    service.store.last_snapshot_unix = float(document.get("created_unix", 0.0))
    log.info("restored %s (%s) from %s", active.name, active.version, path)
    return dict(saved["params"])


def _fits(saved: Mapping[str, Any]) -> bool:
    """Whether a snapshot's state loads into its own policy and parameters."""
    # A trial: its policy's notices (e.g. "no prefill_cost_table given") are about
    # parameters that will not run, and would contradict the configured ones in the log.
    policies_log = logging.getLogger(POLICIES_LOGGER)
    level = policies_log.level
    policies_log.setLevel(logging.ERROR)
    try:
        learned_state(create_policy(saved["name"], saved["params"])).load_state(saved["state"])
    except (PolicyError, UnknownPolicyError):
        return False
    finally:
        policies_log.setLevel(level)
    return True


def log_sources(
    service: DecisionService, configured: Configured, saved: Mapping[str, Any] | None
) -> None:
    """One INFO line: the active policy and each parameter that is not its default, with
    where it came from (a config file, the command line, the snapshot)."""
    active = service.active
    if active.name == configured.policy:
        taken = saved is not None and not configured.pins_policy
        policy_from = configured.policy_origin or (SNAPSHOT if taken else DEFAULT)
        given = configured.params
    else:
        policy_from, given = SNAPSHOT, {}
    defaults = REGISTRY[active.name].default_params()
    parts = []
    for key, value in sorted(active.policy.params().items()):
        if key in given:
            parts.append(_with_origin(key, (value, given[key][1])))
        elif value != defaults.get(key):
            parts.append(_with_origin(key, (value, SNAPSHOT if saved is not None else DEFAULT)))
    log.info(
        "policy %s (%s) from %s; parameters: %s; the others are the policy's defaults",
        active.name,
        active.version,
        policy_from,
        ", ".join(parts) or "none set",
    )


def _with_origin(key: str, value_origin: tuple[Any, str]) -> str:
    value, origin = value_origin
    return f"{key}={value!r} ({origin})"


def _configured_where(configured: Configured) -> str:
    if configured.policy_origin is not None:
        return f"policy from {configured.policy_origin}"
    origins = sorted({origin for _, origin in configured.params.values()})
    return f"parameters for it from {', '.join(origins)}"
