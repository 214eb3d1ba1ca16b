"""Configuration: typed, frozen models, each key's type, default, bounds and description in one
place; from them the Helm chart's schema and the README's reference are generated
(``extproc.config.schema``, ``make config-schema``), and tests keep the three equal.

Nothing here is read at import time. ``load(path)`` reads a YAML file; ``from_mapping(raw)``
builds from an already-parsed mapping (tests, the demo). Every problem found is reported in
one ``ConfigError``, each line naming the dotted key, the bound and the bad value
(``extproc.config.rules``). Unknown keys are errors too: a typo must not silently fall back to
a default. The models are pydantic dataclasses: ``dataclasses.replace`` works (and validates).

The sections live in modules of their own: ``pools`` (engine, engine scrapes, capacity,
autoscaling), ``ledger``, ``tenants``; ``fields`` holds the kinds of value, ``rules`` the
seam with pydantic (rules and the house's error lines), ``schema`` the generators. Every name
consumers read is importable from here.
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Callable, Mapping
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Self, cast

import yaml
from pydantic import BeforeValidator, Field, TypeAdapter, ValidationError, model_validator
from pydantic.dataclasses import dataclass
from pydantic.json_schema import SkipJsonSchema

from extproc.config.fields import (
    MODEL,
    Address,
    File,
    Flag,
    Fraction,
    Int,
    Level,
    Named,
    NonNegative,
    Num,
    Positive,
    Text,
)
from extproc.config.ledger import (
    BreakerConfig,
    LedgerConfig,
    OnUnavailable,
    RedisSentinel,
    RedisTls,
)
from extproc.config.pools import (
    DEFAULT_PRESET,
    FROM_CAPACITY,
    Autoscale,
    AutoscaleConfig,
    CapacityConfig,
    EngineMetricsConfig,
    Pool,
)
from extproc.config.rules import Problem, Rule, early, fail, lines, within
from extproc.config.tenants import (
    MAX_KNOWN_TENANTS,
    PriorityConfig,
    TenantConfig,
    TenantPolicy,
    TenantSource,
)
from extproc.errors import ConfigError

__all__ = [
    "DEFAULT_CLASSES", "DEFAULT_PRESET", "DEFAULT_ROUTES", "FROM_CAPACITY", "MAX_KNOWN_TENANTS",
    "Api", "AutoscaleConfig", "BreakerConfig", "CapacityConfig", "ClassPolicy", "Config",
    "ContentEncoding", "EngineMetricsConfig", "Infeasible", "LedgerConfig", "Mode",
    "OnUnavailable", "Pool", "PriorityConfig", "RedisSentinel", "RedisTls", "RetryAfter", "Route",
    "ServerTls", "TenantConfig", "TenantPolicy", "TenantSource", "TracingConfig", "from_mapping",
    "load",
]


class Mode(StrEnum):
    ENFORCE = "enforce"  # reject what would miss its deadline
    SHADOW = "shadow"  # decide, record and count, but always continue


class Infeasible(StrEnum):
    """What to do with a request that would miss its deadline even on an idle fleet."""

    PASS = "pass"  # not overload: let it through (retrying could never help)
    REJECT = "reject"  # refuse with a 400 that says why (never a 429)


class ContentEncoding(StrEnum):
    """What to do with a compressed request body (``extproc.gateway.encoding``)."""

    REFUSE = "refuse"  # 415, naming the coding
    DECODE = "decode"  # gzip / deflate inflated for reading, within max_inflation_ratio


class Api(StrEnum):
    OPENAI_CHAT = "openai_chat"
    OPENAI_COMPLETIONS = "openai_completions"
    OPENAI_EMBEDDINGS = "openai_embeddings"
    TGI_GENERATE = "tgi_generate"
    OPENAI_RESPONSES = "openai_responses"
    ANTHROPIC_MESSAGES = "anthropic_messages"
    SAGEMAKER_INVOCATIONS = "sagemaker_invocations"
    POOLING = "pooling"


def _zero_is_none(value: Any) -> Any:
    return None if value == 0 and not isinstance(value, bool) else value


@dataclass(frozen=True, config=MODEL)
class ClassPolicy:
    """A service class. ``latency``: interactive, with a time-to-first-token objective;
    ``throughput``: batch work with a long deadline that may queue deep."""

    name: SkipJsonSchema[Text] = ""  # its key under ``classes``
    deadline_ms: Positive = 30_000.0
    """Deadline of its requests unless the client's deadline header names a shorter one."""
    safety_factor: Fraction = 0.8
    """Admit only when the predicted completion fits in this share of the deadline."""
    ttft_ms: Annotated[NonNegative | None, BeforeValidator(_zero_is_none)] = None
    """Time-to-first-token objective (0 or absent: none)."""
    batch: Flag = False
    """Batch work: takes only capacity the interactive classes' measured demand leaves, never a
    queue position."""
    priority: Level | None = None
    """The priority of the class's requests (unless the priority header or the tenant's names
    one)."""


