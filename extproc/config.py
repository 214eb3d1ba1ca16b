"""Configuration: raw mapping -> defaults -> validation (every problem at once) -> frozen objects.

Nothing here is read at import time. ``load(path)`` reads a YAML file; ``from_mapping(raw)``
builds from an already-parsed mapping (tests, the demo). Every problem found is reported in
one ``ConfigError``, each line naming the dotted key, the bound and the bad value. Unknown keys
are errors too: a typo must not silently fall back to a default.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

import yaml

from extproc.autoscale import ScalingPolicy
from extproc.engine import PRESETS, EngineModel
from extproc.errors import ConfigError
from extproc.share import MAX_LEVEL, parse_priority

T = TypeVar("T")


class Mode(StrEnum):
    ENFORCE = "enforce"  # reject what would miss its deadline
    SHADOW = "shadow"  # decide, record and count, but always continue


class Infeasible(StrEnum):
    """What to do with a request that would miss its deadline even on an idle fleet."""

    PASS = "pass"  # not overload: let it through (retrying could never help)
    REJECT = "reject"  # refuse with a 400 that says why (never a 429)


class ContentEncoding(StrEnum):
    """What to do with a compressed request body (``extproc.encoding``)."""

    REFUSE = "refuse"  # 415, naming the coding
    DECODE = "decode"  # gzip / deflate inflated for reading, within max_inflation_ratio


class Api(StrEnum):
    OPENAI_CHAT = "openai_chat"
    OPENAI_COMPLETIONS = "openai_completions"
    OPENAI_EMBEDDINGS = "openai_embeddings"
    TGI_GENERATE = "tgi_generate"


@dataclass(frozen=True)
class ClassPolicy:
    """A service class. ``latency``: interactive, with a time-to-first-token objective;
    ``throughput``: batch work with a long deadline that may queue deep."""

    name: str
    deadline_ms: float
    safety_factor: float
    ttft_ms: float | None = None
    batch: bool = False  # takes only capacity the other classes' demand leaves (admission)
    priority: int | None = None  # its requests' priority (extproc.share); None: the default


@dataclass(frozen=True)
class Route:
    path: str
    api: Api
    service_class: str


@dataclass(frozen=True)
class EngineMetricsConfig:
    """Scraping a pool's engines for their own queues (``extproc.enginestats``): a correction
    to the ledger's view that only ever tightens admission, and never while stale."""

    # HOST:PORT or http(s):// base URLs; None: the capacity source's ready hosts
    targets: tuple[str, ...] | None = None
    interval_s: float = 2.0  # between the end of one scrape round and the next
    timeout_s: float = 0.5  # per replica
    max_age_s: float = 5.0  # a replica's last sample counts this long
    min_coverage: float = 0.5  # fresh / targets below this: stale, no correction
    tolerance: float = 0.25  # engines may hold this much more than the ledger ...
    slack: int = 2  # ... plus this many requests, before it counts as unseen work
    # Learn the pool's output lengths from vllm:request_generation_tokens (extproc.estimate)
    learn_output_lengths: bool = True


@dataclass(frozen=True)
class Pool:
    """Replicas serving one model, and the model of one replica (``extproc.engine``)."""

    name: str
    models: tuple[str, ...] = ("*",)
    replicas: int = 1
    engine: EngineModel = field(default_factory=EngineModel)
    default_max_tokens: int = 512
    tokenizer: str | None = None
    bytes_per_token: float = 4.0
    message_overhead_tokens: int = 4
    non_text_part_tokens: int = 765
    # Output-length prediction (extproc.estimate): the mean and a long (~99th percentile)
    # output of this pool's requests, e.g. from the engines' generation-token histogram.
    # Unset: requests are charged max_tokens in full (the conservative model).
    expected_output_tokens: float | None = None
    long_output_tokens: float | None = None
    # How sure a predicted queue wait must be: its quantile (admission's docstring).
    wait_quantile: float = 0.97
    engine_metrics: EngineMetricsConfig | None = None  # None: the ledger's view alone

    def serves(self, model: str) -> bool:
        return model in self.models or "*" in self.models


class OnUnavailable(StrEnum):
    """What a decision does when the shared ledger cannot be reached in time."""

    FAIL_OPEN = "fail_open"  # decide by the local view (last snapshot + own work), count, log
    FAIL_CLOSED = "fail_closed"  # refuse: 429 with reason ledger_unavailable


@dataclass(frozen=True)
class RedisTls:
    """TLS towards Redis: on for ``rediss://`` URLs, or with ``enabled`` (Sentinel)."""

    enabled: bool = False
    ca_file: str | None = None
    cert_file: str | None = None  # client certificate, when Redis asks for one
    key_file: str | None = None
    check_hostname: bool = True


@dataclass(frozen=True)
class RedisSentinel:
    addresses: tuple[tuple[str, int], ...]
    service_name: str


@dataclass(frozen=True)
class BreakerConfig:
    failures: int = 5  # consecutive failures that open the breaker
    cooldown_ms: float = 500.0  # how long it stays open before one trial call


