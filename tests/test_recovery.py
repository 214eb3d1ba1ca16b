"""What a gateway owes the ledger after an outage, and when it pays: the gate and its leases
against a memory ledger that can be switched off (every call raises ``LedgerUnavailable``), so
the order of calls is exact and no process or timing is involved. ``test_redis_faults`` drives
the same promises through real Redis outages.

The scenario: three requests admitted while the ledger answers; it goes away; one of them ends
(the release it misses is owed) and one more is admitted fail-open (its entry is owed); it
comes back. Whichever comes first, the next decision or the health probe, pays both before
anything reads the ledger for a decision.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence

import pytest

from extproc import config
from extproc.decision.admission import Reason, Snapshot
from extproc.errors import LedgerUnavailable
from extproc.fleet.capacity import StaticCapacity
from extproc.gateway.gate import Gate
from extproc.gateway.localview import View
from extproc.gateway.tenant import Tenant
from extproc.gateway.verdict import Ticket, Verdict
from extproc.ledger import Cap, Entry
from extproc.ledger.memory import MemoryLedger
from extproc.observability.metrics import Metrics


class SwitchedLedger(MemoryLedger):
    """A memory ledger that fails every call while ``down``, and logs every call it takes
    (``calls``: op, request id or pool) with the entries it held then (``held``)."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False
        self.calls: list[tuple[str, str]] = []
        self.held: list[frozenset[str]] = []
        self.answers: list[asyncio.Event] = []  # the snapshots' answers wait for these, in turn
        self.waiting = 0  # snapshots waiting for their answer's turn
        self.two_waiting = asyncio.Event()

    def _take(self, op: str, key: str) -> None:
        if self.down:
            raise LedgerUnavailable("switched off")
        self.calls.append((op, key))
        self.held.append(self.ids())

    def ids(self) -> frozenset[str]:
        """The request ids of the entries held now."""
        return frozenset(self.core._pool("llama").entries)

    async def reserve(self, entry: Entry, ceiling_ms: float | None = None,
                      max_inflight: int | None = None, caps: Sequence[Cap] = ()) -> bool:
        self._take("reserve", entry.request_id)
        return await super().reserve(entry, ceiling_ms, max_inflight, caps)

    async def release(self, request_id: str, pool: str) -> bool:
        self._take("release", request_id)
        return await super().release(request_id, pool)

    async def heartbeat(self, pool: str, request_ids: Sequence[str],
                        lease_ms: float) -> list[str]:
        self._take("heartbeat", pool)
        return await super().heartbeat(pool, request_ids, lease_ms)

    async def snapshot(self, pool: str) -> Snapshot:
        self._take("snapshot", pool)
        taken = await super().snapshot(pool)  # the pool as it is when the call is sent
        if self.answers:
            turn = self.answers.pop(0)
            self.waiting += 1
            if self.waiting == 2:
                self.two_waiting.set()
            await turn.wait()
            self.waiting -= 1
        return taken


def gate_on(ledger: SwitchedLedger) -> Gate:
    cfg = config.from_mapping({
        "listen": "127.0.0.1:0", "metrics_listen": "127.0.0.1:0",
        "pools": [{"name": "llama", "replicas": 1, "models": ["*"],
                   "engine": {"max_num_seqs": 16}}],
        # a shared ledger's settings (the fault policy is only theirs); never connected to
        "tenant": {"source": "header", "tenants": {"acme": {"max_inflight": 2}}},
        "ledger": {"kind": "redis", "url": "redis://127.0.0.1:1", "on_unavailable": "fail_open",
                   "decision_deadline_ms": 10_000},
    })
    return Gate(cfg, ledger, StaticCapacity(cfg.pools), Metrics())


async def decide(gate: Gate, tenant: str | None = None) -> Verdict:
    route = gate.config.route("/v1/chat/completions")
    assert route is not None
    body = {"model": "llama", "max_tokens": 16,
            "messages": [{"role": "user", "content": "the ledger came back"}]}
    return await gate.check(route, route.path, {}, json.dumps(body).encode(),
                            tenant=None if tenant is None else Tenant(tenant, tenant))


def ticket(verdict: Verdict) -> Ticket:
    assert verdict.ticket is not None, verdict
    return verdict.ticket


async def outage(gate: Gate, ledger: SwitchedLedger) -> tuple[set[str], str, str]:
    """Three admitted; the ledger goes away; the first ends, a fourth is admitted without the
    ledger; the ledger comes back. Returns the running ids, the ended one, the unrecorded one."""
    running = [ticket(await decide(gate)) for _ in range(3)]
    ledger.down = True
    ended = running.pop(0)
    await gate.settle(ended)
    outage_admitted = ticket(await decide(gate))
    assert not outage_admitted.recorded
    running.append(outage_admitted)
    ledger.down = False
    ledger.calls.clear()
    ledger.held.clear()
    assert gate.leases.owed()
    return {t.request_id for t in running}, ended.request_id, outage_admitted.request_id


