"""Configuration: typed, frozen models, each key's type, default, bounds and description in one
place; from them the Helm chart's schema and the README's reference are generated
(``extproc.configschema``, ``make config-schema``), and tests keep the three equal.

Nothing here is read at import time. ``load(path)`` reads a YAML file; ``from_mapping(raw)``
builds from an already-parsed mapping (tests, the demo). Every problem found is reported in
one ``ConfigError``, each line naming the dotted key, the bound and the bad value
(``extproc.configrules``). Unknown keys are errors too: a typo must not silently fall back to
a default. The models are pydantic dataclasses: ``dataclasses.replace`` works (and validates).

Length: past the house's ~400 lines because it is the reference of every key (a description
each); the validation machinery and the generators live apart, in ``configrules`` and
``configschema``.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
from collections.abc import Callable, Mapping
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal, Self, cast

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    TypeAdapter,
    ValidationError,
    WithJsonSchema,
    create_model,
    model_validator,
)
from pydantic.dataclasses import dataclass
from pydantic.json_schema import SkipJsonSchema

from extproc.autoscale import ScalingPolicy
from extproc.configrules import Problem, Rule, Section, early, fail, lines, problem, within
from extproc.engine import PRESETS, EngineModel
from extproc.errors import ConfigError
from extproc.share import LEVELS, MAX_LEVEL, parse_priority

_MODEL = ConfigDict(extra="forbid", validate_by_name=True, validate_by_alias=True,
                    use_attribute_docstrings=True)

# No silent conversions: "5" is not a number, 1 is not true (ints are numbers).
Int = Annotated[int, Strict()]
Num = Annotated[float, Strict()]
Flag = Annotated[bool, Strict()]
Text = Annotated[str, Strict()]
Positive = Annotated[Num, within(gt=0)]
NonNegative = Annotated[Num, within(ge=0)]
Fraction = Annotated[Num, within(gt=0, le=1)]
Count = Annotated[Int, within(ge=0)]
Named = Annotated[Text, Rule(lambda v: None if v else "must not be empty", minLength=1)]
File = Annotated[Text, Rule(lambda v: None if Path(v).is_file() else "no such file")]


def _address(v: str) -> str | None:
    if v.startswith("unix:"):
        return None
    host, sep, port = v.rpartition(":")
    if not (sep and host and port.isdigit()):
        return "must be HOST:PORT or unix:PATH"
    # 0: any free port (what tests bind); above 65535 no socket exists, and Envoy's config
    # rendered from this one would name it
    return None if int(port) <= 65535 else "the port must be 0-65535"


def _header(v: str) -> str | None:
    # Lower-case (Envoy sends names lower-cased) and no underscore: Envoy drops headers
    # with underscores when tenant attribution is on (extproc.envoyconf).
    if v and all(c.isascii() and (c.islower() or c.isdigit() or c == "-") for c in v):
        return None
    return "must be a lower-case header name of letters, digits and '-'"


def _level(value: Any) -> Any:
    if (level := parse_priority(value)) is None:
        raise problem(f"must be critical, standard, sheddable or a whole number in"
                      f" [-{MAX_LEVEL}, {MAX_LEVEL}]")
    return level


Address = Annotated[Text, Rule(_address)]
Header = Annotated[Text, Rule(_header, pattern="^[a-z0-9-]+$")]
Level = Annotated[int, BeforeValidator(_level), WithJsonSchema({"anyOf": [
    {"type": "string", "enum": sorted(LEVELS)},
    {"type": "integer", "minimum": -MAX_LEVEL, "maximum": MAX_LEVEL}]})]


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


class OnUnavailable(StrEnum):
    """What a decision does when the shared ledger cannot be reached in time."""

    FAIL_OPEN = "fail_open"  # decide by the local view (last snapshot + own work), count, log
    FAIL_CLOSED = "fail_closed"  # refuse: 429 with reason ledger_unavailable


class TenantSource(StrEnum):
    """Where the tenant comes from (extproc.tenant): never from what the client sent."""

    NONE = "none"  # no attribution
    METADATA = "metadata"  # Envoy dynamic metadata, e.g. jwt_authn's payload_in_metadata
    HEADER = "header"  # a header Envoy removes from the client's request and sets itself


@dataclass(frozen=True, config=_MODEL)
class ClassPolicy:
    """A service class. ``latency``: interactive, with a time-to-first-token objective;
    ``throughput``: batch work with a long deadline that may queue deep."""

    name: SkipJsonSchema[Text] = ""  # its key under ``classes``
    deadline_ms: Positive = 30_000.0
    """Deadline of its requests unless the client's deadline header names a shorter one."""
    safety_factor: Fraction = 0.8
    """Admit only when the predicted completion fits in this share of the deadline."""
    ttft_ms: Annotated[NonNegative | None, BeforeValidator(lambda v: v or None)] = None
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


