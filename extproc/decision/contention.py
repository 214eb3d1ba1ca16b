"""What a request must leave to others when the pool is contended: the admission step's use of
priorities, fair shares and tenant caps (the rules themselves, pure, are ``extproc.decision.share``;
the step, ``extproc.decision.step``, calls these after ``decide`` admitted).

- ``caps`` / ``at_cap``: a tenant's hard caps, checked on the ledger's snapshot (refused
  ``TENANT_CAP``) and handed to the ledger's atomic reserve.
- ``room_for_others``: an admitted request of a lower priority, or of a tenant over its share
  of a contended pool, must still fit after the headroom kept for the traffic it must not crowd
  out (refused ``PRIORITY`` or ``FAIR_SHARE``); otherwise its ledger checks are tightened by
  that room. Shares are of what the model admits, or of the lesser of the measured level and
  the slots where both allow more: shared out of the level alone, a steady tenant kept 0.50x
  its goodput alone beside a neighbour's burst on 70b-16 at 1.5x and 0.15x at 3x (the burst's
  refusals leave room the level probes, past the slots); out of the model's alone, a cold
  start's strict model held two tenants to 12-14 requests of 64 slots for half a minute, each
  keeping room for the other (``room_for_others``). A tenant over its share may use the
  measured level (``extproc.decision.level``) past the model like any other once the room for
  the tenants under theirs is kept (measured: the steady tenant keeps all of its
  goodput at 3x where it kept 0.85x when only tenants within their share could, and a
  1024-sequence pool serves 1.14-1.23x more in time beside a burst).
- ``admission_limit``: the most requests the pool holds while one like this is still admitted,
  the level shares are counted against and the headroom's departures are measured at.

``Scene`` is what one decision sees of its pool, handed down whole.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from extproc.decision.admission import (
    Capacity,
    Cost,
    Decision,
    Outcome,
    Policy,
    Reason,
    Snapshot,
    decide,
)
from extproc.decision.level import measured
from extproc.decision.share import (
    HEADROOM_Z,
    level_of,
    over_share,
    places,
    tenant_group,
    tenant_of,
    water_level,
)
from extproc.ledger import Cap

if TYPE_CHECKING:
    from extproc.decision.learning import PoolLearning
    from extproc.decision.rules import Rules


def caps(tenant: str | None, rules: Rules) -> tuple[Cap, ...]:
    """A tenant's hard caps (``tenant.tenants.<name>`` or ``tenant.others``)."""
    if tenant is None:
        return ()
    policy = rules.tenant.policy(tenant)
    if policy.max_inflight is None and policy.max_outstanding_s is None:
        return ()
    most_ms = None if policy.max_outstanding_s is None else policy.max_outstanding_s * 1000.0
    return (Cap(tenant_group(tenant), policy.max_inflight, most_ms),)


def at_cap(caps: tuple[Cap, ...], decision: Decision, snapshot: Snapshot) -> Decision | None:
    """A refusal (``TENANT_CAP``) when the ledger's snapshot already puts the tenant at a cap;
    the reserve checks the same caps atomically. Retry when one of its requests has ended."""
    for cap in caps:
        n, work = snapshot.groups.get(cap.group, (0, 0.0))
        if ((cap.max_inflight is not None and n + 1 > cap.max_inflight)
                or (cap.max_ms is not None and work + decision.charge_ms > cap.max_ms)):
            return dataclasses.replace(
                decision, outcome=Outcome.REJECT, reason=Reason.TENANT_CAP, ceiling_ms=None,
                max_inflight=None,
                retry_after_ms=max(1.0, decision.completion_ms / max(n, 1)))
    return None


@dataclass(frozen=True)
class Scene:
    """What one decision sees of its pool: the rules, the pool's learning, the ledger's
    snapshot (corrected by the engines), the pool's capacity, this gateway's share of the
    pool's requests in flight (``extproc.decision.step.admit``) and the time."""

    rules: Rules
    learning: PoolLearning
    snapshot: Snapshot
    capacity: Capacity
    share: float
    now: float


