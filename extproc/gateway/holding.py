"""The gate's held requests (``extproc.decision.defer``): each waits on its own ext_proc stream
while one task per pool decides what is held again, in the queue's order, whenever capacity may have
come back. No Envoy, no ledger: the gate passes in how a held request is decided again and how an
admitted one is settled.

- ``hold``: a request the step refused for what waiting can undo is held if it would still
  finish in time after the predicted wait (else refused at once, as before); it waits until a
  pass sends it, its hold ends (429 ``queue_deadline``) or its stream goes (cancelled: it
  leaves the queue, and what a pass had just reserved for it is settled).
- ``first``: an arrival lets what is held have its turn before it is decided itself.
- ``released``: a request ended: a pass now; else one every ``RECHECK_S`` while anything is
  held (other gateways' releases, replicas added, time itself).
- ``refuse_all``: the drain answers every held request with a 429 at once.
- ``blocks``: a higher band than a request's is held, so it is not sent
(``extproc.decision.defer``).

The highest band a pool holds is published to the ledger (``Ledger.wait``) when a request is
held, after every pass and when the last one goes, so that other gateways' lower priorities
yield to it as this gateway's own do: one strict priority order across the gateways of a
shared ledger.

A request is answered once: by a pass (``answer`` set) or by its holder giving up (``answer``
cancelled); a pass that admitted a request whose holder gave up meanwhile settles it, so no
ledger entry outlives its stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from extproc.decision.admission import Outcome, Reason
from extproc.decision.defer import DEFERRABLE, Queue, Refused, Waiter, enter, predicted_wait_ms
from extproc.decision.share import priority_label
from extproc.gateway.verdict import Ticket, Verdict, refused_held

if TYPE_CHECKING:
    from extproc.config import Config
    from extproc.decision.step import Ask
    from extproc.observability.metrics import Metrics

RECHECK_S = 0.05  # while requests are held, a pass this often if nothing wakes one sooner


@dataclasses.dataclass(eq=False)
class _Held:
    """What is kept of a held request (``Waiter.payload``)."""

    answer: asyncio.Future[Verdict]  # set once: by a pass, or cancelled by its holder leaving
    ask: Ask
    arrived: float  # the gate's clock
    last: Verdict  # its latest refusal (the 429 it gets if it is refused after all)


class Holding:
    """What each pool holds, the passes over it one at a time, and the task running them."""

    def __init__(self, config: Config, metrics: Metrics,
                 decide: Callable[[str, Ask], Awaitable[Verdict]],
                 settle: Callable[[Ticket, bool], Awaitable[None]],
                 publish: Callable[[str, int | None], Awaitable[None]],
                 replicas: Callable[[str], int], clock: Callable[[], float]) -> None:
        self.config = config
        self.metrics = metrics
        self._decide = decide  # a held request decided again, on its pool as it is now
        self._settle = settle
        self._publish = publish  # the highest band a pool holds, to the ledger (docstring)
        self._replicas = replicas
        self._clock = clock
        self.queues = {p.name: Queue(config.defer.max_waiting,
                                     config.defer.max_waiting_per_tenant, self._displaced)
                       for p in config.pools}
        # made with each pool's dispatcher, on the loop that runs it
        self._passes: dict[str, asyncio.Lock] = {}
        self._woken: dict[str, asyncio.Event] = {}
        self._dispatchers: dict[str, asyncio.Task[None]] = {}
        self._levels: dict[str, set[int]] = {}  # priority levels ever held, per pool
        for pool in config.pools:
            metrics.held_oldest.labels(pool.name).set_function(
                lambda name=pool.name: self.held(name)[1])

    async def first(self, pool: str) -> None:
        """An arrival: what ``pool`` holds has its turn first."""
        if self.queues[pool]:
            async with self._passes[pool]:
                await self._pass(pool)

    async def hold(self, pool: str, ask: Ask, verdict: Verdict, arrived: float,
                   on_hold: Callable[[float], None] | None) -> Verdict:
        """Hold a refused request until a pass sends it, its hold ends, or its client goes;
        or refuse it at once when the predicted wait does not fit or the pool holds all it
        may. ``on_hold``: told how long it may be held (seconds), before it waits."""
        adm = verdict.admission
        assert adm is not None
        queue, now = self.queues[pool], self._clock()
        replicas = self._replicas(pool)
        weight = self.config.tenant.policy(ask.tenant).weight if ask.tenant else 1.0
        held = _Held(asyncio.get_running_loop().create_future(), ask, arrived, verdict)
        waiter = enter(queue, adm, ask.tenant, weight, arrived=arrived, now=now,
                       replicas=replicas, payload=held)
        if isinstance(waiter, Refused):
            return refused_held(verdict, waiter.reason or verdict.reason, waiter.retry_ms)
        until = waiter.until
        self._count(pool)
        if on_hold is not None:
            on_hold(until - now)
        if pool not in self._dispatchers:
            self._passes[pool], self._woken[pool] = asyncio.Lock(), asyncio.Event()
            self._dispatchers[pool] = asyncio.create_task(self._dispatch(pool))
        try:
            await self._publish(pool, queue.highest())
            async with asyncio.timeout(max(0.0, until - now)):
                answer = await asyncio.shield(held.answer)
        except TimeoutError:
            answer = None  # its hold ended: a pass may still be deciding it (below)
        except asyncio.CancelledError:  # its client left: what a pass just reserved goes
            if (held.answer.done() and not held.answer.cancelled()
                    and (sent := held.answer.result().ticket) is not None):
                await self._settle(sent, False)
            raise
        finally:
            if not held.answer.done():
                held.answer.cancel()  # gone: a pass that sends it now settles it (``_pass``)
                queue.remove(waiter)
                self._count(pool)
                self.released(pool)
        if answer is None:
            answer = refused_held(held.last, Reason.QUEUE_DEADLINE,
                                  predicted_wait_ms(None, queue.held_ms, replicas))
        return dataclasses.replace(answer, held_ms=(self._clock() - arrived) * 1000.0)

    @staticmethod
    def _displaced(waiter: Waiter, refused: Refused) -> None:
        """A held request a higher priority took the place of (``extproc.decision.defer.enter``)."""
        held: _Held = waiter.payload
        if not held.answer.done():
            held.answer.set_result(refused_held(held.last, refused.reason or Reason.QUEUE_FULL,
                                                refused.retry_ms))

    def released(self, pool: str) -> None:
        """Capacity may have come back: a pass now, if anything is held."""
        if (woken := self._woken.get(pool)) is not None:
            woken.set()

    async def _dispatch(self, pool: str) -> None:
        """While the pool holds anything: a pass when woken, or every ``RECHECK_S``."""
        queue, woken = self.queues[pool], self._woken[pool]
        try:
            while queue:
                async with self._passes[pool]:
                    await self._pass(pool)
                await self._publish(pool, queue.highest())
                if not queue:
                    break
                woken.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(RECHECK_S):
                        await woken.wait()
        finally:
            self._dispatchers.pop(pool, None)

    async def _pass(self, pool: str) -> None:
        """Decide again what ``pool`` holds, in its order (``extproc.decision.defer``), each with
        what it has waited taken from its deadline: send what fits now, refuse what no longer can;
        the rest waits on."""
        queue = self.queues[pool]
        for waiter in queue.pass_order():
            held: _Held = waiter.payload
            if held.answer.done():
                continue
            now = self._clock()
            verdict = await self._decide(pool, dataclasses.replace(
                held.ask, waited_ms=(now - held.arrived) * 1000.0))
            if held.answer.done():  # its client left while it was decided
                if verdict.ticket is not None:
                    await self._settle(verdict.ticket, False)
                continue
            if verdict.outcome is Outcome.REJECT and verdict.reason in DEFERRABLE:
                if now < waiter.until:
                    held.last = verdict
                    continue  # it waits on
                verdict = refused_held(verdict, Reason.QUEUE_DEADLINE, predicted_wait_ms(
                    None, queue.held_ms, self._replicas(pool)))
            if verdict.ticket is not None:
                queue.sent(waiter)
            else:
                queue.remove(waiter)
            self._count(pool)
            held.answer.set_result(verdict)

    def blocks(self, pool: str, priority: int) -> bool:
        """``pool`` holds a higher band than ``priority``: nothing of it is sent now."""
        return self.queues[pool].blocks(priority)

    def _count(self, pool: str) -> None:
        """The held-requests gauge: each level held now, and 0 for those held before."""
        seen = self._levels.setdefault(pool, set())
        for level, count in self.queues[pool].depth(seen).items():
            seen.add(level)
            self.metrics.held.labels(pool, priority_label(level)).set(count)

    def held(self, pool: str) -> tuple[int, float]:
        """The requests ``pool`` holds, and how long the oldest has waited (seconds): demand
        the autoscaler counts (``extproc.scaling.control``)."""
        queue = self.queues[pool]
        oldest = queue.oldest()
        return len(queue), 0.0 if oldest is None else max(0.0, self._clock() - oldest)

    def refuse_all(self) -> int:
        """Answer every held request with a 429 at once (the drain: ``extproc.gateway.server``);
        returns how many."""
        refused = 0
        for pool, queue in self.queues.items():
            replicas = self._replicas(pool)
            for waiter in list(queue.order()):
                held: _Held = waiter.payload
                queue.remove(waiter)
                if not held.answer.done():
                    held.answer.set_result(refused_held(
                        held.last, Reason.QUEUE_FULL,
                        predicted_wait_ms(None, queue.held_ms, replicas)))
                    refused += 1
            self._count(pool)
            self.released(pool)
        return refused