@dataclass(frozen=True, config=_MODEL)
class Route:
    path: Annotated[Text, Rule(lambda v: None if v.startswith("/") else "must start with '/'",
                               pattern="^/")]
    """The request path (query string ignored)."""
    api: Api = Api.OPENAI_CHAT
    """How its bodies are read."""
    service_class: Text = Field(default="latency", validation_alias="class")
    """Its service class: a key of `classes`."""


FROM_CAPACITY = "from_capacity"


def _target(v: str) -> str | None:
    scheme, sep, rest = v.partition("://")
    if sep:
        ok = scheme in ("http", "https") and bool(rest)
    else:
        host, _, port = v.rpartition(":")
        ok = bool(host) and port.isdigit()
    return None if ok else "must be HOST:PORT or an http(s):// URL"


def _from_capacity(value: Any) -> Any:
    if value is None or value == FROM_CAPACITY:
        return None
    if not (isinstance(value, list) and value):
        raise problem(f"must be a non-empty list of HOST:PORT or http(s):// URLs,"
                      f" or {FROM_CAPACITY!r}")
    return value


def _distinct_targets(v: tuple[str, ...] | None) -> str | None:
    dups = sorted({t for t in v or () if v and v.count(t) > 1})
    return f"duplicate target {dups[0]!r} (it would be counted twice)" if dups else None


Targets = Annotated[
    tuple[Annotated[Text, Rule(_target)], ...] | None,
    BeforeValidator(_from_capacity), Rule(_distinct_targets, quote=False),
    WithJsonSchema({"anyOf": [{"type": "array", "items": {"type": "string", "minLength": 1},
                               "minItems": 1, "uniqueItems": True},
                              {"const": FROM_CAPACITY}]})]


@dataclass(frozen=True, config=_MODEL)
class EngineMetricsConfig:
    """Scraping a pool's engines for their own queues (``extproc.enginestats``): a correction
    to the ledger's view that only ever tightens admission, and never while stale."""

    targets: Targets = Field(default=None, json_schema_extra={"default": FROM_CAPACITY})
    """Replicas to scrape (HOST:PORT or http(s):// base URLs), or from_capacity: the capacity
    source's ready hosts (not with capacity.source static)."""
    interval_s: Positive = 2.0
    """Between the end of one scrape round and the next."""
    timeout_s: Positive = 0.5
    """Per replica."""
    max_age_s: Positive = 5.0
    """A replica's last sample counts this long (at least interval_s + timeout_s)."""
    min_coverage: Fraction = 0.5
    """Fresh samples / targets below this: the pool is stale and decided on the ledger alone."""
    tolerance: NonNegative = 0.25
    """Engines may hold this much more than the ledger ..."""
    slack: Count = 2
    """... plus this many requests, before the excess counts as work the ledger does not see."""
    learn_output_lengths: Flag = True
    """Learn the pool's output lengths from vllm:request_generation_tokens."""

    @model_validator(mode="after")
    def _samples_outlive_a_round(self) -> Self:
        # A sample must outlive the next round (which may take the whole timeout), or the
        # pool would go stale between two good scrapes.
        if self.max_age_s < self.interval_s + self.timeout_s:
            fail([Problem(("max_age_s",), f"must be >= interval_s + timeout_s"
                          f" ({self.interval_s + self.timeout_s:g}) (got {self.max_age_s:g})",
                          show=False)])
        return self