def room_for_others(tenant: str | None, priority: int, cost: Cost, decision: Decision,
                    policy: Policy, scene: Scene) -> tuple[Decision | None, int]:
    """Priorities and fair shares (``extproc.decision.share``): an admitted request must also fit
    after the room kept for the traffic it must not crowd out, expected while it runs: every
    higher priority's, and, when its tenant is over its share of a contended pool, the
    tenants' under theirs. Returns the refusal (``PRIORITY`` or ``FAIR_SHARE``), the decision
    with its ledger checks tightened by that room, or None when nothing is kept; and the
    admission limit it was measured against (0: none), which the pool records once per
    request (``PoolLearning.decided``: deciding only reads)."""
    rules, learning, snapshot, capacity, now = (
        scene.rules, scene.learning, scene.snapshot, scene.capacity, scene.now)
    # With defer on, a higher priority that finds the pool full is held and goes first at the
    # next release (``extproc.decision.defer``): no room is kept for its predicted arrivals.
    protected = [] if rules.holds else [
        g for g in learning.flows if (level := level_of(g)) is not None and level > priority]
    several = tenant is not None and rules.tenant.fair_share and sum(
        1 for g in learning.flows if tenant_of(g) is not None) > 1
    if not protected and not several:
        return None, 0
    n = snapshot.inflight
    mean_ms = snapshot.outstanding_ms / n if n else decision.charge_ms
    seen_n = math.floor(learning.level.level_ms * capacity.replicas / max(mean_ms, 1e-9))
    model = admission_limit(cost, snapshot, capacity, policy, now, learning.limit.mean)
    limit = max(model, seen_n)  # the model's, or what was measured (``extproc.decision.level``)
    # ``under``: the tenants under their share this one must leave room for (None: it is
    # within its own). Shares of the model's limit, or of the lesser of the measured level and
    # the pool's slots where both are above it. Not of the level alone: past the slots (a
    # 16-slot fleet's level runs to 1.5x them) a burst would be nobody's over-share while the
    # engines queue it. Not of the model alone: where it is stricter than measurement (a cold
    # start's prior), the pool holds its room's worth, every tenant reads over its share and
    # keeps room for the others' expected arrivals, more places than the pool has: all refused,
    # the level and the slots far above (docs/admission.md, "The fair share's room").
    under = None
    if tenant is not None and several:
        room = max(model, min(limit, capacity.slots_with(snapshot, cost))) * mean_ms
        under = _under_their_share(tenant, decision, scene, room, mean_ms)
    protected += under or []
    if not protected:
        return None, limit
    kept = _kept(protected, decision, learning, snapshot, limit, learning.limit.std, scene.share,
                 now)
    if kept <= 0:
        return None, limit
    mean_kv = snapshot.kv_tokens / n if n else cost.kv
    ahead = dataclasses.replace(snapshot, inflight=n + kept,
                                outstanding_ms=snapshot.outstanding_ms + kept * mean_ms,
                                kv_tokens=round(snapshot.kv_tokens + kept * mean_kv))
    seen = decide(cost, ahead, capacity, policy, now)
    seen = measured(seen, cost, ahead, capacity, learning.level,
                    ttft_budget_ms=policy.ttft_budget_ms) or seen
    if not seen.admitted:
        return dataclasses.replace(
            seen, outcome=Outcome.REJECT,
            reason=Reason.FAIR_SHARE if under is not None else Reason.PRIORITY,
            retry_after_ms=max(1.0, seen.retry_after_ms or 0.0)), limit
    assert seen.ceiling_ms is not None and seen.max_inflight is not None
    assert decision.ceiling_ms is not None and decision.max_inflight is not None
    return dataclasses.replace(
        decision, ceiling_ms=min(decision.ceiling_ms, seen.ceiling_ms - kept * mean_ms),
        max_inflight=min(decision.max_inflight, seen.max_inflight - kept)), limit


