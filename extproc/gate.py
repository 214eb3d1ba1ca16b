"""The admission service: request in, verdict out, ledger kept honest. No gRPC, no Envoy.

One request's path: ``check(...)`` parses the body, counts tokens (on a thread when the prompt
is long), reads the ledger snapshot and capacity, calls the pure ``decide`` and, when the
request will run, reserves its ledger entry and returns a ``Ticket``. ``settle(ticket)``
releases the entry when the request ends, however it ends. While a request runs its lease is
renewed every third of its length, so a long generation is never reclaimed.

The server adapter maps the ``Verdict`` to Envoy's answer; nothing here knows about Envoy.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from extproc.admission import Cost, Decision, Outcome, Policy, Reason, decide
from extproc.capacity import CapacitySource
from extproc.config import Config, Infeasible, Mode, Pool, Route
from extproc.errors import BadRequest, RequestError
from extproc.estimate import TokenCounter, counter_for, estimate
from extproc.ledger import Entry, Ledger
from extproc.metrics import Metrics
from extproc.request import InferenceRequest, parse

log = logging.getLogger(__name__)

THREAD_COUNT_CHARS = 16 * 1024  # prompts longer than this are tokenized off the event loop


@dataclass
class Ticket:
    """A reserved ledger entry; ``Gate.settle`` must be called exactly once for it."""

    request_id: str
    pool: str
    service_class: str
    lease_ms: float
    renewer: asyncio.Task[None] | None = field(default=None, repr=False)


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    reason: Reason
    pool: str | None = None
    service_class: str | None = None
    decision: Decision | None = None
    error: RequestError | None = None
    ticket: Ticket | None = None
    enforced: bool = True  # False in shadow mode: the request continues whatever the outcome
    prompt_tokens: int = 0

    @property
    def blocks(self) -> bool:
        """True when the request must be answered by us instead of reaching the backend."""
        return self.enforced and self.outcome in (Outcome.REJECT, Outcome.INVALID, Outcome.ERROR)


class Gate:
    def __init__(
        self,
        config: Config,
        ledger: Ledger,
        capacity: CapacitySource,
        metrics: Metrics,
        *,
        counters: Mapping[str, TokenCounter] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.ledger = ledger
        self.capacity = capacity
        self.metrics = metrics
        self._clock = clock
        self._counters = dict(counters) if counters is not None else {
            p.name: counter_for(p) for p in config.pools
        }
        for pool in config.pools:
            if not self._counters[pool.name].exact:
                log.warning("pool %s has no tokenizer: prompt tokens are estimated at %.1f bytes"
                            " per token", pool.name, pool.bytes_per_token)

    def policy(self, route: Route, headers: Mapping[str, str]) -> Policy:
        """The class policy, with the deadline tightened (never loosened) by the client."""
        cls = self.config.classes[route.service_class]
        deadline = cls.deadline_ms
        raw = headers.get(self.config.deadline_header)
        if raw is not None:
            try:
                asked = float(raw)
            except ValueError:
                asked = float("nan")
            if not asked > 0 or asked == float("inf"):
                raise BadRequest(f"header {self.config.deadline_header} must be a positive"
                                 " number of milliseconds")
            deadline = min(deadline, asked)
        return Policy(deadline_ms=deadline, safety_factor=cls.safety_factor, ttft_ms=cls.ttft_ms)

    async def check(self, route: Route, path: str, headers: Mapping[str, str],
                    body: bytes) -> Verdict:
        started = time.perf_counter()
        verdict = await self._check(route, path, headers, body)
        self.metrics.observe(verdict, self.config.mode, time.perf_counter() - started)
        return verdict

    async def _check(self, route: Route, path: str, headers: Mapping[str, str],
                     body: bytes) -> Verdict:
        cls = route.service_class
        try:
            policy = self.policy(route, headers)
            request = parse(route.api, body, path=path)
        except RequestError as exc:
            return self._refuse(exc, None, cls)
        pool = self.config.pool_for(request.model)
        if pool is None:
            return Verdict(Outcome.PASS, Reason.UNMANAGED, service_class=cls)
        try:
            cost = await self._estimate(request, pool)
        except RequestError as exc:
            return self._refuse(exc, pool.name, cls)

        snapshot = await self.ledger.snapshot(pool.name)
        self.metrics.outstanding.labels(pool.name).set(snapshot.outstanding_ms / 1000.0)
        decision = decide(cost, snapshot, self.capacity.capacity(pool.name), policy,
                          now=self._clock())
        enforced = self.config.mode is Mode.ENFORCE
        verdict = Verdict(decision.outcome, decision.reason, pool.name, cls, decision,
                          enforced=enforced, prompt_tokens=cost.prompt_tokens)
        if decision.reason is Reason.INFEASIBLE and self.config.infeasible is Infeasible.REJECT:
            error = BadRequest(
                "request cannot finish within its deadline even on an idle fleet; lower"
                " max_tokens or raise the deadline", code="deadline_infeasible")
            verdict = dataclasses.replace(verdict, outcome=Outcome.INVALID, error=error)
        if verdict.blocks:
            return verdict
        return dataclasses.replace(verdict, ticket=await self._reserve(pool, cls, decision))

    def refuse(self, error: RequestError, service_class: str) -> Verdict:
        """A verdict for a request refused before it could be checked (e.g. too large)."""
        verdict = self._refuse(error, None, service_class)
        self.metrics.observe(verdict, self.config.mode, 0.0)
        return verdict

    def _refuse(self, error: RequestError, pool: str | None, cls: str) -> Verdict:
        reason = {413: Reason.BODY_TOO_LARGE, 415: Reason.UNSUPPORTED_MEDIA}.get(
            error.status, Reason.BAD_REQUEST)
        return Verdict(Outcome.INVALID, reason, pool, cls, error=error,
                       enforced=True)

    async def _estimate(self, request: InferenceRequest, pool: Pool) -> Cost:
        counter = self._counters[pool.name]
        if sum(len(t) for t in request.texts) > THREAD_COUNT_CHARS:
            return await asyncio.to_thread(estimate, request, pool, counter)
        return estimate(request, pool, counter)

    async def _reserve(self, pool: Pool, cls: str, decision: Decision) -> Ticket:
        """Record a request that will run. Every request that reaches the backend is in the
        ledger, admitted or not (shadow mode, infeasible-passed): it occupies the GPUs."""
        lease_ms = decision.completion_ms + self.config.ledger.lease_grace_ms
        ticket = Ticket(uuid.uuid4().hex, pool.name, cls, lease_ms)
        await self.ledger.reserve(Entry(ticket.request_id, pool.name, decision.service_ms,
                                        lease_ms))
        ticket.renewer = asyncio.create_task(self._renew(ticket))
        self.metrics.inflight(pool.name, +1)
        return ticket

    async def _renew(self, ticket: Ticket) -> None:
        while True:
            await asyncio.sleep(ticket.lease_ms / 3000.0)
            await self.ledger.renew(ticket.request_id, ticket.pool, ticket.lease_ms)

    async def settle(self, ticket: Ticket) -> None:
        """Release a ticket's entry; shielded, so a cancelled stream still releases."""
        if ticket.renewer is not None:
            ticket.renewer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(self._release(ticket))

    async def _release(self, ticket: Ticket) -> None:
        if await self.ledger.release(ticket.request_id, ticket.pool):
            self.metrics.inflight(ticket.pool, -1)

    async def sweep(self) -> int:
        """Expire entries whose lease ended (the backstop for lost streams)."""
        return await self.ledger.expire()

