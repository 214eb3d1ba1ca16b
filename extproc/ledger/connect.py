"""Connecting to the ledger's Redis: the client for a ``ledger`` configuration (standalone,
Sentinel or Cluster; TLS, ACL user and password from the file, the environment or the config),
and where it lives in words for logs, never with credentials."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from redis.asyncio import Redis, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff

from extproc.errors import ConfigError

if TYPE_CHECKING:
    from extproc.config import LedgerConfig


def describe(config: LedgerConfig) -> str:
    """Where the ledger lives, for logs: scheme, host and port, never credentials."""
    if config.sentinel is not None:
        nodes = ",".join(f"{h}:{p}" for h, p in config.sentinel.addresses)
        return f"sentinel service {config.sentinel.service_name} via {nodes}"
    parts = urlsplit(config.url or "")
    if parts.scheme == "unix":
        where = f"unix://{parts.path}"
    else:
        where = f"{parts.scheme}://{parts.hostname}:{parts.port or 6379}"
    return f"cluster via {where}" if config.cluster else where


def password(config: LedgerConfig, environ: Mapping[str, str]) -> str | None:
    if config.password is not None:
        return config.password
    if config.password_file is not None:
        try:
            return Path(config.password_file).read_text("utf-8").rstrip("\r\n")
        except OSError as exc:
            raise ConfigError([f"ledger.password_file: cannot read ({exc.strerror})"]) from exc
    if config.password_env is not None:
        value = environ.get(config.password_env)
        if value is None:
            raise ConfigError([f"ledger.password_env: environment variable"
                               f" {config.password_env} is not set"])
        return value
    return None


def connect(config: LedgerConfig,
            environ: Mapping[str, str] = os.environ) -> tuple[Any, tuple[Any, ...]]:
    """The redis-py client for ``config`` and any helper clients to close with it.

    Timeouts are explicit and short; retries are off (redis-py retries by default, which would
    multiply a dead Redis's cost per decision); CLIENT SETINFO is skipped (one less round trip
    per connection).
    """
    timeout = config.timeout_ms / 1000.0
    kwargs: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "retry": Retry(NoBackoff(), 0),
        "health_check_interval": 0,
        "driver_info": None,
    }
    secret = password(config, environ)
    if config.username is not None:
        kwargs["username"] = config.username
    if secret is not None:
        kwargs["password"] = secret
    url = config.url
    tls = config.tls
    if tls.enabled or (url or "").startswith("rediss://"):
        kwargs.update(ssl_ca_certs=tls.ca_file, ssl_certfile=tls.cert_file,
                      ssl_keyfile=tls.key_file, ssl_check_hostname=tls.check_hostname)
        if url is not None and url.startswith("redis://"):
            url = "rediss://" + url[len("redis://"):]
    if config.sentinel is not None:
        sentinel_kwargs = {k: kwargs[k] for k in ("socket_timeout", "socket_connect_timeout",
                                                  "retry", "driver_info")}
        if tls.enabled:
            kwargs["ssl"] = True
        sentinel = Sentinel(  # type: ignore[no-untyped-call]
            list(config.sentinel.addresses), sentinel_kwargs=sentinel_kwargs, **kwargs)
        return sentinel.master_for(config.sentinel.service_name), tuple(sentinel.sentinels)
    assert url is not None  # config validation guarantees a URL without Sentinel
    if config.cluster:
        return RedisCluster.from_url(url, **kwargs), ()
    return Redis.from_url(url, **kwargs), ()