def _under_their_share(tenant: str, decision: Decision, scene: Scene, room: float,
                       mean_ms: float) -> list[str] | None:
    """None when ``tenant`` is within its weighted max-min share of ``room``, the work tenants
    share (``room_for_others``; requests of ``mean_ms`` each); otherwise the groups of
    the other tenants holding less than theirs, whose expected arrivals it must leave room
    for. A tenant's demand is its outstanding work, or what its arrivals keep in flight
    (Little's law), whichever is more: a tenant crowded out still wants its share. Its
    arrivals stay in flight as long as its requests took, or as long as a typical request
    takes now (this decision's first token, then the pool's mean answer at its step),
    whichever is longer: what a tenant's requests took is known only once they end, too late
    in a burst that slows everyone's (docs/admission.md, "A tenant's demand at the pool's
    pace now")."""
    learning, snapshot, share, now = scene.learning, scene.snapshot, scene.share, scene.now
    weights = scene.rules.tenant.policy
    demands = {t: (work, weights(t).weight) for g, (_, work) in snapshot.groups.items()
               if (t := tenant_of(g)) is not None}
    typical_s = (decision.ttft_ms
                 + scene.capacity.mix.output_tokens * decision.step_ms) / 1000.0
    for g, flow in learning.flows.items():
        if (t := tenant_of(g)) is not None:
            steady = flow.rate(now) / share * max(flow.duration_s, typical_s) * mean_ms
            demands[t] = (max(demands.get(t, (0.0, 0.0))[0], steady), weights(t).weight)
    _, mine = snapshot.groups.get(tenant_group(tenant), (0, 0.0))
    demands[tenant] = (mine + decision.charge_ms, weights(tenant).weight)
    if not over_share(tenant, demands, room):
        return None
    fair = water_level(demands, room)
    return [g for g in learning.flows
            if (t := tenant_of(g)) is not None and t != tenant
            and snapshot.groups.get(g, (0, 0.0))[1] / weights(t).weight < fair]


def _kept(protected: list[str], decision: Decision, learning: PoolLearning,
          snapshot: Snapshot, limit: int, swing: float, share: float, now: float) -> int:
    """Places to keep for the ``protected`` groups (``share.places``): their arrivals there
    is evidence for, the pool's departures at its admission limit, over this request's time
    in flight; plus two measured standard deviations of the limit itself, which moves with
    the traffic's mix from one arrival to the next and with each request's own size, weighed
    by the chance that a protected request (at the rate there is evidence for) arrives while
    this one runs. With none in evidence nothing is kept: while a fresh pool learns its limit
    the limit swings most, and two deviations of it kept 47 places of a limit of 21 for a
    critical priority not yet seen, refusing standard and sheddable traffic alike.

    Departures are measured on what runs (Little's law: each priority's requests in flight,
    the ledger's count, over their mean time in flight), scaled to the limit. Not on what
    asks: a flood of refused sheddable requests departs nothing, and weighing the pool's
    time in flight by arrivals once let a sheddable flood at 3x turn the headroom kept for
    critical requests into more than the whole limit (133 places of 108 on 70b-vllm), so
    that standard requests kept 0.28x of their goodput alone while the pool half idled."""
    horizon_s = decision.completion_ms / 1000.0
    rate = sum(learning.flows[g].rate(now, HEADROOM_Z) for g in protected) / share
    running = [(n, (flow.duration_s if (flow := learning.flows.get(g)) else 0.0) or horizon_s)
               for g, (n, _) in snapshot.groups.items() if level_of(g) is not None and n > 0]
    inflight = sum(n for n, _ in running)
    if inflight:
        departures = sum(n / held_s for n, held_s in running) * max(limit, inflight) / inflight
    else:
        departures = max(limit, 1) / horizon_s if horizon_s > 0 else math.inf
    arrives = -math.expm1(-rate * horizon_s)  # the chance one comes while this one runs
    return math.ceil(places(rate, departures, horizon_s) + HEADROOM_Z * swing * arrives - 1e-9)


def admission_limit(cost: Cost, snapshot: Snapshot, capacity: Capacity, policy: Policy,
                    now: float, hint: float | None = None) -> int:
    """The most requests the pool holds while one like this is still admitted: its work at
    that level is what tenants share (the slots overstate it wherever the deadline binds
    first, and the KV cache where it binds). Found by search on the in-flight count (the
    requests in flight kept at their mean work and KV) from ``hint``, the limit recent
    requests met: a few decisions, not a bisection from nothing."""
    n = snapshot.inflight
    mean_ms = snapshot.outstanding_ms / n if n else capacity.charge_ms(cost)
    mean_kv = snapshot.kv_tokens / n if n else cost.kv

    def fits(count: int) -> bool:
        at = dataclasses.replace(snapshot, inflight=count, outstanding_ms=count * mean_ms,
                                 kv_tokens=round(count * mean_kv))
        return decide(cost, at, capacity, policy, now).admitted

    low = n  # it fits here: it was admitted at n
    start = max(n + 1, round(hint)) if hint is not None else n + 1
    if start > n + 1 and not fits(start - 1):
        high = start - 1  # the limit is below the hint
    else:
        low = max(low, start - 1)
        step = 1
        while fits(low + step) and step < 1 << 20:
            low, step = low + step, step * 2
        high = low + step
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return max(1, low + 1)
