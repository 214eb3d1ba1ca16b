"""Where ready capacity comes from: one small strategy per source.

``StaticCapacity`` reports the replicas configured for each pool. Two sources discover them
and implement the same one method, ``capacity(pool)``:

- ``EnvoyAdminCapacity``: healthy hosts of the pool's upstream cluster, polled from the local
  Envoy's admin endpoint (no cluster permissions needed in the sidecar);
- ``KubernetesCapacity``: ready, not-terminating endpoints of the pool's Service, from its
  EndpointSlices, followed with a watch.

Warming and draining replicas never count: a replica is capacity once it is ready. Both
report ready, starting and draining separately (``replicas(pool)``) and say how stale they are
(``status(pool)``); what a stale source reports is the rule written above ``Freshness``.

Length: past the house's ~400 lines with three sources behind one method; Kubernetes'
(list, watch, reconnect, EndpointSlices) is a third of it and the first to get a module of its
own if it grows.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import ssl
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp

from extproc.decision.admission import Capacity
from extproc.errors import ConfigError

if TYPE_CHECKING:
    from extproc.config import Pool

log = logging.getLogger(__name__)


class CapacitySource(Protocol):
    """Ready capacity per pool. ``start``/``close`` bracket a source's background work;
    ``replicas`` details ready/starting/draining; ``staleness`` is the seconds since the
    source was last known good (``inf``: never)."""

    def capacity(self, pool: str) -> Capacity: ...

    def replicas(self, pool: str) -> Replicas: ...

    def staleness(self, pool: str) -> float: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...


async def cancel_all(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel background tasks and wait until each has ended."""
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    tasks.clear()


def model_of(pool: Pool, replicas: int) -> Capacity:
    """The pool's ``replicas`` ready replicas, each its ``engine``."""
    return Capacity(replicas=replicas, engine=pool.engine, wait_quantile=pool.wait_quantile)


class StaticCapacity:
    def __init__(self, pools: Iterable[Pool]) -> None:
        self._by_name = {p.name: model_of(p, p.replicas) for p in pools}

    def capacity(self, pool: str) -> Capacity:
        return self._by_name[pool]

    def replicas(self, pool: str) -> Replicas:
        return Replicas(ready=self._by_name[pool].replicas)

    def staleness(self, pool: str) -> float:
        return 0.0  # configuration never goes stale

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass


# --- discovered capacity -------------------------------------------------------------------
#
# Both discovering sources share one rule for a source that stops answering, applied per pool:
#
#     fresh       the last observation is current              -> what it saw
#     held        it failed, but less than ``hold_s`` ago      -> the last value seen
#     floor       failing for longer, or never seen            -> min(last ready, floor),
#                                                                 or ``floor`` if never seen
#
# Never silently 0 (every request would be refused) nor "all configured replicas" (the very
# overload admission exists to prevent): the floor is the capacity an operator is willing to
# assume when nothing can be seen (say the Deployment's minimum), and a stale source never
# reports more than it last saw. ``status(pool)`` exposes the state and the age for metrics.


class Freshness(StrEnum):
    FRESH = "fresh"
    HELD = "held"
    FLOOR = "floor"


@dataclass(frozen=True)
class Replicas:
    """Replicas of one pool as a source sees them; only ``ready`` is capacity."""

    ready: int
    starting: int = 0  # exist but not ready yet (warming, waiting for a first health check)
    draining: int = 0  # leaving: terminating pods, hosts Envoy is draining
    unhealthy: int = 0  # failing health checks, ejected, degraded
    addresses: tuple[str, ...] = ()  # "host:port" of the ready ones (for scraping engines)


@dataclass(frozen=True)
class SourceStatus:
    replicas: Replicas  # what ``capacity`` uses now
    freshness: Freshness
    age_s: float  # since the source was last known good (0 while a watch is connected)
    error: str | None = None  # the last failure, for logs (never a metric label)


class _Held:
    """The last good observation of one pool and the rule above."""

    def __init__(self, hold_s: float, floor: int) -> None:
        self.hold_s, self.floor = hold_s, floor
        self.last: Replicas | None = None
        self.good_at: float | None = None
        self.live = False  # a watch is connected: the value is current however old
        self.error: str | None = None

    def observe(self, replicas: Replicas, now: float, *, live: bool = False) -> None:
        self.last, self.good_at, self.live, self.error = replicas, now, live, None

    def lost(self, now: float, error: str) -> None:
        if self.live:
            self.good_at = now  # the watch was current until this moment
        self.live, self.error = False, error

    def status(self, now: float) -> SourceStatus:
        if self.last is None or self.good_at is None:
            return SourceStatus(Replicas(ready=self.floor), Freshness.FLOOR, math.inf,
                                self.error)
        age = 0.0 if self.live else max(0.0, now - self.good_at)
        if self.live or age <= self.hold_s:
            freshness = Freshness.FRESH if self.error is None else Freshness.HELD
            return SourceStatus(self.last, freshness, age, self.error)
        floored = Replicas(ready=min(self.last.ready, self.floor))
        return SourceStatus(floored, Freshness.FLOOR, age, self.error)