DEFAULT_PRESET = "llama-70b-fp8-2xh100"
_ENGINE_COUNTS = ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len")
_STEP = "Step time (one forward pass, linear in what it holds): ms "
_ENGINE_DOCS = {
    "max_num_seqs": "vLLM --max-num-seqs: sequences one replica runs at once at most.",
    "max_num_batched_tokens": "vLLM --max-num-batched-tokens: a step's token budget, decodes"
                              " and prefill chunks together.",
    "block_size": "vLLM --block-size: tokens per KV cache block.",
    "num_gpu_blocks": "KV cache blocks of one replica (vLLM's num_gpu_blocks); 0: unlimited.",
    "max_model_len": "vLLM --max-model-len: prompt + output of one sequence at most.",
    "prefix_caching": "vLLM --enable-prefix-caching: a cached shared prefix is not computed"
                      " again.",
    "step_base_ms": _STEP + "of every step (the weights read once).",
    "ms_per_token": _STEP + "per token scheduled, prefill chunk tokens and decodes alike.",
    "ms_per_seq": _STEP + "per decoding sequence (sampling, per-sequence kernels).",
    "ms_per_kv_token": _STEP + "per token of context the decodes read from the KV cache.",
    "ms_per_prefill_pair": _STEP + "per query-key pair of prefill attention.",
}


def _engine_key(f: dataclasses.Field[Any]) -> Any:
    kind = type(getattr(EngineModel(), f.name))
    typed: Any = {bool: Flag, int: Int, float: Num}[kind]
    if kind is not bool:
        typed = Annotated[typed, within(ge=1 if f.name in _ENGINE_COUNTS else 0)]
    return (typed | None, Field(default=None, description=_ENGINE_DOCS[f.name] + " Default: the"
                                " preset's."))


_ENGINE_SECTION: type[BaseModel] = create_model(
    "Engine", __config__=ConfigDict(extra="forbid"),
    preset=(cast(Any, Literal)[tuple(PRESETS)], Field(default=DEFAULT_PRESET, description=(
        "The calibrated engine the other keys start from (extproc/engine.py): "
        + ", ".join(PRESETS) + "."))),
    **{f.name: _engine_key(f) for f in dataclasses.fields(EngineModel)})


def _engine(section: BaseModel) -> EngineModel:
    values = section.model_dump(exclude_none=True)
    return dataclasses.replace(PRESETS[values.pop("preset")], **values)


@dataclass(frozen=True, config=_MODEL)
class Pool:
    """Replicas serving one model, and the model of one replica (``extproc.engine``)."""

    name: Named
    """Named in capacity.services, metrics and autoscaling."""
    models: Annotated[tuple[Text, ...], Rule(lambda v: None if v else "must not be empty",
                                             minItems=1)] = ("*",)
    """Model names it serves; * serves any model no pool names."""
    replicas: Count = 1
    """Ready replicas assumed (capacity.source static)."""
    engine: Annotated[EngineModel, Section(_ENGINE_SECTION, _engine)] = Field(
        default_factory=EngineModel)
    """One replica as vLLM V1 runs it: a preset and any of its keys over it (extproc/engine.py)."""
    default_max_tokens: Annotated[Int, within(gt=0)] = 512
    """Output tokens charged when a request names no max_tokens."""
    tokenizer: File | None = None
    """A tokenizer.json for exact prompt counts; absent: estimated from bytes_per_token."""
    bytes_per_token: Positive = 4.0
    """UTF-8 bytes per prompt token, when estimating."""
    message_overhead_tokens: Count = 4
    """Tokens a chat message adds beyond its text."""
    non_text_part_tokens: Count = 765
    """Tokens charged for a non-text content part (an image)."""
    # Output-length prediction (extproc.estimate): the mean and a long (~99th percentile)
    # output of this pool's requests, e.g. from the engines' generation-token histogram.
    expected_output_tokens: Positive | None = None
    """Mean output of its requests; absent: max_tokens charged in full."""
    long_output_tokens: Positive | None = None
    """A long (~99th percentile) output, at least expected_output_tokens."""
    wait_quantile: Annotated[Num, within(ge=0.5, lt=1)] = 0.97
    """How sure a predicted queue wait must be: its quantile."""
    engine_metrics: EngineMetricsConfig | None = None
    """Scrape the engines' /metrics as a correction to the ledger's view; absent: off."""

    def serves(self, model: str) -> bool:
        return model in self.models or "*" in self.models

    @model_validator(mode="after")
    def _long_is_not_below_the_mean(self) -> Self:
        mean, long = self.expected_output_tokens, self.long_output_tokens
        if mean is not None and long is not None and long < mean:
            fail([Problem(("long_output_tokens",), f"must be >= expected_output_tokens"
                          f" ({mean:g}) (got {long:g})", show=False)])
        return self