@dataclass(frozen=True)
class LedgerConfig:
    """``memory`` (default): exact for one gateway replica. ``redis``: shared by replicas.

    The Redis settings below are used only with ``kind: redis``. The password is kept out of
    ``repr`` (and so out of logs); prefer ``password_file`` or ``password_env``.
    """

    kind: str = "memory"
    lease_grace_ms: float = 30_000.0  # the simulator's lease past a request's expected finish
    # A gateway's entries outlive its last heartbeat by this much (extproc.leases): a replica
    # that dies costs the fleet its requests' capacity for about this long, not a minute.
    liveness_ms: float = 3_000.0
    sweep_interval_ms: float = 1_000.0
    url: str | None = None  # redis://, rediss:// (TLS) or unix:// ; a seed node for a cluster
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    password_file: str | None = None
    password_env: str | None = None
    tls: RedisTls = field(default_factory=RedisTls)
    sentinel: RedisSentinel | None = None
    cluster: bool = False
    key_prefix: str = "extproc"
    timeout_ms: float = 50.0  # connect and socket timeout of every Redis call
    decision_deadline_ms: float = 75.0  # the most one decision waits on the ledger in total
    on_unavailable: OnUnavailable = OnUnavailable.FAIL_OPEN
    breaker: BreakerConfig = field(default_factory=BreakerConfig)


@dataclass(frozen=True)
class CapacityConfig:
    """Where ready replicas come from (see extproc.capacity)."""

    source: str = "static"  # static: pools[].replicas | envoy: Envoy admin | kubernetes
    envoy_admin_url: str = "http://127.0.0.1:9901"
    services: Mapping[str, str] = field(default_factory=dict)  # pool -> "namespace/service"
    hold_s: float = 10.0  # keep the last value this long when the source fails...
    floor: int = 1  # ...then assume at most this many ready replicas


@dataclass(frozen=True)
class AutoscaleConfig:
    window_s: float = 15.0  # the control window
    policy: ScalingPolicy = field(default_factory=ScalingPolicy)  # extproc.autoscale


@dataclass(frozen=True)
class TracingConfig:
    endpoint: str | None = None  # OTLP gRPC, e.g. "http://jaeger-collector:4317"; None: off
    sample_ratio: float = 1.0  # for root spans; a sampled parent (Envoy's) is always followed
    service_name: str = "extproc"


@dataclass(frozen=True)
class RetryAfter:
    min_s: int = 1
    max_s: int = 60
    jitter: float = 0.5  # Retry-After is drawn from [t, t * (1 + jitter)]


class TenantSource(StrEnum):
    """Where the tenant comes from (extproc.tenant): never from what the client sent."""

    NONE = "none"  # no attribution
    METADATA = "metadata"  # Envoy dynamic metadata, e.g. jwt_authn's payload_in_metadata
    HEADER = "header"  # a header Envoy removes from the client's request and sets itself


@dataclass(frozen=True)
class TenantPolicy:
    """What one tenant is entitled to (extproc.share): its weight in fair shares, its
    requests' priority, and optional hard caps the ledger enforces atomically."""

    weight: float = 1.0
    priority: int | None = None  # None: from the header, then the class, then the default
    max_inflight: int | None = None  # the most requests it may have in flight
    max_outstanding_s: float | None = None  # the most GPU-seconds of work it may owe


@dataclass(frozen=True)
class PriorityConfig:
    """Where a request's priority comes from (extproc.share), first that names one: the
    header (set by Envoy, never by the client), its tenant's, its class's, ``default``."""

    header: str | None = None
    default: int = 0


@dataclass(frozen=True)
class TenantConfig:
    source: TenantSource = TenantSource.NONE
    metadata_namespace: str = "envoy.filters.http.jwt_authn"
    metadata_key: str = "jwt_payload"  # jwt_authn's payload_in_metadata; "": none
    claim: tuple[str, ...] = ("tenant",)  # the claim's key (a path into nested claims)
    header: str = "x-tenant-id"
    known: tuple[str, ...] = ()  # tenants that are metric labels; the rest count as "other"
    default: str = "anonymous"  # charged when no tenant is named
    fair_share: bool = True  # contended pools are shared max-min by weight (extproc.share)
    tenants: Mapping[str, TenantPolicy] = field(default_factory=dict)
    others: TenantPolicy = field(default_factory=TenantPolicy)  # every tenant not listed

    def policy(self, name: str) -> TenantPolicy:
        return self.tenants.get(name, self.others)


@dataclass(frozen=True)
class ServerTls:
    """mTLS on ``listen``: clients (Envoy) must present a certificate ``client_ca_file``
    signed. Files are re-read when they change (extproc.tls)."""

    cert_file: str
    key_file: str
    client_ca_file: str
    reload_interval_s: float = 10.0  # how often a new connection checks the files at most


@dataclass(frozen=True)
class Config:
    pools: tuple[Pool, ...]
    classes: Mapping[str, ClassPolicy]
    routes: tuple[Route, ...]
    listen: str = "127.0.0.1:50051"
    metrics_listen: str = "127.0.0.1:9464"
    mode: Mode = Mode.ENFORCE
    infeasible: Infeasible = Infeasible.PASS
    max_body_bytes: int = 8 * 1024 * 1024
    content_encoding: ContentEncoding = ContentEncoding.REFUSE
    max_inflation_ratio: float = 20.0  # decoded / compressed bytes, with content_encoding decode
    deadline_header: str = "x-admission-deadline-ms"
    drain_grace_s: float = 25.0
    shed_wait_ms: float = 500.0  # 429 at once while bodies wait longer for us (0: never)
    ledger: LedgerConfig = field(default_factory=LedgerConfig)
    retry_after: RetryAfter = field(default_factory=RetryAfter)
    decision_log: str | None = None  # JSONL of every decision, for extproc replay
    tracing: TracingConfig = field(default_factory=TracingConfig)
    capacity: CapacityConfig = field(default_factory=CapacityConfig)
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    keda_listen: str | None = None  # KEDA external scaler gRPC (HOST:PORT); None: off
    tenant: TenantConfig = field(default_factory=TenantConfig)
    priority: PriorityConfig = field(default_factory=PriorityConfig)
    tls: ServerTls | None = None  # mTLS on ``listen``; None: plaintext (loopback, unix)

    def route(self, path: str) -> Route | None:
        """The route for a request path (query string ignored), or None to pass it untouched."""
        bare = path.split("?", 1)[0]
        for route in self.routes:
            if route.path == bare:
                return route
        return None

    def pool_for(self, model: str) -> Pool | None:
        exact = [p for p in self.pools if model in p.models]
        if exact:
            return exact[0]
        return next((p for p in self.pools if "*" in p.models), None)


