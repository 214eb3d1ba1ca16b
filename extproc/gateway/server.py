"""The gRPC adapter: Envoy's ext_proc stream in, ``Gate`` calls, Envoy answers out.

Envoy opens one stream per HTTP request and (with every response phase skipped) keeps it open
until the request has finished, so the stream's end is the request's end: the ledger entry is
released in ``finally`` whether the stream ends cleanly, is cancelled (client gone) or fails.

Phases: request headers are sent, except on the one-trip route (``extproc.gateway.envoyconf``): an
admission POST whose headers condemn nothing sends its body alone, with the headers we read as
attributes (``extproc.gateway.request.headers_from_attributes``), and they are checked there as the
headers phase would (``_condemned``). A path not configured for admission is answered with
a mode override that skips its body (it passes untouched). For admission paths the body comes
BUFFERED_PARTIAL: Envoy buffers up to its limit (set just above ``max_body_bytes``) and sends
what it has; a body that did not end within the limit, or a ``content-length`` over the cap,
gets our 413 JSON instead of Envoy's plain-text error.

Health: the process serves ``""`` and the ext_proc service name while it runs, and turns both
NOT_SERVING when it drains; Envoy health-checks ``""`` on every processor
(``extproc.gateway.envoyconf``) and stops sending streams to one that fails or drains, and
``/ready`` on the metrics listener says the same over HTTP (200 or 503) for probes that cannot reach
gRPC. The ledger has a service name of its own, ``extproc.ledger``: SERVING while the ledger answers
its probe (every quarter second) and holds this gateway's entries (after an outage, the probe
reconciles first: ``Leases.probe``), NOT_SERVING while it does not. The processor keeps answering
either way, by the ledger's fault policy, so Envoy never loses its processor to a Redis outage; an
operator who wants pods out of rotation while Redis is away (fail-closed deployments) probes
``extproc.ledger``. Starting without Redis is not an error: the process serves, reports the
ledger down and recovers on its own.

Listener: ``listen`` is HOST:PORT or ``unix:PATH``; with a ``tls`` section it serves mutual
TLS only (``extproc.gateway.tls``: clients must present a certificate the configured CA signed; the
files are re-read when they change). Tenant: read once per stream, from the request headers
message, only from what Envoy vouches for (``extproc.gateway.tenant``), and passed to every verdict.

Shedding: when the processor itself is the bottleneck, its queue is invisible (streams wait in
gRPC's buffers and the event loop, not in anything we count) and past Envoy's
``message_timeout`` (2 s) Envoy answers 504 on its own while we go on working for streams it
gave up on. The wait shows per request, though: from our answer to its headers to its body
reaching us is one trip through that queue (a fraction of a millisecond when idle). One
request's wait also holds its client's upload time (a large body on a slow link), so the
signal is the median of the last ``Delay.SIZE`` requests' waits (one trip: from the
request's start, Envoy's ``request.time``, to its body reaching us): while it is over
``shed_wait_ms``, bodies get 429 ``processor_overloaded`` (the Retry-After minimum) at once,
unparsed. A refusal costs a small fraction of a decision, so the queue drains, the waits fall,
shedding stops, and the answers stay fast. Requests are refused then without asking whether the GPUs
have room; that is the honest answer (we cannot decide in time). More processor capacity is
``serve --workers N`` or more gateway replicas. The waits are ``extproc_processor_wait_seconds``.

Drain (SIGTERM): health turns NOT_SERVING at once; new streams are still served (Envoy in the
same pod is draining too, and refusing them would turn into 5xx), until no stream has been
open or started for ``DRAIN_IDLE_S`` (and 20 samples in a row, so a stalled event loop, with
streams waiting to be dispatched, never looks quiet) or ``drain_grace_s`` has passed; then it
exits. A sample counts streams started since the last one, not only those open at the
instant: a stream lives a few milliseconds, so at 40 requests a second most instants see
none open, and 20 such instants in a row once ended a drain with traffic still flowing.

Length: past the house's ~400 lines with the stream adapter (``Processor``) and the process
around it (``Service``: listeners, health, metrics endpoint, sweeper, heartbeat, drain, and the
builders of the gate's collaborators); the next split is ``Service`` and its builders.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import signal
import statistics
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from datetime import datetime
from typing import TYPE_CHECKING

import grpc
from aiohttp import web
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.accesslog.v3 import als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from extproc.config import Config, ContentEncoding, Route
from extproc.errors import BodyTooLarge, LedgerUnavailable, RequestError
from extproc.fleet.capacity import (
    CapacitySource,
    EnvoyAdminCapacity,
    KubernetesCapacity,
    StaticCapacity,
)
from extproc.fleet.enginestats import DESTINATION_KEY, DESTINATION_NAMESPACE, EngineStats, Targets
from extproc.gateway import encoding, responses
from extproc.gateway.accesslog import ClientsWhoLeft
from extproc.gateway.gate import Gate
from extproc.gateway.leases import HEARTBEATS_PER_LEASE
from extproc.gateway.request import (
    ATTRIBUTES_KEY,
    REQUEST_TIME,
    check_content_type,
    forwarded_headers,
    headers_from_attributes,
)
from extproc.gateway.retry import retry_delay_ms
from extproc.gateway.tenant import Tenant, Tenants
from extproc.gateway.tls import ServerCertificates
from extproc.ledger.memory import MemoryLedger
from extproc.ledger.redis import RedisLedger
from extproc.observability.metrics import Metrics
from extproc.observability.telemetry import Tracing
from extproc.scaling.control import Control
from extproc.scaling.keda import ExternalScaler
from extproc.scaling.keda import add_to_server as add_scaler

if TYPE_CHECKING:
    from extproc.gateway.verdict import Ticket, Verdict
    from extproc.ledger import Ledger

log = logging.getLogger(__name__)

SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"
LEDGER_SERVICE = "extproc.ledger"
LEDGER_PROBE_S = 0.25
DRAIN_IDLE_S = 2.0
MAX_DESTINATION_CHARS = 256  # a host:port is far shorter: anything longer is cut, not kept


def build_ledger(config: Config, metrics: Metrics) -> Ledger:
    """The configured ledger; nothing is connected yet (a missing Redis is not fatal)."""
    if config.ledger.kind == "redis":
        return RedisLedger.from_config(config.ledger, [p.name for p in config.pools],
                                       on_breaker=metrics.ledger_breaker)
    return MemoryLedger()
_SKIP_BODY = processing_mode_pb2.ProcessingMode(
    request_body_mode=processing_mode_pb2.ProcessingMode.NONE)


def header_map(headers: pb.HttpHeaders) -> dict[str, str]:
    """Envoy sends header values as raw bytes; names arrive lower-cased."""
    return {h.key: h.raw_value.decode("latin-1") if h.raw_value else h.value
            for h in headers.headers.headers}


class Delay:
    """The median of the last ``size`` waits: the processor's own queueing delay."""

    SIZE = 15

    def __init__(self, shed_wait_s: float, size: int = SIZE) -> None:
        self.shed_wait_s = shed_wait_s
        self._waits: deque[float] = deque([0.0] * size, maxlen=size)

    def add(self, wait_s: float) -> None:
        self._waits.append(wait_s)

    @property
    def behind(self) -> bool:
        return 0 < self.shed_wait_s < statistics.median(self._waits)