@dataclass(frozen=True, config=_MODEL)
class RedisTls:
    """TLS towards Redis: on for ``rediss://`` URLs, or with ``enabled`` (Sentinel)."""

    enabled: Flag = False
    """TLS without a rediss:// URL (Sentinel)."""
    ca_file: File | None = None
    """CA bundle; absent: the system's."""
    cert_file: File | None = None
    """Client certificate, when Redis asks for one."""
    key_file: File | None = None
    """The client certificate's key."""
    check_hostname: Flag = True
    """Check that Redis's certificate names the host dialled."""

    @model_validator(mode="after")
    def _cert_and_key_together(self) -> Self:
        if (self.cert_file is None) != (self.key_file is None):
            fail([Problem(("key_file",), "cert_file and key_file go together", show=False)])
        return self


def _host_port(value: Any) -> Any:
    host, _, port = str(value).rpartition(":")
    if not (isinstance(value, str) and host and port.isdigit()):
        raise problem("must be HOST:PORT")
    return host, int(port)


@dataclass(frozen=True, config=_MODEL)
class RedisSentinel:
    addresses: Annotated[
        tuple[Annotated[tuple[str, int], BeforeValidator(_host_port),
                        WithJsonSchema({"type": "string", "pattern": "^.+:[0-9]+$"})], ...],
        Rule(lambda v: None if v else "must be a non-empty list of HOST:PORT", minItems=1),
    ]
    """Sentinels, HOST:PORT each."""
    service_name: Named
    """The monitored master's name."""


@dataclass(frozen=True, config=_MODEL)
class BreakerConfig:
    failures: Annotated[Int, within(ge=1)] = 5
    """Consecutive failures that open the breaker."""
    cooldown_ms: NonNegative = 500.0
    """How long it stays open before one trial call."""


def _redis_url(v: str) -> str | None:
    scheme, sep, rest = v.partition("://")
    if not sep or scheme not in ("redis", "rediss", "unix") or not rest:
        return "must be a redis://, rediss:// or unix:// URL"
    return None


_REDIS_ONLY = "Redis only. "


