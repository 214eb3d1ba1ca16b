"""The simulated replica runs the engine's scheduler in virtual time; its decode runs and their
cuts give exactly the times of stepping the scheduler one step at a time."""

from __future__ import annotations

import heapq
import random

import pytest

from extproc.fleet.engine import EngineModel, Scheduler, Sequence
from extproc.sim.clients import Attempt
from extproc.sim.engine import Replica
from extproc.sim.workload import Job

MODEL = EngineModel(max_num_seqs=6, max_num_batched_tokens=48, block_size=4, num_gpu_blocks=50,
                    max_model_len=120, step_base_ms=20.0, ms_per_token=0.1, ms_per_seq=2.0,
                    ms_per_kv_token=0.05, ms_per_prefill_pair=0.0001)


class Harness:
    """One replica and the event loop around it."""

    def __init__(self, model: EngineModel = MODEL) -> None:
        self.events: list[tuple[float, int, int]] = []
        self.seq = 0
        self.replica = Replica(0, model, self._schedule)
        self.finished: list[Attempt] = []

    def _schedule(self, t: float, replica: Replica) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, replica.version))

    def submit(self, at: float, prompt: int, output: int) -> Attempt:
        self.run_until(at)
        a = Attempt(Job(at, prompt, output), 0, at, str(self.seq), output, output, 1e9, None)
        self.replica.submit(a, at)
        return a

    def run_until(self, t: float = float("inf")) -> None:
        while self.events and self.events[0][0] <= t:
            when, _, version = heapq.heappop(self.events)
            if version == self.replica.version:
                self.replica.plan(when, self.finished)


def stepped(model: EngineModel, arrivals: list[tuple[float, int, int]]
            ) -> list[tuple[float, float]]:
    """The reference: the scheduler stepped one step at a time; an arrival joins the queue at
    the first step boundary at or after it (at once when the engine is idle). Returns
    (first token, finish) per arrival."""
    sched = Scheduler(model)
    seqs = [Sequence(p, o) for _, p, o in arrivals]
    times: dict[int, list[float]] = {i: [-1.0, -1.0] for i in range(len(seqs))}
    index = {id(s): i for i, s in enumerate(seqs)}
    now, nxt = 0.0, 0
    while True:
        while nxt < len(arrivals) and arrivals[nxt][0] <= now + 1e-12:
            sched.add(seqs[nxt])
            nxt += 1
        step = sched.schedule()
        if step is None:
            if nxt == len(arrivals):
                break
            now = arrivals[nxt][0]
            continue
        now += step.duration_ms / 1000.0
        before = [s.generated for s in step.seqs]
        done = sched.complete(step)
        for s, g in zip(step.seqs, before, strict=True):
            if g == 0 and s.generated > 0:
                times[index[id(s)]][0] = now
        for s in done:
            times[index[id(s)]][1] = now
    return [(times[i][0], times[i][1]) for i in range(len(seqs))]


@pytest.mark.parametrize("seed", range(8))
def test_the_replica_gives_the_times_of_stepping_one_step_at_a_time(seed: int) -> None:
    rng = random.Random(seed)
    t = 0.0
    arrivals = []
    for _ in range(40):
        t += rng.expovariate(4.0)
        arrivals.append((t, rng.randint(1, 60), rng.randint(1, 50)))
    h = Harness()
    attempts = [h.submit(at, p, o) for at, p, o in arrivals]
    h.run_until()
    expected = stepped(MODEL, arrivals)
    assert [a.first_token_at for a in attempts] == pytest.approx([e[0] for e in expected])
    assert [a.finished_at for a in attempts] == pytest.approx([e[1] for e in expected])
    assert {id(a) for a in h.finished} == {id(a) for a in attempts}
    assert h.replica.sched.free_blocks == MODEL.num_gpu_blocks


def test_a_lone_request_takes_its_prefill_then_a_step_per_token() -> None:
    h = Harness()
    a = h.submit(0.0, prompt=40, output=10)
    h.run_until()
    prefill = MODEL.step_ms(40, 0, 0, 40 * 20)
    decodes = sum(MODEL.itl_ms(1, 40 + i) for i in range(9))
    assert a.first_token_at == pytest.approx(prefill / 1000)
    assert a.finished_at == pytest.approx((prefill + decodes) / 1000)
    assert a.gpu_s == pytest.approx(a.finished_at)  # alone: every step was its own
    assert h.replica.busy_s == pytest.approx(a.finished_at)


def test_an_arrival_cuts_a_run_at_the_next_step_boundary() -> None:
    h = Harness()
    first = h.submit(0.0, prompt=4, output=100)
    h.run_until(0.5)
    late = h.submit(0.5, prompt=4, output=2)
    h.run_until()
    assert late.started_at > 0.5
    assert late.started_at - 0.5 < MODEL.itl_ms(1, 40) / 1000  # within one step
    assert first.finished_at > late.finished_at


def test_an_abort_drops_a_waiting_request_at_once_and_a_running_one_at_a_boundary() -> None:
    full = EngineModel(max_num_seqs=1, num_gpu_blocks=0, step_base_ms=10.0)
    h = Harness(full)
    running = h.submit(0.0, prompt=1, output=50)
    waiting = h.submit(0.0, prompt=1, output=5)
    h.run_until(0.1)
    assert h.replica.abort(waiting, 0.1) is True  # from the queue: the caller accounts for it
    assert h.replica.abort(running, 0.1) is False  # at the boundary, reported by plan
    h.run_until()
    assert running in h.finished and running.finished_at < 0
    assert running.generated < 50 and h.replica.idle
    assert waiting.started_at < 0
