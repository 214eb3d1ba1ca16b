"""One inference replica in virtual time: ``fleet.engine.Scheduler`` driven by the event loop.

The scheduler is the one the fake backend runs (vLLM V1's rules: a token budget per step,
chunked prefill, KV blocks allocated as sequences grow, preemption of the newest sequence by
recomputation, the prefix cache). This module only adds time: a step scheduled at ``t`` ends
at ``t + step_ms``, where the replica settles it and schedules the next one.

Runs of decode steps. Most steps of a busy replica are pure decodes of an unchanged batch,
and those differ only by the context each sequence reads, one token longer every step. So
when a step is a pure decode and nothing waiting can join, the replica plans a *run*: it jumps
straight to the boundary where the first sequence finishes or the KV cache would need a block
it does not have (``Scheduler.decode_run``), ``k`` steps at once, timed exactly
(``Scheduler.run_ms``: the step times grow linearly). An arrival that could join, or an abort,
cuts the run at the next step boundary (``Scheduler.steps_within``), exactly where the real
engine would notice it. A step with prefill in it (a chunk of a new prompt, a resumed
preemption) is one event.

Accounting, per replica: ``busy_s`` (time with a step running), ``occupancy_s`` (the integral
of ``running / max_num_seqs``), ``work_s`` (tensor work: prefill tokens at their cost and each
decode token at its cost in a batch at the engine's knee, ``knee_batch``: the batch past which a
decode step costs more than its fixed part; linear in load, like a DCGM tensor-activity gauge)
and per attempt ``gpu_s`` (each step's time split over its sequences by their tokens; the
shares add up to the busy time).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from extproc.fleet.engine import EngineModel, Scheduler, Step

if TYPE_CHECKING:
    from extproc.sim.clients import Attempt

INF = float("inf")


def knee_batch(model: EngineModel, context: float = 1024.0) -> float:
    """The batch at which a decode step's per-sequence part equals its fixed part."""
    per_seq = model.ms_per_token + model.ms_per_seq + model.ms_per_kv_token * context
    return max(1.0, min(float(model.max_num_seqs), model.step_base_ms / per_seq))