def _with_default_classes(raw: Any) -> Any:
    """The built-in classes with the file's over them, key by key; each learns its name."""
    if not isinstance(raw, Mapping):
        return raw
    merged: dict[str, Any] = {k: dict(v) for k, v in DEFAULT_CLASSES.items()}
    for name, body in raw.items():
        merged[name] = ({**merged.get(name, {}), **body} if isinstance(body, Mapping)
                        else body)
    return {name: {**body, "name": name} if isinstance(body, Mapping) else body
            for name, body in merged.items()}


@dataclass(frozen=True, config=MODEL)
class Route:
    path: Annotated[Text, Rule(lambda v: None if v.startswith("/") else "must start with '/'",
                               pattern="^/")]
    """The request path (query string ignored)."""
    api: Api = Api.OPENAI_CHAT
    """How its bodies are read."""
    service_class: Text = Field(default="latency", validation_alias="class")
    """Its service class: a key of `classes`."""


@dataclass(frozen=True, config=MODEL)
class TracingConfig:
    endpoint: Annotated[Text, Rule(lambda v: None if v.startswith(("http://", "https://"))
                                   else "must be an http:// or https:// URL")] | None = None
    """OTLP gRPC, e.g. http://jaeger-collector:4317; absent: off."""
    sample_ratio: Annotated[Num, within(ge=0, le=1)] = 1.0
    """For root spans; a sampled parent (Envoy's) is always followed."""
    service_name: Named = "extproc"
    """The service.name of the spans."""


@dataclass(frozen=True, config=MODEL)
class RetryAfter:
    min_s: Annotated[Int, within(ge=1)] = 1
    """The shortest Retry-After, seconds."""
    max_s: Annotated[Int, within(le=120, why="SDKs give up beyond")] = 60
    """The longest, seconds."""
    jitter: NonNegative = 0.5
    """Retry-After is drawn from [t, t x (1 + jitter)]."""

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        if self.max_s < self.min_s:
            fail([Problem(("max_s",), f"must be >= retry_after.min_s ({self.min_s})",
                          self.max_s)])
        return self


@dataclass(frozen=True, config=MODEL)
class DeferConfig:
    """Holding a refused request until it fits (extproc.decision.defer, docs/defer.md)."""

    enabled: Flag = False
    """Hold a request that does not fit now but would after the predicted wait, instead of a
    429 at once; Envoy's ext_proc max_message_timeout is then the longest class deadline."""
    max_waiting: Annotated[Int, within(ge=1)] = 256
    """Requests one pool holds at most; beyond, a higher priority takes a lower one's place
    (429 queue_full to it), else 429 queue_full."""
    max_waiting_per_tenant: Annotated[Int, within(ge=1)] = 64
    """... and one tenant's at most (with tenants attributed)."""


@dataclass(frozen=True, config=MODEL)
class ServerTls:
    """mTLS on ``listen``: clients (Envoy) must present a certificate ``client_ca_file``
    signed. Files are re-read when they change (extproc.gateway.tls)."""

    cert_file: File
    """The server's certificate (PEM)."""
    key_file: File
    """Its key (PEM, unencrypted)."""
    client_ca_file: File
    """Clients (Envoy) must present a certificate this CA signed."""
    reload_interval_s: NonNegative = 10.0
    """How often a new connection checks the files at most."""

    @model_validator(mode="wrap")
    @classmethod
    def _clients_must_be_checked(cls, raw: Any, handler: Callable[[Any], Self]) -> Self:
        found = []
        if isinstance(raw, Mapping) and "client_ca_file" not in raw:
            found = [Problem(("client_ca_file",), "required (clients must present a"
                             " certificate)", show=False)]
        return cast(Self, early(raw, handler, found))


