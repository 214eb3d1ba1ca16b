"""SIGTERM to ``extproc serve`` under load, through a real Envoy: health turns NOT_SERVING
first, every request that finishes within the drain grace is answered as usual (no 5xx, even
fail-closed, where any stream the processor dropped would be a 503), then the process exits 0.
"""

from __future__ import annotations

import asyncio
import signal
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from extproc.gateway.server import SERVICE_NAME
from tests.conftest import pool
from tests.traffic import Ask, Traffic, count, figures, health, wait_until

pytestmark = pytest.mark.integration

GRACE_S = 3.0
RATE_RPS = 40.0  # a request every 25 ms: a stream is always open, so the drain uses its grace
EXIT_MARGIN_S = 5.0  # after the grace: gRPC stop (0.5 s), background tasks (<= 2 s), exit


def ready(stack: Any) -> int:
    """The HTTP mirror of the processor's health (``/ready`` on its metrics listener)."""
    url = stack.metrics_url.replace("/metrics", "/ready")
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return int(err.code)


async def drain_under_load(stack: Any) -> dict[str, Any]:
    proc = stack.processes["extproc"]
    port = stack.grpc_port
    assert health(port) == "SERVING" and health(port, SERVICE_NAME) == "SERVING"
    assert ready(stack) == 200
    async with Traffic(stack.url, Ask(output_tokens=8), timeout_s=10.0) as traffic:
        stop = asyncio.Event()
        load = asyncio.create_task(traffic.open(RATE_RPS, stop))
        await asyncio.sleep(1.0)
        proc.signal(signal.SIGTERM)
        term = time.monotonic()
        seen: list[str] = []  # what the processor said, each time we asked

        def left_serving() -> bool:
            seen.append(health(port, SERVICE_NAME))
            return seen[-1] != "SERVING"

        to_not_serving = await wait_until(left_serving, 5.0, "health leaves SERVING",
                                          interval=0.02)
        seen_overall = health(port)
        ready_draining = ready(stack)
        exited_s = await wait_until(lambda: proc.popen.poll() is not None,
                                    GRACE_S + EXIT_MARGIN_S + 5.0, "extproc exits")
        await asyncio.sleep(0.5)
        stop.set()
        await load
    return {"traffic": traffic, "term": term, "to_not_serving": to_not_serving, "seen": seen[-1],
            "seen_overall": seen_overall, "ready_draining": ready_draining,
            "exited_s": exited_s, "rc": proc.popen.returncode}


def test_sigterm_turns_not_serving_then_drains_without_5xx_then_exits(
        stack_factory: Any) -> None:
    stack = stack_factory({"pools": [pool(replicas=1, max_num_seqs=4)], "drain_grace_s": GRACE_S},
                          fail_open=False, backend_args=["--max-running", "8",
                                                         "--time-scale", "0.1"])
    run = asyncio.run(drain_under_load(stack))
    traffic: Traffic = run["traffic"]
    term: float = run["term"]
    within = [r for r in traffic.replies if r.ended < term + GRACE_S]
    during = [r for r in within if r.started > term + run["to_not_serving"]]
    print(figures(to_not_serving_s=run["to_not_serving"], exited_s=run["exited_s"],
                  rc=run["rc"], within_grace=count(within), after_not_serving=count(during),
                  after_grace=count([r for r in traffic.replies if r.ended >= term + GRACE_S])))

    assert run["seen"] == "NOT_SERVING" and run["seen_overall"] == "NOT_SERVING"
    assert run["ready_draining"] == 503
    assert run["to_not_serving"] < 2.0
    kinds = count(within)
    assert set(kinds) <= {"200", "429"} and "200" in kinds, kinds  # no 5xx, error or hang
    assert len(during) >= RATE_RPS * GRACE_S / 3  # still serving while NOT_SERVING
    assert run["rc"] == 0
    assert GRACE_S - 0.5 < run["exited_s"] < GRACE_S + EXIT_MARGIN_S
