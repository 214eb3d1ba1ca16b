"""``kill -9`` of ``extproc serve`` under load, through a real Envoy, and its restart.

Fail-closed, Envoy answers every request the processor cannot see with ``status_on_error``
(503 here) at once; fail-open, traffic flows unadmitted and Envoy counts each such request in
``http.<prefix>.ext_proc.failure_mode_allowed``. Either way no request hangs, and a restarted
processor decides again (200 and 429) with no operator action: Envoy reconnects by itself.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Any

import pytest

from extproc_dev.stack import LocalStack, envoy_binary
from tests.conftest import pool
from tests.traffic import Ask, Reply, Traffic, count, envoy_stats, figures

pytestmark = pytest.mark.integration

RATE_RPS = 20.0
DEAD_S = 2.0  # how long the processor stays dead
SETTLE_S = 0.2  # after the kill, for Envoy to see the connection gone (it takes ~1 ms)
ANSWER_S = 2.0  # "at once": the most any request may take to be answered here
FAILED_STAT = "http.ingress.ext_proc.failure_mode_allowed"

# 1 replica x 2 slots at 2 ms/token: each request is charged ~0.6 s, so with a 1.2 s deadline
# (0.96 s budget) two fit at a time and the rest of 20 req/s get 429. The backend really runs
# 20 tokens in ~0.2 s, with slots to spare for the unadmitted traffic of fail-open.
SETTINGS = {"pools": [pool(replicas=1, max_num_seqs=2,
                   engine={"step_base_ms": 1.1, "ms_per_seq": 0.82})],
            "drain_grace_s": 0}
BACKEND = ["--max-running", "8", "--time-scale", "0.5"]
ASK = Ask(prompt_tokens=20, max_tokens=300, output_tokens=20, deadline_ms=1200)


@dataclass
class Timeline:
    killed: float = 0.0
    restarting: float = 0.0
    up: float = 0.0


def decisions(stack: LocalStack) -> float:
    return stack.metric("extproc_admission_decisions_total")


async def kill_and_restart(stack: LocalStack) -> tuple[Traffic, Timeline]:
    """Open-loop load; ``kill -9`` of the processor; ``DEAD_S`` later, a restart; load on
    until two seconds after the new processor answers."""
    when = Timeline()
    async with Traffic(stack.url, ASK, timeout_s=10.0) as traffic:
        stop = asyncio.Event()
        load = asyncio.create_task(traffic.open(RATE_RPS, stop))
        await asyncio.sleep(1.5)
        assert decisions(stack) > 0, "admission was deciding before the kill"
        stack.processes["extproc"].signal(signal.SIGKILL)
        when.killed = time.monotonic()
        await asyncio.sleep(DEAD_S)
        when.restarting = time.monotonic()
        await asyncio.to_thread(stack.start_extproc)
        when.up = time.monotonic()
        await asyncio.sleep(2.5)
        stop.set()
        await load
    return traffic, when


def assert_none_hangs(replies: list[Reply]) -> None:
    kinds = count(replies)
    assert "timeout" not in kinds, kinds
    slowest = max(r.seconds for r in replies)
    assert slowest < ANSWER_S + 1.0, f"slowest answer {slowest:.2f}s; {kinds}"


def assert_admission_resumed(stack: LocalStack, traffic: Traffic, when: Timeline) -> None:
    after = traffic.between(when.up + 0.3, float("inf"))
    kinds = count(after)
    assert kinds.get("200", 0) > 0 and kinds.get("429", 0) > 0, kinds
    assert set(kinds) <= {"200", "429"}, kinds
    assert decisions(stack) >= len(after)  # the new process decided each of them


def test_kill_9_fail_closed_answers_the_configured_status_at_once(stack_factory: Any) -> None:
    stack = stack_factory(SETTINGS, fail_open=False, status_on_error=503, backend_args=BACKEND)
    traffic, when = asyncio.run(kill_and_restart(stack))
    before = traffic.between(0, when.killed - 1.0)  # none of them still running at the kill
    dead = traffic.between(when.killed + SETTLE_S, when.restarting)
    in_flight = traffic.between(when.killed - 1.0, when.killed + SETTLE_S)
    print(figures(sent=len(traffic.replies), before=count(before), dead=count(dead),
                  in_flight=count(in_flight), restart_s=when.up - when.restarting))

    assert set(count(before)) <= {"200", "429"}, count(before)
    assert len(dead) >= RATE_RPS * DEAD_S / 2
    assert count(dead) == {"503": len(dead)}  # the configured status, every one
    assert max(r.seconds for r in dead) < ANSWER_S
    assert_none_hangs(traffic.replies)
    assert_admission_resumed(stack, traffic, when)


def test_kill_9_fail_open_lets_traffic_through_and_envoy_counts_it(stack_factory: Any) -> None:
    stack = stack_factory(SETTINGS, fail_open=True, backend_args=BACKEND)
    stats = envoy_stats(stack.admin_port, "ext_proc")
    assert FAILED_STAT in stats, sorted(stats)  # the stat's real name in Envoy 1.40
    allowed_before = stats[FAILED_STAT]
    traffic, when = asyncio.run(kill_and_restart(stack))
    dead = traffic.between(when.killed + SETTLE_S, when.restarting)
    allowed = envoy_stats(stack.admin_port, "ext_proc")[FAILED_STAT] - allowed_before
    print(figures(sent=len(traffic.replies), all=count(traffic.replies), dead=count(dead),
                  failure_mode_allowed=allowed, restart_s=when.up - when.restarting))

    assert len(dead) >= RATE_RPS * DEAD_S / 2
    assert count(dead) == {"200": len(dead)}  # unadmitted, but served
    assert allowed >= len(dead)
    assert set(count(traffic.replies)) <= {"200", "429"}, count(traffic.replies)
    assert_none_hangs(traffic.replies)
    assert_admission_resumed(stack, traffic, when)


def test_status_on_error_is_rendered_and_checked(tmp_path: Any) -> None:
    """``extproc envoy-config --status-on-error``: the code reaches Envoy's ext_proc filter
    (and passes ``envoy --mode validate``); a code Envoy does not define is refused."""
    from extproc import cli

    out = tmp_path / "envoy.yaml"
    assert cli.main(["envoy-config", "--fail-closed", "--status-on-error", "502",
                     "-o", str(out)]) == 0
    text = out.read_text()
    assert "status_on_error:\n                code: BadGateway" in text
    result = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(out)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    for bad in ("599", "200", "abc"):
        with pytest.raises(SystemExit):
            cli.main(["envoy-config", "--status-on-error", bad])