def _writable_dir(v: str) -> str | None:
    parent = Path(v).parent
    return None if parent.is_dir() else f"no such directory {str(parent)!r}"


def _pools(v: tuple[Pool, ...]) -> str | None:
    names = [p.name for p in v]
    if dups := sorted({n for n in names if names.count(n) > 1}):
        return f"duplicate name {dups[0]!r}"
    return None if v else "must be a non-empty list"


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
    # vLLM serves generation on these too: left out, they would be ways around admission
    {"path": "/v1/responses", "api": "openai_responses", "class": "latency"},
    {"path": "/v1/messages", "api": "anthropic_messages", "class": "latency"},
    {"path": "/invocations", "api": "sagemaker_invocations", "class": "latency"},
    # ... and vLLM's pooling models (prefill only) on these
    *({"path": path, "api": "pooling", "class": "throughput"} for path in (
        "/pooling", "/classify", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank")),
]

Classes = Annotated[Mapping[str, ClassPolicy], BeforeValidator(_with_default_classes)]


def canonical_path(path: str) -> str:
    """The path as the most lenient backend routes it: query string dropped, percent-escapes
    decoded until none is left (``%2F`` and ``%252F`` included), backslashes read as slashes,
    runs of slashes merged, dot segments resolved, a trailing slash dropped. vLLM's server
    (Starlette on uvicorn) routes on the decoded path: ``/v1/chat%2Fcompletions`` is its chat
    endpoint."""
    bare = path.split("?", 1)[0].split("#", 1)[0]
    for _ in range(4):  # each round decodes one level of escaping; 4 is beyond any client
        decoded = urllib.parse.unquote(bare)
        if decoded == bare:
            break
        bare = decoded
    parts: list[str] = []
    for part in bare.replace("\\", "/").split("/"):
        if part == "..":
            if parts:
                parts.pop()
        elif part not in ("", "."):
            parts.append(part)
    return "/" + "/".join(parts)


@dataclass(frozen=True, config=MODEL)
class Config:
    pools: Annotated[tuple[Pool, ...], Rule(_pools, quote=False, minItems=1)] = Field(
        default_factory=lambda: (Pool(name="default"),))
    """Replica pools; absent: one pool named default serving every model."""
    classes: Classes = Field(default_factory=lambda: TypeAdapter(Classes).validate_python({}))
    """Service classes, merged key by key over the built-in latency (deadline 30 s, ttft 2 s, safety
    0.8) and throughput (600 s, 0.9, batch)."""
    routes: tuple[Route, ...] = Field(
        default_factory=lambda: TypeAdapter(tuple[Route, ...]).validate_python(DEFAULT_ROUTES))
    """Paths decided on; absent: the JSON inference paths of vLLM and TGI (README). Other paths
    pass."""
    listen: Address = "127.0.0.1:50051"
    """The ext_proc gRPC server: HOST:PORT or unix:PATH."""
    metrics_listen: Address = "127.0.0.1:9464"
    """Prometheus /metrics."""
    mode: Mode = Mode.ENFORCE
    """enforce: refuse what would miss its deadline; shadow: decide and count, never refuse."""
    infeasible: Infeasible = Infeasible.PASS
    """A request that cannot fit even on an idle fleet: pass, or reject with a 400."""
    max_body_bytes: Annotated[Int, within(gt=0)] = 8 * 1024 * 1024
    """Bodies larger are refused with a 413."""
    content_encoding: ContentEncoding = ContentEncoding.REFUSE
    """A compressed body: refuse (415) or decode gzip / deflate to read it."""
    max_inflation_ratio: Annotated[Num, within(ge=1)] = 20.0
    """Decoded / compressed bytes at most, with content_encoding decode."""
    deadline_header: Annotated[Text, Rule(lambda v: None if v and v == v.lower() else
                                          "must be lower-case", pattern="^[^A-Z]+$")] = (
        "x-admission-deadline-ms")
    """The client's deadline in ms."""
    drain_grace_s: NonNegative = 25.0
    """SIGTERM: keep serving open streams this long at most."""
    shed_wait_ms: NonNegative = 500.0
    """429 at once while bodies wait longer than this for a decision (0: never)."""
    ledger: LedgerConfig = Field(default_factory=LedgerConfig)
    """Where admitted work is recorded: in memory, or in Redis shared by replicas."""
    retry_after: RetryAfter = Field(default_factory=RetryAfter)
    """The Retry-After of a 429."""
    defer: DeferConfig = Field(default_factory=DeferConfig)
    """Hold what fits after a wait instead of refusing it (the gateway's queue)."""
    decision_log: Annotated[Text, Rule(_writable_dir)] | None = None
    """JSONL of every decision, for extproc replay; absent: off."""
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    """OpenTelemetry spans of decisions."""
    capacity: CapacityConfig = Field(default_factory=CapacityConfig)
    """Where ready replicas come from."""
    autoscale: Autoscale = Field(default_factory=AutoscaleConfig)
    """Control window and replica recommender thresholds (docs/autoscaling.md); their bounds
    are checked by ScalingPolicy (extproc/scaling/autoscale.py)."""
    keda_listen: Address | None = None
    """KEDA external scaler gRPC (HOST:PORT); absent: off."""
    tenant: TenantConfig = Field(default_factory=TenantConfig)
    """Who a request is charged to, and fair shares between tenants."""
    priority: PriorityConfig = Field(default_factory=PriorityConfig)
    """Where a request's priority comes from."""
    tls: ServerTls | None = None
    """Mutual TLS on listen; absent: plaintext (loopback, unix)."""

    def route(self, path: str) -> Route | None:
        """The route for a request path, or None to pass it untouched. The path is matched
        as a backend that decodes it would route it (``canonical_path``), so no spelling of
        an admission path passes undecided, whatever Envoy in front normalized."""
        bare = canonical_path(path)
        for route in self.routes:
            if route.path == bare:
                return route
        return None

    def pool_for(self, model: str) -> Pool | None:
        exact = [p for p in self.pools if model in p.models]
        if exact:
            return exact[0]
        return next((p for p in self.pools if "*" in p.models), None)

    @model_validator(mode="wrap")
    @classmethod
    def _routes_name_classes(cls, raw: Any, handler: Callable[[Any], Self]) -> Self:
        """A route's class must exist; checked on the raw file so that it is reported with
        every other problem, even when a class itself is invalid."""
        found = []
        if isinstance(raw, Mapping) and isinstance(raw.get("routes"), list):
            given = raw.get("classes")
            names = sorted({*DEFAULT_CLASSES, *(given if isinstance(given, Mapping) else ())})
            found = [Problem(("routes", i, "class"), f"must be one of {names}", r["class"])
                     for i, r in enumerate(raw["routes"])
                     if isinstance(r, Mapping) and "class" in r and r["class"] not in names]
        return cast(Self, early(raw, handler, found))

    @model_validator(mode="after")
    def _capacity_knows_the_pools(self) -> Self:
        found, cap = [], self.capacity
        for name in cap.services:
            if name not in {pool.name for pool in self.pools}:
                found.append(Problem(("capacity", "services"), f"{name!r} is not a pool name",
                                     show=False))
        for i, pool in enumerate(self.pools):
            if cap.source == "kubernetes" and pool.name not in cap.services:
                found.append(Problem(("capacity", "services"),
                                     f"pool {pool.name!r} needs its Service", show=False))
            if (cap.source == "static" and pool.engine_metrics is not None
                    and pool.engine_metrics.targets is None):
                found.append(Problem(("pools", i, "engine_metrics", "targets"),
                                     "a list is required with capacity.source 'static' (it"
                                     " discovers no hosts)", show=False))
        if found:
            fail(found)
        return self


_CONFIG = TypeAdapter(Config)


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
    try:
        return _CONFIG.validate_python({} if raw is None else raw)
    except ValidationError as exc:
        # from None: pydantic's own text quotes every value, secrets included
        raise ConfigError(lines(exc)) from None