DEFAULT_CLASSES: dict[str, dict[str, Any]] = {
    "latency": {"deadline_ms": 30_000, "ttft_ms": 2_000, "safety_factor": 0.8},
    "throughput": {"deadline_ms": 600_000, "safety_factor": 0.9, "batch": True},
}

DEFAULT_ROUTES: list[dict[str, Any]] = [
    {"path": "/v1/chat/completions", "api": "openai_chat", "class": "latency"},
    {"path": "/v1/completions", "api": "openai_completions", "class": "latency"},
    {"path": "/v1/embeddings", "api": "openai_embeddings", "class": "throughput"},
    {"path": "/generate", "api": "tgi_generate", "class": "latency"},
    {"path": "/generate_stream", "api": "tgi_generate", "class": "latency"},
]


class _Reader:
    """Pulls typed values out of a raw mapping, collecting problems instead of raising."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems

    def section(self, raw: Any, key: str) -> dict[str, Any]:
        if raw is None:
            return {}
        if not isinstance(raw, Mapping):
            self.problems.append(f"{key}: must be a mapping, got {type(raw).__name__}")
            return {}
        return dict(raw)

    def take(
        self,
        raw: dict[str, Any],
        prefix: str,
        key: str,
        kind: Callable[[Any], T],
        default: T,
        check: Callable[[T], str | None] | None = None,
    ) -> T:
        name = f"{prefix}{key}"
        if key not in raw:
            return default
        value = raw.pop(key)
        try:
            typed = _coerce(value, kind)
        except (TypeError, ValueError) as exc:
            self.problems.append(f"{name}: {exc} (got {value!r})")
            return default
        if check is not None and (why := check(typed)) is not None:
            self.problems.append(f"{name}: {why} (got {value!r})")
            return default
        return typed

    def leftovers(self, raw: Mapping[str, Any], prefix: str) -> None:
        for key in raw:
            self.problems.append(f"{prefix}{key}: unknown key")


def _coerce(value: Any, kind: Callable[[Any], T]) -> T:
    if isinstance(value, bool) and kind in (int, float):
        raise TypeError("must be a number, not a boolean")
    if kind is bool and not isinstance(value, bool):
        raise TypeError("must be true or false")
    if kind is int and not isinstance(value, int):
        raise TypeError("must be an integer")
    if kind is float and not isinstance(value, int | float):
        raise TypeError("must be a number")
    if kind is str and not isinstance(value, str):
        raise TypeError("must be a string")
    return kind(value)


def _positive(v: float) -> str | None:
    return None if v > 0 else "must be > 0"


def _non_negative(v: float) -> str | None:
    return None if v >= 0 else "must be >= 0"


def _fraction(v: float) -> str | None:
    return None if 0 < v <= 1 else "must be in (0, 1]"


def _address(v: str) -> str | None:
    if v.startswith("unix:"):
        return None
    host, sep, port = v.rpartition(":")
    if not (sep and host and port.isdigit()):
        return "must be HOST:PORT or unix:PATH"
    # 0: any free port (what tests bind); above 65535 no socket exists, and Envoy's config
    # rendered from this one would name it
    return None if int(port) <= 65535 else "the port must be 0-65535"


def _writable_dir(v: str) -> str | None:
    parent = Path(v).parent
    return None if parent.is_dir() else f"no such directory {str(parent)!r}"


def load(path: str | os.PathLike[str]) -> Config:
    """Read and validate a YAML configuration file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
        raw = yaml.safe_load(text) or {}
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read ({exc.strerror})"]) from exc
    except yaml.YAMLError as exc:
        raise ConfigError([f"{path}: not valid YAML ({exc})"]) from exc
    return from_mapping(raw)


