"""The ledger: in memory, or in Redis (a URL, Sentinel or a Cluster; TLS; the password from a
file or the environment, never in errors or ``repr``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import Annotated, Any, Literal, Self, cast

from pydantic import BeforeValidator, Field, WithJsonSchema, model_validator
from pydantic.dataclasses import dataclass

from extproc.config.fields import MODEL, File, Flag, Int, Named, NonNegative, Num, Positive, Text
from extproc.config.rules import Problem, Rule, early, fail, problem, within


class OnUnavailable(StrEnum):
    """What a decision does when the shared ledger cannot be reached in time."""

    FAIL_OPEN = "fail_open"  # decide by the local view (last snapshot + own work), count, log
    FAIL_CLOSED = "fail_closed"  # refuse: 429 with reason ledger_unavailable


@dataclass(frozen=True, config=MODEL)
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


@dataclass(frozen=True, config=MODEL)
class RedisSentinel:
    addresses: Annotated[
        tuple[Annotated[tuple[str, int], BeforeValidator(_host_port),
                        WithJsonSchema({"type": "string", "pattern": "^.+:[0-9]+$"})], ...],
        Rule(lambda v: None if v else "must be a non-empty list of HOST:PORT", minItems=1),
    ]
    """Sentinels, HOST:PORT each."""
    service_name: Named
    """The monitored master's name."""


@dataclass(frozen=True, config=MODEL)
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


@dataclass(frozen=True, config=MODEL)
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