class Processor(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, gate: Gate, rng: random.Random | None = None) -> None:
        self.gate = gate
        self.config = gate.config
        self.rng = rng or random.Random()
        self.open_streams = 0
        self.streams_started = 0  # ever: a drain sample sees streams that came and went
        self.delay = Delay(self.config.shed_wait_ms / 1000.0)
        self.tenants = Tenants(gate.config.tenant)
        self.header_names = forwarded_headers(self.config)  # what one trip's attributes hold
        self._warned_no_headers = False

    async def Process(
        self, requests: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ProcessingResponse]:
        self.open_streams += 1
        self.streams_started += 1
        ticket: Ticket | None = None
        decided = False  # one decision per stream: a request phase repeated after it continues
        deciding = False  # a body's decision is under way
        completed = False
        try:
            headers: Mapping[str, str] | None = None  # None: none came (one trip)
            tenant: Tenant | None = None
            destination: str | None = None  # the replica an endpoint picker chose
            answered = time.monotonic()  # when we last answered Envoy
            async for message in requests:
                phase = message.WhichOneof("request")
                if phase == "request_headers" and not decided:
                    headers = header_map(message.request_headers)
                    tenant = self._tenant(message, headers)
                    destination = destination_of(message)
                    answer, verdict = await self._on_headers(message.request_headers, headers,
                                                             tenant=tenant)
                elif phase == "request_body" and not decided:
                    one_trip = headers is None
                    if headers is None:  # one trip: the headers came as the body's attributes
                        headers, waited = self._attributes(message)
                        tenant = self._tenant(message, headers)
                    else:
                        waited = time.monotonic() - answered
                    destination = destination_of(message) or destination
                    self.delay.add(waited)
                    self.gate.metrics.processor_wait.observe(waited)
                    trace = _trace_context(context) if self.gate.tracing.enabled else {}
                    deciding = True
                    # A held request (extproc.decision.defer) extends Envoy's message timeout for
                    # its hold while its decision waits.
                    holds: asyncio.Queue[float] = asyncio.Queue()
                    body = asyncio.ensure_future(self._on_body(
                        message.request_body, headers, trace, tenant=tenant,
                        one_trip=one_trip, on_hold=holds.put_nowait, destination=destination))
                    hold: asyncio.Future[float] | None = None
                    try:
                        while not body.done():
                            hold = asyncio.ensure_future(holds.get())
                            await asyncio.wait((body, hold), return_when=asyncio.FIRST_COMPLETED)
                            if hold.done():
                                yield responses.extend_timeout(hold.result())
                    finally:
                        if hold is not None:
                            hold.cancel()
                        if not body.done():  # the stream went away while it was held
                            body.cancel()
                            with contextlib.suppress(asyncio.CancelledError):
                                await body
                        elif not body.cancelled() and body.exception() is None:
                            ticket = _ticket(body.result()[1])  # settled below, however
                    answer, verdict = body.result()
                    deciding = False
                else:
                    # a phase we did not ask for, or a request phase repeated after the
                    # decision: continue, so a misconfigured Envoy never hangs a request
                    answer, verdict = responses.continue_phase(phase), None
                if verdict is not None:
                    ticket, decided = verdict.ticket, True
                yield answer
                answered = time.monotonic()
                if answer.HasField("immediate_response"):
                    return
            completed = True  # Envoy closed the stream cleanly: the request finished
        finally:
            self.open_streams -= 1
            if deciding:  # Envoy (or the client) gave up before our answer
                self.gate.metrics.fallthroughs.labels("too_late").inc()
            if ticket is not None:
                await self.gate.settle(ticket, completed)

    def _tenant(self, message: pb.ProcessingRequest, headers: Mapping[str, str]
                ) -> Tenant | None:
        """Who is charged: only from the metadata Envoy forwarded or a header Envoy set
        (extproc.gateway.tenant); every copy of the header is passed, as Envoy sent it (one trip:
        the copies come joined by commas, which reads as ambiguous, as two copies do)."""
        if not self.tenants.enabled:
            return None
        pairs = ([(h.key, h.raw_value.decode("latin-1") if h.raw_value else h.value)
                  for h in message.request_headers.headers.headers]
                 if message.HasField("request_headers") else list(headers.items()))
        return self.tenants.resolve(message.metadata_context.filter_metadata, pairs)

    def _attributes(self, message: pb.ProcessingRequest) -> tuple[dict[str, str], float]:
        """One trip: the headers the body's attributes carry, and how long the request
        waited since it began (``request.time``; the processor's queue, module docstring)."""
        if ATTRIBUTES_KEY not in message.attributes:
            # Neither headers nor the attributes that carry them: an Envoy configuration
            # that skips the headers phase without sending them (not one envoy-config
            # renders). Nothing says what the request is, so it passes undecided: counted,
            # and said once.
            self.gate.metrics.fallthroughs.labels("no_headers").inc()
            if not self._warned_no_headers:
                self._warned_no_headers = True
                log.warning("a request body came without its headers or the attributes that"
                            " carry them: passed without a decision (is Envoy's configuration"
                            " rendered by `extproc envoy-config`?)")
            return {}, 0.0
        attributes = message.attributes[ATTRIBUTES_KEY]
        headers = headers_from_attributes(attributes, self.header_names)
        began = (attributes.fields[REQUEST_TIME].string_value
                 if REQUEST_TIME in attributes.fields else "")
        try:
            waited = time.time() - datetime.fromisoformat(began).timestamp()
        except ValueError:
            waited = 0.0
        return headers, max(0.0, waited)

    async def _on_headers(
        self, message: pb.HttpHeaders, headers: Mapping[str, str], *,
        tenant: Tenant | None = None,
    ) -> tuple[pb.ProcessingResponse, Verdict | None]:
        route = self.config.route(headers.get(":path", ""))
        if route is None or headers.get(":method", "POST") != "POST":
            return pb.ProcessingResponse(request_headers=pb.HeadersResponse(),
                                         mode_override=_SKIP_BODY), None
        if (condemned := self._condemned(route, headers, tenant)) is not None:
            return self._answer(condemned)
        if message.end_of_stream:  # a POST without a body: decide now (it is a 400)
            return self._answer(await self.gate.check(route, headers[":path"], headers, b"",
                                                      tenant=tenant))
        return responses.continue_headers(), None

    def _condemned(self, route: Route, headers: Mapping[str, str],
                   tenant: Tenant | None) -> Verdict | None:
        """The refusal of what the headers alone condemn, if they do: a ``content-length``
        over the cap (413), a body we cannot read (415: not JSON, extproc.gateway.request, or in a
        coding we do not take, extproc.gateway.encoding)."""
        if _declared_length(headers.get("content-length", "")) > self.config.max_body_bytes:
            return self._too_large(route.service_class, tenant)
        try:
            check_content_type(headers.get("content-type"))
            self._coding(headers)
        except RequestError as exc:
            return self.gate.refuse(exc, route.service_class, tenant)
        return None

    async def _on_body(
        self, message: pb.HttpBody, headers: Mapping[str, str], trace: Mapping[str, str], *,
        tenant: Tenant | None = None, one_trip: bool = False,
        on_hold: Callable[[float], None] | None = None, destination: str | None = None,
    ) -> tuple[pb.ProcessingResponse, Verdict | None]:
        path = headers.get(":path", "")
        route = self.config.route(path)
        if route is None or headers.get(":method", "POST") != "POST":
            return responses.continue_body(), None
        if one_trip and (condemned := self._condemned(route, headers, tenant)) is not None:
            return self._answer(condemned)  # Envoy's route checked them: only if it changed
        if self.delay.behind:  # we are the queue: shed, unparsed (module docstring)
            return self._answer(self.gate.shed(route.service_class, tenant))
        if not message.end_of_stream or len(message.body) > self.config.max_body_bytes:
            return self._answer(self._too_large(route.service_class, tenant))
        body = message.body
        try:
            if (how := self._coding(headers)) is not None:  # read inflated, forwarded as sent
                body = encoding.decode(body, how, max_bytes=self.config.max_body_bytes,
                                       max_ratio=self.config.max_inflation_ratio)
        except RequestError as exc:
            return self._answer(self.gate.refuse(exc, route.service_class, tenant))
        return self._answer(await self.gate.check(route, path, headers, body, trace,
                                                  tenant=tenant, on_hold=on_hold,
                                                  destination=destination))

    def _coding(self, headers: Mapping[str, str]) -> encoding.Coding | None:
        return encoding.coding(headers.get("content-encoding"),
                               decode=self.config.content_encoding is ContentEncoding.DECODE)

    def _too_large(self, service_class: str, tenant: Tenant | None = None) -> Verdict:
        error = BodyTooLarge(f"request body exceeds the limit of {self.config.max_body_bytes}"
                             " bytes", code="request_too_large")
        return self.gate.refuse(error, service_class, tenant)

    def _answer(self, verdict: Verdict) -> tuple[pb.ProcessingResponse, Verdict]:
        ticket = verdict.ticket.request_id if verdict.ticket is not None else None
        return responses.with_verdict(self._response(verdict), verdict.outcome, verdict.reason,
                                      verdict.pool, verdict.service_class, ticket), verdict

    def _response(self, verdict: Verdict) -> pb.ProcessingResponse:
        if not verdict.blocks:
            return responses.continue_body()
        if verdict.error is not None:
            return responses.refused(verdict.error, verdict.reason)
        retry_ms = verdict.decision.retry_after_ms if verdict.decision else None
        delay_ms = retry_delay_ms(retry_ms, self.config.retry_after, self.rng)
        return responses.overloaded(verdict.reason, delay_ms)