@dataclass(frozen=True, config=_MODEL)
class LedgerConfig:
    """``memory`` (default): exact for one gateway replica. ``redis``: shared by replicas.

    The Redis settings below are used only with ``kind: redis``. The password is kept out of
    ``repr`` (and so out of logs); prefer ``password_file`` or ``password_env``.
    """

    kind: Literal["memory", "redis"] = "memory"
    """memory: exact for one gateway replica; redis: shared by replicas."""
    lease_grace_ms: Positive = 30_000.0
    """The simulator's lease past a request's expected finish."""
    liveness_ms: Annotated[Num, within(ge=100, why="heartbeats every third")] = 3_000.0
    """A gateway's entries outlive its last heartbeat by this much: a replica that dies costs the
    fleet its requests' capacity for about this long."""
    sweep_interval_ms: Positive = 1_000.0
    """How often lapsed entries are swept."""
    url: Annotated[Text, Rule(_redis_url)] | None = None
    """Redis only. redis://, rediss:// (TLS) or unix://; a seed node for a cluster."""
    username: Text | None = None
    """Redis only. ACL user."""
    password: Named | None = Field(default=None, repr=False)
    """Redis only. Prefer password_file or password_env."""
    password_file: File | None = None
    """Redis only. A file holding it."""
    password_env: Named | None = None
    """Redis only. An environment variable holding it."""
    tls: RedisTls = Field(default_factory=RedisTls)
    """Redis only. TLS."""
    sentinel: RedisSentinel | None = None
    """Redis only. Find the master through Sentinel instead of url."""
    cluster: Flag = False
    """Redis only. url is a Redis Cluster node."""
    key_prefix: Annotated[Text, Rule(lambda v: None if v and not set(v) & set("{} ") else
                                     "must be non-empty, without braces or spaces",
                                     pattern="^[^{} ]+$")] = "extproc"
    """Redis only. Prefix of every key (gateways sharing one Redis with different prefixes
    keep apart ledgers)."""
    timeout_ms: Positive = 50.0
    """Redis only. Connect and socket timeout of every Redis call."""
    decision_deadline_ms: Positive = 75.0
    """Redis only. The most one decision waits on the ledger in total."""
    on_unavailable: OnUnavailable = OnUnavailable.FAIL_OPEN
    """Redis only. What a decision does when the ledger cannot be reached in time."""
    breaker: BreakerConfig = Field(default_factory=BreakerConfig)
    """Redis only. Stop calling a failing Redis for a while."""

    @model_validator(mode="wrap")
    @classmethod
    def _redis_keys_need_redis(cls, raw: Any, handler: Callable[[Any], Self]) -> Self:
        found = []
        if isinstance(raw, Mapping) and (kind := raw.get("kind", "memory")) != "redis":
            found = [Problem((key,), f"only used with ledger.kind 'redis' (kind is {kind!r})",
                             show=False) for key in raw if key in _REDIS_KEYS]
        return cast(Self, early(raw, handler, found, drop=_REDIS_KEYS))

    @model_validator(mode="after")
    def _coherent(self) -> Self:
        found, unix = [], self.url is not None and self.url.startswith("unix:")
        given = [k for k in ("password", "password_file", "password_env") if getattr(self, k)]
        if len(given) > 1:
            found.append(Problem((given[1],), "give only one of password, password_file,"
                                 f" password_env (got {', '.join(given)})", show=False))
        if self.kind == "redis" and self.url is None and self.sentinel is None:
            found.append(Problem(("url",), "required with kind 'redis' (or give"
                                 " ledger.sentinel)", show=False))
        if self.cluster and self.sentinel is not None:
            found.append(Problem(("cluster",), "cannot be combined with ledger.sentinel",
                                 show=False))
        if self.cluster and unix:
            found.append(Problem(("cluster",), "a cluster is not reached over a unix socket"
                                 " URL", show=False))
        if unix and self.tls.enabled:
            found.append(Problem(("tls", "enabled"), "not with a unix socket URL", show=False))
        if found:
            fail(found)
        return self


_REDIS_KEYS = frozenset(f.name for f in dataclasses.fields(LedgerConfig)) - {
    "kind", "lease_grace_ms", "liveness_ms", "sweep_interval_ms"}


@dataclass(frozen=True, config=_MODEL)
class CapacityConfig:
    """Where ready replicas come from (see extproc.capacity)."""

    source: Literal["static", "envoy", "kubernetes"] = "static"
    """static: pools[].replicas; envoy: Envoy admin's healthy hosts; kubernetes: each pool's Service
    endpoints."""
    envoy_admin_url: Annotated[Text, Rule(lambda v: None if v.startswith("http://")
                                          else "must be http://", pattern="^http://")] = (
        "http://127.0.0.1:9901")
    """Envoy's admin interface (source envoy)."""
    services: Mapping[str, Annotated[Text, Rule(
        lambda v: None if v.count("/") == 1 else "must be 'namespace/service'",
        pattern="^[^/]+/[^/]+$")]] = Field(default_factory=dict)
    """Pool name -> namespace/service (source kubernetes)."""
    hold_s: NonNegative = 10.0
    """Keep the last value this long when the source fails ..."""
    floor: Count = 1
    """... then assume at most this many ready replicas."""


@dataclasses.dataclass(frozen=True)
class AutoscaleConfig:
    window_s: float = 15.0  # the control window
    policy: ScalingPolicy = dataclasses.field(default_factory=ScalingPolicy)


def _line_comments(cls: type) -> dict[str, str]:
    """The comment on each field's line of ``cls``: ScalingPolicy documents its keys so."""
    lines = inspect.getsource(cls).splitlines()
    return {m[1]: m[2] for m in (re.match(r"\s+(\w+): [^#]*#\s*(.+)", ln) for ln in lines) if m}


def _policy_key(f: dataclasses.Field[Any], doc: str) -> Any:
    typed: Any = {int: Int, float: Num}.get(type(f.default), Num | None)
    return (typed, Field(default=f.default, description=doc))


_AUTOSCALE_SECTION: type[BaseModel] = create_model(
    "Autoscale", __config__=ConfigDict(extra="forbid"),
    window_s=(Positive, Field(default=15.0, description="The control window.")),
    **{f.name: _policy_key(f, _line_comments(ScalingPolicy).get(f.name, ""))
       for f in dataclasses.fields(ScalingPolicy)})


