"""Where ready capacity comes from: one small strategy per source.

``StaticCapacity`` reports the replicas configured for each pool. Sources that discover
replicas (Envoy's admin endpoint, Kubernetes EndpointSlices) implement the same one method.
Warming and draining replicas never count: a replica is capacity once it is ready.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from extproc.admission import Capacity
from extproc.config import Pool


class CapacitySource(Protocol):
    def capacity(self, pool: str) -> Capacity: ...


def model_of(pool: Pool, replicas: int) -> Capacity:
    return Capacity(
        replicas=replicas,
        max_running=pool.max_running,
        prefill_ms_per_token=pool.prefill_ms_per_token,
        itl_ms_at_1=pool.itl_ms_at_1,
        itl_ms_per_running=pool.itl_ms_per_running,
    )


class StaticCapacity:
    def __init__(self, pools: Iterable[Pool]) -> None:
        self._by_name = {p.name: model_of(p, p.replicas) for p in pools}

    def capacity(self, pool: str) -> Capacity:
        return self._by_name[pool]
