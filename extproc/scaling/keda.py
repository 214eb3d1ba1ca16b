"""KEDA external scaler: each pool's replica recommendation, served over KEDA's gRPC interface.

A ScaledObject names the pool in its trigger's metadata (KEDA passes it as
``scalerMetadata``)::

    triggers:
      - type: external-push          # or `external` (polling only)
        metadata:
          scalerAddress: extproc.inference.svc:9443
          pool: llama

The metric. KEDA turns ``GetMetricSpec`` into an HPA External metric with an ``AverageValue``
target of ``targetSize`` (its default ``metricType``), and the HPA then computes

    desired = ceil(metricValue / targetSize)

We report ``metricValue = desired replicas`` with ``targetSize = 1``, so the HPA's arithmetic
reproduces our recommendation. The alternative, a load figure (say outstanding work) over a
per-replica target, would hand the sizing back to the HPA's proportional rule and lose what
the recommender adds: the asymmetric steps, counting replicas already starting, the failure
state, the cooldown. Two HPA behaviours still sit on top, and the docs say how to neutralise
them: its tolerance (no change while ``|desired / current - 1| <= 0.1``: set
``behavior.scaleUp/scaleDown.tolerance: 0`` where the cluster supports it) and its
stabilization windows (ours already stabilise; keep the HPA's short). Keep the ScaledObject's
min/max equal to the recommender's.

``IsActive`` is the recommendation's ``active`` flag (any demand, or a desired count above
zero): false lets KEDA scale the target to zero when its ``minReplicaCount`` is 0.
``StreamIsActive`` sends the current flag when KEDA opens the stream and again whenever it
flips; ``notify()`` (called after publishing new recommendations) wakes the streams at once,
and they also re-check every ``poll_interval_s``.

Errors, as KEDA sees them: a ref without ``pool`` is INVALID_ARGUMENT; a pool the callable
does not know (``KeyError``) is NOT_FOUND; a known pool with no recommendation yet (``None``)
is UNAVAILABLE for metrics (the HPA keeps the current count rather than act on a guess) and
active for ``IsActive`` (never scale to zero for want of data).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import grpc

from extproc._proto import externalscaler_pb2 as pb
from extproc._proto import externalscaler_pb2_grpc as pb_grpc
from extproc.scaling.autoscale import Recommendation

SERVICE_NAME = "externalscaler.ExternalScaler"
POOL_KEY = "pool"

RecommendationFor = Callable[[str], Recommendation | None]  # raises KeyError: unknown pool


def metric_name(pool: str) -> str:
    return f"extproc-{pool}-desired-replicas"


class ExternalScaler(pb_grpc.ExternalScalerServicer):  # type: ignore[misc]
    def __init__(self, recommendation: RecommendationFor, *,
                 poll_interval_s: float = 1.0) -> None:
        self._recommendation = recommendation
        self.poll_interval_s = poll_interval_s
        self._changed = asyncio.Event()

    def notify(self) -> None:
        """Wake every StreamIsActive to re-read its pool (call on the event loop)."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def _lookup(self, ref: pb.ScaledObjectRef,
                      context: grpc.aio.ServicerContext) -> tuple[str, Recommendation | None]:
        pool = ref.scalerMetadata.get(POOL_KEY, "")
        if not pool:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"trigger metadata must name the pool: {POOL_KEY}: <name>")
        try:
            return pool, self._recommendation(pool)
        except KeyError:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no pool named {pool!r}")
            raise  # abort raises; this line only tells the type checker

    @staticmethod
    def _active(rec: Recommendation | None) -> bool:
        return True if rec is None else rec.active

    async def IsActive(self, request: pb.ScaledObjectRef,
                       context: grpc.aio.ServicerContext) -> pb.IsActiveResponse:
        _, rec = await self._lookup(request, context)
        return pb.IsActiveResponse(result=self._active(rec))

    async def StreamIsActive(self, request: pb.ScaledObjectRef,
                             context: grpc.aio.ServicerContext
                             ) -> AsyncIterator[pb.IsActiveResponse]:
        _, rec = await self._lookup(request, context)
        sent = self._active(rec)
        yield pb.IsActiveResponse(result=sent)
        while True:
            changed = self._changed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), self.poll_interval_s)
            _, rec = await self._lookup(request, context)
            if self._active(rec) != sent:
                sent = self._active(rec)
                yield pb.IsActiveResponse(result=sent)

    async def GetMetricSpec(self, request: pb.ScaledObjectRef,
                            context: grpc.aio.ServicerContext) -> pb.GetMetricSpecResponse:
        pool, _ = await self._lookup(request, context)
        spec = pb.MetricSpec(metricName=metric_name(pool), targetSize=1, targetSizeFloat=1.0)
        return pb.GetMetricSpecResponse(metricSpecs=[spec])

    async def GetMetrics(self, request: pb.GetMetricsRequest,
                         context: grpc.aio.ServicerContext) -> pb.GetMetricsResponse:
        pool, rec = await self._lookup(request.scaledObjectRef, context)
        if rec is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"no recommendation for pool {pool!r} yet")
            raise AssertionError("unreachable")  # abort raises
        value = pb.MetricValue(metricName=request.metricName or metric_name(pool),
                               metricValue=rec.desired, metricValueFloat=float(rec.desired))
        return pb.GetMetricsResponse(metricValues=[value])


def add_to_server(scaler: ExternalScaler, server: grpc.aio.Server) -> None:
    """Register the scaler on a grpc.aio server (the ext_proc server's or one of its own)."""
    pb_grpc.add_ExternalScalerServicer_to_server(scaler, server)
