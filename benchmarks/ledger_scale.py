"""Reserve+release latency of the Redis ledger at 10, 1,000 and 100,000 in-flight entries.

The claim under test: the ledger's cost does not grow with load (the outstanding work is an
aggregate the scripts keep; every script is O(log n) at most). Target: the 100,000-entry pool
within 1.5x of the 10-entry pool.

Method, in one run so that the figures are comparable:

1. Three pools live side by side in one Redis, filled (through the very ``reserve`` script,
   pipelined) to 10, 1,000 and 100,000 entries with hour-long leases.
2. Client view: rounds of one reserve+release pair per pool, in a shuffled order each round,
   one call at a time as a gateway makes them (``RedisLedger`` from ``redis.asyncio``), each
   reserve with a ceiling so the check runs. Drift and noise hit every size alike.
3. Server view: per size, ``INFO commandstats`` microseconds per EVALSHA over a phase of pairs
   on that pool alone (``CONFIG RESETSTAT`` first): Redis's own cost, without the network and
   the Python client.

Usage::

    python benchmarks/ledger_scale.py [--url redis://HOST:PORT] [--pairs 3000] [--out FILE]

Without ``--url`` it starts its own ``redis-server`` on a free port (``tests/redis_server.py``).
Prints a table and writes JSON (default ``benchmarks/results/ledger_scale.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from extproc import config  # noqa: E402
from extproc.ledger import Entry  # noqa: E402
from extproc.ledger.redis import _RESERVE, RedisLedger  # noqa: E402

SIZES = (10, 1_000, 100_000)
LEASE_MS = 3_600_000.0
COST_MS = 1_234.5
CEILING_MS = 1e15  # checked on every reserve, never reached
TARGET = 1.5


def fill(url: str, prefix: str, pool: str, n: int) -> None:
    """``n`` entries through the reserve script itself, pipelined in batches."""
    client = redis.Redis.from_url(url)
    ledger = RedisLedger(None, key_prefix=prefix)
    keys = ledger.keys(pool)
    sha = client.script_load(_RESERVE.source)  # as the ledger sends it: helpers in front
    for start in range(0, n, 5_000):
        pipe = client.pipeline(transaction=False)
        for i in range(start, min(n, start + 5_000)):
            # id, cost, lease, no ceiling, no KV tokens, no count, no groups
            pipe.evalsha(sha, len(keys), *keys, f"fill-{i}", repr(COST_MS), repr(LEASE_MS),
                         "", "0", "", "")
        pipe.execute()
    assert client.zcard(keys[0]) == n
    client.close()


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def pair(ledger: RedisLedger, pool: str) -> float:
    rid = uuid.uuid4().hex
    started = time.perf_counter()
    ok = await ledger.reserve(Entry(rid, pool, COST_MS, LEASE_MS), CEILING_MS)
    released = await ledger.release(rid, pool)
    elapsed = time.perf_counter() - started
    assert ok and released
    return elapsed * 1e6


async def measure(url: str, prefix: str, pools: dict[int, str], pairs: int,
                  server_pairs: int) -> dict[int, dict[str, float]]:
    settings = config.from_mapping({"ledger": {"kind": "redis", "url": url, "timeout_ms": 1_000,
                                               "key_prefix": prefix}})
    ledger = RedisLedger.from_config(settings.ledger, list(pools.values()))
    admin = redis.Redis.from_url(url)
    rng = random.Random(7)
    client_us: dict[int, list[float]] = {n: [] for n in pools}
    try:
        for pool in pools.values():  # warm: connections, scripts cached
            for _ in range(50):
                await pair(ledger, pool)
        for _ in range(pairs):
            order = list(pools.items())
            rng.shuffle(order)
            for n, pool in order:
                client_us[n].append(await pair(ledger, pool))
        server_us: dict[int, float] = {}
        for n, pool in pools.items():
            admin.config_resetstat()
            for _ in range(server_pairs):
                await pair(ledger, pool)
            stats = admin.info("commandstats")["cmdstat_evalsha"]
            server_us[n] = float(stats["usec"]) / float(stats["calls"])
        for n, pool in pools.items():
            snap = await ledger.snapshot(pool)
            assert snap.inflight == n, (pool, snap)  # every pair left the pool as it was
    finally:
        await ledger.close()
        admin.close()
    return {n: {
        "pairs": len(samples),
        "p50_us": statistics.median(samples),
        "p90_us": pct(samples, 0.90),
        "p99_us": pct(samples, 0.99),
        "mean_us": statistics.fmean(samples),
        "server_us_per_script_call": server_us[n],
    } for n, samples in client_us.items()}


def run(url: str, pairs: int) -> dict[str, Any]:
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    pools = {n: f"size{n}" for n in SIZES}
    started = time.perf_counter()
    for n, pool in pools.items():
        fill(url, prefix, pool, n)
    fill_s = time.perf_counter() - started
    try:
        import uvloop  # what ``extproc serve`` runs on

        results = uvloop.run(measure(url, prefix, pools, pairs, min(pairs, 2_000)))
    except ImportError:
        results = asyncio.run(measure(url, prefix, pools, pairs, min(pairs, 2_000)))
    client = redis.Redis.from_url(url)
    version = client.info("server")["redis_version"]
    for key in client.scan_iter(f"{prefix}:*"):
        client.delete(key)
    client.close()
    small = results[SIZES[0]]
    ratios = {str(n): {k: r[k] / small[k] for k in ("p50_us", "mean_us",
                                                      "server_us_per_script_call")}
              for n, r in results.items()}
    largest = ratios[str(SIZES[-1])]
    return {
        "benchmark": "ledger_scale",
        "what": "Redis ledger reserve (with ceiling) + release, one call at a time",
        "redis_version": version,
        "fill_seconds": round(fill_s, 2),
        "sizes": {str(n): {k: round(v, 2) for k, v in r.items()} for n, r in results.items()},
        "ratio_to_smallest": {n: {k: round(v, 3) for k, v in r.items()}
                              for n, r in ratios.items()},
        "target": f"{SIZES[-1]:,} entries within {TARGET}x of {SIZES[0]}",
        "within_target": largest["p50_us"] <= TARGET and largest["mean_us"] <= TARGET,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", help="an existing Redis (default: start one on a free port)")
    p.add_argument("--pairs", type=int, default=3_000, help="measured pairs per size")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/ledger_scale.json"))
    args = p.parse_args(argv)
    if args.url:
        report = run(args.url, args.pairs)
    else:
        from tests.redis_server import RedisServer

        with RedisServer() as server:
            report = run(server.url, args.pairs)
    print(f"{'entries':>9} {'p50 µs':>8} {'p90 µs':>8} {'p99 µs':>8} {'mean µs':>8}"
          f" {'server µs/call':>15} {'p50 ratio':>10} {'server ratio':>13}")
    for n, r in report["sizes"].items():
        ratio = report["ratio_to_smallest"][n]
        print(f"{int(n):>9,} {r['p50_us']:>8.0f} {r['p90_us']:>8.0f} {r['p99_us']:>8.0f}"
              f" {r['mean_us']:>8.0f} {r['server_us_per_script_call']:>15.2f}"
              f" {ratio['p50_us']:>9.2f}x {ratio['server_us_per_script_call']:>12.2f}x")
    print(f"target ({report['target']}): {'met' if report['within_target'] else 'MISSED'}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if report["within_target"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
