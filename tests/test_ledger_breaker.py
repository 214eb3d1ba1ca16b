"""The circuit breaker's state machine, on an injected clock (no sleeping)."""

from extproc.ledger.breaker import Breaker, State


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def breaker(clock: Clock, seen: list[State] | None = None) -> Breaker:
    return Breaker(failures=3, cooldown_s=0.5, clock=clock,
                   on_change=None if seen is None else seen.append)


def test_opens_after_consecutive_failures_only() -> None:
    b = breaker(Clock())
    for _ in range(2):
        assert b.allow()
        b.failure()
    b.success()  # a success in between resets the count
    for _ in range(2):
        b.failure()
    assert b.state is State.CLOSED and b.allow()
    b.failure()
    assert b.state is State.OPEN and not b.allow()


def test_half_open_lets_exactly_one_trial_through_after_the_cooldown() -> None:
    clock = Clock()
    b = breaker(clock)
    for _ in range(3):
        b.failure()
    clock.now += 0.49
    assert not b.allow()
    clock.now += 0.02
    assert b.state is State.HALF_OPEN
    assert b.allow()  # the trial
    assert not b.allow()  # everyone else still waits for it
    b.success()
    assert b.state is State.CLOSED and b.allow() and b.allow()


def test_a_failed_trial_reopens_for_a_full_cooldown() -> None:
    clock = Clock()
    seen: list[State] = []
    b = breaker(clock, seen)
    for _ in range(3):
        b.failure()
    clock.now += 0.5
    assert b.allow()
    b.failure()
    assert b.state is State.OPEN
    clock.now += 0.3
    assert not b.allow()
    clock.now += 0.2
    assert b.allow()
    b.success()
    assert seen == [State.OPEN, State.HALF_OPEN, State.OPEN, State.HALF_OPEN, State.CLOSED]