def _autoscale(section: BaseModel) -> AutoscaleConfig:
    """``window_s`` plus any field of ``ScalingPolicy``, validated by it."""
    values = section.model_dump()
    window_s = values.pop("window_s")
    try:
        return AutoscaleConfig(window_s=window_s, policy=ScalingPolicy(**values))
    except ConfigError as exc:
        fail([Problem(tuple(key.split(".")[1:]), why, show=False)
              for key, _, why in (line.partition(": ") for line in exc.problems)])


@dataclass(frozen=True, config=_MODEL)
class TracingConfig:
    endpoint: Annotated[Text, Rule(lambda v: None if v.startswith(("http://", "https://"))
                                   else "must be an http:// or https:// URL")] | None = None
    """OTLP gRPC, e.g. http://jaeger-collector:4317; absent: off."""
    sample_ratio: Annotated[Num, within(ge=0, le=1)] = 1.0
    """For root spans; a sampled parent (Envoy's) is always followed."""
    service_name: Named = "extproc"
    """The service.name of the spans."""


@dataclass(frozen=True, config=_MODEL)
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


@dataclass(frozen=True, config=_MODEL)
class TenantPolicy:
    """What one tenant is entitled to (extproc.share): its weight in fair shares, its
    requests' priority, and optional hard caps the ledger enforces atomically."""

    weight: Positive = 1.0
    """Its weight in max-min fair shares of a contended pool."""
    priority: Level | None = None
    """Its requests' priority (unless the priority header names one)."""
    max_inflight: Annotated[Int, within(ge=1)] | None = None
    """Hard cap: the most requests it may have in flight."""
    max_outstanding_s: Positive | None = None
    """Hard cap: the most GPU-seconds of work it may owe."""


@dataclass(frozen=True, config=_MODEL)
class PriorityConfig:
    """Where a request's priority comes from (extproc.share), first that names one: the
    header (set by Envoy, never by the client), its tenant's, its class's, ``default``."""

    header: Header | None = None
    """A header Envoy sets (client copies are removed) that names a request's priority."""
    default: Level = 0
    """The priority of requests nothing else names."""


MAX_KNOWN_TENANTS = 100  # each known tenant is a metric label value: keep the set bounded
_TENANT_KEYS_BY_SOURCE = {
    TenantSource.METADATA: ("metadata_namespace", "metadata_key", "claim"),
    TenantSource.HEADER: ("header",),
}


def _tenant_name(v: str) -> str | None:
    if not v or len(v) > 64:
        return "must be 1 to 64 characters"
    return "is reserved for tenants not in tenant.known" if v == "other" else None


def _known(v: tuple[str, ...]) -> str | None:
    if dups := sorted({k for k in v if v.count(k) > 1}):
        return f"duplicate name {dups[0]!r}"
    if len(v) > MAX_KNOWN_TENANTS:
        return (f"at most {MAX_KNOWN_TENANTS} names, each a metric label value"
                f" (got {len(v)})")
    return None


def _tenant_names(v: Mapping[str, Any]) -> str | None:
    bad = [(name, why) for name in v if (why := _tenant_name(name)) is not None]
    return f"{bad[0][1]} (got {bad[0][0]!r})" if bad else None


