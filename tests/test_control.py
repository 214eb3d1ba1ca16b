"""The autoscaling loop: counts in, recommendation out — in the unit and in the server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from extproc._proto import externalscaler_pb2 as kpb
from extproc._proto import externalscaler_pb2_grpc as kpb_grpc
from extproc.config import Pool
from extproc.decision.admission import Outcome, Reason
from extproc.decision.running import Running
from extproc.fleet.capacity import StaticCapacity
from extproc.fleet.engine import EngineModel
from extproc.gateway.verdict import Answer, Ticket, Verdict
from extproc.observability.metrics import Metrics
from extproc.scaling.autoscale import Direction, ScalingPolicy
from extproc.scaling.control import Control
from extproc.scaling.keda import metric_name
from tests.extproc_client import Stream, admit_one, body, chat, headers, serving


@pytest.fixture(autouse=True)
async def end_streams() -> AsyncIterator[None]:
    yield
    await Stream.end_all()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def control(clock: Clock, **policy: Any) -> tuple[Control, Metrics]:
    metrics = Metrics()
    pools = [Pool(name="llama", replicas=2, engine=EngineModel(max_num_seqs=2))]
    ctl = Control({"llama": ScalingPolicy(**policy)}, StaticCapacity(pools), metrics,
                  classes=("latency", "throughput"), window_s=15, clock=clock)
    return ctl, metrics


def admitted(rid: str) -> Verdict:
    return Verdict(Answer(Outcome.ADMIT, Reason.FITS, "latency"), "llama",
                   ticket=Ticket(rid, "llama", 1000.0, Running("latency", 0.0)))


def rejected() -> Verdict:
    return Verdict(Answer(Outcome.REJECT, Reason.DEADLINE, "latency"), "llama")


def sample(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_window_counts_and_the_oldest_admitted_age() -> None:
    clock = Clock()
    ctl, _ = control(clock)
    first, second = admitted("a"), admitted("b")
    ctl.decided(first)
    clock.now += 5
    ctl.decided(second)
    ctl.decided(rejected())
    clock.now += 1
    assert first.ticket is not None and second.ticket is not None
    ctl.settled(first.ticket, completed=True)
    clock.now += 4
    w = ctl.window("llama", clock.now)
    assert (w.arrivals, w.admitted, w.rejected, w.departures) == (3, 2, 1, 1)
    assert w.oldest_age_s == 5.0  # "b", admitted 5 s after "a", which has finished
    assert w.ready == 2 and w.queue_depth == 0
    ctl.settled(second.ticket, completed=False)  # cancelled: not a successful departure
    assert ctl.window("llama", clock.now).departures == 1
    assert ctl.oldest_age_s("llama", clock.now) == 0.0


def test_a_window_of_rejections_recommends_scaling_up_and_publishes_it() -> None:
    clock = Clock()
    ctl, metrics = control(clock, min_replicas=1, max_replicas=10)
    for i in range(10):
        ctl.decided(admitted(str(i)))
    for _ in range(20):
        ctl.decided(rejected())
    clock.now += 15
    rec = ctl.tick()["llama"]
    assert rec.direction is Direction.UP and rec.desired > 2
    assert ctl.recommendation("llama") == rec
    assert sample(metrics, "extproc_admission_reject_ratio", pool="llama") == 20 / 30
    assert sample(metrics, "extproc_autoscale_desired_replicas", pool="llama") == rec.desired
    assert sample(metrics, "extproc_queue_oldest_age_seconds", pool="llama",
                  **{"class": "latency"}) == 15.0
    assert sample(metrics, "extproc_queue_oldest_age_seconds", pool="llama",
                  **{"class": "throughput"}) == 0.0
    assert sample(metrics, "extproc_pool_replicas", pool="llama", state="ready") == 2
    # counts start over; in-flight requests (and their age) carry on
    assert ctl.window("llama", clock.now).arrivals == 0


async def test_server_serves_its_recommendation_to_keda() -> None:
    async with serving({
        "listen": "127.0.0.1:0", "metrics_listen": "127.0.0.1:0", "keda_listen": "127.0.0.1:0",
        "pools": [{"name": "llama", "replicas": 1, "engine": {"max_num_seqs": 2}}],
        # a window counts from 5 decisions, however slowly a loaded machine sends them
        "autoscale": {"window_s": 0.5, "min_decisions": 5, "min_replicas": 1,
                      "max_replicas": 8},
    }) as (svc, stub):
        held = [await admit_one(stub, 500) for _ in range(2)]

        async def refused(n: int) -> None:  # overload: every further request is refused
            for _ in range(n):
                s = Stream(stub)
                await s.send(headers())
                assert (await s.send(body(chat(500)))).immediate_response.status.code == 429

        # The overload goes on while we ask, so however slowly a loaded machine sends it,
        # the windows keep holding refusals; ask until one has recommended more replicas.
        async with grpc.aio.insecure_channel(f"127.0.0.1:{svc.keda_port}") as keda:
            scaler = kpb_grpc.ExternalScalerStub(keda)
            ref = kpb.ScaledObjectRef(name="vllm", namespace="ns",
                                      scalerMetadata={"pool": "llama"})
            seen: list[int] = []
            for _ in range(100):
                await refused(5)
                try:
                    got = await scaler.GetMetrics(kpb.GetMetricsRequest(
                        scaledObjectRef=ref, metricName=metric_name("llama")))
                except grpc.aio.AioRpcError as exc:  # no window has ended yet
                    assert exc.code() is grpc.StatusCode.UNAVAILABLE, exc
                else:
                    seen.append(got.metricValues[0].metricValue)
                    if seen[-1] >= 2:
                        break
                await asyncio.sleep(0.1)
        for s in held:
            await s.close()
    assert seen and seen[-1] >= 2, seen  # up from the single ready replica
