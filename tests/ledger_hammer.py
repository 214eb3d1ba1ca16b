"""A worker process for the cross-process atomicity test: small imports, so that spawning
several of them costs little (the test module itself imports pytest and hypothesis)."""

from __future__ import annotations

import asyncio
import random

from extproc import config
from extproc.ledger import Entry
from extproc.ledger.redis import RedisLedger

CEILING_MS = 2_000.0


def hammer(url: str, prefix: str, seed: int, rounds: int, cost_range: tuple[float, float],
            release: bool) -> tuple[list[float], list[float], int]:
    """One OS process: waves of concurrent reserves against one ceiling, releasing some of
    its own entries between waves. Returns (costs recorded, costs released, refusals)."""

    async def run() -> tuple[list[float], list[float], int]:
        settings_ = {"kind": "redis", "url": url, "timeout_ms": 5_000, "key_prefix": prefix}
        ledger = RedisLedger.from_config(config.from_mapping({"ledger": settings_}).ledger,
                                         ["p"])
        rng = random.Random(seed)
        held: list[tuple[str, float]] = []
        recorded: list[float] = []
        released: list[float] = []
        refused = 0
        try:
            for wave in range(rounds):
                costs = [rng.uniform(*cost_range) for _ in range(25)]
                ids = [f"{seed}-{wave}-{i}" for i in range(len(costs))]
                answers = await asyncio.gather(*(
                    ledger.reserve(Entry(i, "p", c, 60_000), CEILING_MS)
                    for i, c in zip(ids, costs, strict=True)))
                for rid, cost, ok in zip(ids, costs, answers, strict=True):
                    if ok:
                        held.append((rid, cost))
                        recorded.append(cost)
                    else:
                        refused += 1
                if release:
                    rng.shuffle(held)
                    gone, held = held[: len(held) // 2], held[len(held) // 2:]
                    for rid, cost in gone:
                        assert await ledger.release(rid, "p")
                        released.append(cost)
        finally:
            await ledger.close()
        return recorded, released, refused

    return asyncio.run(run())


def race_for_slots(url: str, prefix: str, seed: int, rounds: int,
                   slots: int) -> tuple[int, int, int]:
    """One OS process: waves of 25 concurrent reserves that may hold at most ``slots`` entries
    in all (``max_inflight``, no work ceiling), releasing its entries at random between
    waves. Returns (entries recorded, entries released, refusals)."""

    async def run() -> tuple[int, int, int]:
        settings_ = {"kind": "redis", "url": url, "timeout_ms": 5_000, "key_prefix": prefix}
        ledger = RedisLedger.from_config(config.from_mapping({"ledger": settings_}).ledger,
                                         ["p"])
        rng = random.Random(seed)
        held: list[str] = []
        recorded = released = refused = 0
        try:
            for wave in range(rounds):
                ids = [f"{seed}-{wave}-{i}" for i in range(25)]
                answers = await asyncio.gather(*(
                    ledger.reserve(Entry(i, "p", 10.0, 60_000), None, slots) for i in ids))
                for rid, ok in zip(ids, answers, strict=True):
                    if ok:
                        held.append(rid)
                        recorded += 1
                    else:
                        refused += 1
                rng.shuffle(held)
                k = rng.randint(0, len(held))
                gone, held = held[:k], held[k:]
                for rid in gone:
                    assert await ledger.release(rid, "p")
                    released += 1
                await asyncio.sleep(rng.uniform(0.0, 0.002))
        finally:
            await ledger.close()
        return recorded, released, refused

    return asyncio.run(run())


CAP = 5  # the capped tenant's most requests in flight


def hammer_cap(url: str, prefix: str, seed: int, rounds: int) -> int:
    """One OS process: waves of concurrent reserves of one capped tenant (``CAP`` requests),
    releasing some of its own between waves. Returns how many it recorded."""
    from extproc.ledger import Cap

    async def run() -> int:
        settings_ = {"kind": "redis", "url": url, "timeout_ms": 5_000, "key_prefix": prefix}
        ledger = RedisLedger.from_config(config.from_mapping({"ledger": settings_}).ledger,
                                         ["p"])
        rng = random.Random(seed)
        held: list[str] = []
        recorded = 0
        caps = (Cap("t:acme", max_inflight=CAP, max_ms=CAP * 100.0),)
        try:
            for wave in range(rounds):
                ids = [f"{seed}-{wave}-{i}" for i in range(10)]
                answers = await asyncio.gather(*(
                    ledger.reserve(Entry(i, "p", 100.0, 60_000, groups=("p:0", "t:acme")),
                                   caps=caps) for i in ids))
                for rid, ok in zip(ids, answers, strict=True):
                    if ok:
                        held.append(rid)
                        recorded += 1
                rng.shuffle(held)
                gone, held = held[: len(held) // 2], held[len(held) // 2:]
                for rid in gone:
                    assert await ledger.release(rid, "p")
        finally:
            await ledger.close()
        return recorded

    return asyncio.run(run())