TenantName = Annotated[Text, Rule(_tenant_name, minLength=1, maxLength=64)]
Claim = Annotated[
    tuple[Named, ...], BeforeValidator(lambda v: [v] if isinstance(v, str) else v),
    Rule(lambda v: None if v else "must be a claim name or a non-empty list of names"
         " (a path into nested claims)"),
    WithJsonSchema({"anyOf": [{"type": "string", "minLength": 1}, {
        "type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1}]})]


@dataclass(frozen=True, config=_MODEL)
class TenantConfig:
    source: TenantSource = TenantSource.NONE
    """Where the tenant comes from: none, metadata (e.g. jwt_authn's payload) or header."""
    metadata_namespace: Named = "envoy.filters.http.jwt_authn"
    """source metadata: the namespace."""
    metadata_key: Text = "jwt_payload"
    """source metadata: the key in it (jwt_authn's payload_in_metadata); empty: none."""
    claim: Claim = ("tenant",)
    """source metadata: the claim naming the tenant (a list: a path into nested claims)."""
    header: Header = "x-tenant-id"
    """source header: a header Envoy removes from the client's request and sets itself."""
    known: Annotated[tuple[TenantName, ...], Rule(_known, quote=False, uniqueItems=True,
                                                 maxItems=MAX_KNOWN_TENANTS)] = ()
    """Tenants that are metric labels; the rest count as other."""
    default: TenantName = "anonymous"
    """Charged when no tenant is named."""
    fair_share: Flag = True
    """Share a contended pool max-min by weight between tenants."""
    tenants: Annotated[Mapping[str, TenantPolicy], Rule(_tenant_names, quote=False)] = Field(
        default_factory=dict)
    """Per tenant: weight, priority and hard caps."""
    others: TenantPolicy = Field(default_factory=TenantPolicy)
    """Every tenant not listed in tenants."""

    def policy(self, name: str) -> TenantPolicy:
        return self.tenants.get(name, self.others)

    @model_validator(mode="wrap")
    @classmethod
    def _keys_of_its_source(cls, raw: Any, handler: Callable[[Any], Self]) -> Self:
        """Keys of one source are errors with another (a typo'd source must not leave a
        configured claim silently unused)."""
        found = []
        if isinstance(raw, Mapping):
            source = str(raw.get("source", TenantSource.NONE.value))
            found = [Problem((key,), f"only used with tenant.source {other.value!r}"
                             f" (source is {source!r})", show=False)
                     for other, keys in _TENANT_KEYS_BY_SOURCE.items() if other != source
                     for key in keys if key in raw]
        drop = [str(p.loc[0]) for p in found]
        # duplicates among known, reported with any bad name in it (the field's own check
        # runs only once every name is good)
        known = raw.get("known") if isinstance(raw, Mapping) else None
        if isinstance(known, list) and (why := _known(tuple(map(str, known)))):
            found.append(Problem(("known",), why, show=False))
        return cast(Self, early(raw, handler, found, drop))


@dataclass(frozen=True, config=_MODEL)
class ServerTls:
    """mTLS on ``listen``: clients (Envoy) must present a certificate ``client_ca_file``
    signed. Files are re-read when they change (extproc.tls)."""

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
]

Classes = Annotated[Mapping[str, ClassPolicy], BeforeValidator(_with_default_classes)]


@dataclass(frozen=True, config=_MODEL)
class Config:
    pools: Annotated[tuple[Pool, ...], Rule(_pools, quote=False, minItems=1)] = Field(
        default_factory=lambda: (Pool(name="default"),))
    """Replica pools; absent: one pool named default serving every model."""
    classes: Classes = Field(default_factory=lambda: TypeAdapter(Classes).validate_python({}))
    """Service classes, merged key by key over the built-in latency (deadline 30 s, ttft 2 s, safety
    0.8) and throughput (600 s, 0.9, batch)."""
    routes: tuple[Route, ...] = Field(
        default_factory=lambda: TypeAdapter(tuple[Route, ...]).validate_python(DEFAULT_ROUTES))
    """Paths decided on; absent: the OpenAI and TGI paths. Other paths pass."""
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
    decision_log: Annotated[Text, Rule(_writable_dir)] | None = None
    """JSONL of every decision, for extproc replay; absent: off."""
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    """OpenTelemetry spans of decisions."""
    capacity: CapacityConfig = Field(default_factory=CapacityConfig)
    """Where ready replicas come from."""
    autoscale: Annotated[AutoscaleConfig, Section(_AUTOSCALE_SECTION, _autoscale)] = Field(
        default_factory=AutoscaleConfig)
    """Control window and replica recommender thresholds (docs/autoscaling.md); their bounds
    are checked by ScalingPolicy (extproc/autoscale.py)."""
    keda_listen: Address | None = None
    """KEDA external scaler gRPC (HOST:PORT); absent: off."""
    tenant: TenantConfig = Field(default_factory=TenantConfig)
    """Who a request is charged to, and fair shares between tenants."""
    priority: PriorityConfig = Field(default_factory=PriorityConfig)
    """Where a request's priority comes from."""
    tls: ServerTls | None = None
    """Mutual TLS on listen; absent: plaintext (loopback, unix)."""

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
