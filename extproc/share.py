"""Who gets the capacity when there is not enough: priorities, and fair shares between tenants.

Pure functions; the admission step (``extproc.step``) applies them after ``decide`` has found
that a request fits.

**Groups.** Each request belongs to two groups the ledger counts (in-flight requests and
outstanding work per group, atomically with the pool's totals): its priority ``p:<level>`` and,
when tenants are attributed, its tenant ``t:<name>``. The pool's learning measures each group's
arrival rate and time in flight (``extproc.learning.Demand``).

**Priority.** A level is an integer, higher first; ``critical`` is 1, ``standard`` 0,
``sheddable`` -1. The engines serve first come, first served, so a request already waits
behind everything in flight, whatever its priority; ``decide`` accounts for that. What a
priority adds is a *reserve*: a request is admitted only if it would also fit after the
requests of every higher priority expected to arrive while it runs. A request of the highest
priority present is refused only when it would miss its own deadline.

**Fair share.** While the pool is contended (the outstanding work of every tenant, this request
included, exceeds what the pool's slots hold), each tenant is entitled to its weighted max-min
share of that work: the water level ``L`` with ``sum_i min(W_i, w_i L) = C``. A tenant whose
outstanding work with this request exceeds ``w L`` is over its share, and its request must also
leave room for the tenants under their share: the same reserve, for their expected arrivals.
Shares are in GPU time (the ledger's cost), not in requests: a tenant of long prompts does not
get more of the fleet by sending fewer, larger requests.

**The reserve** for a set of protected groups over ``T``, the admitted request's predicted
time in flight: each group ``g`` has ``n`` requests in flight, arrivals at ``lambda`` a second,
each in flight ``D`` on average. After ``T`` it expects ``n (1 - T / D)+`` of those still
running and ``lambda min(T, D)`` newcomers (an infinite-server queue), so its growth is the
difference from ``n``; arrivals are Poisson, so two standard deviations are added::

    reserve = ( sum_g [n_g (1 - T/D_g)+ + lambda_g min(T, D_g) - n_g]
                + 2 sqrt(sum_g lambda_g min(T, D_g)) )+

A protected group at its steady level (``n = lambda D``) needs only the fluctuation; one that
is arriving but holds nothing yet (a tenant starting, critical traffic rising) needs its whole
expected demand; one that is draining frees room. Measured, not a fixed split: with no
protected traffic the reserve is zero and a single tenant or priority takes the whole fleet.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import quote, unquote

CRITICAL, STANDARD, SHEDDABLE = 1, 0, -1
LEVELS = {"critical": CRITICAL, "standard": STANDARD, "sheddable": SHEDDABLE}
LABELS = {v: k for k, v in LEVELS.items()}
MAX_LEVEL = 100  # levels are -100..100: a metric label each, so a bounded set
RESERVE_Z = 2.0  # standard deviations of Poisson arrivals the reserve adds


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


@dataclass(frozen=True, slots=True)
class Flow:
    """A group as the reserve sees it: in flight now, arrivals a second, mean time in flight."""

    inflight: float
    rate: float
    duration_s: float


def reserve(flows: Iterable[Flow], horizon_s: float) -> float:
    """Requests' worth of room to keep for ``flows`` over ``horizon_s`` (module docstring)."""
    growth = variance = 0.0
    for f in flows:
        d = f.duration_s if f.duration_s > 0 else horizon_s
        arriving = f.rate * min(horizon_s, d)
        staying = f.inflight * max(0.0, 1.0 - horizon_s / d) if d > 0 else 0.0
        growth += staying + arriving - f.inflight
        variance += arriving
    return max(0.0, growth + RESERVE_Z * math.sqrt(variance))


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
