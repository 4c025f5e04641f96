"""Fleet learning through Redis: every sidecar of a deployment learns from the whole fleet.

With ``--fleet redis://…`` a background thread, every ``interval_s``:

1. reads, for each learner key of the active policy, what this sidecar learned itself
   (policies/fleet_stats.py: sufficient statistics, never decisions, engines or requests)
   and publishes it as this member's record;
2. reads the records of every member alive (published within ``ttl_s``), checks them as
   snapshots are checked (size, JSON, format, scope, finite numbers in range, shapes) and
   sums the others' per learner key;
3. merges each sum into the learner as its fleet part, holding that learner's lock for
   the few microseconds the fold takes (decisions of other learners go on).

Layout, under ``nightjar:{deployment}:{scope}`` (scope: the policy, its statistics' schema
and Γmax, so only statistics that can be summed meet): ``members`` a sorted set, member →
last publish (unix s), pruned past the TTL; ``member:{id}`` a hash, learner id → record,
written whole in one transaction and expiring after the TTL. Another deployment name is
another key space: two deployments never pool in one Redis.

Fail-open: Redis slow, down, full or holding garbage costs this thread only. Decisions
never wait on Redis (the link holds a learner's lock only to fold numbers in, never over
I/O); local learning goes on with what the learner holds (its fleet part forgets at its
own steps); a bad record is refused with a logged reason and
``nightjar_fleet_rejected_total{reason}``; the client reconnects at the next period.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import re
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import redis
from prometheus_client import Counter, Gauge, Histogram
from redis.credentials import CredentialProvider

from nightjar_common.json_input import JsonError, load_json
from policy_server.metrics import Metrics
from policy_server.policies.base import PolicyError, parse_params
from policy_server.policies.fleet_stats import GoodputStats, Pooling

log = logging.getLogger("nightjar.fleet")

FORMAT = "nightjar-fleet/1"
# A record is one learner's statistics: a few KB (goodput: ~15 KB with every batch-size
# octave run). Larger is not ours.
MAX_RECORD_BYTES = 1 << 20
# Members whose records one merge reads; a larger fleet pools its most recent ones.
MAX_MEMBERS = 1024
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")
REJECT_REASONS = ("size", "json", "format", "scope", "stats", "member")


class FleetConfigError(ValueError):
    """Fleet settings that do not fit (the server refuses to start with them)."""


@dataclasses.dataclass(frozen=True, slots=True)
class FleetOptions:
    """The ``fleet`` settings (config table ``[fleet]``, flags ``--fleet*``)."""

    # redis://, rediss:// (TLS) or unix:// URL; "" = fleet learning off.
    url: str = ""
    # Keeps deployments apart in one Redis: only sidecars of one deployment pool.
    deployment: str = "default"
    # This sidecar's id in the fleet ("" = the host name: a pod's name). A restart under
    # the same id replaces its record; a new id is a new member.
    member: str = ""
    # File holding the Redis password (a mounted Secret), read at each connection; the
    # URL's user name, if any, goes with it (ACL users).
    password_file: str = ""
    # rediss:// only: the CA to verify the server with (default: the system's), and a
    # client certificate and key for mutual TLS.
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    # Seconds between publish-and-merge rounds, and after which a silent member stops
    # counting.
    interval_s: float = 5.0
    ttl_s: float = 60.0
    # Socket timeout of each Redis call: a slow Redis delays this thread by at most this.
    timeout_s: float = 2.0
    # Fleet learner keys this sidecar holds at most (as --max-learner-keys bounds its own).
    max_learners: int = 256

    def __post_init__(self) -> None:
        if not self.url:
            return
        scheme = urllib.parse.urlsplit(self.url).scheme
        if scheme not in ("redis", "rediss", "unix"):
            raise PolicyError(f"url must be redis://, rediss:// or unix://, got {scheme!r}")
        if (self.tls_ca or self.tls_cert or self.tls_key) and scheme != "rediss":
            raise PolicyError("tls_ca, tls_cert and tls_key need a rediss:// url")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise PolicyError("a client certificate needs both tls_cert and tls_key")
        if self.password_file and urllib.parse.urlsplit(self.url).password:
            raise PolicyError("give the password in the url or in password_file, not both")
        for name in ("deployment", "member"):
            value = getattr(self, name)
            if (value or name == "deployment") and not _NAME.fullmatch(value):
                raise PolicyError(
                    f"{name} must be 1..253 letters, digits, '.', '_' or '-', got {value!r}"
                )
        if not 0.1 <= self.interval_s <= 3600:
            raise PolicyError("interval_s must be in 0.1..3600")
        if not self.interval_s * 2 <= self.ttl_s <= 86400:
            raise PolicyError("ttl_s must be in 2 x interval_s..86400")
        if not 0.05 <= self.timeout_s <= 60:
            raise PolicyError("timeout_s must be in 0.05..60")
        if not 1 <= self.max_learners <= 1 << 16:
            raise PolicyError("max_learners must be in 1..65536")

    @classmethod
    def parse(cls, settings: Mapping[str, Any]) -> FleetOptions:
        try:
            return parse_params(cls, settings, "fleet")
        except PolicyError as exc:
            raise FleetConfigError(str(exc).replace("policy 'fleet'", "fleet")) from exc

    @property
    def member_id(self) -> str:
        return self.member or socket.gethostname()[:253]


class _PasswordFile(CredentialProvider):
    """The password read from its file at each new connection: a rotated Secret is taken
    up at the next reconnect, no restart."""

    def __init__(self, path: str, username: str) -> None:
        self.path = path
        self.username = username

    def get_credentials(self) -> tuple[str] | tuple[str, str]:
        password = Path(self.path).read_text().strip()
        return (self.username, password) if self.username else (password,)


def connect(options: FleetOptions) -> redis.Redis:
    """A client (no connection yet: it connects at its first call and after each failure)."""
    url = options.url
    extra: dict[str, Any] = {}
    if options.password_file:
        parts = urllib.parse.urlsplit(url)
        username = urllib.parse.unquote(parts.username or "")
        if parts.password:
            raise FleetConfigError("give the password in the url or in password_file, not both")
        host = parts.netloc.rpartition("@")[2]
        url = urllib.parse.urlunsplit(parts._replace(netloc=host))
        extra["credential_provider"] = _PasswordFile(options.password_file, username)
    elif urllib.parse.urlsplit(url).password:
        log.warning("the fleet url holds a password: it shows in the process list; use a file")
    if urllib.parse.urlsplit(url).scheme == "rediss":
        extra.update(
            ssl_ca_certs=options.tls_ca or None,
            ssl_certfile=options.tls_cert or None,
            ssl_keyfile=options.tls_key or None,
        )
    return redis.Redis.from_url(
        url,
        socket_timeout=options.timeout_s,
        socket_connect_timeout=options.timeout_s,
        # Redis' own retries would hold this thread past its period: the next round retries.
        retry_on_timeout=False,
        retry=None,
        health_check_interval=30,
        client_name=f"nightjar-{options.member_id}"[:64],
        **extra,
    )


class FleetMetrics:
    def __init__(self, metrics: Metrics) -> None:
        r = metrics.registry
        self.up = Gauge(
            "nightjar_fleet_link_up",
            "1 while the last round with Redis (publish and read) succeeded, else 0.",
            registry=r,
        )
        self.members = Gauge(
            "nightjar_fleet_members",
            "Members of this deployment and scope seen alive at the last read (this one too).",
            registry=r,
        )
        self.merge_age = Gauge(
            "nightjar_fleet_last_merge_age_seconds",
            "Seconds since the fleet's evidence was last merged (since the link started, "
            "before the first).",
            registry=r,
        )
        self.poolable = Gauge(
            "nightjar_fleet_poolable",
            "1 when the active policy can pool its learning with the fleet, else 0.",
            registry=r,
        )
        self.evidence_steps = Gauge(
            "nightjar_fleet_evidence_steps",
            "Steps the pooled learners hold, by source: local (this sidecar's engines) or "
            "fleet (the other members').",
            ["source"],
            registry=r,
        )
        self.evidence_tokens = Gauge(
            "nightjar_fleet_evidence_acceptance_tokens",
            "Forgotten draft tokens of acceptance evidence the pooled learners hold, by "
            "source (local, fleet).",
            ["source"],
            registry=r,
        )
        self.errors = Counter(
            "nightjar_fleet_errors",
            "Rounds with Redis that failed, by operation (publish, read).",
            ["operation"],
            registry=r,
        )
        self.rejected = Counter(
            "nightjar_fleet_rejected",
            "Fleet records refused, by reason: size, json, format, scope, stats, member.",
            ["reason"],
            registry=r,
        )
        self.round_seconds = Histogram(
            "nightjar_fleet_round_seconds",
            "Wall time of one publish-and-merge round (Redis calls included).",
            buckets=(1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0),
            registry=r,
        )
        for operation in ("publish", "read"):
            self.errors.labels(operation)
        for reason in REJECT_REASONS:
            self.rejected.labels(reason)
        for source in ("local", "fleet"):
            self.evidence_steps.labels(source)
            self.evidence_tokens.labels(source)


@dataclasses.dataclass(slots=True)
class RoundReport:
    """What one round did (tests and the benchmark read it)."""

    published: int = 0
    members: list[str] = dataclasses.field(default_factory=list)
    merged: int = 0
    rejected: dict[str, int] = dataclasses.field(default_factory=dict)
    ok: bool = True


class FleetLink:
    """The link of one sidecar's decision service to its fleet in Redis."""

    def __init__(
        self,
        service: Any,
        options: FleetOptions,
        metrics: Metrics,
        client: redis.Redis | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.service = service
        self.options = options
        self.member = options.member_id
        self.client = client if client is not None else connect(options)
        self.metrics = FleetMetrics(metrics)
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_merge = time.monotonic()
        self._up: bool | None = None
        self._warned: set[tuple[str, str]] = set()
        self._said_cannot_pool = ""
        self._members = 0
        self._pools = True
        self.metrics.merge_age.set_function(lambda: time.monotonic() - self._last_merge)

    def status(self) -> dict[str, Any]:
        """The link as GetState shows it (admin.proto, GetStateResponse.fleet_json)."""
        return {
            "member": self.member,
            "deployment": self.options.deployment,
            "link_up": self._up,
            "members": self._members,
            "last_merge_age_s": round(time.monotonic() - self._last_merge, 3),
            "pools": self._pools,
        }

    # -- the thread ---------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="nightjar-fleet", daemon=True)
        self._thread.start()
        log.info(
            "fleet learning: member %s of deployment %s, every %gs (members leave after %gs)",
            self.member,
            self.options.deployment,
            self.options.interval_s,
            self.options.ttl_s,
        )

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.options.timeout_s * 4 + 1)
        with contextlib.suppress(Exception):
            self.client.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.round()
            except Exception:  # a defect: logged, never the end of the sidecar's learning
                log.exception("fleet round failed")
            self._stop.wait(self.options.interval_s)

    # -- one round ----------------------------------------------------------------------

    def round(self) -> RoundReport:
        """Publish this member's evidence and merge the fleet's, once."""
        report = RoundReport()
        started = time.perf_counter()
        active = self.service.active
        pool = active.pooling
        self._pools = pool is not None
        self.metrics.poolable.set(0 if pool is None else 1)
        if pool is None:
            # Nothing to merge is not a stale merge (NightjarFleetLinkDown reads the age).
            self._last_merge = time.monotonic()
            if self._said_cannot_pool != active.name:
                self._said_cannot_pool = active.name
                log.warning(
                    "fleet learning idle: policy %s cannot pool its learning (goodput can)",
                    active.name,
                )
            return report
        self._said_cannot_pool = ""
        prefix = f"nightjar:{self.options.deployment}:{pool.pool_scope}"
        learners = pool.pooled_learners()[: self.options.max_learners]
        records: dict[str, str] = {}
        now = self._clock()
        for learner in learners:
            with self._learner(active, learner) as still_active:
                stats = pool.local_evidence(learner, self.member) if still_active else None
            if stats is not None:
                records[learner] = json.dumps(
                    {
                        "format": FORMAT,
                        "scope": pool.pool_scope,
                        "member": self.member,
                        "learner": learner,
                        "published_unix": now,
                        "stats": stats.to_json(),
                    },
                    separators=(",", ":"),
                )
        report.published = len(records)
        try:
            alive = self._publish(prefix, records, now)
        except (redis.RedisError, OSError) as exc:  # OSError: the password file
            self._failed("publish", exc)
            report.ok = False
            return report
        try:
            fleet = self._read(prefix, pool, alive, report)
        except (redis.RedisError, OSError) as exc:  # OSError: the password file
            self._failed("read", exc)
            report.ok = False
            return report
        self._link_up()
        report.members = alive
        self._members = len(set(alive) | {self.member})
        self.metrics.members.set(self._members)
        # Learners this sidecar holds, then the fleet's others (a new sidecar starts warm).
        targets = list(dict.fromkeys([*learners, *sorted(fleet)]))[: self.options.max_learners]
        for learner in targets:
            with self._learner(active, learner) as still_active:
                if not still_active:
                    break
                pool.merge_fleet(
                    learner, fleet.get(learner, GoodputStats.zero()), self.member, alive
                )
            report.merged += 1
        self._last_merge = time.monotonic()
        self._evidence(active, pool, targets)
        self.metrics.round_seconds.observe(time.perf_counter() - started)
        return report

    def _publish(self, prefix: str, records: Mapping[str, str], now: float) -> list[str]:
        """Write this member's record whole and read who is alive."""
        ttl = self.options.ttl_s
        key = f"{prefix}:member:{self.member}"
        with self.client.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            if records:
                pipe.hset(key, mapping=dict[Any, Any](records))
                pipe.expire(key, math.ceil(ttl))
            pipe.zadd(f"{prefix}:members", {self.member: now})
            pipe.zremrangebyscore(f"{prefix}:members", "-inf", f"({now - ttl}")
            pipe.expire(f"{prefix}:members", math.ceil(ttl * 2))
            pipe.zrevrangebyscore(f"{prefix}:members", "+inf", now - ttl, start=0, num=MAX_MEMBERS)
            replies = pipe.execute()
        return [_text(m) for m in replies[-1]]

    def _read(
        self, prefix: str, pool: Pooling, alive: list[str], report: RoundReport
    ) -> dict[str, GoodputStats]:
        """The other members' evidence, summed per learner; bad records refused."""
        others = [m for m in alive if m != self.member]
        if not others:
            return {}
        with self.client.pipeline(transaction=False) as pipe:
            for member in others:
                pipe.hgetall(f"{prefix}:member:{member}")
            replies = pipe.execute()
        fleet: dict[str, GoodputStats] = {}
        for member, record in zip(others, replies, strict=True):
            for field, value in dict(record).items():
                learner = _text(field)
                stats = self._checked(pool, member, learner, value, report)
                if stats is None:
                    continue
                total = fleet.get(learner)
                fleet[learner] = stats if total is None else total.plus(stats)
        return fleet

    def _checked(
        self, pool: Pooling, member: str, learner: str, value: bytes, report: RoundReport
    ) -> GoodputStats | None:
        """A member's record of ``learner`` as snapshots are checked, or None (counted and
        logged with its reason)."""
        if len(value) > MAX_RECORD_BYTES:
            return self._reject(member, "size", f"{len(value):,} bytes", report)
        try:
            document = load_json(value)
        except JsonError as exc:
            return self._reject(member, "json", str(exc), report)
        if not isinstance(document, dict) or document.get("format") != FORMAT:
            return self._reject(member, "format", f"not a {FORMAT} record", report)
        if document.get("scope") != pool.pool_scope or document.get("learner") != learner:
            return self._reject(
                member, "scope", f"scope {document.get('scope')!r} of {learner!r}", report
            )
        if document.get("member") != member:
            return self._reject(member, "member", f"signed {document.get('member')!r}", report)
        try:
            return pool.stats_from_json(document.get("stats"))
        except (KeyError, TypeError, ValueError) as exc:
            return self._reject(member, "stats", repr(exc), report)

    def _reject(
        self, member: str, reason: str, detail: str, report: RoundReport
    ) -> GoodputStats | None:
        self.metrics.rejected.labels(reason).inc()
        report.rejected[reason] = report.rejected.get(reason, 0) + 1
        # Once per member and reason at WARNING: a bad member repeats every round.
        level = logging.DEBUG if (member, reason) in self._warned else logging.WARNING
        self._warned.add((member, reason))
        log.log(level, "fleet record of member %r refused (%s): %s", member, reason, detail[:200])
        return None  # what _checked answers for a refused record

    def _failed(self, operation: str, exc: Exception) -> None:
        self.metrics.errors.labels(operation).inc()
        self.metrics.up.set(0)
        if self._up is not False:
            log.warning(
                "fleet link down (%s: %s); deciding and learning locally, retrying every %gs",
                operation,
                exc,
                self.options.interval_s,
            )
        self._up = False

    def _link_up(self) -> None:
        self.metrics.up.set(1)
        if self._up is not True:
            log.info("fleet link up: %s", _redacted(self.options.url))
        self._up = True

    def _evidence(self, active: Any, pool: Pooling, learners: list[str]) -> None:
        totals = {"local": [0.0, 0.0], "fleet": [0.0, 0.0]}
        for learner in learners:
            with self._learner(active, learner) as still_active:
                if not still_active:
                    return
                local, fleet = pool.evidence(learner)
            for source, summary in (("local", local), ("fleet", fleet)):
                totals[source][0] += summary["steps"]
                totals[source][1] += summary["acceptance_tokens"]
        for source, (steps, tokens) in totals.items():
            self.metrics.evidence_steps.labels(source).set(steps)
            self.metrics.evidence_tokens.labels(source).set(tokens)

    @contextlib.contextmanager
    def _learner(self, active: Any, learner: str) -> Iterator[bool]:
        """Hold ``learner``'s lock, the one the service's steps of it hold; whether
        ``active`` is still the active policy (an activation holds every learner's lock,
        so it cannot change while this is held)."""
        with self.service.holding_learner(learner) as now:
            yield now is active


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _redacted(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    if parts.password:
        host = parts.netloc.rpartition("@")[2]
        user = f"{parts.username}:***@" if parts.username else ":***@"
        return urllib.parse.urlunsplit(parts._replace(netloc=user + host))
    return url


def start(service: Any, settings: Mapping[str, Any], metrics: Metrics) -> FleetLink | None:
    """The fleet link of ``settings`` started, or None when no url is set."""
    options = FleetOptions.parse(settings)
    if not options.url:
        return None
    link = FleetLink(service, options, metrics)
    service.fleet_status = link.status
    link.start()
    return link


# Flags of nightjar-server (cli.py), each a key of the ``fleet`` settings.
FLAGS = (
    (
        "url",
        "--fleet",
        str,
        "pool learning with the deployment's other sidecars through this "
        "Redis (redis://, rediss:// for TLS, unix://); default off",
    ),
    (
        "deployment",
        "--fleet-deployment",
        str,
        "only sidecars of this deployment name pool (default 'default')",
    ),
    (
        "member",
        "--fleet-member",
        str,
        "this sidecar's id in the fleet (default: the host "
        "name, a pod's name); a restart under the same id replaces its contribution",
    ),
    (
        "password_file",
        "--fleet-password-file",
        str,
        "file holding the Redis password (a mounted Secret), read at each connection",
    ),
    ("tls_ca", "--fleet-tls-ca", str, "PEM CA to verify a rediss:// server with"),
    (
        "tls_cert",
        "--fleet-tls-cert",
        str,
        "PEM client certificate for a rediss:// server (mutual TLS)",
    ),
    ("tls_key", "--fleet-tls-key", str, "PEM private key of --fleet-tls-cert"),
    (
        "interval_s",
        "--fleet-interval-s",
        float,
        "seconds between publish-and-merge rounds (default 5)",
    ),
    ("ttl_s", "--fleet-ttl-s", float, "a member silent this long stops counting (default 60)"),
)


def add_arguments(parser: Any) -> None:
    """The ``--fleet*`` flags on nightjar-server's argument parser."""
    for key, flag, kind, text in FLAGS:
        parser.add_argument(flag, dest=f"fleet_{key}", type=kind, help=text)


def settings_from_args(args: Any) -> dict[str, Any]:
    """The ``fleet`` settings the flags give (over the config file's, key by key)."""
    return {
        key: getattr(args, f"fleet_{key}")
        for key, *_ in FLAGS
        if getattr(args, f"fleet_{key}", None) is not None
    }