def _ticket(verdict: Verdict | None) -> Ticket | None:
    return verdict.ticket if verdict is not None else None


def destination_of(message: pb.ProcessingRequest) -> str | None:
    """The replica an endpoint picker in front of us chose (``host:port``; of a list of
    fallbacks, the first), from the metadata Envoy forwards (``extproc.fleet.enginestats``); never
    from a header, which a client could send itself. None: there is none."""
    metadata = message.metadata_context.filter_metadata
    if DESTINATION_NAMESPACE not in metadata:
        return None
    fields = metadata[DESTINATION_NAMESPACE].fields
    if DESTINATION_KEY not in fields or not fields[DESTINATION_KEY].HasField("string_value"):
        return None
    first = fields[DESTINATION_KEY].string_value.split(",", 1)[0].strip()
    return first[:MAX_DESTINATION_CHARS] or None


def _trace_context(context: grpc.aio.ServicerContext) -> dict[str, str]:
    """W3C trace context Envoy's tracer put in the gRPC call's metadata, if any."""
    return {k: v for k, v in (context.invocation_metadata() or ())
            if k in ("traceparent", "tracestate") and isinstance(v, str)}


def _declared_length(value: str) -> int:
    """``content-length`` as a number: 0 unless plain ASCII digits (Envoy's codec refuses
    anything else before we see it); more digits than any body has count as endless."""
    if not (value.isascii() and value.isdigit()):
        return 0
    return int(value) if len(value) <= 18 else 10**18