class _Discovered:
    """What both discovering sources share: per-pool state, ``capacity``, a background task."""

    def __init__(self, pools: Iterable[Pool], *, hold_s: float, floor: int | Mapping[str, int],
                 clock: Callable[[], float]) -> None:
        self._pools = {p.name: p for p in pools}
        floors = floor if isinstance(floor, Mapping) else {n: floor for n in self._pools}
        self._held = {n: _Held(hold_s, floors.get(n, 1)) for n in self._pools}
        self._clock = clock
        self._tasks: list[asyncio.Task[None]] = []

    def capacity(self, pool: str) -> Capacity:
        return model_of(self._pools[pool], self.replicas(pool).ready)

    def replicas(self, pool: str) -> Replicas:
        return self.status(pool).replicas

    def status(self, pool: str) -> SourceStatus:
        return self._held[pool].status(self._clock())

    def staleness(self, pool: str) -> float:
        """Seconds since the pool's source was last known good (``inf``: never)."""
        return self.status(pool).age_s

    async def close(self) -> None:
        await cancel_all(self._tasks)


def envoy_hosts(doc: Mapping[str, Any], cluster: str) -> Replicas | None:
    """Count one cluster's hosts in Envoy's ``/clusters?format=json``; None if it is absent.

    A host is draining when EDS says DRAINING or it waits for removal; starting while its
    first active health check is pending; unhealthy when it fails active health checks (or
    timed out, or was excluded by an immediate failure), is ejected as an outlier, or is
    degraded (Envoy routes to degraded hosts only when nothing healthy is left). Anything
    else is ready: EDS HEALTHY, or UNKNOWN, which Envoy itself treats as healthy.
    """
    for status in doc.get("cluster_statuses", []):
        if status.get("name") != cluster:
            continue
        ready: list[str] = []
        starting = draining = unhealthy = 0
        for host in status.get("host_statuses", []):
            health = host.get("health_status", {})
            eds = health.get("eds_health_status", "UNKNOWN")
            if eds == "DRAINING" or health.get("pending_dynamic_removal"):
                draining += 1
            elif health.get("pending_active_hc"):
                starting += 1
            elif eds in ("UNHEALTHY", "TIMEOUT", "DEGRADED") or any(health.get(flag) for flag in (
                    "failed_active_health_check", "failed_outlier_check",
                    "failed_active_degraded_check", "excluded_via_immediate_hc_fail",
                    "active_hc_timeout")):
                unhealthy += 1
            else:
                sock = host.get("address", {}).get("socket_address", {})
                ready.append(f"{sock.get('address', '')}:{sock.get('port_value', 0)}")
        return Replicas(len(ready), starting, draining, unhealthy, tuple(ready))
    return None


class EnvoyAdminCapacity(_Discovered):
    """Ready hosts of each pool's upstream cluster, polled from the local Envoy's admin API.

    The sidecar needs no cluster permissions: the Envoy in the same pod already health-checks
    the replicas. ``clusters`` maps a pool to its Envoy cluster (default: every pool to
    ``inference``, the cluster ``envoyconf`` renders). Call ``start()`` once on the event loop
    (it polls every ``interval_s``), ``close()`` on shutdown; ``poll()`` is one round.
    """

    def __init__(self, pools: Iterable[Pool], admin_url: str, *,
                 clusters: Mapping[str, str] | None = None, interval_s: float = 1.0,
                 timeout_s: float = 0.5, hold_s: float = 10.0,
                 floor: int | Mapping[str, int] = 1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(pools, hold_s=hold_s, floor=floor, clock=clock)
        self.url = admin_url.rstrip("/") + "/clusters?format=json"
        self.clusters = {n: (clusters or {}).get(n, "inference") for n in self._pools}
        self.interval_s = interval_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=self._timeout)
        await self.poll()
        self._tasks.append(asyncio.create_task(self._loop()))

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.poll()

    async def poll(self) -> None:
        """Fetch the admin document once and update every pool; failures are recorded."""
        session = self._session or aiohttp.ClientSession(timeout=self._timeout)
        try:
            async with session.get(self.url) as resp:
                resp.raise_for_status()
                doc = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            self._failed(f"envoy admin {self.url}: {exc!r}")
            return
        finally:
            if session is not self._session:
                await session.close()
        now = self._clock()
        for pool, cluster in self.clusters.items():
            found = envoy_hosts(doc, cluster) if isinstance(doc, dict) else None
            if found is None:
                self._held[pool].lost(now, f"cluster {cluster!r} not in envoy admin")
            else:
                self._held[pool].observe(found, now)

    def _failed(self, error: str) -> None:
        now = self._clock()
        if all(held.error is None for held in self._held.values()):
            log.warning("capacity source failing: %s", error)
        for held in self._held.values():
            held.lost(now, error)

    async def close(self) -> None:
        await super().close()
        if self._session is not None:
            await self._session.close()
            self._session = None