def from_mapping(raw: Any) -> Config:
    """Build a validated ``Config``; raise ``ConfigError`` listing every problem."""
    problems: list[str] = []
    r = _Reader(problems)
    top = r.section(raw, "<root>")

    classes = _classes(r, top.pop("classes", None))
    routes = _routes(r, top.pop("routes", None), classes)
    pools = _pools(r, top.pop("pools", None))

    ledger = _ledger(r, top.pop("ledger", None))

    ra = r.section(top.pop("retry_after", None), "retry_after")
    retry_after = RetryAfter(
        min_s=r.take(ra, "retry_after.", "min_s", int, 1,
                     lambda v: None if v >= 1 else "must be >= 1"),
        max_s=r.take(ra, "retry_after.", "max_s", int, 60,
                     lambda v: None if v <= 120 else "must be <= 120 (SDKs give up beyond)"),
        jitter=r.take(ra, "retry_after.", "jitter", float, 0.5, _non_negative),
    )
    r.leftovers(ra, "retry_after.")
    if retry_after.max_s < retry_after.min_s:
        problems.append(
            f"retry_after.max_s: must be >= retry_after.min_s ({retry_after.min_s})"
            f" (got {retry_after.max_s})"
        )

    capacity = _capacity(r, top.pop("capacity", None), pools)
    autoscale = _autoscale(r, top.pop("autoscale", None))
    tr = r.section(top.pop("tracing", None), "tracing")
    tracing = TracingConfig(
        endpoint=r.take(tr, "tracing.", "endpoint", str, "",
                        lambda v: None if v.startswith(("http://", "https://"))
                        else "must be an http:// or https:// URL") or None,
        sample_ratio=r.take(tr, "tracing.", "sample_ratio", float, 1.0,
                            lambda v: None if 0 <= v <= 1 else "must be in [0, 1]"),
        service_name=r.take(tr, "tracing.", "service_name", str, "extproc",
                            lambda v: None if v else "must not be empty"),
    )
    r.leftovers(tr, "tracing.")

    config = Config(
        pools=pools,
        classes=classes,
        routes=routes,
        listen=r.take(top, "", "listen", str, "127.0.0.1:50051", _address),
        metrics_listen=r.take(top, "", "metrics_listen", str, "127.0.0.1:9464", _address),
        mode=r.take(top, "", "mode", _enum(Mode), Mode.ENFORCE),
        infeasible=r.take(top, "", "infeasible", _enum(Infeasible), Infeasible.PASS),
        max_body_bytes=r.take(top, "", "max_body_bytes", int, 8 * 1024 * 1024, _positive),
        content_encoding=r.take(top, "", "content_encoding", _enum(ContentEncoding),
                                ContentEncoding.REFUSE),
        max_inflation_ratio=r.take(top, "", "max_inflation_ratio", float, 20.0,
                                   lambda v: None if v >= 1 else "must be >= 1"),
        deadline_header=r.take(top, "", "deadline_header", str, "x-admission-deadline-ms",
                               lambda v: None if v and v == v.lower() else "must be lower-case"),
        drain_grace_s=r.take(top, "", "drain_grace_s", float, 25.0, _non_negative),
        shed_wait_ms=r.take(top, "", "shed_wait_ms", float, 500.0, _non_negative),
        ledger=ledger,
        retry_after=retry_after,
        decision_log=r.take(top, "", "decision_log", str, "", _writable_dir) or None,
        tracing=tracing,
        capacity=capacity,
        autoscale=autoscale,
        keda_listen=r.take(top, "", "keda_listen", str, "", _address) or None,
        tenant=_tenant(r, top.pop("tenant", None)),
        priority=_priority(r, top.pop("priority", None)),
        tls=_server_tls(r, top.pop("tls", None)),
    )
    r.leftovers(top, "")
    if problems:
        raise ConfigError(problems)
    return config


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError("must be true or false")
    return value


def _existing_file(v: str) -> str | None:
    return None if Path(v).is_file() else "no such file"


def _ledger(r: _Reader, raw: Any) -> LedgerConfig:
    """The ``ledger`` section; Redis keys are checked only with ``kind: redis``."""
    p = "ledger."
    led = r.section(raw, "ledger")
    d = LedgerConfig()
    kind = r.take(led, p, "kind", str, "memory",
                  lambda v: None if v in ("memory", "redis") else "must be 'memory' or 'redis'")
    grace = r.take(led, p, "lease_grace_ms", float, d.lease_grace_ms, _positive)
    sweep = r.take(led, p, "sweep_interval_ms", float, d.sweep_interval_ms, _positive)
    liveness = r.take(led, p, "liveness_ms", float, d.liveness_ms,
                      lambda v: None if v >= 100 else "must be >= 100 (heartbeats every third)")
    if kind != "redis":
        for key in [k for k in led if k in _REDIS_KEYS]:
            r.problems.append(f"{p}{key}: only used with ledger.kind 'redis' (kind is {kind!r})")
            led.pop(key)
        r.leftovers(led, p)
        return LedgerConfig(kind=kind, lease_grace_ms=grace, sweep_interval_ms=sweep,
                            liveness_ms=liveness)

    # The URL and the password may carry a secret: their errors never quote the value.
    url = _secret(r, led, p, "url", _redis_url)
    secrets = [k for k in ("password", "password_file", "password_env") if k in led]
    if len(secrets) > 1:
        r.problems.append(f"{p}{secrets[1]}: give only one of password, password_file,"
                          f" password_env (got {', '.join(secrets)})")
    password = _secret(r, led, p, "password", lambda v: None if v else "must not be empty")
    password_file = r.take(led, p, "password_file", str, "", _existing_file) or None
    password_env = r.take(led, p, "password_env", str, "",
                          lambda v: None if v else "must not be empty") or None
    username = r.take(led, p, "username", str, "") or None
    tls = _tls(r, led.pop("tls", None))
    sentinel = _sentinel(r, led.pop("sentinel", None))
    cluster = r.take(led, p, "cluster", _flag, False)
    if url is None and sentinel is None:
        r.problems.append(f"{p}url: required with kind 'redis' (or give ledger.sentinel)")
    if cluster and sentinel is not None:
        r.problems.append(f"{p}cluster: cannot be combined with ledger.sentinel")
    if cluster and url is not None and url.startswith("unix:"):
        r.problems.append(f"{p}cluster: a cluster is not reached over a unix socket URL")
    if url is not None and url.startswith("unix:") and tls.enabled:
        r.problems.append(f"{p}tls.enabled: not with a unix socket URL")
    timeout_ms = r.take(led, p, "timeout_ms", float, d.timeout_ms, _positive)
    deadline_ms = r.take(led, p, "decision_deadline_ms", float, d.decision_deadline_ms,
                         _positive)
    brk = r.section(led.pop("breaker", None), "ledger.breaker")
    breaker = BreakerConfig(
        failures=r.take(brk, p + "breaker.", "failures", int, 5,
                        lambda v: None if v >= 1 else "must be >= 1"),
        cooldown_ms=r.take(brk, p + "breaker.", "cooldown_ms", float, 500.0, _non_negative),
    )
    r.leftovers(brk, p + "breaker.")
    config = LedgerConfig(
        kind=kind, lease_grace_ms=grace, sweep_interval_ms=sweep, liveness_ms=liveness,
        url=url, username=username,
        password=password, password_file=password_file, password_env=password_env, tls=tls,
        sentinel=sentinel, cluster=cluster,
        key_prefix=r.take(led, p, "key_prefix", str, d.key_prefix,
                          lambda v: None if v and not set(v) & set("{} ")
                          else "must be non-empty, without braces or spaces"),
        timeout_ms=timeout_ms,
        decision_deadline_ms=deadline_ms,
        on_unavailable=r.take(led, p, "on_unavailable", _enum(OnUnavailable),
                              OnUnavailable.FAIL_OPEN),
        breaker=breaker,
    )
    r.leftovers(led, p)
    return config