def server_options(max_body_bytes: int) -> list[tuple[str, int]]:
    """The gRPC server's options (also the no-op processor's in ``benchmarks/``).

    The body arrives in one message. Envoy cuts an oversize body only after its buffer passed
    the limit, so the message can overshoot by about one read batch (bounded by the same
    limit): allow twice the cap, then answer 413 ourselves."""
    return [("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", 2 * max_body_bytes + 1024 * 1024)]


class Service:
    """The running process: gRPC server, health, metrics endpoint, lease sweeper, drain."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.metrics = Metrics()
        self.capacity = build_capacity(config)
        ledger = build_ledger(config, self.metrics)
        engines = build_engines(config, self.capacity)
        self.control = Control({p.name: config.autoscale.policy for p in config.pools},
                               self.capacity, self.metrics,
                               classes=tuple(config.classes), window_s=config.autoscale.window_s)
        self.tracing = Tracing(config.tracing)
        self.gate = Gate(config, ledger, self.capacity, self.metrics, engines=engines,
                         tracing=self.tracing, listeners=(self.control,))
        self.control.held = self.gate.holding.held
        for name, stats in self.gate.engines.items():
            self.metrics.watch_engines(name, functools.partial(stats.latest, name))
        self.keda: grpc.aio.Server | None = None
        self.ledger_up: bool | None = None
        self.processor = Processor(self.gate)
        # mTLS on ``listen`` (extproc.gateway.tls): the files are checked here, re-read when changed
        self.tls = (ServerCertificates(config.tls, on_reload=self.metrics.tls_reload)
                    if config.tls is not None else None)
        self.health = health.aio.HealthServicer()
        self.server = grpc.aio.server(options=server_options(config.max_body_bytes))
        pb_grpc.add_ExternalProcessorServicer_to_server(self.processor, self.server)
        als_pb2_grpc.add_AccessLogServiceServicer_to_server(ClientsWhoLeft(self.gate),
                                                            self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.grpc_port = 0
        self.metrics_port = 0
        self.keda_port = 0
        self._runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()
        self._closing = False  # background loops end on it even if a cancellation is lost
        self.draining = False  # NOT_SERVING: Envoy's health checks take it out of rotation

    async def start(self) -> None:
        if self.tls is not None:
            self.grpc_port = self.server.add_secure_port(self.config.listen,
                                                         self.tls.credentials())
        else:
            self.grpc_port = self.server.add_insecure_port(self.config.listen)
        await self.server.start()
        if self.config.keda_listen:
            scaler = ExternalScaler(self.control.recommendation)
            self.control.listeners.append(scaler.notify)
            self.keda = grpc.aio.server()
            add_scaler(scaler, self.keda)
            self.keda_port = self.keda.add_insecure_port(self.config.keda_listen)
            await self.keda.start()
        await self.capacity.start()
        for pool in self.config.pools:  # after capacity: it may name the replicas to scrape
            if pool.engine_metrics is not None and pool.name in self.gate.engines:
                await self.gate.engines[pool.name].start([pool.name],
                                                         pool.engine_metrics.interval_s)
        self._tasks.append(asyncio.create_task(self.control.run()))
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        await self.probe_ledger()
        if isinstance(self.gate.ledger, RedisLedger):
            self._tasks.append(asyncio.create_task(self._watch_ledger()))
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/ready", self._ready)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        host, _, port = self.config.metrics_listen.rpartition(":")
        site = web.TCPSite(self._runner, host, int(port))
        await site.start()
        self.metrics_port = self._runner.addresses[0][1]
        self._tasks.append(asyncio.create_task(self._sweep()))
        self._tasks.append(asyncio.create_task(self._heartbeat()))
        log.info("serving", extra={"grpc": self.grpc_port, "metrics": self.metrics_port,
                                   "mode": self.config.mode.value})

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(),
                            content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type": "version=0.0.4"})

    async def _ready(self, _: web.Request) -> web.Response:
        """The gRPC health of the processor over HTTP, for probes that cannot speak gRPC (a
        kubelet probing a sidecar that listens on a Unix socket): 200 while it serves, 503
        once it drains."""
        return web.Response(status=503 if self.draining else 200,
                            text="draining\n" if self.draining else "serving\n")

    async def _sweep(self) -> None:
        while not self._closing:
            await asyncio.sleep(self.config.ledger.sweep_interval_ms / 1000.0)
            try:
                if dropped := await self.gate.sweep():
                    log.warning("expired %d ledger entries whose lease ended", dropped)
            except LedgerUnavailable as exc:  # the health probe reports the outage
                log.debug("lease sweep skipped: %s", exc)
            except Exception:
                log.exception("lease sweep failed")

    async def _heartbeat(self) -> None:
        """Renew this process's ledger entries every third of their lease (``Gate.heartbeat``):
        when the process dies they lapse within ``ledger.liveness_ms``."""
        period = self.config.ledger.liveness_ms / 1000.0 / HEARTBEATS_PER_LEASE
        while not self._closing:
            await asyncio.sleep(period)
            try:
                await self.gate.heartbeat()
            except LedgerUnavailable as exc:  # the health probe reports the outage
                log.debug("heartbeat skipped: %s", exc)
            except Exception:
                log.exception("heartbeat failed")

    async def probe_ledger(self) -> bool:
        """Probe the ledger once, reconciling what it missed (``Gate.probe``), and report it
        on ``extproc.ledger`` (and the metric)."""
        ledger = self.gate.ledger
        why = ""
        try:
            if isinstance(ledger, RedisLedger):
                await self.gate.probe(ledger.check())
            up = True
        except LedgerUnavailable as exc:
            up, why = False, str(exc)
        if up is not self.ledger_up:
            self.ledger_up = up
            self.metrics.ledger_up.set(1 if up else 0)
            serving = health_pb2.HealthCheckResponse
            await self.health.set(LEDGER_SERVICE, serving.SERVING if up else serving.NOT_SERVING)
            if up:
                log.info("ledger available", extra={"ledger": self.config.ledger.kind})
            else:
                log.warning("ledger unavailable: %s", why,
                            extra={"policy": self.config.ledger.on_unavailable.value})
        return up

    async def _watch_ledger(self) -> None:
        while not self._closing:
            await asyncio.sleep(LEDGER_PROBE_S)
            await self.probe_ledger()

    async def drain(self) -> None:
        """Turn NOT_SERVING, answer what the gateway holds with a 429 at once, keep serving
        while streams are open (up to the grace), stop."""
        self.draining = True
        await self.health.enter_graceful_shutdown()
        self.gate.holding.refuse_all()
        loop = asyncio.get_running_loop()
        until = loop.time() + self.config.drain_grace_s
        idle_since: float | None = None
        idle_samples = 0  # a stalled loop is one sample, however long it stalled
        started = self.processor.streams_started
        while loop.time() < until:
            seen, started = started, self.processor.streams_started
            if self.processor.open_streams == 0 and started == seen:
                idle_since = idle_since or loop.time()
                idle_samples += 1
                if loop.time() - idle_since >= DRAIN_IDLE_S and idle_samples >= 20:
                    break
            else:
                idle_since, idle_samples = None, 0
            await asyncio.sleep(0.1)
        await self.stop()

    async def stop(self) -> None:
        self._closing = True
        await self.server.stop(grace=0.5)
        if self.keda is not None:
            await self.keda.stop(grace=0.5)
        for stats in self.gate.engines.values():
            await stats.close()
        await self.capacity.close()
        self.tracing.shutdown()
        if self.gate.decision_log is not None:
            self.gate.decision_log.close()
        for task in self._tasks:
            task.cancel()
        if self._tasks:  # bounded: a task that lost its cancellation must not block the exit
            _, stuck = await asyncio.wait(self._tasks, timeout=2.0)
            for task in stuck:
                log.warning("background task did not stop: %s", task.get_name())
        if self._runner is not None:
            await self._runner.cleanup()
        await self.gate.ledger.close()
        self._stopping.set()

    async def wait(self) -> None:
        await self._stopping.wait()


def build_capacity(config: Config) -> CapacitySource:
    """The configured source of ready replicas (``capacity.source``)."""
    cap = config.capacity
    if cap.source == "envoy":
        return EnvoyAdminCapacity(config.pools, cap.envoy_admin_url, hold_s=cap.hold_s,
                                  floor=cap.floor)
    if cap.source == "kubernetes":
        return KubernetesCapacity(config.pools, cap.services, hold_s=cap.hold_s,
                                  floor=cap.floor)
    return StaticCapacity(config.pools)


def build_engines(config: Config, capacity: CapacitySource) -> dict[str, EngineStats]:
    """A scraper of the engines' own ``/metrics`` for each pool with ``engine_metrics``; with
    no ``targets`` listed it scrapes the ready hosts the capacity source discovered."""
    engines: dict[str, EngineStats] = {}
    for pool in config.pools:
        settings = pool.engine_metrics
        if settings is None:
            continue
        targets: Targets | dict[str, tuple[str, ...]] = (
            {pool.name: settings.targets} if settings.targets is not None
            else lambda name: capacity.replicas(name).addresses)
        engines[pool.name] = EngineStats(targets, timeout_s=settings.timeout_s,
                                         max_age_s=settings.max_age_s,
                                         min_coverage=settings.min_coverage)
    return engines


async def serve(config: Config) -> None:
    """Run until SIGTERM or SIGINT, then drain and exit."""
    service = Service(config)
    await service.start()
    loop = asyncio.get_running_loop()
    draining: list[asyncio.Task[None]] = []

    def on_signal() -> None:
        if not draining:
            log.info("signal received: draining")
            draining.append(asyncio.ensure_future(service.drain()))

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    await service.wait()