def endpoint_slices(slices: Iterable[Mapping[str, Any]]) -> Replicas:
    """Count the endpoints of a Service's EndpointSlices.

    Ready: ``conditions.ready`` true (or absent, which the API says to read as ready) and not
    ``terminating``; draining: terminating; starting: neither (a pod that is not ready yet).
    An endpoint listed twice (dual-stack Services keep one slice per address family) counts
    once, keyed by its target pod.
    """
    seen: set[str] = set()
    ready: list[str] = []
    starting = draining = 0
    for doc in sorted(slices, key=lambda s: str(s.get("metadata", {}).get("name", ""))):
        ports = doc.get("ports") or []
        port = ports[0].get("port") if ports and isinstance(ports[0], Mapping) else None
        for ep in doc.get("endpoints") or []:
            ref = ep.get("targetRef") or {}
            addresses = ep.get("addresses") or []
            if ref:
                key = ref.get("uid") or f"{ref.get('namespace')}/{ref.get('name')}"
            else:
                key = addresses[0] if addresses else ""
            if not key or key in seen:
                continue
            seen.add(key)
            cond = ep.get("conditions") or {}
            if cond.get("terminating") is True:
                draining += 1
            elif cond.get("ready", True) is not False:
                host = addresses[0] if addresses else ""
                host = f"[{host}]" if ":" in host else host
                ready.append(f"{host}:{port}" if port is not None else host)
            else:
                starting += 1
    return Replicas(len(ready), starting, draining, 0, tuple(ready))


class _Gone(Exception):
    """The watch's resourceVersion is too old (HTTP 410): list again."""


SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


@dataclass(frozen=True)
class ApiServer:
    """How to reach the Kubernetes API, and how patiently: its address, the bearer token's
    file (re-read on every request: projected tokens rotate) and the CA's, the namespace of
    Services named without one (None: the pod's own, from its service account), a request's
    timeout, a watch's, and the pause before a failed list or watch is tried again."""

    url: str
    token_path: str = f"{SERVICE_ACCOUNT}/token"
    ca_path: str = f"{SERVICE_ACCOUNT}/ca.crt"
    namespace: str | None = None
    timeout_s: float = 5.0
    watch_timeout_s: int = 300
    retry_s: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", self.url.rstrip("/"))  # paths are appended to it

    @classmethod
    def in_cluster(cls, environ: Mapping[str, str] = os.environ, **settings: Any) -> ApiServer:
        """The API as a pod sees it: ``KUBERNETES_SERVICE_HOST``/``_PORT``."""
        host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get(
            "KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise ConfigError(["capacity.kubernetes: not in a cluster"
                               " (KUBERNETES_SERVICE_HOST unset): the EndpointSlices source"
                               " reads the API a pod sees"])
        url = f"https://{host}:{port}" if ":" not in host else f"https://[{host}]:{port}"
        return cls(url, **settings)