_REDIS_KEYS = frozenset({
    "url", "username", "password", "password_file", "password_env", "tls", "sentinel",
    "cluster", "key_prefix", "timeout_ms", "decision_deadline_ms", "on_unavailable", "breaker",
})


def _secret(r: _Reader, raw: dict[str, Any], prefix: str, key: str,
            check: Callable[[str], str | None]) -> str | None:
    """A string that may hold a credential: like ``take``, but errors never echo it."""
    if key not in raw:
        return None
    value = raw.pop(key)
    why = "must be a string" if not isinstance(value, str) else check(value)
    if why is not None:
        r.problems.append(f"{prefix}{key}: {why} (value not shown)")
        return None
    return str(value)


def _redis_url(v: str) -> str | None:
    scheme, sep, rest = v.partition("://")
    if not sep or scheme not in ("redis", "rediss", "unix") or not rest:
        return "must be a redis://, rediss:// or unix:// URL"
    return None


def _tls(r: _Reader, raw: Any) -> RedisTls:
    p = "ledger.tls."
    body = r.section(raw, "ledger.tls")
    tls = RedisTls(
        enabled=r.take(body, p, "enabled", _flag, False),
        ca_file=r.take(body, p, "ca_file", str, "", _existing_file) or None,
        cert_file=r.take(body, p, "cert_file", str, "", _existing_file) or None,
        key_file=r.take(body, p, "key_file", str, "", _existing_file) or None,
        check_hostname=r.take(body, p, "check_hostname", _flag, True),
    )
    r.leftovers(body, p)
    if (tls.cert_file is None) != (tls.key_file is None):
        r.problems.append(f"{p}key_file: cert_file and key_file go together")
    return tls


def _sentinel(r: _Reader, raw: Any) -> RedisSentinel | None:
    if raw is None:
        return None
    p = "ledger.sentinel."
    body = r.section(raw, "ledger.sentinel")
    addresses: list[tuple[str, int]] = []
    items = body.pop("addresses", None)
    if not isinstance(items, list) or not items:
        r.problems.append(f"{p}addresses: must be a non-empty list of HOST:PORT (got {items!r})")
    else:
        for i, item in enumerate(items):
            host, _, port = str(item).rpartition(":")
            if not (isinstance(item, str) and host and port.isdigit()):
                r.problems.append(f"{p}addresses[{i}]: must be HOST:PORT (got {item!r})")
            else:
                addresses.append((host, int(port)))
    if "service_name" not in body:
        r.problems.append(f"{p}service_name: required")
    name = r.take(body, p, "service_name", str, "",
                  lambda v: None if v else "must not be empty")
    r.leftovers(body, p)
    return RedisSentinel(addresses=tuple(addresses), service_name=name)


def _capacity(r: _Reader, raw: Any, pools: tuple[Pool, ...]) -> CapacityConfig:
    body = r.section(raw, "capacity")
    p = "capacity."
    services = body.pop("services", {})
    if not isinstance(services, Mapping) or not all(
            isinstance(v, str) and v.count("/") == 1 for v in services.values()):
        r.problems.append(f"{p}services: must map pool names to 'namespace/service'")
        services = {}
    for name in services:
        if name not in {pool.name for pool in pools}:
            r.problems.append(f"{p}services: {name!r} is not a pool name")
    out = CapacityConfig(
        source=r.take(body, p, "source", str, "static",
                      lambda v: None if v in ("static", "envoy", "kubernetes")
                      else "must be one of 'static', 'envoy', 'kubernetes'"),
        envoy_admin_url=r.take(body, p, "envoy_admin_url", str, "http://127.0.0.1:9901",
                               lambda v: None if v.startswith("http://") else "must be http://"),
        services=dict(services),
        hold_s=r.take(body, p, "hold_s", float, 10.0, _non_negative),
        floor=r.take(body, p, "floor", int, 1, _non_negative),
    )
    r.leftovers(body, p)
    if out.source == "kubernetes":
        for pool in pools:
            if pool.name not in out.services:
                r.problems.append(f"{p}services: pool {pool.name!r} needs its Service")
    for i, pool in enumerate(pools):
        if (out.source == "static" and pool.engine_metrics is not None
                and pool.engine_metrics.targets is None):
            r.problems.append(f"pools[{i}].engine_metrics.targets: a list is required with"
                              f" capacity.source 'static' (it discovers no hosts)")
    return out


