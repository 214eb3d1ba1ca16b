"""The one place where verdicts become Envoy answers.

- continue: an empty ``CommonResponse`` for the phase that carried the decision;
- 429 (overload): ``retry-after-ms`` and ``Retry-After`` (its ceiling in whole seconds) from
  ``retry_delay_ms``: when the request would fit, at least ``min_s``, stretched by a random factor
  in [1, 1 + jitter] so that rejected clients do not return together, capped at ``max_s`` (the
  OpenAI SDK ignores hints above 120 s). Whole seconds alone undo the jitter: clients rejected
  together round to the same one or two values and come back in waves. The official OpenAI
  Python SDK reads the non-standard ``retry-after-ms`` first, so it keeps the spread; clients
  that know only ``Retry-After`` wait its ceiling, never less than the millisecond value;
- 4xx (the request itself is unusable): ``x-should-retry: false``, since retrying cannot help.

Every answer we make ourselves has an OpenAI-style JSON error body and an
``x-admission-reason`` header. Bodies never quote the request.

Every answer to a decided request, continue or not, also carries the verdict as Envoy dynamic
metadata in ``ADMISSION_NAMESPACE`` (``with_verdict``: outcome, reason, pool, class, and the
ticket of a request that runs, a random id; no tenant, nothing of the request's content),
which Envoy's access log writes on the request's line (``envoyconf.ACCESS_LOG``) and sends
back with the entry of a request whose client left (``extproc.gateway.accesslog``).
"""

from __future__ import annotations

import json
import math
import random
from typing import TYPE_CHECKING

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2

from extproc.decision.admission import Reason
from extproc.gateway.retry import retry_delay_ms

if TYPE_CHECKING:
    from extproc.config import RetryAfter
    from extproc.errors import RequestError

REASON_HEADER = "x-admission-reason"
ADMISSION_NAMESPACE = "extproc"  # Envoy's dynamic metadata namespace for the verdict

_OVERLOAD_MESSAGES = {
    Reason.DEADLINE: "The model is at capacity: this request would not finish within its"
    " deadline.",
    Reason.TTFT: "The model is at capacity: this request would not start within its"
    " time-to-first-token objective.",
    Reason.NO_CAPACITY: "The model has no room for this request now.",
    Reason.KV_CACHE: "The model's KV cache is full: this request would wait for memory.",
    Reason.LEDGER_UNAVAILABLE: "Admission control is unavailable.",
    Reason.PROCESSOR_OVERLOADED: "The gateway is at capacity.",
}


def retry_after_s(retry_after_ms: float | None, rules: RetryAfter, rng: random.Random) -> int:
    """``Retry-After`` in whole seconds: the ceiling of ``retry_delay_ms``, in [min_s, max_s]."""
    return _ceil_s(retry_delay_ms(retry_after_ms, rules, rng))


def _ceil_s(ms: int) -> int:
    return -(-ms // 1000)


def error_body(message: str, type_: str, code: str | None, param: str | None = None) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}
    ).encode()


def with_verdict(response: pb.ProcessingResponse, outcome: str, reason: str,
                 pool: str | None, service_class: str | None,
                 ticket: str | None = None) -> pb.ProcessingResponse:
    """``response`` with the verdict as dynamic metadata (module docstring)."""
    fields = {"outcome": outcome, "reason": reason, "pool": pool, "class": service_class,
              "ticket": ticket}
    response.dynamic_metadata.fields[ADMISSION_NAMESPACE].struct_value.update(
        {k: v for k, v in fields.items() if v is not None})
    return response


def continue_phase(phase: str | None) -> pb.ProcessingResponse:
    """Continue, for the phase a message carried (``WhichOneof("request")``)."""
    if phase == "request_headers":
        return continue_headers()
    if phase == "request_body":
        return continue_body()
    if phase == "response_headers":
        return pb.ProcessingResponse(response_headers=pb.HeadersResponse())
    if phase == "response_body":
        return pb.ProcessingResponse(response_body=pb.BodyResponse())
    if phase == "request_trailers":
        return pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
    return pb.ProcessingResponse(response_trailers=pb.TrailersResponse())


def continue_headers() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(request_headers=pb.HeadersResponse())


def continue_body() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(request_body=pb.BodyResponse())


def extend_timeout(seconds: float) -> pb.ProcessingResponse:
    """Envoy's message timeout for the message being processed, extended to ``seconds`` from
    now (a held request: ``extproc.decision.defer``; within the filter's
    ``max_message_timeout``)."""
    response = pb.ProcessingResponse()
    response.override_message_timeout.FromMilliseconds(max(1, math.ceil(seconds * 1000.0)))
    return response


def overloaded(reason: Reason, retry_ms: int) -> pb.ProcessingResponse:
    """The 429 for a delay from ``retry_delay_ms``: both headers say the same time."""
    retry_s = _ceil_s(retry_ms)
    message = _OVERLOAD_MESSAGES.get(reason, "The model is at capacity.")
    body = error_body(f"{message} Retry after {retry_s} seconds.", "overloaded_error", reason.value)
    return _immediate(429, body, {"retry-after-ms": str(retry_ms), "retry-after": str(retry_s),
                                  REASON_HEADER: reason.value, "x-should-retry": "true"})


def refused(error: RequestError, reason: Reason) -> pb.ProcessingResponse:
    body = error_body(error.message, error.type, error.code or reason.value, error.param)
    return _immediate(error.status, body, {REASON_HEADER: reason.value, "x-should-retry": "false"})


def _immediate(status: int, body: bytes, headers: dict[str, str]) -> pb.ProcessingResponse:
    headers = {"content-type": "application/json", **headers}
    mutation = pb.HeaderMutation(set_headers=[
        base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k, raw_value=v.encode()))
        for k, v in headers.items()
    ])
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status),
        headers=mutation,
        body=body,
        details=f"extproc_{headers.get(REASON_HEADER, 'refused')}",
    ))
