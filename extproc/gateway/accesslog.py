"""Envoy's word on which clients left: its gRPC access log service (ALS), on the processor's port.

Envoy ends a request's ext_proc stream the same way whether the answer completed or its client
went away first (measured through Envoy 1.40: the OpenAI SDK's timeout reads, at the processor,
as a clean end of the stream), so the stream cannot tell the gateway that a client gave up.
Envoy's access log can: its response flags say the downstream connection or stream ended first
(``DC``, ``DR``). The rendered configuration (``envoyconf._clients_who_left``) sends the entries
of such requests, and only those, to this service, every ``envoyconf.LEFT_FLUSH_S``; each
carries the dynamic metadata the verdict set (``responses.with_verdict``: its ``ticket``), and
the gate tells the request's pool what its stream showed (``Gate.left``: how long its answer is
at least, for its retry and the pool's lengths).

Nothing else is read from an entry (it carries the request's path and a few headers, never its
body), and nothing of it is kept. The ticket is a random id that reaches no client (Envoy's
stdout access log does not write it), so only what can reach the processor's port (Envoy, where
``tls`` or a Unix socket guards it) can name one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

from extproc.gateway.responses import ADMISSION_NAMESPACE

if TYPE_CHECKING:
    from extproc.gateway.gate import Gate


class ClientsWhoLeft(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    async def StreamAccessLogs(
            self, requests: AsyncIterator[als_pb2.StreamAccessLogsMessage],
            context: grpc.aio.ServicerContext) -> als_pb2.StreamAccessLogsResponse:
        async for message in requests:
            for entry in message.http_logs.log_entry:
                fields = entry.common_properties.metadata.filter_metadata.get(
                    ADMISSION_NAMESPACE)
                if fields is not None and "ticket" in fields.fields:
                    self.gate.left(fields.fields["ticket"].string_value)
        return als_pb2.StreamAccessLogsResponse()

