"""Who gets the capacity when there is not enough: priorities, and fair shares between tenants.

Pure functions; the admission step (``extproc.decision.step``) applies them after ``decide`` has
found that a request fits.

**Groups.** Each request belongs to two groups the ledger counts (in-flight requests and
outstanding work per group, atomically with the pool's totals): its priority ``p:<level>`` and,
when tenants are attributed, its tenant ``t:<name>``. The pool's learning measures each group's
arrival rate and time in flight (``extproc.decision.learning.Demand``).

**Priority.** A level is an integer, higher first; ``critical`` is 1, ``standard`` 0,
``sheddable`` -1. The engines serve first come, first served, so a request already waits
behind everything in flight, whatever its priority; ``decide`` accounts for that. What a
priority adds is *headroom*: a request is admitted only if it would also fit after the
requests of every higher priority expected to arrive while it runs. A request of the highest
priority present is refused only when it would miss its own deadline.

**Fair share.** While the pool is contended (the outstanding work of every tenant, this request
included, exceeds what the pool's slots hold), each tenant is entitled to its weighted max-min
share of that work: the water level ``L`` with ``sum_i min(W_i, w_i L) = C``. A tenant whose
outstanding work with this request exceeds ``w L`` is over its share, and its request must also
leave room for the tenants under their share: the same headroom, for their expected arrivals.
Shares are in GPU time (the ledger's cost), not in requests: a tenant of long prompts does not
get more of the fleet by sending fewer, larger requests.

**The headroom.** Requests are admitted while the engines' queues hold fewer than some limit
(what ``decide`` finds still meets a deadline). A demoted request is admitted only below that
limit less ``r`` places: the room kept for the protected traffic, arriving at ``lambda`` a
second. Freed slots go to whoever asks first, and under overload demoted requests always ask;
but they stop ``r`` places short, so the protected arrivals fill those places, and every
departure (the pool's, at ``mu`` a second: requests in flight over their mean time in flight)
empties one. The protected excess over the demoted level is a birth-death queue, born at
``lambda`` and drained at ``mu``; it passes ``r`` with probability ``rho^r``, ``rho = lambda /
mu``, and a protected request is refused only then. So::

    r = log(MISS) / log(rho)                    (MISS = 1%: the attainment target's)

never more than the protected arrivals expected while the demoted request runs, ``T``, with two
standard deviations (``lambda T + 2 sqrt(lambda T)``), which is also ``r`` when the protected
traffic alone would keep the pool busy (``rho >= 1``). Measured, not a fixed split: with no
protected traffic the headroom is zero and a single tenant or priority takes the whole fleet;
with a trickle it is a place or two.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from urllib.parse import quote, unquote

CRITICAL, STANDARD, SHEDDABLE = 1, 0, -1
LEVELS = {"critical": CRITICAL, "standard": STANDARD, "sheddable": SHEDDABLE}
LABELS = {v: k for k, v in LEVELS.items()}
MAX_LEVEL = 100  # levels are -100..100: a metric label each, so a bounded set
HEADROOM_Z = 2.0  # standard deviations of Poisson arrivals the headroom adds
MISS = 0.01  # the chance a protected request finds its headroom full


def parse_priority(value: object) -> int | None:
    """A level from a name (``critical``, ``standard``, ``sheddable``) or a whole number in
    ``[-MAX_LEVEL, MAX_LEVEL]`` (an integer, or its decimal text); None otherwise."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        text = value.strip().lower()
        if text in LEVELS:
            return LEVELS[text]
        try:
            value = int(text)
        except ValueError:
            return None
    if isinstance(value, int) and -MAX_LEVEL <= value <= MAX_LEVEL:
        return value
    return None


def priority_label(level: int) -> str:
    """The metric label of a level: its name, or the number."""
    return LABELS.get(level, str(level))


def priority_group(level: int) -> str:
    return f"p:{level}"


def tenant_group(name: str) -> str:
    """Percent-encoded: a group name never holds a space (the Redis ledger's separator)."""
    return f"t:{quote(name, safe='')}"


def level_of(group: str) -> int | None:
    """The level of a priority group, None for any other group."""
    return int(group[2:]) if group.startswith("p:") else None


def tenant_of(group: str) -> str | None:
    return unquote(group[2:]) if group.startswith("t:") else None


def places(rate: float, departures: float, horizon_s: float) -> float:
    """Places to keep for protected arrivals at ``rate`` a second, the pool's requests
    leaving at ``departures`` a second, for a request in flight ``horizon_s`` (docstring)."""
    if rate <= 0 or horizon_s <= 0:
        return 0.0
    arrivals = rate * horizon_s
    most = arrivals + HEADROOM_Z * math.sqrt(arrivals)
    rho = rate / departures if departures > 0 else math.inf
    if rho >= 1.0:
        return most
    return min(most, math.log(MISS) / math.log(rho))


def water_level(demands: Mapping[str, tuple[float, float]], capacity: float) -> float:
    """The max-min level ``L``: ``sum_i min(W_i, w_i L) = capacity`` for demands ``name ->
    (W, w)``; ``inf`` when every demand fits (nobody is over a share)."""
    if sum(w for w, _ in demands.values()) <= capacity:
        return math.inf
    left = capacity
    ordered = sorted(demands.values(), key=lambda d: d[0] / d[1])
    weights = sum(weight for _, weight in ordered)
    for work, weight in ordered:
        level = left / weights
        if work / weight > level:
            return level
        left -= work
        weights -= weight
    return math.inf  # unreachable: the demands exceed the capacity


def over_share(tenant: str, demands: Mapping[str, tuple[float, float]],
               capacity: float) -> bool:
    """Whether ``tenant``'s demand (its outstanding work, its request included) exceeds its
    weighted max-min share of ``capacity``."""
    work, weight = demands[tenant]
    return work > weight * water_level(demands, capacity)