def _autoscale(r: _Reader, raw: Any) -> AutoscaleConfig:
    """``window_s`` plus any field of ``ScalingPolicy``, validated by it."""
    body = r.section(raw, "autoscale")
    p = "autoscale."
    window_s = r.take(body, p, "window_s", float, 15.0, _positive)
    defaults = {f.name: f.default for f in dataclasses.fields(ScalingPolicy)}
    values: dict[str, Any] = {}
    for key in [k for k in body if k in defaults]:
        kind: Callable[[Any], Any] = int if isinstance(defaults[key], int) else float
        values[key] = r.take(body, p, key, kind, defaults[key])
    r.leftovers(body, p)
    try:
        policy = ScalingPolicy(**values)
    except ConfigError as exc:
        r.problems.extend(exc.problems)
        policy = ScalingPolicy()
    return AutoscaleConfig(window_s=window_s, policy=policy)


def _enum(kind: type[Any]) -> Callable[[Any], Any]:
    def convert(value: Any) -> Any:
        try:
            return kind(value)
        except ValueError:
            choices = ", ".join(repr(m.value) for m in kind)
            raise ValueError(f"must be one of {choices}") from None

    return convert


def _classes(r: _Reader, raw: Any) -> dict[str, ClassPolicy]:
    merged: dict[str, Any] = {k: dict(v) for k, v in DEFAULT_CLASSES.items()}
    for name, body in r.section(raw, "classes").items():
        merged[name] = {**merged.get(name, {}), **r.section(body, f"classes.{name}")}
    out: dict[str, ClassPolicy] = {}
    for name, body in merged.items():
        p = f"classes.{name}."
        deadline = r.take(body, p, "deadline_ms", float, 30_000.0, _positive)
        ttft = r.take(body, p, "ttft_ms", float, 0.0, _non_negative)
        out[name] = ClassPolicy(
            name=name,
            deadline_ms=deadline,
            ttft_ms=ttft or None,
            safety_factor=r.take(body, p, "safety_factor", float, 0.8, _fraction),
            batch=r.take(body, p, "batch", _flag, False),
            priority=r.take(body, p, "priority", _level, None),
        )
        r.leftovers(body, p)
    return out


def _level(value: Any) -> int:
    level = parse_priority(value)
    if level is None:
        raise ValueError(f"must be critical, standard, sheddable or a whole number in"
                         f" [-{MAX_LEVEL}, {MAX_LEVEL}]")
    return level


def _priority(r: _Reader, raw: Any) -> PriorityConfig:
    p = "priority."
    body = r.section(raw, "priority")
    config = PriorityConfig(
        header=r.take(body, p, "header", str, "", _header_name) or None,
        default=r.take(body, p, "default", _level, 0),
    )
    r.leftovers(body, p)
    return config


def _tenant_policy(r: _Reader, raw: Any, p: str) -> TenantPolicy:
    body = r.section(raw, p.rstrip("."))
    inflight = r.take(body, p, "max_inflight", int, 0,
                      lambda v: None if v >= 1 else "must be >= 1")
    policy = TenantPolicy(
        weight=r.take(body, p, "weight", float, 1.0, _positive),
        priority=r.take(body, p, "priority", _level, None),
        max_inflight=inflight or None,
        max_outstanding_s=r.take(body, p, "max_outstanding_s", float, 0.0, _positive) or None,
    )
    r.leftovers(body, p)
    return policy


def _routes(r: _Reader, raw: Any, classes: Mapping[str, ClassPolicy]) -> tuple[Route, ...]:
    items = DEFAULT_ROUTES if raw is None else raw
    if not isinstance(items, list):
        r.problems.append(f"routes: must be a list, got {type(items).__name__}")
        return ()
    routes: list[Route] = []
    for i, item in enumerate(items):
        body = r.section(item, f"routes[{i}]")
        p = f"routes[{i}]."
        if "path" not in body:
            r.problems.append(f"{p}path: required")
        path = r.take(body, p, "path", str, "",
                      lambda v: None if v.startswith("/") else "must start with '/'")
        api = r.take(body, p, "api", _enum(Api), Api.OPENAI_CHAT)
        cls = r.take(body, p, "class", str, "latency",
                     lambda v: None if v in classes else f"must be one of {sorted(classes)}")
        r.leftovers(body, p)
        routes.append(Route(path=path, api=api, service_class=cls))
    return tuple(routes)


def _pools(r: _Reader, raw: Any) -> tuple[Pool, ...]:
    items = [{"name": "default"}] if raw is None else raw
    if not isinstance(items, list) or not items:
        r.problems.append("pools: must be a non-empty list")
        return ()
    pools: list[Pool] = []
    d = Pool(name="")
    for i, item in enumerate(items):
        body = r.section(item, f"pools[{i}]")
        p = f"pools[{i}]."
        models = body.pop("models", list(d.models))
        if not (isinstance(models, list) and models and all(isinstance(m, str) for m in models)):
            r.problems.append(f"{p}models: must be a non-empty list of strings (got {models!r})")
            models = list(d.models)
        tokenizer = r.take(body, p, "tokenizer", str, "")
        if tokenizer and not Path(tokenizer).is_file():
            r.problems.append(f"{p}tokenizer: no such file (got {tokenizer!r})")
        pools.append(Pool(
            name=r.take(body, p, "name", str, f"pool{i}", lambda v: None if v else "required"),
            models=tuple(models),
            replicas=r.take(body, p, "replicas", int, d.replicas, _non_negative),
            engine=_engine(r, body, p),
            default_max_tokens=r.take(body, p, "default_max_tokens", int,
                                      d.default_max_tokens, _positive),
            tokenizer=tokenizer or None,
            bytes_per_token=r.take(body, p, "bytes_per_token", float, d.bytes_per_token,
                                   _positive),
            message_overhead_tokens=r.take(body, p, "message_overhead_tokens", int,
                                           d.message_overhead_tokens, _non_negative),
            non_text_part_tokens=r.take(body, p, "non_text_part_tokens", int,
                                        d.non_text_part_tokens, _non_negative),
            **_output_lengths(r, body, p),
            engine_metrics=_engine_metrics(r, body.pop("engine_metrics", None),
                                           f"{p}engine_metrics."),
        ))
        r.leftovers(body, p)
    names = [p.name for p in pools]
    for dup in sorted({n for n in names if names.count(n) > 1}):
        r.problems.append(f"pools: duplicate name {dup!r}")
    return tuple(pools)


