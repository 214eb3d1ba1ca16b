"""Overload honesty: offered 2x and 5x what the processor itself can decide, through a real
Envoy (fail-closed), every request still gets an honest answer within its deadline and none
hangs; when the overload ends, prompt decisions come back (how long that takes is printed).
While bodies wait for the processor longer than ``shed_wait_ms`` it answers 429
``processor_overloaded`` unparsed (``extproc.gateway.server``); what still waits past Envoy's
``message_timeout`` gets Envoy's 504.

The processor is made the bottleneck on purpose: prompts of ~6,800 tokens of random Han
characters (``Ask.han``: no piece of one is in the processor's piece cache), each different,
counted exactly with the real Llama 3 tokenizer (a few ms each, on the event loop), while the
fake backend runs 10x faster than the pool's model says. Its saturation is measured first
with closed-loop clients, so the test scales with the machine it runs on.

The honest answers: 200 (admitted and served), 429 (refused by admission or shed), the configured
``status_on_error`` 503 (the processor's stream failed) and 504, which Envoy itself answers
when a message waits past ``message_timeout`` (2 s; Envoy has no setting for that status).
The worst the processor can add is two such waits (headers, then body): 4 s. The deadline
(8 s) leaves room for a slow, shared machine.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from extproc_dev.stack import LocalStack
from tests.conftest import pool
from tests.traffic import Ask, Traffic, count, figures, saturation_rps

pytestmark = pytest.mark.integration

DEADLINE_MS = 8_000.0
SECONDS = 3.0  # of offered load at each level
HONEST = {"200", "429", "503", "504"}
# 4,000 Han characters, ~6,800 Llama 3 tokens: under extproc.tokens.pricing.ESTIMATE_CHARS, so every
# prompt is counted before its decision (~2.5 ms of the processor's CPU)
ASK = Ask(prompt_tokens=4_000, max_tokens=64, output_tokens=8, deadline_ms=DEADLINE_MS,
          han=True)


async def offer(stack: LocalStack, rate_rps: float) -> Traffic:
    async with Traffic(stack.url, ASK, timeout_s=DEADLINE_MS / 1000) as traffic:
        await traffic.open(rate_rps, SECONDS)
    return traffic


async def recovery_s(stack: LocalStack, within_s: float = 30.0) -> float:
    """Seconds until a request alone is decided (200 or 429) within a second again."""
    began = time.monotonic()
    async with Traffic(stack.url, ASK, timeout_s=5.0) as traffic:
        while True:
            reply = await traffic.one()
            if reply.kind in ("200", "429") and reply.seconds < 1.0:
                return time.monotonic() - began
            assert time.monotonic() - began < within_s, f"no prompt decision: {reply}"
            await asyncio.sleep(0.1)


async def overload(stack: LocalStack) -> list[str]:
    saturation = await saturation_rps(stack.url, ASK, clients=32, seconds=3.0)
    lines = [figures(saturation_rps=saturation)]
    assert saturation > 5, "the stack served almost nothing"
    for factor in (2, 5):
        decided = stack.metric("extproc_admission_decisions_total")
        began = time.monotonic()
        traffic = await offer(stack, factor * saturation)
        replies = traffic.replies
        kinds = count(replies)
        slowest = max(r.seconds for r in replies)
        recovered_s = await recovery_s(stack)
        sent_s = max(r.started for r in replies) - min(r.started for r in replies)
        lines.append(figures(factor=factor, requests=len(replies), sent_rps=len(replies) / sent_s,
                             outcomes=kinds, slowest_s=slowest,
                             decided=stack.metric("extproc_admission_decisions_total")
                             - decided, run_s=time.monotonic() - began,
                             recovered_s=recovered_s))

        assert set(kinds) <= HONEST, kinds  # no timeout, no connection error, no other status
        assert slowest < DEADLINE_MS / 1000, slowest
        assert kinds.get("200", 0) + kinds.get("429", 0) > 0, kinds  # still deciding
    return lines


def test_2x_and_5x_saturation_get_honest_answers_within_the_deadline(
        stack_factory: Any, llama3_tokenizer: str) -> None:
    stack = stack_factory(
        {"pools": [pool(replicas=1, max_num_seqs=4, tokenizer=llama3_tokenizer)]},
        fail_open=False, status_on_error=503,
        backend_args=["--max-running", "4", "--time-scale", "0.1"])
    for line in asyncio.run(overload(stack)):
        print(line)
