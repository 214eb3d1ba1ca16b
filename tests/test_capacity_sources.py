"""Discovered capacity: Envoy's admin endpoint (a real Envoy) and Kubernetes EndpointSlices
(recorded API documents served by a small fake API server), and the staleness rule."""

from __future__ import annotations

import asyncio
import json
import math
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from extproc.config import Pool
from extproc.errors import ConfigError
from extproc.fleet.capacity import (
    ApiServer,
    EnvoyAdminCapacity,
    Freshness,
    KubernetesCapacity,
    Replicas,
    StaticCapacity,
    endpoint_slices,
    envoy_hosts,
)
from extproc.fleet.engine import EngineModel
from extproc_dev.stack import LocalStack, free_port
from tests.conftest import pool

DATA = Path(__file__).parent / "data"
POOLS = [Pool(name="llama", engine=EngineModel(max_num_seqs=4))]


class Clock:
    """A hand-driven monotonic clock: staleness is read against it."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


async def until(predicate: Callable[[], bool], within: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not predicate():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def counts(r: Replicas) -> tuple[int, int, int, int]:
    return r.ready, r.starting, r.draining, r.unhealthy


# --- Envoy -----------------------------------------------------------------------------------

def test_envoy_host_states() -> None:
    doc = json.loads((DATA / "envoy-clusters.json").read_text())
    got = envoy_hosts(doc, "inference")
    assert got is not None
    # healthy x2 and one with no health status (UNKNOWN: Envoy routes to it) are ready; a new
    # host awaiting its first check is starting; DRAINING and pending removal are draining;
    # failing active checks, outlier-ejected and degraded are unhealthy
    assert counts(got) == (3, 1, 2, 3)
    assert got.addresses == ("10.4.0.10:8000", "10.4.0.11:8001", "10.4.0.18:8008")
    assert envoy_hosts(doc, "missing") is None


def set_health(url: str, healthy: bool) -> None:
    body = json.dumps({"healthy": healthy}).encode()
    req = urllib.request.Request(url + "/admin/health", data=body, method="POST",
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        assert resp.status == 200


@pytest.mark.integration
async def test_envoy_admin_follows_real_health_checks(tmp_path: Path) -> None:
    clock = Clock()
    with LocalStack(tmp_path, {"pools": [pool()]}, backends=2) as stack:
        source = EnvoyAdminCapacity(POOLS, f"http://127.0.0.1:{stack.admin_port}",
                                    interval_s=0.1, hold_s=10.0, floor=1, clock=clock)
        await source.start()
        try:
            assert counts(source.replicas("llama")) == (2, 0, 0, 0)
            assert source.capacity("llama").replicas == 2
            assert source.status("llama").freshness is Freshness.FRESH

            await asyncio.to_thread(set_health, stack.backend_url(1), False)
            await until(lambda: source.replicas("llama").ready == 1, within=15)
            assert counts(source.replicas("llama")) == (1, 0, 0, 1)
            assert source.replicas("llama").addresses == (
                f"127.0.0.1:{stack.backend_ports[0]}",)
            assert source.capacity("llama").replicas == 1

            await asyncio.to_thread(set_health, stack.backend_url(1), True)
            await until(lambda: source.replicas("llama").ready == 2, within=15)

            # Envoy goes away: the last value is held, then it falls to the floor
            stack.processes["envoy"].stop()
            await until(lambda: source.status("llama").freshness is Freshness.HELD)
            assert source.capacity("llama").replicas == 2
            assert source.status("llama").error is not None
            clock.t += 11.0
            status = source.status("llama")
            assert (status.freshness, status.replicas.ready) == (Freshness.FLOOR, 1)
            assert source.staleness("llama") >= 11.0
        finally:
            await source.close()


async def test_envoy_admin_never_seen_reports_the_floor() -> None:
    source = EnvoyAdminCapacity(POOLS, f"http://127.0.0.1:{free_port()}", floor={"llama": 3})
    await source.poll()
    status = source.status("llama")
    assert (status.freshness, status.replicas.ready, status.age_s) == (
        Freshness.FLOOR, 3, math.inf)
    assert source.capacity("llama").replicas == 3  # never 0, never "all"
    await source.close()


def test_static_capacity_is_unchanged() -> None:
    assert StaticCapacity([Pool(name="p", replicas=5)]).capacity("p").replicas == 5


# --- Kubernetes ------------------------------------------------------------------------------

def recorded(name: str) -> Any:
    return json.loads((DATA / "endpointslices" / name).read_text())


def recorded_events(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (DATA / "endpointslices" / name).read_text().splitlines()]


def test_endpoint_slice_counting() -> None:
    listed = recorded("list-1000.json")["items"]
    # two ready, one not yet ready (starting), one terminating (draining: never capacity,
    # even while it still serves its last requests)
    got = endpoint_slices(listed)
    assert counts(got) == (2, 1, 1, 0)
    assert got.addresses == ("10.4.0.11:8000", "10.4.1.12:8000")
    # a dual-stack Service lists every pod twice, once per address family: counted once
    events = recorded_events("watch-1000.jsonl")
    dual = [events[0]["object"], events[1]["object"], listed[1]]
    assert counts(endpoint_slices(dual)) == (3, 1, 1, 0)
    # absent conditions: the API says to read an unknown `ready` as ready
    assert endpoint_slices([{"endpoints": [{"addresses": ["10.0.0.1"]}]}]).ready == 1


class FakeApiServer:
    """Just enough of the Kubernetes API: list and watch EndpointSlices in one namespace."""

    def __init__(self) -> None:
        self.lists = [recorded("list-1000.json"), recorded("list-2000.json")]
        self.events: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()  # None: end stream
        self.requests: list[tuple[str, dict[str, str], str]] = []  # (kind, query, auth)
        self.watch_status = 200
        self.failing = False
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        assert request.match_info["ns"] == "inference"
        assert request.query["labelSelector"] == "kubernetes.io/service-name=vllm-llama"
        watching = request.query.get("watch") == "true"
        self.requests.append(("watch" if watching else "list", dict(request.query),
                              request.headers.get("Authorization", "")))
        if self.failing:
            return web.json_response({"kind": "Status", "code": 500}, status=500)
        if not watching:
            return web.json_response(self.lists.pop(0) if len(self.lists) > 1 else self.lists[0])
        if self.watch_status != 200:
            return web.json_response({"kind": "Status", "code": self.watch_status},
                                     status=self.watch_status)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        while (event := await self.events.get()) is not None:
            await response.write(json.dumps(event).encode() + b"\n")
        await response.write_eof()
        return response

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices",
                           self.handle)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"

    def kinds(self) -> list[str]:
        return [kind for kind, _, _ in self.requests]


@pytest.fixture
async def api() -> AsyncIterator[FakeApiServer]:
    server = FakeApiServer()
    await server.start()
    yield server
    server.events.put_nowait(None)
    assert server.runner is not None
    await server.runner.cleanup()


def kube(api: FakeApiServer, token: Path, clock: Callable[[], float] | None = None,
         **kw: Any) -> KubernetesCapacity:
    return KubernetesCapacity(POOLS, {"llama": "inference/vllm-llama"},
                              api=ApiServer(api.url, token_path=str(token), retry_s=0.05), **kw,
                              **({"clock": clock} if clock else {}))


async def test_kubernetes_list_then_watch(api: FakeApiServer, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("token-1\n")
    source = kube(api, token)
    await source.start()
    try:
        await until(lambda: api.kinds() == ["list", "watch"])
        assert counts(source.replicas("llama")) == (2, 1, 1, 0)
        watch = api.requests[1][1]
        assert (watch["resourceVersion"], watch["allowWatchBookmarks"]) == ("1000", "true")
        assert api.requests[0][2] == "Bearer token-1"
        assert source.status("llama").freshness is Freshness.FRESH
        assert source.staleness("llama") == 0.0  # a connected watch is current however old

        events = recorded_events("watch-1000.jsonl")
        api.events.put_nowait(events[0])  # MODIFIED: the starting pod became ready
        await until(lambda: counts(source.replicas("llama")) == (3, 0, 1, 0))
        api.events.put_nowait(events[1])  # ADDED: the IPv6 slice, plus a new pod warming up
        await until(lambda: counts(source.replicas("llama")) == (3, 1, 1, 0))
        api.events.put_nowait(events[2])  # DELETED: the terminating pod's slice is gone
        await until(lambda: counts(source.replicas("llama")) == (3, 1, 0, 0))
        assert source.capacity("llama").replicas == 3

        api.events.put_nowait(events[3])  # BOOKMARK: only a resourceVersion
        api.events.put_nowait(None)  # the watch times out normally: resume, no re-list
        await until(lambda: api.kinds() == ["list", "watch", "watch"])
        assert api.requests[2][1]["resourceVersion"] == "1010"

        token.write_text("token-2\n")  # projected tokens rotate: read on every request
        api.events.put_nowait(events[4])  # ERROR 410 Gone: list again, watch from there
        await until(lambda: api.kinds()[3:] == ["list", "watch"])
        await until(lambda: counts(source.replicas("llama")) == (4, 0, 0, 0))
        assert api.requests[4][1]["resourceVersion"] == "2000"
        assert api.requests[4][2] == "Bearer token-2"

        api.watch_status = 410  # the same, answered as an HTTP status
        api.events.put_nowait(None)
        await until(lambda: api.kinds()[5:7] == ["watch", "list"])
        await asyncio.sleep(0.3)  # 410 again and again: re-lists are paced, not a hot loop
        assert 3 <= source.lists <= 3 + 0.3 / 0.05 + 1
        api.watch_status = 200
        await until(lambda: api.kinds()[-1] == "watch" and api.requests[-1][1].get(
            "resourceVersion") == "2000")
        assert source.status("llama").freshness is Freshness.FRESH
    finally:
        await source.close()


async def test_kubernetes_source_lost_is_held_then_floored(api: FakeApiServer,
                                                           tmp_path: Path) -> None:
    clock = Clock()
    token = tmp_path / "token"
    token.write_text("t")
    source = kube(api, token, clock, hold_s=30.0, floor=1)
    await source.start()
    try:
        await until(lambda: source.replicas("llama").ready == 2)
        clock.t += 500  # however long a connected watch is quiet, it is current
        assert source.status("llama").freshness is Freshness.FRESH
        api.failing = True
        api.events.put_nowait(None)  # the watch ends, and the API server keeps failing
        await until(lambda: source.status("llama").freshness is Freshness.HELD)
        assert source.capacity("llama").replicas == 2  # the last value, for a while
        clock.t += 29
        assert source.status("llama").freshness is Freshness.HELD
        clock.t += 2
        status = source.status("llama")
        assert (status.freshness, status.replicas.ready) == (Freshness.FLOOR, 1)
        assert status.age_s == pytest.approx(31)
        assert "500" in (status.error or "")
        api.failing = False  # back: listed afresh (the second recorded list), watched, fresh
        await until(lambda: source.status("llama").freshness is Freshness.FRESH)
        assert source.capacity("llama").replicas == 4
    finally:
        await source.close()


def test_kubernetes_in_cluster_settings(tmp_path: Path) -> None:
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    source = KubernetesCapacity(POOLS, {"llama": "vllm-llama"},
                                api=ApiServer.in_cluster(env, namespace="ml"))
    assert source.api.url == "https://10.96.0.1:443"
    assert source.services == {"llama": ("ml", "vllm-llama")}
    v6 = KubernetesCapacity(POOLS, {"llama": "a/b"},
                            api=ApiServer.in_cluster({"KUBERNETES_SERVICE_HOST": "fd00::1"}))
    assert v6.api.url == "https://[fd00::1]:443"
    with pytest.raises(ConfigError, match="KUBERNETES_SERVICE_HOST"):
        ApiServer.in_cluster({})
    assert ApiServer("https://10.96.0.1:443/").url == "https://10.96.0.1:443"  # as given, less /
    with pytest.raises(ConfigError, match="unknown pool 'mistral'"):
        KubernetesCapacity(POOLS, {"mistral": "a/b"}, api=ApiServer("http://x"))
