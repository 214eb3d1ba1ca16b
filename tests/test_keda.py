"""The KEDA external scaler over real gRPC, called as KEDA calls it, and its generated code."""

from __future__ import annotations

import asyncio
import filecmp
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from extproc._proto import externalscaler_pb2 as pb
from extproc._proto import externalscaler_pb2_grpc as pb_grpc
from extproc.scaling.autoscale import Direction, Reading, Reason, Recommendation
from extproc.scaling.keda import ExternalScaler, add_to_server, metric_name

pytestmark = pytest.mark.integration  # starts processes (Envoy, extproc, helm, an interpreter)

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ("externalscaler_pb2.py", "externalscaler_pb2.pyi", "externalscaler_pb2_grpc.py")


def test_checked_in_generated_code_matches_the_proto(tmp_path: Path) -> None:
    # the command in proto/externalscaler.proto's header, into a temporary tree
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-Iextproc/_proto=proto",
                    f"--python_out={tmp_path}", f"--pyi_out={tmp_path}",
                    f"--grpc_python_out={tmp_path}", "extproc/_proto/externalscaler.proto"],
                   cwd=ROOT, check=True)
    for name in GENERATED:
        fresh, checked_in = tmp_path / "extproc" / "_proto" / name, ROOT / "extproc/_proto" / name
        assert filecmp.cmp(fresh, checked_in, shallow=False), (
            f"extproc/_proto/{name} is stale: regenerate it (see proto/externalscaler.proto)")


def test_wire_names_and_numbers_are_kedas() -> None:
    def fields(message: type) -> dict[str, int]:
        return {f.name: f.number for f in message.DESCRIPTOR.fields}

    assert pb.DESCRIPTOR.package == "externalscaler"
    service = pb.DESCRIPTOR.services_by_name["ExternalScaler"]
    assert sorted(m.name for m in service.methods) == [
        "GetMetricSpec", "GetMetrics", "IsActive", "StreamIsActive"]
    assert fields(pb.ScaledObjectRef) == {"name": 1, "namespace": 2, "scalerMetadata": 3}
    assert fields(pb.MetricSpec) == {"metricName": 1, "targetSize": 2, "targetSizeFloat": 3}
    assert fields(pb.GetMetricsRequest) == {"scaledObjectRef": 1, "metricName": 2}
    assert fields(pb.MetricValue) == {"metricName": 1, "metricValue": 2, "metricValueFloat": 3}


def rec(desired: int, active: bool = True) -> Recommendation:
    return Recommendation(desired, desired, Direction.HOLD, Reason.STEADY, Reading.NORMAL,
                          active=active)


class Pools:
    """The live state the lead wires in: pool -> latest recommendation (None: not yet)."""

    def __init__(self) -> None:
        self.by_pool: dict[str, Recommendation | None] = {"llama": rec(4), "warming": None}

    def __call__(self, pool: str) -> Recommendation | None:
        return self.by_pool[pool]


@dataclass
class Keda:
    pools: Pools
    scaler: ExternalScaler
    channel: grpc.aio.Channel
    stub: pb_grpc.ExternalScalerStub


@pytest.fixture
async def keda() -> AsyncIterator[Keda]:
    """Our scaler on a real grpc.aio server; a client on the generated stubs, as KEDA's."""
    pools = Pools()
    scaler = ExternalScaler(pools, poll_interval_s=0.2)
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    add_to_server(scaler, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield Keda(pools, scaler, channel, pb_grpc.ExternalScalerStub(channel))
    await channel.close()
    await server.stop(grace=0)
    await asyncio.sleep(0.05)  # let cancelled handlers finish before the loop closes


def ref(pool: str | None = "llama") -> pb.ScaledObjectRef:
    meta = {"scalerAddress": "extproc.inference:9443"} | ({"pool": pool} if pool else {})
    return pb.ScaledObjectRef(name="vllm-llama", namespace="inference", scalerMetadata=meta)


async def test_keda_builds_an_hpa_metric_and_reads_desired_replicas(keda: Keda) -> None:
    pools, stub = keda.pools, keda.stub
    # KEDA: GetMetricSpec when it builds the HPA ...
    spec = (await stub.GetMetricSpec(ref())).metricSpecs
    assert [(s.metricName, s.targetSize, s.targetSizeFloat) for s in spec] == [
        (metric_name("llama"), 1, 1.0)]
    # ... then, every HPA sync, GetMetrics with that name (its own "s0-" prefix removed), then
    # IsActive; the HPA computes ceil(value / target) = the recommendation
    request = pb.GetMetricsRequest(scaledObjectRef=ref(), metricName=spec[0].metricName)
    values = (await stub.GetMetrics(request)).metricValues
    assert [(v.metricName, v.metricValue, v.metricValueFloat) for v in values] == [
        (metric_name("llama"), 4, 4.0)]
    assert (await stub.IsActive(ref())).result is True
    pools.by_pool["llama"] = rec(11)
    values = (await stub.GetMetrics(request)).metricValues
    assert values[0].metricValueFloat == 11.0


async def test_errors_keda_can_act_on(keda: Keda) -> None:
    stub = keda.stub
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.IsActive(ref(pool=None))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.GetMetricSpec(ref("nope"))
    assert err.value.code() is grpc.StatusCode.NOT_FOUND
    # a pool with no recommendation yet: no metric (the HPA holds), but active (no scale to 0)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=ref("warming"),
                                                   metricName=metric_name("warming")))
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    assert (await stub.IsActive(ref("warming"))).result is True


async def test_stream_is_active_sends_now_then_each_change(keda: Keda) -> None:
    pools, scaler, stub = keda.pools, keda.scaler, keda.stub
    stream = stub.StreamIsActive(ref())
    received: asyncio.Queue[bool] = asyncio.Queue()

    async def read() -> None:
        async for message in stream:
            received.put_nowait(message.result)

    reader = asyncio.create_task(read())
    try:
        assert await asyncio.wait_for(received.get(), 5) is True  # the state on open
        pools.by_pool["llama"] = rec(0, active=False)  # no notify: the poll (0.2 s) finds it
        assert await asyncio.wait_for(received.get(), 5) is False
        # Pushed at once, not at the next poll: with the poll a minute away, a change
        # that arrives within seconds came by the notify (no timing a loaded machine breaks).
        scaler.poll_interval_s = 60.0
        await asyncio.sleep(0.5)  # the stream's pending 0.2 s wait ends; the next is 60 s
        pools.by_pool["llama"] = rec(2, active=True)
        scaler.notify()
        assert await asyncio.wait_for(received.get(), 5) is True
        pools.by_pool["llama"] = rec(2, active=True)  # no change: nothing sent
        scaler.notify()
        await asyncio.sleep(0.3)
        assert received.empty()
    finally:
        stream.cancel()
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)


async def test_newer_keda_falls_back_when_stream_metric_spec_is_unimplemented(
        keda: Keda) -> None:
    # KEDA >= 2.17 also opens StreamMetricSpec and falls back to polling on UNIMPLEMENTED
    call = keda.channel.unary_stream("/externalscaler.ExternalScaler/StreamMetricSpec",
                                request_serializer=pb.ScaledObjectRef.SerializeToString,
                                response_deserializer=pb.GetMetricSpecResponse.FromString)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in call(ref()):
            pass
    assert err.value.code() is grpc.StatusCode.UNIMPLEMENTED
