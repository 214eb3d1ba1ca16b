"""Envoy's bootstrap, rendered from our own settings so the two can never disagree.

Choices made here, each matching what the server expects:

- ext_proc processing modes: request headers SEND; request body BUFFERED_PARTIAL; every
  response phase SKIP (the stream still lasts until the request ends, which is how the ledger
  learns completion); ``allow_mode_override`` so paths we do not manage skip their body.
- Body limit: the listener's buffer limit is ``max_body_bytes`` plus a little, so a body up to
  the cap reaches us whole and a larger one arrives cut short; the server then answers our
  413 JSON, never Envoy's plain-text 413.
- ``message_timeout`` 2 s: exact tokenization of the longest prompt we count exactly (512 KiB)
  takes ~0.35 s on one core; the default 200 ms would fail long prompts under load.
- ``failure_mode_allow: true`` (fail-open) by default: if the processor is down, traffic flows
  as if there were no admission control (the pre-existing behaviour) and Envoy counts it in
  ``ext_proc.failure_mode_allowed``; set ``fail_open: false`` to answer 503 instead.
- Circuit breakers: Envoy's default of 1,024 concurrent requests per cluster would cap long
  LLM streams (one ext_proc gRPC stream per HTTP request): both clusters get 100,000.
- No route timeout: generations can run for many minutes; clients own their deadlines.
- Upstream health checks on ``/health``.
"""

from __future__ import annotations

import ipaddress
import urllib.parse
from dataclasses import dataclass
from typing import Any

import yaml

from extproc.config import Config

BUFFER_SLACK_BYTES = 1024
_BIG = 100_000
_TYPE = "type.googleapis.com/envoy."
_HTTP2 = {  # gRPC upstreams
    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": _TYPE + "extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http2_protocol_options": {}},
    },
}


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
    access_log: bool = False


def _address(host: str, port: int) -> dict[str, Any]:
    if host.startswith("unix:"):
        return {"pipe": {"path": host.removeprefix("unix:")}}
    return {"socket_address": {"address": host, "port_value": port}}


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def extproc_endpoint(listen: str) -> tuple[str, int]:
    """Where Envoy reaches the server listening on ``listen`` (HOST:PORT or unix:PATH);
    a wildcard listen address is reached on loopback."""
    if listen.startswith("unix:"):
        return listen, 0
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    return ("127.0.0.1" if host in ("0.0.0.0", "::", "") else host), int(port)


def _breakers() -> dict[str, Any]:
    return {"thresholds": [{
        "priority": "DEFAULT", "max_connections": _BIG, "max_pending_requests": _BIG,
        "max_requests": _BIG, "max_retries": 3,
    }]}