def _output_lengths(r: _Reader, body: dict[str, Any], p: str) -> dict[str, Any]:
    """A pool's output-length prediction (both optional, a long output never below the mean)
    and the quantile its queue-wait predictions are held to."""
    expected = r.take(body, p, "expected_output_tokens", float, 0.0, _positive) or None
    long = r.take(body, p, "long_output_tokens", float, 0.0, _positive) or None
    if expected is not None and long is not None and long < expected:
        r.problems.append(f"{p}long_output_tokens: must be >= {p}expected_output_tokens"
                          f" ({expected:g}) (got {long:g})")
    quantile = r.take(body, p, "wait_quantile", float, Pool.wait_quantile,
                      lambda v: None if 0.5 <= v < 1 else "must be in [0.5, 1)")
    return {"expected_output_tokens": expected, "long_output_tokens": long,
            "wait_quantile": quantile}


FROM_CAPACITY = "from_capacity"

# Pool keys of the first cost model, now in the engine section under vLLM's names.
_MOVED_TO_ENGINE = {"max_running": "max_num_seqs", "prefill_ms_per_token": "ms_per_token",
                    "itl_ms_at_1": "step_base_ms", "itl_ms_per_running": "ms_per_seq"}
_ENGINE_COUNTS = ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len")


def _engine(r: _Reader, pool: dict[str, Any], p: str) -> EngineModel:
    """A pool's ``engine`` section: a ``preset`` (default ``llama-70b-fp8-2xh100``) and any
    field of ``EngineModel`` over it, each named as vLLM names it."""
    for old, new in _MOVED_TO_ENGINE.items():
        if old in pool:
            pool.pop(old)
            r.problems.append(f"{p}{old}: moved to {p}engine.{new} (see extproc.engine)")
    q = f"{p}engine."
    body = r.section(pool.pop("engine", None), q.rstrip("."))
    preset = r.take(body, q, "preset", str, "llama-70b-fp8-2xh100",
                    lambda v: None if v in PRESETS else f"must be one of {sorted(PRESETS)}")
    base = PRESETS.get(preset, EngineModel())
    values: dict[str, Any] = {}
    for f in dataclasses.fields(EngineModel):
        default = getattr(base, f.name)
        if f.name == "prefix_caching":
            values[f.name] = r.take(body, q, f.name, _flag, default)
        elif f.name in _ENGINE_COUNTS:
            values[f.name] = r.take(body, q, f.name, int, default, _positive)
        elif f.name == "num_gpu_blocks":
            values[f.name] = r.take(body, q, f.name, int, default, _non_negative)
        else:
            values[f.name] = r.take(body, q, f.name, float, default, _non_negative)
    r.leftovers(body, q)
    return EngineModel(**values)


def _engine_metrics(r: _Reader, raw: Any, p: str) -> EngineMetricsConfig | None:
    """A pool's ``engine_metrics`` section (absent or null: off). ``targets`` is a list of
    replicas, or ``from_capacity`` (the default): the hosts the capacity source discovers,
    checked against ``capacity.source`` in ``_capacity``."""
    body = r.section(raw, p.rstrip("."))
    if not isinstance(raw, Mapping):
        return None  # absent, or refused by ``section``
    d = EngineMetricsConfig()
    targets = _targets(r, body.pop("targets", FROM_CAPACITY), f"{p}targets")
    interval = r.take(body, p, "interval_s", float, d.interval_s, _positive)
    timeout = r.take(body, p, "timeout_s", float, d.timeout_s, _positive)
    # A sample must outlive the next round (which may take the whole timeout), or the pool
    # would go stale between two good scrapes.
    max_age = r.take(body, p, "max_age_s", float, d.max_age_s,
                     lambda v: None if v >= interval + timeout else
                     f"must be >= interval_s + timeout_s ({interval + timeout:g})")
    config = EngineMetricsConfig(
        targets=targets, interval_s=interval, timeout_s=timeout, max_age_s=max_age,
        min_coverage=r.take(body, p, "min_coverage", float, d.min_coverage, _fraction),
        tolerance=r.take(body, p, "tolerance", float, d.tolerance, _non_negative),
        slack=r.take(body, p, "slack", int, d.slack, _non_negative),
        learn_output_lengths=r.take(body, p, "learn_output_lengths", bool,
                                    d.learn_output_lengths),
    )
    r.leftovers(body, p)
    return config


