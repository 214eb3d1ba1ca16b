"""One inference replica in virtual time: the fake backend's continuous-batching engine.

The rules are those of ``extproc.fakebackend.Engine`` (and vLLM's scheduler, simplified):

1. a FIFO waiting queue; at a step boundary waiting sequences join the batch, oldest first,
   while ``running < max_running`` and their ``prompt + output`` fits the KV budget (a sequence
   that does not fit blocks those behind it); nothing is preempted;
2. a step lasts ``prefill_ms_per_token x (prompt tokens joining) + itl(b)`` with
   ``itl(b) = itl_ms_at_1 + itl_ms_per_running x (b - 1)`` for ``b`` running sequences, and
   emits one token to each of them; a sequence leaves with its last token.

Batched steps: between two events that change the batch, every step lasts the same ``itl(b)``,
so instead of one event per token the replica plans a *run*: it jumps straight to the boundary
where the next sequence finishes (``k`` steps ahead, ``k`` = the fewest tokens any running
sequence still owes). An arrival that could join, or an abort, re-plans at the next step
boundary, exactly where the real engine would notice it. Token positions are step counts
(``end_step = step at join + output``), so advancing ``k`` steps is O(1) plus one pass over
the (small) batch.

Work done (``work_s``) counts prefill time plus every generated token at the cost it has in a
full batch (``itl(B) / B``): the replica's share of its full-batch throughput in use, which is
linear in load (batch occupancy is not: a half-loaded replica runs a batch far below half
full, because smaller batches step faster).

GPU time is attributed per sequence: its own prefill plus ``itl(b) / b`` for every step it
ran in, summed with one accumulator per replica (``share``), so the attributions add up to the
replica's busy time exactly. That is what "GPU-seconds wasted" adds up.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from extproc.fakebackend import EngineModel

if TYPE_CHECKING:
    from extproc.sim.clients import Attempt

INF = float("inf")


class Replica:
    """A replica's batch, queue and plan. Times are seconds of virtual time."""

    __slots__ = (
        "_itl_s",
        "_prefill_s",
        "_work_per_token_s",
        "busy_s",
        "index",
        "kv_reserved",
        "last_t",
        "model",
        "occupancy_s",
        "planned",
        "planned_steps",
        "ready_at",
        "run_b",
        "run_d",
        "run_d0",
        "run_share",
        "run_share0",
        "run_step0",
        "run_t0",
        "running",
        "schedule",
        "share",
        "started_at",
        "state",
        "step",
        "stopped_at",
        "version",
        "waiting",
        "work_s",
    )

    def __init__(self, index: int, model: EngineModel,
                 schedule: Callable[[float, Replica], None]) -> None:
        self.index = index
        self.model = model
        self.schedule = schedule  # the event loop's hook: "call plan() on me at time t"
        self.waiting: deque[Attempt] = deque()
        self.running: list[Attempt] = []
        self.step = 0  # steps completed since the replica started
        self.share = 0.0  # per-sequence GPU seconds accumulated (sum of itl(b)/b)
        self.busy_s = 0.0  # time with at least one running sequence
        self.occupancy_s = 0.0  # integral of running / max_running over time
        self.work_s = 0.0  # work done, in seconds of a full batch's token throughput
        self._work_per_token_s = model.itl_ms(model.max_running) / model.max_running / 1000.0
        self.run_t0 = 0.0
        self.run_d0 = 0.0
        self.run_d = 0.0
        self.run_share = 0.0
        self.run_step0 = 0
        self.run_share0 = 0.0
        self.run_b = 0
        self.planned = INF  # time of the next planned boundary event
        self.planned_steps = 0  # steps of the current run completed at that event
        self.version = 0  # bumps on re-plan: stale heap events are skipped
        self.kv_reserved = 0
        self.last_t = 0.0
        self.state = "starting"
        self.started_at = 0.0
        self.ready_at = 0.0
        self.stopped_at = INF
        self._itl_s = [0.0] + [model.itl_ms(b) / 1000.0 for b in range(1, model.max_running + 1)]
        self._prefill_s = model.prefill_ms_per_token / 1000.0

    @property
    def load(self) -> int:
        return len(self.running) + len(self.waiting)

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    def submit(self, a: Attempt, now: float) -> None:
        """Queue ``a``; if it can join the batch, make sure the replica looks at the next
        boundary (at once when idle)."""
        a.replica = self
        a.queued_at = now
        joinable = (not self.waiting and len(self.running) < self.model.max_running)
        self.waiting.append(a)
        if joinable:
            self._replan_at_boundary(now)

    def abort(self, a: Attempt, now: float) -> None:
        """The client went away: drop ``a`` at the next step boundary (vLLM's abort)."""
        a.aborted = True
        if a.started_at >= 0.0 and a.finished_at < 0.0:
            self._replan_at_boundary(now)
        # a waiting one is skipped when it reaches the head of the queue

    def _replan_at_boundary(self, now: float) -> None:
        if not self.running:
            if self.planned > now:
                self._set_plan(now, 0)
            return
        d0, d = self.run_d0, self.run_d
        first = self.run_t0 + d0
        if now <= first:
            j, tb = 1, first
        else:
            j = 1 + int(-(-(now - first) // d))  # ceil
            tb = first + (j - 1) * d
        if tb < self.planned:
            self._set_plan(tb, j)

    def _set_plan(self, t: float, steps: int) -> None:
        self.version += 1
        self.planned = t
        self.planned_steps = steps
        self.schedule(t, self)

    def plan(self, now: float, finished: list[Attempt]) -> None:
        """At a step boundary: settle the steps run since the last plan, let finished and
        aborted sequences leave (appended to ``finished``), admit waiting ones, plan ahead."""
        model = self.model
        running = self.running
        j = self.planned_steps
        self.accrue(now)
        if running:
            self.work_s += j * self.run_b * self._work_per_token_s
            self.step = self.run_step0 + j
            self.share = self.run_share0 + j * self.run_share
            step, share = self.step, self.share
            keep: list[Attempt] = []
            for a in running:
                if a.end_step <= step:
                    a.finished_at = now
                    a.gpu_s += share - a.join_share
                    self.kv_reserved -= a.footprint
                    finished.append(a)
                elif a.aborted:
                    a.gpu_s += share - a.join_share
                    self.kv_reserved -= a.footprint
                    finished.append(a)
                else:
                    keep.append(a)
            running = self.running = keep
        self.planned = INF
        self.planned_steps = 0

        # admit, FIFO, while slots and the KV budget allow
        waiting = self.waiting
        budget = model.kv_cache_tokens
        prefill_tokens = 0
        joined: list[Attempt] = []
        while waiting and len(running) < model.max_running:
            a = waiting[0]
            if a.aborted:
                waiting.popleft()
                finished.append(a)
                continue
            if budget and self.kv_reserved + a.footprint > budget:
                break
            waiting.popleft()
            running.append(a)
            joined.append(a)
            self.kv_reserved += a.footprint
            prefill_tokens += a.prompt_tokens
        if not running:
            self.run_b = 0
            return

        b = len(running)
        d = self._itl_s[b]
        d0 = d + prefill_tokens * self._prefill_s
        self.run_t0, self.run_d0, self.run_d, self.run_b = now, d0, d, b
        self.run_step0, self.run_share0, self.run_share = self.step, self.share, d / b
        step = self.step
        for a in joined:
            a.started_at = now
            a.first_token_at = now + d0
            a.end_step = step + a.output_tokens
            a.join_share = self.share
            a.gpu_s += a.prompt_tokens * self._prefill_s
        self.work_s += prefill_tokens * self._prefill_s
        k = min(a.end_step for a in running) - step
        self._set_plan(now + d0 + (k - 1) * d, k)

    def accrue(self, now: float) -> None:
        """Add the time since the last call to the busy and occupancy integrals."""
        elapsed = now - self.last_t
        if self.run_b and elapsed > 0.0:
            self.busy_s += elapsed
            self.occupancy_s += elapsed * self.run_b / self.model.max_running
        self.last_t = now

    def oldest_waiting(self) -> float:
        """Queue time of the head of the waiting queue (INF when empty)."""
        for a in self.waiting:
            if not a.aborted:
                return a.queued_at
        return INF