def bootstrap(config: Config, topo: Topology) -> dict[str, Any]:
    ext_proc = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": _TYPE + "extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "extproc"}},
            "failure_mode_allow": topo.fail_open,
            "status_on_error": {"code": 503},
            "message_timeout": "2s",
            "allow_mode_override": True,
            "processing_mode": {
                "request_header_mode": "SEND",
                "response_header_mode": "SKIP",
                "request_body_mode": "BUFFERED_PARTIAL",
                "response_body_mode": "NONE",
                "request_trailer_mode": "SKIP",
                "response_trailer_mode": "SKIP",
            },
        },
    }
    hcm: dict[str, Any] = {
        "@type": _TYPE + "extensions.filters.network.http_connection_manager.v3"
                 ".HttpConnectionManager",
        "stat_prefix": "ingress",
        "codec_type": "AUTO",
        "stream_idle_timeout": "600s",
        "route_config": {
            "name": "inference",
            "virtual_hosts": [{
                "name": "inference",
                "domains": ["*"],
                "routes": [{"match": {"prefix": "/"},
                            "route": {"cluster": "inference", "timeout": "0s"}}],
            }],
        },
        "http_filters": [
            ext_proc,
            {"name": "envoy.filters.http.router", "typed_config": {
                "@type": _TYPE + "extensions.filters.http.router.v3.Router"}},
        ],
    }
    otel = _collector(config.tracing.endpoint)
    if otel is not None:
        # Envoy's own span for each request, exported to the same collector as ours; the
        # ext_proc gRPC call carries its trace context, so our decision span is its child.
        hcm["tracing"] = {
            "random_sampling": {"value": config.tracing.sample_ratio * 100.0},
            "provider": {"name": "envoy.tracers.opentelemetry", "typed_config": {
                "@type": _TYPE + "config.trace.v3.OpenTelemetryConfig",
                "grpc_service": {"envoy_grpc": {"cluster_name": "otel"}, "timeout": "1s"},
                "service_name": "envoy",
            }},
        }
    if topo.access_log:
        hcm["access_log"] = [{"name": "envoy.access_loggers.stdout", "typed_config": {
            "@type": _TYPE + "extensions.access_loggers.stream.v3.StdoutAccessLog"}}]
    return {
        "admin": {"address": _address("127.0.0.1", topo.admin_port)},
        "static_resources": {
            "listeners": [{
                "name": "inference",
                "address": _address(topo.listen_address, topo.listen_port),
                "per_connection_buffer_limit_bytes": config.max_body_bytes + BUFFER_SLACK_BYTES,
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": hcm,
                }]}],
            }],
            "clusters": [
                {
                    "name": "inference",
                    # Kubernetes Services are DNS names: resolve them, every address a host
                    "type": "STATIC" if all(_is_ip(h) for h, _ in topo.backends)
                    else "STRICT_DNS",
                    "connect_timeout": "1s",
                    # full scan: with few replicas, two random choices often pick the same
                    # host and overfill it while admission assumes balanced slots
                    "load_balancing_policy": {"policies": [{"typed_extension_config": {
                        "name": "envoy.load_balancing_policies.least_request",
                        "typed_config": {
                            "@type": _TYPE + "extensions.load_balancing_policies.least_request"
                                     ".v3.LeastRequest",
                            "selection_method": "FULL_SCAN",
                        },
                    }}]},
                    "per_connection_buffer_limit_bytes": config.max_body_bytes + BUFFER_SLACK_BYTES,
                    "circuit_breakers": _breakers(),
                    "health_checks": [{
                        "timeout": "1s", "interval": "2s", "unhealthy_threshold": 2,
                        "healthy_threshold": 1, "no_traffic_interval": "2s",
                        "http_health_check": {"path": "/health"},
                    }],
                    "load_assignment": {"cluster_name": "inference", "endpoints": [{
                        "lb_endpoints": [{"endpoint": {"address": _address(h, p)}}
                                         for h, p in topo.backends],
                    }]},
                },
                {
                    "name": "extproc",
                    "type": "STATIC",
                    "connect_timeout": "1s",
                    "typed_extension_protocol_options": _HTTP2,
                    "circuit_breakers": _breakers(),
                    "load_assignment": {"cluster_name": "extproc", "endpoints": [{
                        "lb_endpoints": [{"endpoint": {"address": _address(h, p)}}
                                         for h, p in (topo.extproc, *topo.extra_extprocs)],
                    }]},
                },
                *([_otel_cluster(*otel)] if otel is not None else []),
            ],
        },
    }


def _collector(endpoint: str | None) -> tuple[str, int] | None:
    if not endpoint:
        return None
    url = urllib.parse.urlsplit(endpoint)
    return url.hostname or "127.0.0.1", url.port or 4317


def _otel_cluster(host: str, port: int) -> dict[str, Any]:
    return {
        "name": "otel",
        "type": "STATIC" if _is_ip(host) else "STRICT_DNS",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": _HTTP2,
        "load_assignment": {"cluster_name": "otel", "endpoints": [{
            "lb_endpoints": [{"endpoint": {"address": _address(host, port)}}],
        }]},
    }


def render(config: Config, topo: Topology) -> str:
    header = "# Generated by `extproc envoy-config`; edit the settings, not this file.\n"
    return header + yaml.safe_dump(bootstrap(config, topo), sort_keys=False, width=120)