def _targets(r: _Reader, value: Any, key: str) -> tuple[str, ...] | None:
    """``from_capacity`` (None), or a non-empty list of distinct HOST:PORT or base URLs."""
    if value == FROM_CAPACITY:
        return None
    if not (isinstance(value, list) and value):
        r.problems.append(f"{key}: must be a non-empty list of HOST:PORT or http(s):// URLs,"
                          f" or {FROM_CAPACITY!r} (got {value!r})")
        return ()
    for i, item in enumerate(value):
        if not (isinstance(item, str) and _is_target(item)):
            r.problems.append(f"{key}[{i}]: must be HOST:PORT or an http(s):// URL"
                              f" (got {item!r})")
    names = [t for t in value if isinstance(t, str)]
    for dup in sorted({t for t in names if names.count(t) > 1}):
        r.problems.append(f"{key}: duplicate target {dup!r} (it would be counted twice)")
    return tuple(names)


def _is_target(v: str) -> bool:
    scheme, sep, rest = v.partition("://")
    if sep:
        return scheme in ("http", "https") and bool(rest)
    host, _, port = v.rpartition(":")
    return bool(host) and port.isdigit()


MAX_KNOWN_TENANTS = 100  # each known tenant is a metric label value: keep the set bounded
_TENANT_KEYS_BY_SOURCE = {
    TenantSource.METADATA: ("metadata_namespace", "metadata_key", "claim"),
    TenantSource.HEADER: ("header",),
}


def _tenant_name(v: str) -> str | None:
    if not v or len(v) > 64:
        return "must be 1 to 64 characters"
    return "is reserved for tenants not in tenant.known" if v == "other" else None


def _header_name(v: str) -> str | None:
    # Lower-case (Envoy sends names lower-cased) and no underscore: Envoy drops headers
    # with underscores when tenant attribution is on (extproc.envoyconf).
    if v and all(c.isascii() and (c.islower() or c.isdigit() or c == "-") for c in v):
        return None
    return "must be a lower-case header name of letters, digits and '-'"


def _tenant(r: _Reader, raw: Any) -> TenantConfig:
    """The ``tenant`` section: keys of one source are errors with another (a typo'd source
    must not leave a configured claim silently unused)."""
    p = "tenant."
    body = r.section(raw, "tenant")
    d = TenantConfig()
    source = r.take(body, p, "source", _enum(TenantSource), d.source)
    for other, keys in _TENANT_KEYS_BY_SOURCE.items():
        for key in [k for k in keys if k in body and other is not source]:
            r.problems.append(f"{p}{key}: only used with tenant.source {other.value!r}"
                              f" (source is {source.value!r})")
            body.pop(key)
    claim = d.claim
    if "claim" in body:
        value = body.pop("claim")
        path = [value] if isinstance(value, str) else value
        if (isinstance(path, list) and path
                and all(isinstance(k, str) and k for k in path)):
            claim = tuple(path)
        else:
            r.problems.append(f"{p}claim: must be a claim name or a non-empty list of names"
                              f" (a path into nested claims) (got {value!r})")
    known = body.pop("known", [])
    if not (isinstance(known, list) and all(isinstance(k, str) for k in known)):
        r.problems.append(f"{p}known: must be a list of tenant names (got {known!r})")
        known = []
    for i, name in enumerate(known):
        if (why := _tenant_name(name)) is not None:
            r.problems.append(f"{p}known[{i}]: {why} (got {name!r})")
    for dup in sorted({k for k in known if known.count(k) > 1}):
        r.problems.append(f"{p}known: duplicate name {dup!r}")
    if len(known) > MAX_KNOWN_TENANTS:
        r.problems.append(f"{p}known: at most {MAX_KNOWN_TENANTS} names, each a metric label"
                          f" value (got {len(known)})")
    config = TenantConfig(
        source=source,
        metadata_namespace=r.take(body, p, "metadata_namespace", str, d.metadata_namespace,
                                  lambda v: None if v else "must not be empty"),
        metadata_key=r.take(body, p, "metadata_key", str, d.metadata_key),
        claim=claim,
        header=r.take(body, p, "header", str, d.header, _header_name),
        known=tuple(known),
        default=r.take(body, p, "default", str, d.default, _tenant_name),
        fair_share=r.take(body, p, "fair_share", _flag, d.fair_share),
        tenants={name: _tenant_policy(r, policy, f"{p}tenants.{name}.")
                 for name, policy in r.section(body.pop("tenants", None),
                                               f"{p}tenants").items()},
        others=_tenant_policy(r, body.pop("others", None), f"{p}others."),
    )
    for name in config.tenants:
        if (why := _tenant_name(name)) is not None:
            r.problems.append(f"{p}tenants: {why} (got {name!r})")
    r.leftovers(body, p)
    return config


def _server_tls(r: _Reader, raw: Any) -> ServerTls | None:
    """The ``tls`` section (mutual TLS on ``listen``); absent: plaintext."""
    if raw is None:
        return None
    p = "tls."
    body = r.section(raw, "tls")
    for key in ("cert_file", "key_file", "client_ca_file"):
        if key not in body:
            r.problems.append(f"{p}{key}: required (clients must present a certificate)"
                              if key == "client_ca_file" else f"{p}{key}: required")
    tls = ServerTls(
        cert_file=r.take(body, p, "cert_file", str, "", _existing_file),
        key_file=r.take(body, p, "key_file", str, "", _existing_file),
        client_ca_file=r.take(body, p, "client_ca_file", str, "", _existing_file),
        reload_interval_s=r.take(body, p, "reload_interval_s", float,
                                 ServerTls.reload_interval_s, _non_negative),
    )
    r.leftovers(body, p)
    return tls
