"""A circuit breaker for the ledger's store: stop calling a Redis that is not answering.

    closed ──(``failures`` consecutive failures)──▶ open ──(``cooldown`` passes)──▶ half-open
      ▲                                               ▲                                │
      └──────────────(the one trial call succeeds)────┼────────────────────────────────┤
                                                      └───(the trial call fails)───────┘

Closed: every call goes through; a success resets the failure count. Open: calls are refused
at once (the caller applies its fault policy without waiting on a dead store). Half-open:
exactly one trial call goes through, the others are still refused; its outcome closes or
re-opens the breaker. A trial whose caller gives up (cancellation) counts as a failure: a store
that never answers must keep the breaker open.

With a cool-down of half a second and the server probing the ledger every quarter second,
recovery after the store returns takes under a second with or without traffic.

``now`` is passed in by the caller's clock (injectable), so the state machine is tested
without sleeping.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import IntEnum


class State(IntEnum):
    """Also the value of the breaker-state gauge."""

    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class Breaker:
    def __init__(self, failures: int = 5, cooldown_s: float = 0.5, *,
                 clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[State], None] | None = None) -> None:
        if failures < 1 or cooldown_s < 0:
            raise ValueError("failures must be >= 1 and cooldown_s >= 0")
        self.failures = failures
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._on_change = on_change
        self._state = State.CLOSED
        self._count = 0  # consecutive failures while closed
        self._opened_at = 0.0
        self._trial = False  # a half-open trial call is in flight

    @property
    def state(self) -> State:
        """The state as of now (an open breaker whose cool-down passed reads half-open)."""
        if self._state is State.OPEN and self._clock() - self._opened_at >= self.cooldown_s:
            return State.HALF_OPEN
        return self._state

    def allow(self) -> bool:
        """May a call go through now? A True in half-open is the single trial: its outcome
        must be reported with ``success`` or ``failure``."""
        if self._state is State.CLOSED:
            return True
        if self._state is State.OPEN:
            if self._clock() - self._opened_at < self.cooldown_s:
                return False
            self._set(State.HALF_OPEN)
        if self._trial:
            return False
        self._trial = True
        return True

    def success(self) -> None:
        self._count = 0
        self._trial = False
        if self._state is not State.CLOSED:
            self._set(State.CLOSED)

    def failure(self) -> None:
        self._trial = False
        if self._state is State.CLOSED:
            self._count += 1
            if self._count < self.failures:
                return
        self._count = 0
        self._opened_at = self._clock()
        self._set(State.OPEN)

    def _set(self, state: State) -> None:
        changed = state is not self._state
        self._state = state
        if changed and self._on_change is not None:
            self._on_change(state)