class KubernetesCapacity(_Discovered):
    """Ready endpoints of each pool's Service, from its EndpointSlices, kept current by a watch.

    Per Service: list the slices (label ``kubernetes.io/service-name``), then watch from the
    list's resourceVersion (``watch=true``, bookmarks on); each event (ADDED, MODIFIED,
    DELETED) updates the set and the count. A watch that times out normally resumes from the
    last resourceVersion seen; a 410 Gone (as a status or an ERROR event) lists again; any
    other failure marks the pool's source failing (see the staleness rule above) and retries
    after ``ApiServer.retry_s``. While the watch is connected the count is current, however old.

    In the cluster the API is the pod's (``ApiServer.in_cluster``: the address from
    ``KUBERNETES_SERVICE_HOST``/``_PORT``, the bearer token and CA from the service account's
    mount). RBAC: ``get``, ``list`` and ``watch`` on ``endpointslices`` in the
    discovery.k8s.io group, in the Services' namespaces. ``services`` maps a pool to
    ``"namespace/name"`` or ``"name"`` (the pod's own namespace).
    """

    def __init__(self, pools: Iterable[Pool], services: Mapping[str, str], *,
                 api: ApiServer | None = None, hold_s: float = 30.0,
                 floor: int | Mapping[str, int] = 1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(pools, hold_s=hold_s, floor=floor, clock=clock)
        self.api = api = api if api is not None else ApiServer.in_cluster()
        unknown = sorted(set(services) - set(self._pools))
        if unknown:
            raise ConfigError([f"capacity.kubernetes.services: unknown pool {n!r}"
                               for n in unknown])
        namespace = api.namespace
        if namespace is None and any("/" not in s for s in services.values()):
            namespace = _read(f"{SERVICE_ACCOUNT}/namespace") or "default"
        self.services = {p: tuple(s.split("/", 1)) if "/" in s else (namespace or "default", s)
                         for p, s in services.items()}
        self._session: aiohttp.ClientSession | None = None
        self.lists = 0  # how many times a full list was made (a re-list follows a 410)
        self._events = {p: 0 for p in self.services}  # watch events since the last list

    async def start(self) -> None:
        ssl_ctx: ssl.SSLContext | bool = False
        if self.api.url.startswith("https:"):
            ssl_ctx = ssl.create_default_context(cafile=self.api.ca_path)
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ssl_ctx))
        for pool, (ns, name) in self.services.items():
            self._tasks.append(asyncio.create_task(self._follow(pool, ns, name)))

    async def close(self) -> None:
        await super().close()
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _headers(self) -> dict[str, str]:
        token = _read(self.api.token_path)
        return {"Accept": "application/json",
                **({"Authorization": f"Bearer {token}"} if token else {})}

    def _path(self, ns: str) -> str:
        return f"{self.api.url}/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"

    async def _follow(self, pool: str, ns: str, name: str) -> None:
        """List, then watch, forever. A 410 lists again at once, unless the watch before it
        brought no event (then it pauses ``retry_s``, never a hot loop); other failures mark
        the source failing and retry after ``retry_s``."""
        held = self._held[pool]
        while True:
            self._events[pool] = 0
            try:
                slices, version = await self._list(ns, name)
                held.observe(endpoint_slices(slices.values()), self._clock(), live=True)
                while True:
                    version = await self._watch(pool, ns, name, slices, version)
            except _Gone:
                log.info("endpointslices of %s/%s: resourceVersion expired, listing again", ns,
                         name)
                if self._events[pool]:
                    continue
            except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as exc:
                if held.error is None:
                    log.warning("endpointslices of %s/%s: %r", ns, name, exc)
                held.lost(self._clock(), f"endpointslices {ns}/{name}: {exc!r}")
            await asyncio.sleep(self.api.retry_s)

    async def _list(self, ns: str, name: str) -> tuple[dict[str, Mapping[str, Any]], str]:
        assert self._session is not None
        self.lists += 1
        params = {"labelSelector": f"kubernetes.io/service-name={name}"}
        timeout = aiohttp.ClientTimeout(total=self.api.timeout_s)
        async with self._session.get(self._path(ns), params=params, headers=self._headers(),
                                     timeout=timeout) as resp:
            if resp.status == 410:
                raise _Gone()
            resp.raise_for_status()
            doc = await resp.json(content_type=None)
        items = {item["metadata"]["name"]: item for item in doc.get("items") or []}
        return items, str(doc["metadata"]["resourceVersion"])

    async def _watch(self, pool: str, ns: str, name: str, slices: dict[str, Mapping[str, Any]],
                     version: str) -> str:
        """Follow one watch request to its end; return the last resourceVersion seen."""
        assert self._session is not None
        params = {"labelSelector": f"kubernetes.io/service-name={name}", "watch": "true",
                  "resourceVersion": version, "allowWatchBookmarks": "true",
                  "timeoutSeconds": str(self.api.watch_timeout_s)}
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.api.timeout_s,
                                        sock_read=self.api.watch_timeout_s + 30)
        held = self._held[pool]
        async with self._session.get(self._path(ns), params=params, headers=self._headers(),
                                     timeout=timeout) as resp:
            if resp.status == 410:
                raise _Gone()
            resp.raise_for_status()
            held.observe(endpoint_slices(slices.values()), self._clock(), live=True)
            buffer = b""
            async for chunk in resp.content.iter_any():
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line.strip():
                        self._events[pool] += 1
                        version = self._apply(json.loads(line), slices, version)
                        held.observe(endpoint_slices(slices.values()), self._clock(), live=True)
        return version

    @staticmethod
    def _apply(event: Mapping[str, Any], slices: dict[str, Mapping[str, Any]],
               version: str) -> str:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise _Gone()
            raise ValueError(f"watch error: {obj.get('reason')}: {obj.get('message')}")
        meta = obj.get("metadata") or {}
        if kind in ("ADDED", "MODIFIED"):
            slices[meta["name"]] = obj
        elif kind == "DELETED":
            slices.pop(meta.get("name", ""), None)
        return str(meta.get("resourceVersion") or version)  # BOOKMARK carries only this


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return None