class Replica:
    """A replica's scheduler, its step in progress and its plan. Times are seconds."""

    __slots__ = (
        "_decode_work_s",
        "_prefill_work_s",
        "_run_first_ms",
        "_run_steps",
        "_run_t0",
        "_step",
        "aborts",
        "busy_s",
        "index",
        "last_t",
        "model",
        "occupancy_s",
        "planned",
        "ready_at",
        "sched",
        "schedule",
        "started_at",
        "state",
        "stopped_at",
        "version",
        "work_s",
    )

    def __init__(self, index: int, model: EngineModel,
                 schedule: Callable[[float, Replica], None]) -> None:
        self.index = index
        self.model = model
        self.sched = Scheduler(model)
        self.schedule = schedule  # the event loop's hook: "call plan() on me at time t"
        self._step: Step | None = None  # the step (or the first step of the run) in progress
        self._run_steps = 0  # steps in the run in progress, ending at ``planned``
        self._run_t0 = 0.0
        self._run_first_ms = 0.0
        self.aborts: list[Attempt] = []  # running attempts to drop at the next boundary
        self.planned = INF
        self.version = 0  # bumps on re-plan: stale heap events are skipped
        self.busy_s = 0.0
        self.occupancy_s = 0.0
        self.work_s = 0.0
        k = knee_batch(model)
        self._decode_work_s = model.itl_ms(k, 1024.0) / k / 1000.0
        self._prefill_work_s = model.ms_per_token / 1000.0
        self.last_t = 0.0
        self.state = "starting"
        self.started_at = 0.0
        self.ready_at = 0.0
        self.stopped_at = INF

    @property
    def running(self) -> list[Attempt]:
        return self.sched.running  # type: ignore[return-value]  # only attempts go in

    @property
    def waiting(self) -> list[Attempt]:
        return list(self.sched.waiting)  # type: ignore[arg-type]

    @property
    def load(self) -> int:
        return len(self.sched.running) + len(self.sched.waiting)

    @property
    def idle(self) -> bool:
        return not self.sched.running and not self.sched.waiting

    def submit(self, a: Attempt, now: float) -> None:
        """Queue ``a``; if it can join the batch, make sure the replica looks at the next
        boundary (at once when idle)."""
        a.replica = self
        a.queued_at = now
        sched = self.sched
        joinable = not sched.waiting and len(sched.running) < self.model.max_num_seqs
        sched.add(a)
        if self._step is None:
            self._set_plan(now, 0)
        elif joinable and self._run_steps > 1:
            self._cut(now)

    def abort(self, a: Attempt, now: float) -> bool:
        """The client went away: drop ``a`` (vLLM's abort): from the queue at once (True),
        from the batch at the next step boundary, where ``plan`` reports it (False)."""
        a.aborted = True
        if a.done:
            return False
        if a not in self.sched.running:
            self.sched.remove(a)
            return True
        self.aborts.append(a)
        if self._run_steps > 1:
            self._cut(now)
        return False

    def _cut(self, now: float) -> None:
        """End the run in progress at the first step boundary at or after ``now``."""
        elapsed_ms = (now - self._run_t0) * 1000.0
        steps = self.sched.steps_within(self._run_first_ms, elapsed_ms)
        if steps < self._run_steps:
            end = self._run_t0 + self.sched.run_ms(self._run_first_ms, steps) / 1000.0
            self._run_steps = steps
            self._set_plan(end, steps)

    def _set_plan(self, t: float, steps: int) -> None:
        self.version += 1
        self.planned = t
        self._run_steps = steps
        self.schedule(t, self)

    def plan(self, now: float, finished: list[Attempt]) -> None:
        """At a step boundary: settle what ran, drop aborted attempts (appended to
        ``finished``, with the finished ones), schedule the next step or run."""
        self.accrue(now)
        sched = self.sched
        step = self._step
        if step is not None:
            done = self._settle(step, now)
            for a in done:
                a.finished_at = now
            finished.extend(done)
        self._step = None
        self.planned = INF
        for a in self.aborts:
            if not a.done:
                sched.remove(a)
                finished.append(a)
        self.aborts.clear()

        step = sched.schedule()
        if step is None:
            self._run_steps = 0
            return
        for seq in step.joined:
            if seq.started_at < 0.0:  # type: ignore[attr-defined]  # only attempts go in
                seq.started_at = now  # type: ignore[attr-defined]
        self._step = step
        steps = sched.decode_run() if step.pure_decode else 1
        self._run_t0, self._run_first_ms = now, step.duration_ms
        self._set_plan(now + sched.run_ms(step.duration_ms, steps) / 1000.0, steps)

    def _settle(self, step: Step, now: float) -> list[Attempt]:
        """Apply the step or run that just ended; attribute its time and work."""
        steps = self._run_steps
        elapsed = now - self._run_t0
        if steps <= 1:
            total = sum(step.tokens) or 1
            for seq, n in zip(step.seqs, step.tokens, strict=True):
                seq.gpu_s += elapsed * n / total  # type: ignore[attr-defined]
            before = [s.generated for s in step.seqs]
            done = self.sched.complete(step)
            for seq, gen in zip(step.seqs, before, strict=True):
                if gen == 0 and seq.generated > 0:
                    seq.first_token_at = now  # type: ignore[attr-defined]
            self.work_s += (step.prefill_tokens * self._prefill_work_s
                            + step.decodes * self._decode_work_s)
        else:
            share = elapsed / len(step.seqs)
            for seq in step.seqs:
                seq.gpu_s += share  # type: ignore[attr-defined]
            done = self.sched.advance(steps)
            self.work_s += steps * len(step.seqs) * self._decode_work_s
        return done  # type: ignore[return-value]

    def accrue(self, now: float) -> None:
        """Add the time since the last call to the busy and occupancy integrals."""
        elapsed = now - self.last_t
        if self._step is not None and elapsed > 0.0:
            self.busy_s += elapsed
            self.occupancy_s += elapsed * len(self.sched.running) / self.model.max_num_seqs
        self.last_t = now

    def oldest_waiting(self) -> float:
        """Queue time of the head of the waiting queue (INF when empty)."""
        for a in self.sched.waiting:
            return a.queued_at  # type: ignore[attr-defined,no-any-return]
        return INF