async def test_the_first_decision_after_an_outage_pays_what_is_owed_before_it_reads() -> None:
    ledger = SwitchedLedger()
    gate = gate_on(ledger)
    running, ended, unrecorded = await outage(gate, ledger)
    verdict = await decide(gate)
    first_read = next(i for i, (op, _) in enumerate(ledger.calls) if op == "snapshot")
    assert ledger.calls[:first_read] == [("release", ended), ("heartbeat", "llama"),
                                         ("reserve", unrecorded)]
    assert ledger.held[first_read] == running  # what the decision read is what runs
    assert not gate.leases.owed()
    assert ledger.ids() == running | {ticket(verdict).request_id}


async def test_the_health_probe_pays_what_is_owed_so_serving_means_the_entries_are_back() -> None:
    ledger = SwitchedLedger()
    gate = gate_on(ledger)
    running, ended, unrecorded = await outage(gate, ledger)
    await gate.probe(ledger.snapshot("llama"))
    assert ledger.calls == [("snapshot", "llama"), ("release", ended), ("heartbeat", "llama"),
                            ("reserve", unrecorded)]
    assert ledger.ids() == running
    assert not gate.leases.owed()
    ledger.calls.clear()
    await decide(gate)  # nothing left to pay: the decision reads at once
    assert ledger.calls[0] == ("snapshot", "llama")


async def test_a_probe_cut_short_by_the_ledger_leaves_the_debt_for_the_next_one() -> None:
    ledger = SwitchedLedger()
    gate = gate_on(ledger)
    running, ended, unrecorded = await outage(gate, ledger)
    ledger.down = True
    with pytest.raises(LedgerUnavailable):
        await gate.probe(ledger.snapshot("llama"))
    assert gate.leases.owed()
    ledger.down = False
    await gate.probe(ledger.snapshot("llama"))
    assert ledger.ids() == running
    assert ("release", ended) in ledger.calls and ("reserve", unrecorded) in ledger.calls
    assert not gate.leases.owed()


async def test_the_local_view_counts_an_admission_made_while_another_decisions_read_was_out(
        ) -> None:
    """Two decisions read the ledger at once (both see it empty); the second's answer comes
    back after the first was admitted. The local view must hold both, as the ledger does:
    reset to the late answer, it forgot the first (and an outage then admitted one too many)."""
    ledger = SwitchedLedger()
    gate = gate_on(ledger)
    first, second = asyncio.Event(), asyncio.Event()
    ledger.answers = [first, second]
    one = asyncio.create_task(decide(gate))
    two = asyncio.create_task(decide(gate))
    await ledger.two_waiting.wait()
    first.set()
    ticket(await one)
    second.set()
    ticket(await two)
    assert len(ledger.ids()) == 2
    assert gate.leases.local("llama").inflight == 2
    ledger.down = True  # and the outage decides on it
    assert gate.leases.local("llama").inflight == 2


async def test_a_tenants_cap_holds_on_the_local_view_in_an_outage() -> None:
    """acme may have 2 in flight and has 2 when the ledger goes away: a third is refused on
    the local view, as the ledger would refuse it, while another tenant is admitted fail-open.
    (The local view used to drop the snapshot's groups, and let acme past its cap.)"""
    ledger = SwitchedLedger()
    gate = gate_on(ledger)
    for _ in range(2):
        ticket(await decide(gate, "acme"))
    assert (await decide(gate, "acme")).reason is Reason.TENANT_CAP
    ledger.down = True
    refused = await decide(gate, "acme")
    assert refused.ticket is None and refused.reason is Reason.TENANT_CAP
    assert not ticket(await decide(gate, "zeta")).recorded
    assert gate.leases.local("llama").groups["t:acme"][0] == 2


def test_the_local_view_keeps_the_newest_snapshot_by_when_its_call_was_sent() -> None:
    """Times are when calls were sent. A change before a snapshot's call is in it; one after
    is added; an older call's answer that comes back late changes nothing."""
    view = View()
    view.change((1, 100.0, 10), ("t:a",), at=1.0)
    view.saw(Snapshot(inflight=1, outstanding_ms=100.0, kv_tokens=10, groups={"t:a": (1, 100.0)}),
             sent=2.0)
    view.change((1, 50.0, 5), ("t:a",), at=3.0)
    view.saw(Snapshot(inflight=0, outstanding_ms=0.0), sent=0.5)
    seen = view.snapshot()
    assert (seen.inflight, seen.outstanding_ms, seen.kv_tokens) == (2, 150.0, 15)
    assert seen.groups == {"t:a": (2, 150.0)}
    view.saw(Snapshot(inflight=2, outstanding_ms=150.0, kv_tokens=15,
                      groups={"t:a": (2, 150.0)}), sent=4.0)
    assert view.snapshot().groups == {"t:a": (2, 150.0)} and view.changes == []
    view.change((-1, -100.0, -10), ("t:a",), at=5.0)  # one ends
    assert view.snapshot().groups == {"t:a": (1, 50.0)}
