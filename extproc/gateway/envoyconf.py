"""Envoy's bootstrap, rendered from our own settings so the two can never disagree.

It is built from ``envoy-data-plane``'s typed messages (betterproto2 dataclasses validated by
pydantic): a misspelled field or a wrongly typed value fails when the message is made (and under
mypy), not in Envoy. It is written as protobuf's JSON form with proto field names, the form
Envoy reads from YAML; the few proto3 defaults we mean to state (``failure_mode_allow: false``,
``type: STATIC``...) are written anyway, and each ``typed_config`` (a ``google.protobuf.Any``)
as ``{"@type": ..., **fields}`` (see ``_Doc``).

Choices made here, each matching what the server expects:

- ext_proc processing modes: request headers SEND; request body BUFFERED_PARTIAL; every
  response phase SKIP (the stream still lasts until the request ends, which is how the ledger
  learns completion); ``allow_mode_override`` so paths we do not manage skip their body.
  One trip (``Topology.one_trip``, the default: it measured cheaper, docs/performance.md): an
  admission POST whose headers condemn nothing skips the headers phase on a route of its own
  (``_routes``), its headers sent as attributes with the body.
- Body limit: the listener's buffer limit is ``max_body_bytes`` plus a little, so a body up to
  the cap reaches us whole and a larger one arrives cut short; the server then answers our
  413 JSON, never Envoy's plain-text 413.
- ``message_timeout`` 2 s: exact tokenization of the longest prompt we count exactly (512 KiB)
  takes ~0.35 s on one core; the default 200 ms would fail long prompts under load.
- ``failure_mode_allow: true`` (fail-open) by default: if the processor is down, traffic flows
  as if there were no admission control (the pre-existing behaviour) and Envoy counts it in
  ``ext_proc.failure_mode_allowed``; set ``fail_open: false`` to answer ``status_on_error``
  instead (503 by default: it tells clients and retry policies the gateway is briefly unable,
  where Envoy's own default, 500, says the request broke something).
- Circuit breakers: Envoy's default of 1,024 concurrent requests per cluster would cap long
  LLM streams (one ext_proc gRPC stream per HTTP request): both clusters get 100,000.
- Path normalization: RFC 3986 (dot segments, escaped unreserved characters), merged
  slashes, and ``%2F``/``%5C`` unescaped and forwarded, so a route, ext_proc and the backend
  all see ``/v1/chat/completions`` for ``/v1/chat%2Fcompletions``, ``/%761/chat/completions``
  or ``//v1/chat/completions`` (a backend that routes on the decoded path, as vLLM's does,
  would otherwise serve them unjudged). Unescaping rather than rejecting keeps such a request
  an ordinary one, decided like any other; the sidecar matches routes on the decoded path
  as well (``config.canonical_path``), for an Envoy configured otherwise.
- Access log (``Topology.access_log``, on by default): ``ACCESS_LOG``, one JSON object per
  request on Envoy's stdout, with the verdict the sidecar sends back as dynamic metadata.
- The clients who left (``_clients_who_left``, always): the access log entries of requests
  whose client went away before the answer ended (``DC``, ``DR``), over gRPC to the
  processor's own port (``extproc.gateway.accesslog``), every ``LEFT_FLUSH_S``.
- No route timeout: generations can run for many minutes; clients own their deadlines.
- ``request_timeout`` (``Topology.request_timeout_s``, 30 s): the time a client has to send
  the whole request, headers and body. It stops once the request is in, so it never cuts a
  generation; it cuts a body shorter than its ``Content-Length`` (a broken or hostile client)
  with Envoy's 408 instead of holding the ext_proc stream and the connection for the
  10-minute idle timeout. 30 s is the latency class's whole deadline: a request still
  arriving by then has missed it anyway.
- ``forward_rules`` (``_forward_rules``): the sidecar is sent only the request headers it
  reads (path, method, the content headers, the deadline header, trace context, the tenant
  header when that is the tenant's source, the priority header when one is configured).
  Clients' ``Authorization``, API keys and cookies reach the backend as before, never the
  processor, its logs or its memory.
- Overload manager: a global limit on downstream connections (``MAX_DOWNSTREAM_CONNECTIONS``),
  without which Envoy 1.40 warns at start that none is configured. Set high: admission, not
  connection counting, is how this gateway sheds load; the limit guards file descriptors.
- Upstream health checks on ``/health``.
- The processor cluster: active gRPC health checks every 0.5 s (two failures take a host out)
  and outlier detection on connection failures, so a dead or draining ``extproc serve`` stops
  getting streams within about a second (``_processor_health_check``).
- Tenant trust (only with ``tenant.source`` set; ``_trust_tenant_source``): the metadata
  namespace is forwarded to ext_proc, client copies of the tenant header are removed before
  any filter runs, headers with underscores are dropped. ``Topology.http_filters`` puts the
  operator's filters (e.g. jwt_authn) before ext_proc.
- ``Topology.extproc_tls``: mTLS towards the processor (``tls`` in its config); a
  ``listen: unix:PATH`` processor is reached at a ``pipe`` address.

Length: past the house's ~400 lines for one bootstrap document, one small function per
Envoy resource, read top to bottom as the document reads.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import urllib.parse
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import betterproto2
import yaml
from envoy_data_plane.envoy.config.accesslog.v3 import (
    AccessLog,
    AccessLogFilter,
    ResponseFlagFilter,
)
from envoy_data_plane.envoy.config.bootstrap.v3 import Admin, Bootstrap, BootstrapStaticResources
from envoy_data_plane.envoy.config.cluster.v3 import (
    CircuitBreakers,
    CircuitBreakersThresholds,
    Cluster,
    ClusterDiscoveryType,
    LoadBalancingPolicy,
    LoadBalancingPolicyPolicy,
    OutlierDetection,
)
from envoy_data_plane.envoy.config.common.mutation_rules.v3 import HeaderMutation
from envoy_data_plane.envoy.config.core import v3 as core
from envoy_data_plane.envoy.config.core.v3 import (
    Address,
    ApiVersion,
    GrpcService,
    GrpcServiceEnvoyGrpc,
    HealthCheck,
    HealthCheckGrpcHealthCheck,
    HealthCheckHttpHealthCheck,
    Http2ProtocolOptions,
    Pipe,
    RoutingPriority,
    SocketAddress,
    SubstitutionFormatString,
    TypedExtensionConfig,
)
from envoy_data_plane.envoy.config.endpoint.v3 import (
    ClusterLoadAssignment,
    Endpoint,
    LbEndpoint,
    LocalityLbEndpoints,
)
from envoy_data_plane.envoy.config.listener.v3 import Filter, FilterChain, Listener
from envoy_data_plane.envoy.config.overload.v3 import OverloadManager, ResourceMonitor
from envoy_data_plane.envoy.config.route.v3 import (
    HeaderMatcher,
    Route,
    RouteAction,
    RouteConfiguration,
    RouteMatch,
    VirtualHost,
)
from envoy_data_plane.envoy.config.trace.v3 import OpenTelemetryConfig, TracingHttp
from envoy_data_plane.envoy.extensions.access_loggers.grpc.v3 import (
    CommonGrpcAccessLogConfig,
    HttpGrpcAccessLogConfig,
)
from envoy_data_plane.envoy.extensions.access_loggers.stream.v3 import StdoutAccessLog
from envoy_data_plane.envoy.extensions.filters.http.buffer.v3 import Buffer, BufferPerRoute
from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import (
    ExternalProcessor,
    ExtProcOverrides,
    ExtProcPerRoute,
    HeaderForwardingRules,
    MetadataOptions,
    MetadataOptionsMetadataNamespaces,
    ProcessingMode,
    ProcessingModeBodySendMode,
    ProcessingModeHeaderSendMode,
)
from envoy_data_plane.envoy.extensions.filters.http.router.v3 import Router
from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import (
    HttpConnectionManager,
    HttpConnectionManagerCodecType,
    HttpConnectionManagerPathWithEscapedSlashesAction,
    HttpConnectionManagerTracing,
    HttpFilter,
)
from envoy_data_plane.envoy.extensions.http.early_header_mutation.header_mutation import (
    v3 as early_header_mutation,
)
from envoy_data_plane.envoy.extensions.load_balancing_policies.least_request.v3 import (
    LeastRequest,
    LeastRequestSelectionMethod,
)
from envoy_data_plane.envoy.extensions.resource_monitors.downstream_connections.v3 import (
    DownstreamConnectionsConfig,
)
from envoy_data_plane.envoy.extensions.transport_sockets.tls import v3 as tls
from envoy_data_plane.envoy.extensions.upstreams.http.v3 import (
    HttpProtocolOptions,
    HttpProtocolOptionsExplicitHttpConfig,
)
from envoy_data_plane.envoy.type.matcher.v3 import ListStringMatcher, StringMatcher
from envoy_data_plane.envoy.type.v3 import HttpStatus, Int64Range, Percent, StatusCode
from envoy_data_plane.google.protobuf import Any as AnyProto
from envoy_data_plane.google.protobuf import Struct

from extproc.config import Config, TenantConfig, TenantSource
from extproc.fleet.enginestats import DESTINATION_NAMESPACE
from extproc.gateway.request import REQUEST_TIME, forwarded_headers, header_attribute
from extproc.gateway.responses import ADMISSION_NAMESPACE

BUFFER_SLACK_BYTES = 1024
# Envoy's access log, one JSON object per request: what operators' log pipelines parse.
# ``admission``/``reason``/``pool``/``class`` are the sidecar's verdict (dynamic metadata it
# sends back: ``responses.verdict_metadata``), absent where it did not decide (a path it does
# not manage, or fail-open while it is away: ``details`` then says ``ext_proc_error``...).
# The path is logged without its query string (where some clients put API keys); no header a
# client controls but the request id and user agent, and never the body.
ACCESS_LOG: dict[str, str] = {
    "start_time": "%START_TIME%",
    "method": "%REQ(:METHOD)%",
    "path": "%PATH(NQ)%",
    "protocol": "%PROTOCOL%",
    "status": "%RESPONSE_CODE%",
    "details": "%RESPONSE_CODE_DETAILS%",
    "flags": "%RESPONSE_FLAGS%",
    "admission": f"%DYNAMIC_METADATA({ADMISSION_NAMESPACE}:outcome)%",
    "reason": f"%DYNAMIC_METADATA({ADMISSION_NAMESPACE}:reason)%",
    "pool": f"%DYNAMIC_METADATA({ADMISSION_NAMESPACE}:pool)%",
    "class": f"%DYNAMIC_METADATA({ADMISSION_NAMESPACE}:class)%",
    "retry_after_ms": "%RESP(RETRY-AFTER-MS)%",
    "bytes_received": "%BYTES_RECEIVED%",
    "bytes_sent": "%BYTES_SENT%",
    "duration_ms": "%DURATION%",
    "upstream_host": "%UPSTREAM_HOST%",
    "request_id": "%REQ(X-REQUEST-ID)%",
    "user_agent": "%REQ(USER-AGENT)%",
}

MAX_DOWNSTREAM_CONNECTIONS = 100_000
LEFT_FLUSH_S = 0.1  # well within the OpenAI SDK's first retry delay (0.375-0.5 s)
_BIG = 100_000
_HEADER = ProcessingModeHeaderSendMode
_BODY = ProcessingModeBodySendMode

_M = TypeVar("_M", bound=betterproto2.Message)


class _Doc:
    """What protobuf's JSON form would lose, kept beside the typed messages of one render.

    Messages validate by rebuilding themselves from their fields, so nothing can ride on the
    instances; this side table (keyed by identity, holding the objects alive) does instead.
    """

    def __init__(self) -> None:
        self._explicit: dict[int, tuple[betterproto2.Message, tuple[str, ...]]] = {}
        self._packed: dict[int, tuple[AnyProto, betterproto2.Message]] = {}

    def explicit(self, msg: _M, *fields: str) -> _M:
        """Write ``fields`` even at their proto3 default (``false``, ``STATIC``, ``DEFAULT``,
        ``NONE``), which the JSON form leaves out: the file then says what it chose."""
        for name in fields:
            getattr(msg, name)  # a misspelled name fails here, not silently in the output
        self._explicit[id(msg)] = (msg, fields)
        return msg

    def pack(self, msg: betterproto2.Message) -> AnyProto:
        """A ``typed_config``: ``google.protobuf.Any`` holds only the serialized bytes, and
        its own ``to_dict`` unpacks them into a fresh message (losing explicit defaults), so
        the typed message is kept here and written as ``{"@type": ..., **fields}``."""
        packed = AnyProto.pack(msg)
        self._packed[id(packed)] = (packed, msg)
        return packed

    def json(self, msg: betterproto2.Message) -> dict[str, Any]:
        """The protobuf JSON form with proto field names (what Envoy's YAML loader reads):
        betterproto2's ``to_dict`` for scalars, enums (by name), durations ("2s") and wrapper
        types; nested messages are recursed here so explicit defaults and ``Any``s survive."""
        if isinstance(msg, AnyProto):
            if id(msg) not in self._packed:  # packed by a caller (Topology.http_filters)
                return msg.to_dict(casing=betterproto2.Casing.SNAKE)
            return {"@type": msg.type_url, **self.json(self._packed[id(msg)][1])}
        out = msg.to_dict(casing=betterproto2.Casing.SNAKE)
        if isinstance(msg, Struct):  # its JSON form is the mapping itself, not its fields
            return out
        if id(msg) in self._explicit:
            full = msg.to_dict(casing=betterproto2.Casing.SNAKE, include_default_values=True)
            out.update({name: full[name] for name in self._explicit[id(msg)][1]})
        assert dataclasses.is_dataclass(msg)  # every betterproto2 message is one
        for field in dataclasses.fields(msg):
            value = getattr(msg, field.name)
            key = field.name.rstrip("_")  # as to_dict names it (``from_`` is "from")
            if isinstance(value, betterproto2.Message):
                out[key] = self.json(value)
            elif isinstance(value, list) and any(isinstance(v, betterproto2.Message)
                                                 for v in value):
                out[key] = [self.json(v) for v in value]
            elif isinstance(value, dict) and any(isinstance(v, betterproto2.Message)
                                                 for v in value.values()):
                out[key] = {k: self.json(v) for k, v in value.items()}
        return out


def _clients_who_left(doc: _Doc) -> AccessLog:
    """The access log entries of requests whose client left before the answer ended (response
    flags ``DC``, ``DR``), and only those, sent to the processor's own gRPC port, flushed every
    ``LEFT_FLUSH_S`` (``extproc.gateway.accesslog``: the ext_proc stream ends the same way
    whether the answer completed or its client left)."""
    return AccessLog(
        name="envoy.access_loggers.http_grpc",
        filter=AccessLogFilter(response_flag_filter=ResponseFlagFilter(flags=["DC", "DR"])),
        typed_config=doc.pack(HttpGrpcAccessLogConfig(common_config=CommonGrpcAccessLogConfig(
            log_name="clients-who-left", transport_api_version=ApiVersion.V3,
            grpc_service=GrpcService(envoy_grpc=GrpcServiceEnvoyGrpc(cluster_name="extproc")),
            buffer_flush_interval=_s(LEFT_FLUSH_S)))))


def _s(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)


def _http2(doc: _Doc) -> dict[str, AnyProto]:  # gRPC upstreams
    return {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": doc.pack(HttpProtocolOptions(
        explicit_http_config=HttpProtocolOptionsExplicitHttpConfig(
            http2_protocol_options=Http2ProtocolOptions()),
    ))}


@dataclass(frozen=True)
class Topology:
    """Where things listen in one deployment of the gateway."""

    listen_port: int = 10000
    listen_address: str = "127.0.0.1"
    admin_port: int = 9901
    backends: tuple[tuple[str, int], ...] = (("127.0.0.1", 8000),)
    extproc: tuple[str, int] = ("127.0.0.1", 50051)
    extra_extprocs: tuple[tuple[str, int], ...] = ()  # more replicas sharing one ledger
    fail_open: bool = True
    status_on_error: int = 503  # what a fail-closed gateway answers while the processor is away
    access_log: bool = True  # one JSON line per request on Envoy's stdout (ACCESS_LOG)
    processor: bool = True  # False: no ext_proc filter nor cluster (the benchmark's baseline)
    # Filters placed before ext_proc, e.g. the JWT filter whose payload names the tenant
    # (their typed_config packed with ``google.protobuf.Any.pack``).
    http_filters: tuple[HttpFilter, ...] = ()
    extproc_tls: ExtprocTls | None = None  # mTLS towards the processor (its ``tls`` section)
    request_timeout_s: float = 30.0  # to receive a whole request (headers and body)
    # One gRPC round trip per admission request whose headers condemn nothing (``_routes``);
    # False: headers, then body, for every request (two trips)
    one_trip: bool = True


@dataclass(frozen=True)
class ExtprocTls:
    """Envoy's side of mTLS towards ``extproc serve``: its client certificate and the CA
    that signed the server's. ``server_name``: sent as SNI and required among the server
    certificate's DNS names; None: any certificate the CA signed is accepted."""

    cert_file: str
    key_file: str
    ca_file: str
    server_name: str | None = None


def error_status(code: int) -> StatusCode:
    """An HTTP error status (4xx or 5xx) Envoy knows by name: its ``HttpStatus`` accepts
    only the codes of its ``StatusCode`` enum, so any other number fails here, not in Envoy."""
    if 400 <= code <= 599 and code in StatusCode._value2member_map_:
        return StatusCode(code)
    raise ValueError(f"status_on_error must be a 4xx or 5xx status Envoy defines, got {code}")


def _address(host: str, port: int) -> Address:
    if host.startswith("unix:"):
        return Address(pipe=Pipe(path=host.removeprefix("unix:")))
    return Address(socket_address=SocketAddress(address=host, port_value=port))


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _discovery(*hosts: str) -> ClusterDiscoveryType:
    # Kubernetes Services are DNS names: resolve them, every address a host
    return (ClusterDiscoveryType.STATIC if all(_is_ip(h) for h in hosts)
            else ClusterDiscoveryType.STRICT_DNS)


def _assignment(name: str, hosts: tuple[tuple[str, int], ...]) -> ClusterLoadAssignment:
    return ClusterLoadAssignment(cluster_name=name, endpoints=[LocalityLbEndpoints(
        lb_endpoints=[LbEndpoint(endpoint=Endpoint(address=_address(h, p))) for h, p in hosts],
    )])


def extproc_endpoint(listen: str) -> tuple[str, int]:
    """Where Envoy reaches the server listening on ``listen`` (HOST:PORT or unix:PATH);
    a wildcard listen address is reached on loopback."""
    if listen.startswith("unix:"):
        return listen, 0
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    return ("127.0.0.1" if host in ("0.0.0.0", "::", "") else host), int(port)


def _breakers(doc: _Doc) -> CircuitBreakers:
    return CircuitBreakers(thresholds=[doc.explicit(CircuitBreakersThresholds(
        priority=RoutingPriority.DEFAULT, max_connections=_BIG, max_pending_requests=_BIG,
        max_requests=_BIG, max_retries=3,
    ), "priority")])


# A dead processor must stop getting streams within a couple of seconds (fail-open, each
# stream it gets passes unadmitted; fail-closed, each gets a 503): two signals, both on.
PROCESSOR_HC_INTERVAL_S = 0.5
PROCESSOR_HC_TIMEOUT_S = 1.0


def _processor_health_check() -> HealthCheck:
    """Active gRPC health checks of each processor (``grpc.health.v1``, service ``""``: the
    server turns it NOT_SERVING as soon as it drains). Two failures in a row take a host out:
    a killed process refuses the connection at once, so within ~1 s of its death. The 1 s
    timeout is generous: a processor that cannot answer a health check for a second is too
    busy to decide in time anyway. One success puts it back (a restarted worker)."""
    return HealthCheck(
        timeout=_s(PROCESSOR_HC_TIMEOUT_S), interval=_s(PROCESSOR_HC_INTERVAL_S),
        no_traffic_interval=_s(PROCESSOR_HC_INTERVAL_S), unhealthy_threshold=2,
        healthy_threshold=1, grpc_health_check=HealthCheckGrpcHealthCheck(service_name=""),
    )


def _processor_outlier_detection() -> OutlierDetection:
    """Passive ejection between health checks: two consecutive locally originated failures
    (connection refused or reset: a dead process) eject the host at once, for 2 s at first.
    ``max_ejection_percent`` 50 keeps at least one of two processors in rotation."""
    return OutlierDetection(
        split_external_local_origin_errors=True, consecutive_local_origin_failure=2,
        enforcing_consecutive_local_origin_failure=100, interval=_s(1),
        base_ejection_time=_s(2), max_ejection_percent=50,
    )


def hold_limit_s(config: Config) -> float:
    """The longest the gateway may hold a request (``extproc.decision.defer``): its longest class
    deadline, and a second for the answer to reach Envoy."""
    return max(c.deadline_ms for c in config.classes.values()) / 1000.0 + 1.0


def bootstrap(config: Config, topo: Topology) -> dict[str, Any]:
    """The bootstrap as typed ``envoy-data-plane`` messages (a misspelled field or a wrong
    type fails here), returned in the protobuf JSON form Envoy loads."""
    doc = _Doc()
    one_trip = topo.one_trip and topo.processor
    ext_proc = HttpFilter(name="envoy.filters.http.ext_proc", typed_config=doc.pack(doc.explicit(
        ExternalProcessor(
            grpc_service=GrpcService(envoy_grpc=GrpcServiceEnvoyGrpc(cluster_name="extproc")),
            failure_mode_allow=topo.fail_open,
            status_on_error=HttpStatus(code=error_status(topo.status_on_error)),
            message_timeout=_s(2),
            # a held request (extproc.decision.defer) extends its message's timeout, up to this
            max_message_timeout=_s(hold_limit_s(config)) if config.defer.enabled else None,
            allow_mode_override=True,
            forward_rules=_forward_rules(config),
            # one trip: the headers the sidecar reads, with the body (_routes); Envoy 1.40
            # sends a filter's attributes with a stream's first message and ignores a
            # route's own list
            request_attributes=_attributes(config) if one_trip else [],
            metadata_options=_metadata_options(config),
            processing_mode=_processing_mode(doc, _HEADER.SEND),
        ), "failure_mode_allow")))
    hcm = doc.explicit(HttpConnectionManager(
        stat_prefix="ingress",
        codec_type=HttpConnectionManagerCodecType.AUTO,
        stream_idle_timeout=_s(600),
        request_timeout=_s(topo.request_timeout_s),
        # the path every filter, the route and the backend see is the canonical one, so a
        # path spelled otherwise (%2F, %76, dot segments, //) cannot route past admission
        # (module docstring: path normalization)
        normalize_path=True,
        merge_slashes=True,
        path_with_escaped_slashes_action=(
            HttpConnectionManagerPathWithEscapedSlashesAction.UNESCAPE_AND_FORWARD),
        route_config=RouteConfiguration(name="inference", virtual_hosts=[VirtualHost(
            name="inference",
            domains=["*"],
            routes=_routes(doc, config, one_trip),
        )]),
        http_filters=[
            *topo.http_filters,
            *([ext_proc] if topo.processor else []),
            # one trip: holds the request's headers back from the router until its body is
            # in and past ext_proc (_routes); only on the one-trip routes
            *([HttpFilter(name=BUFFER_FILTER, typed_config=doc.pack(Buffer(
                max_request_bytes=config.max_body_bytes + BUFFER_SLACK_BYTES)))]
              if one_trip else []),
            HttpFilter(name="envoy.filters.http.router", typed_config=doc.pack(Router())),
        ],
    ), "codec_type")
    _trust_tenant_source(doc, config.tenant, hcm, config.priority.header)
    otel = _collector(config.tracing.endpoint)
    if otel is not None:
        # Envoy's own span for each request, exported to the same collector as ours; the
        # ext_proc gRPC call carries its trace context, so our decision span is its child.
        hcm.tracing = HttpConnectionManagerTracing(
            random_sampling=Percent(value=config.tracing.sample_ratio * 100.0),
            provider=TracingHttp(name="envoy.tracers.opentelemetry", typed_config=doc.pack(
                OpenTelemetryConfig(
                    grpc_service=GrpcService(envoy_grpc=GrpcServiceEnvoyGrpc(cluster_name="otel"),
                                             timeout=_s(1)),
                    service_name="envoy",
                ))),
        )
    hcm.access_log = [_clients_who_left(doc)]
    if topo.access_log:
        hcm.access_log.append(AccessLog(name="envoy.access_loggers.stdout",
                                        typed_config=doc.pack(StdoutAccessLog(
                                            log_format=SubstitutionFormatString(
                                                json_format=Struct.from_dict(ACCESS_LOG))))))
    buffer_limit = config.max_body_bytes + BUFFER_SLACK_BYTES
    inference = doc.explicit(Cluster(
        name="inference",
        type=_discovery(*(h for h, _ in topo.backends)),
        connect_timeout=_s(1),
        # full scan: with few replicas, two random choices often pick the same
        # host and overfill it while admission assumes balanced slots
        load_balancing_policy=LoadBalancingPolicy(policies=[LoadBalancingPolicyPolicy(
            typed_extension_config=TypedExtensionConfig(
                name="envoy.load_balancing_policies.least_request",
                typed_config=doc.pack(LeastRequest(
                    selection_method=LeastRequestSelectionMethod.FULL_SCAN)),
            ))]),
        per_connection_buffer_limit_bytes=buffer_limit,
        circuit_breakers=_breakers(doc),
        health_checks=[HealthCheck(
            timeout=_s(1), interval=_s(2), unhealthy_threshold=2, healthy_threshold=1,
            no_traffic_interval=_s(2),
            http_health_check=HealthCheckHttpHealthCheck(path="/health"),
        )],
        load_assignment=_assignment("inference", topo.backends),
    ), "type")
    extproc = doc.explicit(Cluster(
        name="extproc",
        type=ClusterDiscoveryType.STATIC,
        connect_timeout=_s(1),
        typed_extension_protocol_options=_http2(doc),
        circuit_breakers=_breakers(doc),
        health_checks=[_processor_health_check()],
        outlier_detection=_processor_outlier_detection(),
        load_assignment=_assignment("extproc", (topo.extproc, *topo.extra_extprocs)),
        transport_socket=_upstream_tls(doc, topo.extproc_tls),
    ), "type")
    return doc.json(Bootstrap(
        admin=Admin(address=_address("127.0.0.1", topo.admin_port)),
        overload_manager=_overload_manager(doc),
        static_resources=BootstrapStaticResources(
            listeners=[Listener(
                name="inference",
                address=_address(topo.listen_address, topo.listen_port),
                per_connection_buffer_limit_bytes=buffer_limit,
                filter_chains=[FilterChain(filters=[Filter(
                    name="envoy.filters.network.http_connection_manager",
                    typed_config=doc.pack(hcm),
                )])],
            )],
            clusters=[inference, *([extproc] if topo.processor else []),
                      *([_otel_cluster(doc, *otel)] if otel is not None else [])],
        ),
    ))


def _processing_mode(doc: _Doc, request_headers: ProcessingModeHeaderSendMode
                     ) -> ProcessingMode:
    """The request's headers as given (SEND, or SKIP for one trip), its body BUFFERED_PARTIAL,
    every response phase skipped."""
    return doc.explicit(ProcessingMode(
        request_header_mode=request_headers,
        response_header_mode=_HEADER.SKIP,
        request_body_mode=_BODY.BUFFERED_PARTIAL,
        response_body_mode=_BODY.NONE,
        request_trailer_mode=_HEADER.SKIP,
        response_trailer_mode=_HEADER.SKIP,
    ), "response_body_mode")


def _attributes(config: Config) -> list[str]:
    """What one trip's body brings (``extproc.gateway.request.headers_from_attributes``): the start
    of the request and the headers the sidecar reads but ``content-length`` (the route checked
    it, and Envoy leaves it out of a buffered body's attributes)."""
    return [REQUEST_TIME, *(header_attribute(name) for name in forwarded_headers(config)
                            if name != "content-length")]


def _routes(doc: _Doc, config: Config, one_trip: bool) -> list[Route]:
    """Every request goes to the inference cluster. With ``one_trip``, an admission path's
    POST whose headers condemn nothing (a ``content-length`` from 1 to ``max_body_bytes``,
    ``content-type: application/json``, no ``content-encoding``) takes a route whose ext_proc
    skips the headers phase: the body alone goes to the sidecar, with the headers it reads
    as attributes (``_attributes``) and the request's start time. Any
    other request keeps both phases, so what the headers condemn is answered at once (413,
    415, a body-less POST's 400) and the rest is checked as before.

    Without the headers phase, ext_proc lets the headers go on at once and holds only the
    body: the router would open the upstream request before the decision (measured: the
    backend saw every request, refused ones too, re-framed as chunked). The buffer filter
    after ext_proc holds them until the whole body has passed ext_proc, so a refused request
    never reaches the backend; it is disabled on every other route."""
    upstream = RouteAction(cluster="inference", timeout=_s(0))
    if not one_trip:
        return [Route(match=RouteMatch(prefix="/"), route=upstream)]
    everything = Route(match=RouteMatch(prefix="/"), route=upstream, typed_per_filter_config={
        BUFFER_FILTER: doc.pack(BufferPerRoute(disabled=True))})
    overrides = ExtProcPerRoute(overrides=ExtProcOverrides(
        processing_mode=_processing_mode(doc, _HEADER.SKIP)))
    clean = [
        HeaderMatcher(name=":method", string_match=StringMatcher(exact="POST")),
        HeaderMatcher(name="content-length",
                      range_match=Int64Range(start=1, end=config.max_body_bytes + 1)),
        HeaderMatcher(name="content-type",
                      string_match=StringMatcher(exact="application/json", ignore_case=True)),
        HeaderMatcher(name="content-encoding", present_match=True, invert_match=True),
    ]
    return [*(Route(match=RouteMatch(path=route.path, headers=clean), route=upstream,
                    typed_per_filter_config={"envoy.filters.http.ext_proc": doc.pack(overrides)})
              for route in config.routes), everything]


BUFFER_FILTER = "envoy.filters.http.buffer"


def _forward_rules(config: Config) -> HeaderForwardingRules:
    return HeaderForwardingRules(allowed_headers=ListStringMatcher(
        patterns=[StringMatcher(exact=name) for name in forwarded_headers(config)]))


def _overload_manager(doc: _Doc) -> OverloadManager:
    return OverloadManager(resource_monitors=[ResourceMonitor(
        name="envoy.resource_monitors.global_downstream_max_connections",
        typed_config=doc.pack(DownstreamConnectionsConfig(
            max_active_downstream_connections=MAX_DOWNSTREAM_CONNECTIONS)),
    )])


def _metadata_options(config: Config) -> MetadataOptions:
    """What the sidecar writes back: its verdict in ``ADMISSION_NAMESPACE``
    (``responses.verdict_metadata``), read by the access log. With ``tenant.source:
    metadata``, Envoy also forwards that namespace (e.g. the JWT payload jwt_authn wrote) on
    each ext_proc message; with a pool's ``engine_metrics.idle_destination``, the endpoint
    picker's (``extproc.fleet.enginestats``: the replica it chose); nothing else is forwarded."""
    tenant = config.tenant
    forwarded = ([tenant.metadata_namespace] if tenant.source is TenantSource.METADATA else [])
    if any(p.engine_metrics is not None and p.engine_metrics.idle_destination
           for p in config.pools):
        forwarded.append(DESTINATION_NAMESPACE)
    return MetadataOptions(
        forwarding_namespaces=(MetadataOptionsMetadataNamespaces(untyped=forwarded)
                               if forwarded else None),
        receiving_namespaces=MetadataOptionsMetadataNamespaces(untyped=[ADMISSION_NAMESPACE]))


def _trust_tenant_source(doc: _Doc, tenant: TenantConfig, hcm: HttpConnectionManager,
                         priority_header: str | None = None) -> None:
    """What makes a tenant unforgeable by clients (extproc.gateway.tenant):

    - any source: headers with underscores are dropped (``x_tenant_id`` is not our header,
      but backends that fold ``_`` into ``-``, as CGI and WSGI do, would read it as one),
      counted in the codec stats ``http1.dropped_headers_with_underscores`` (and http2's).
      Dropping rather than rejecting keeps innocent underscore headers from becoming 400s.
    - ``header``: every client copy of the header is removed before any filter runs (the
      connection manager's early header mutation; route-level ``request_headers_to_remove``
      would be too late: the router applies it after ext_proc has seen the header). Only a
      filter of this chain, e.g. jwt_authn's ``claim_to_headers``, can set it again.
    - ``priority.header`` (extproc.decision.share) is trusted the same way: removed early, set only
      by the operator's filters (from a verified claim, or per route).
    """
    if tenant.source is TenantSource.NONE and priority_header is None:
        return
    hcm.common_http_protocol_options = core.HttpProtocolOptions(
        headers_with_underscores_action=(
            core.HttpProtocolOptionsHeadersWithUnderscoresAction.DROP_HEADER))
    removed = [*([tenant.header] if tenant.source is TenantSource.HEADER else []),
               *([priority_header] if priority_header is not None else [])]
    if removed:
        hcm.early_header_mutation_extensions = [core.TypedExtensionConfig(
            name="envoy.http.early_header_mutation.header_mutation",
            typed_config=doc.pack(early_header_mutation.HeaderMutation(
                mutations=[HeaderMutation(remove=name) for name in removed])),
        )]


def _upstream_tls(doc: _Doc, settings: ExtprocTls | None) -> core.TransportSocket | None:
    """mTLS towards the processor: Envoy's client certificate, the server's CA, HTTP/2 by
    ALPN (gRPC), and the server's name checked when one is given."""
    if settings is None:
        return None
    sans = ([tls.SubjectAltNameMatcher(san_type=tls.SubjectAltNameMatcherSanType.DNS,
                                       matcher=StringMatcher(exact=settings.server_name))]
            if settings.server_name else [])
    return core.TransportSocket(name="envoy.transport_sockets.tls", typed_config=doc.pack(
        tls.UpstreamTlsContext(
            sni=settings.server_name or "",
            common_tls_context=tls.CommonTlsContext(
                alpn_protocols=["h2"],
                tls_certificates=[tls.TlsCertificate(
                    certificate_chain=core.DataSource(filename=settings.cert_file),
                    private_key=core.DataSource(filename=settings.key_file))],
                validation_context=tls.CertificateValidationContext(
                    trusted_ca=core.DataSource(filename=settings.ca_file),
                    match_typed_subject_alt_names=sans),
            ),
        )))


def _collector(endpoint: str | None) -> tuple[str, int] | None:
    if not endpoint:
        return None
    url = urllib.parse.urlsplit(endpoint)
    return url.hostname or "127.0.0.1", url.port or 4317


def _otel_cluster(doc: _Doc, host: str, port: int) -> Cluster:
    return doc.explicit(Cluster(
        name="otel",
        type=_discovery(host),
        connect_timeout=_s(1),
        typed_extension_protocol_options=_http2(doc),
        load_assignment=_assignment("otel", ((host, port),)),
    ), "type")


def render(config: Config, topo: Topology) -> str:
    header = "# Generated by `extproc envoy-config`; edit the settings, not this file.\n"
    return header + yaml.safe_dump(bootstrap(config, topo), sort_keys=False, width=120)
