"""The ``ledger`` section of the configuration: memory by default, Redis by URL or Sentinel."""

from pathlib import Path

import pytest

from extproc import config
from extproc.config import OnUnavailable
from extproc.errors import ConfigError
from extproc.ledger.connect import describe, password


def ledger(**section: object) -> config.LedgerConfig:
    return config.from_mapping({"ledger": section}).ledger


def problems(**section: object) -> list[str]:
    with pytest.raises(ConfigError) as err:
        config.from_mapping({"ledger": section})
    return err.value.problems


def test_memory_is_the_default_and_redis_defaults_are_short_and_fail_open() -> None:
    assert ledger().kind == "memory"
    c = ledger(kind="redis", url="redis://10.0.0.5:6380/0")
    assert (c.timeout_ms, c.decision_deadline_ms) == (50.0, 75.0)
    assert c.on_unavailable is OnUnavailable.FAIL_OPEN
    assert (c.breaker.failures, c.breaker.cooldown_ms) == (5, 500.0)
    assert c.key_prefix == "extproc" and not c.cluster and c.sentinel is None
    assert describe(c) == "redis://10.0.0.5:6380"


def test_every_redis_problem_names_its_key() -> None:
    found = "\n".join(problems(
        kind="redis", url="http://x", timeout_ms=0, decision_deadline_ms=-1,
        on_unavailable="maybe", key_prefix="a{b}", cluster="yes",
        breaker={"failures": 0, "colour": 1}, tls={"ca_file": "/nonexistent"}, typo=1))
    for expected in [
        "ledger.url: must be a redis://, rediss:// or unix:// URL",
        "ledger.timeout_ms: must be > 0",
        "ledger.decision_deadline_ms: must be > 0",
        "ledger.on_unavailable: must be one of 'fail_open', 'fail_closed'",
        "ledger.key_prefix: must be non-empty, without braces or spaces",
        "ledger.cluster: must be true or false",
        "ledger.breaker.failures: must be >= 1",
        "ledger.breaker.colour: unknown key",
        "ledger.tls.ca_file: no such file",
        "ledger.typo: unknown key",
    ]:
        assert expected in found


def test_redis_needs_a_url_or_sentinel_and_forms_must_be_coherent() -> None:
    assert problems(kind="redis") == [
        "ledger.url: required with kind 'redis' (or give ledger.sentinel)"]
    assert "ledger.cluster: cannot be combined with ledger.sentinel" in problems(
        kind="redis", cluster=True,
        sentinel={"addresses": ["127.0.0.1:26379"], "service_name": "m"})
    assert "ledger.cluster: a cluster is not reached over a unix socket URL" in problems(
        kind="redis", cluster=True, url="unix:///run/redis.sock")
    assert problems(kind="redis", sentinel={"addresses": ["nohost"]}) == [
        "ledger.sentinel.addresses[0]: must be HOST:PORT (got 'nohost')",
        "ledger.sentinel.service_name: required"]


def test_redis_keys_with_the_memory_ledger_are_an_error_not_ignored() -> None:
    assert problems(url="redis://x:6379") == [
        "ledger.url: only used with ledger.kind 'redis' (kind is 'memory')"]


def test_a_password_never_appears_in_errors_or_repr(tmp_path: Path) -> None:
    found = "\n".join(problems(kind="redis", url="redis://u:hunter2@host:6379",
                               password="s3cret", password_env="X"))
    assert "password_env: give only one of password, password_file, password_env" in found
    bad = "\n".join(problems(kind="redis", url="redis:/hunter2", password=12345))
    assert "hunter2" not in bad and "12345" not in bad
    assert "ledger.password: must be a string (value not shown)" in bad
    c = ledger(kind="redis", url="redis://u:hunter2@host:6379", password="s3cret")
    assert "s3cret" not in repr(c)
    assert "hunter2" not in describe(c)


def test_password_comes_from_a_file_or_the_environment(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text("from-file\n")
    c = ledger(kind="redis", url="redis://h:1", password_file=str(secret))
    assert password(c, {}) == "from-file"
    c = ledger(kind="redis", url="redis://h:1", password_env="REDIS_PW")
    assert password(c, {"REDIS_PW": "from-env"}) == "from-env"
    with pytest.raises(ConfigError, match=r"ledger\.password_env: environment variable"
                                          r" REDIS_PW is not set"):
        password(c, {})
    [problem] = problems(kind="redis", url="redis://h:1", password_file=str(tmp_path / "nope"))
    assert problem.startswith("ledger.password_file: no such file")


def test_sentinel_and_unix_forms_are_described_without_secrets() -> None:
    c = ledger(kind="redis", sentinel={"addresses": ["10.0.0.1:26379", "10.0.0.2:26379"],
                                       "service_name": "ledger"}, on_unavailable="fail_closed")
    assert c.sentinel is not None and c.sentinel.addresses[1] == ("10.0.0.2", 26379)
    assert c.on_unavailable is OnUnavailable.FAIL_CLOSED
    assert describe(c) == "sentinel service ledger via 10.0.0.1:26379,10.0.0.2:26379"
    c = ledger(kind="redis", url="unix:///run/redis.sock?password=pw")
    assert describe(c) == "unix:///run/redis.sock"
