"""The 429's delay: retry-after-ms spread within its range, Retry-After its ceiling."""

from __future__ import annotations

import json
import math
import random

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.config import RetryAfter
from extproc.decision.admission import Reason
from extproc.gateway.responses import overloaded, retry_after_s
from extproc.gateway.retry import retry_delay_ms

DEFAULT = RetryAfter()  # min_s 1, max_s 60, jitter 0.5


def headers_of(resp: pb.ProcessingResponse) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode()
            for h in resp.immediate_response.headers.set_headers}


@pytest.mark.parametrize("hint", [None, 0.0, -50.0, 400.0, 1000.0, 2500.0, 30_000.0])
def test_delay_lies_between_the_floored_hint_and_its_jittered_stretch(hint: float | None) -> None:
    rng = random.Random(1)
    base = max(hint or 0.0, 1000.0)
    for _ in range(1000):
        ms = retry_delay_ms(hint, DEFAULT, rng)
        assert isinstance(ms, int)
        assert base <= ms <= math.ceil(base * 1.5)


def test_retry_after_is_the_ceiling_of_the_same_draw() -> None:
    for seed in range(200):
        ms = retry_delay_ms(1700.0, DEFAULT, random.Random(seed))
        assert retry_after_s(1700.0, DEFAULT, random.Random(seed)) == math.ceil(ms / 1000)


@pytest.mark.parametrize("ms", [1000, 1001, 1499, 1999, 2000, 2001, 60_000])
def test_the_429_headers_agree(ms: int) -> None:
    resp = overloaded(Reason.TTFT, ms)
    hdrs = headers_of(resp)
    assert resp.immediate_response.status.code == 429
    assert hdrs["retry-after-ms"] == str(ms)
    assert hdrs["retry-after"] == str(math.ceil(ms / 1000))  # never earlier than the ms value
    assert hdrs["x-should-retry"] == "true" and hdrs["x-admission-reason"] == "ttft"
    message = json.loads(resp.immediate_response.body)["error"]["message"]
    assert message.endswith(f"Retry after {math.ceil(ms / 1000)} seconds.")


@pytest.mark.parametrize("hint", [None, 3000.0])
def test_same_hint_draws_are_spread_over_the_jitter_width(hint: float | None) -> None:
    # At the floor too: 1,000 clients rejected with the same hint come back over
    # [base, 1.5 x base], not at one instant.
    rng = random.Random(7)
    base = max(hint or 0.0, 1000.0)
    draws = [retry_delay_ms(hint, DEFAULT, rng) for _ in range(1000)]
    assert len(set(draws)) >= 300
    assert max(draws) - min(draws) >= 0.9 * 0.5 * base
    per_100ms = [sum(1 for d in draws if base + i * 100 <= d < base + (i + 1) * 100)
                 for i in range(int(base * 0.5) // 100)]
    assert max(per_100ms) <= 0.35 * len(draws)  # no bin holds the herd
    # what whole seconds made of the same draws: one or two values
    assert len({math.ceil(d / 1000) for d in draws}) <= 2


@pytest.mark.parametrize("hint", [59_000.0, 1e9, math.inf, math.nan])
def test_the_cap_holds(hint: float) -> None:
    rng = random.Random(3)
    for _ in range(500):
        ms = retry_delay_ms(hint, DEFAULT, rng)
        assert 1000 <= ms <= 60_000
        assert retry_after_s(hint, DEFAULT, rng) <= 60
    assert retry_delay_ms(1e9, DEFAULT, rng) == 60_000


def test_no_jitter_gives_the_floored_hint_exactly() -> None:
    rules = RetryAfter(min_s=1, max_s=1, jitter=0.0)
    assert retry_delay_ms(None, rules, random.Random()) == 1000
    assert retry_after_s(300.0, rules, random.Random()) == 1
    assert retry_delay_ms(2400.0, RetryAfter(min_s=1, max_s=60, jitter=0.0),
                          random.Random()) == 2400
