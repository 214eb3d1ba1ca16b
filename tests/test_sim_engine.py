"""The simulated replica follows the fake backend's continuous-batching rules, in virtual time."""

import heapq

import pytest

from extproc.fakebackend import EngineModel
from extproc.sim.clients import Attempt
from extproc.sim.engine import Replica
from extproc.workload import Job

MODEL = EngineModel(max_running=4, prefill_ms_per_token=0.1, itl_ms_at_1=20.0,
                    itl_ms_per_running=2.0)


class Harness:
    """One replica and the event loop around it."""

    def __init__(self, model: EngineModel = MODEL) -> None:
        self.events: list[tuple[float, int, int]] = []
        self.seq = 0
        self.now = 0.0
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
                self.now = when
                self.replica.plan(when, self.finished)
        self.now = max(self.now, t) if t != float("inf") else self.now


def itl(b: int) -> float:
    return MODEL.itl_ms(b) / 1000.0


def test_a_lone_request_takes_prefill_plus_its_tokens_at_batch_one() -> None:
    h = Harness()
    a = h.submit(0.0, prompt=1000, output=50)
    h.run_until()
    assert a.first_token_at == pytest.approx(0.1 + itl(1))
    assert a.finished_at == pytest.approx(0.1 + 50 * itl(1))
    assert h.replica.step == 50


def test_a_batch_steps_at_its_own_inter_token_latency() -> None:
    h = Harness()
    short = h.submit(0.0, prompt=100, output=10)
    long = h.submit(0.0, prompt=100, output=30)
    h.run_until()
    # both joined at t=0? the first joined alone; the second at the next boundary
    assert short.first_token_at == pytest.approx(0.01 + itl(1))
    start = short.first_token_at
    assert long.started_at == pytest.approx(start)
    # from there both run at itl(2): the short one's remaining 9 tokens
    assert short.finished_at == pytest.approx(start + 0.01 + itl(2) + 8 * itl(2))
    # then the long one is alone again
    done_together = short.finished_at
    remaining = 30 - (1 + 8)
    assert long.finished_at == pytest.approx(done_together + remaining * itl(1))


def test_an_arrival_joins_at_the_next_step_boundary() -> None:
    h = Harness()
    h.submit(0.0, prompt=0, output=100)
    late = h.submit(0.5 * itl(1) + 3 * itl(1), prompt=0, output=5)  # mid-step 4
    h.run_until()
    assert late.started_at == pytest.approx(4 * itl(1))
    assert late.first_token_at == pytest.approx(4 * itl(1) + itl(2))


def test_the_batch_is_capped_and_the_queue_is_fifo() -> None:
    h = Harness()
    first = [h.submit(0.0, prompt=0, output=20) for _ in range(4)]
    queued = [h.submit(0.0, prompt=0, output=5) for _ in range(2)]
    h.run_until(0.001)
    assert len(h.replica.running) == 1 and len(h.replica.waiting) == 5
    h.run_until()
    assert max(a.started_at for a in first) < min(a.started_at for a in queued)
    assert queued[0].started_at <= queued[1].started_at
    assert all(a.finished_at > 0 for a in first + queued)


def test_the_kv_budget_blocks_the_head_of_the_queue() -> None:
    h = Harness(EngineModel(max_running=4, prefill_ms_per_token=0.0, itl_ms_at_1=10.0,
                            itl_ms_per_running=0.0, kv_cache_tokens=1000))
    big = h.submit(0.0, prompt=700, output=100)
    blocked = h.submit(0.0, prompt=300, output=100)  # 800 + 400 > 1000
    small = h.submit(0.0, prompt=10, output=10)  # would fit, but waits behind (FIFO)
    h.run_until()
    assert blocked.started_at == pytest.approx(big.finished_at)
    assert small.started_at >= blocked.started_at


def test_gpu_time_attributed_to_sequences_adds_up_to_busy_time() -> None:
    h = Harness()
    attempts = [h.submit(0.013 * i, prompt=50 * i, output=7 + 5 * i) for i in range(12)]
    h.run_until()
    h.replica.accrue(h.now)
    assert sum(a.gpu_s for a in attempts) == pytest.approx(h.replica.busy_s)
    assert h.replica.idle


def test_an_abort_frees_the_slot_at_the_next_boundary() -> None:
    h = Harness()
    a = h.submit(0.0, prompt=0, output=1000)
    h.run_until(1.0)
    h.replica.abort(a, 1.0)
    h.run_until()
    assert a in h.finished and a.finished_at < 0  # left unfinished
    assert a.gpu_s == pytest.approx(h.replica.step * itl(1))
    assert h.replica.idle
