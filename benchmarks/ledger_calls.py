"""Redis calls, client CPU and admissions/s of the gate's admit+release path: before vs after.

What issue 19's ledger lever changes: an admission read the pool's snapshot, then reserved
(two script calls), and each finished request released on its own (a third). Now the reserve
and release answers carry the snapshot the next decision reuses
(``extproc.gateway.leases.FRESH_MS``), and releases queued together go in one script call per pool.

Method, in one run so that the figures are comparable: one ``redis-server`` (free port,
``tests/redis_server.py``); each variant runs in a process of its own on uvloop, driving
``Gate.check`` and ``Gate.settle`` (the server's calls, without gRPC) against it:

- ``before``: the gate and ledger as of ``--base`` (default: where this branch left
  ``main``), extracted with ``git archive`` into a temporary directory placed first on
  ``sys.path``;
- ``after``: the working tree;
- ``after, FRESH_MS=0``: the working tree with the reuse off (every decision calls
  ``snapshot``; releases still batched): what each of the two levers gives; ``--fresh-ms``
  adds columns with other bounds.

Each variant runs ``--repeat`` times, interleaved, and each figure is the median of its runs.
Phases per variant (each after ``CONFIG RESETSTAT``, read back with ``INFO commandstats``):

- ``saturating``: ``--concurrency`` closed-loop clients, each admitting and at once settling
  one request after another (short chat prompt, a pool large enough to admit them all);
- ``moderate``: an open loop, Poisson arrivals at ``--rate`` requests/s, each held
  ``--hold-ms`` before it is settled;
- ``two gateways``: two gates (each its own ledger client) on one pool of 4 slots, 16
  closed-loop clients alternating between them, admissions held ``--hold-ms``: each gate's
  view misses the other's latest changes; the share admitted, reserve calls per decision
  (above 1: refused reserves decided again) and snapshot calls per decision.

Per phase: Redis calls per admitted request (the script calls the ledger sent: EVALSHA and
EVAL in commandstats) and Redis commands (those plus the commands the scripts ran), client
CPU per admission (``time.process_time`` of the whole process: parsing, pricing, deciding,
metrics and the Redis client), admissions/s, and the share of decisions
that called ``snapshot`` (``extproc_ledger_call_duration_seconds_count{op="snapshot"}``: the
view was older than ``FRESH_MS``, or a decision other than an admission was decided again).

Usage::

    python benchmarks/ledger_calls.py [--base REV] [--requests 4000] [--concurrency 32]
                                      [--rate 200] [--hold-ms 20] [--repeat 3]
                                      [--fresh-ms MS ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("before", "after", "after, FRESH_MS=0")
PHASES = ("saturating", "moderate", "two gateways")
DEADLINE_MS = float(os.environ.get("LEDGER_CALLS_DEADLINE_MS", "3000"))
LONG = json.dumps({"model": "m", "max_tokens": int(os.environ.get("LEDGER_CALLS_TOKENS", "256")),
                   "messages": [{"role": "user", "content": "Tell a story."}]}).encode()
BODY = json.dumps({"model": "m", "max_tokens": 16,
                   "messages": [{"role": "user", "content": "Say hello in one word."}]}).encode()


def settings(url: str) -> dict[str, Any]:
    return {
        "pools": [{"name": "llm", "replicas": 64, "bytes_per_token": 4.0,
                   "engine": {"max_num_seqs": 256}}],
        "ledger": {"kind": "redis", "url": url, "timeout_ms": 1_000,
                   "decision_deadline_ms": 1_000, "key_prefix": f"calls-{uuid.uuid4().hex[:8]}"},
    }


# --- one variant, in its own process ----------------------------------------------------------

async def phase(gate: Any, admin: Any, metrics: Any, name: str, requests: int,
                concurrency: int, rate: float, hold_s: float) -> dict[str, float]:
    route = gate.config.route("/v1/chat/completions")
    path = "/v1/chat/completions"
    admitted = decided = 0
    arrivals = random.Random(7)
    pending: set[asyncio.Task[None]] = set()

    async def one() -> None:
        nonlocal admitted, decided
        verdict = await gate.check(route, path, {}, BODY)
        decided += 1
        if verdict.ticket is not None:
            admitted += 1
            if hold_s:
                await asyncio.sleep(hold_s)
            await gate.settle(verdict.ticket)

    async def client(n: int) -> None:
        for _ in range(n):
            await one()

    def snapshots() -> float:
        value = metrics.registry.get_sample_value(
            "extproc_ledger_call_duration_seconds_count", {"op": "snapshot"})
        return float(value or 0.0)

    reads = snapshots()
    admin.config_resetstat()
    cpu, wall = time.process_time(), time.perf_counter()
    if name == "saturating":
        await asyncio.gather(*(client(requests // concurrency) for _ in range(concurrency)))
    else:
        for _ in range(requests):
            task = asyncio.create_task(one())
            pending.add(task)
            task.add_done_callback(pending.discard)
            await asyncio.sleep(arrivals.expovariate(rate))
        await asyncio.gather(*pending)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    await asyncio.sleep(0.05)  # releases still in flight land before the count is read
    stats = admin.info("commandstats")
    commands = sum(v["calls"] for k, v in stats.items()
                   if k not in ("cmdstat_info", "cmdstat_config|resetstat", "cmdstat_config"))
    calls = sum(stats.get(k, {}).get("calls", 0) for k in ("cmdstat_evalsha", "cmdstat_eval"))
    return {
        "decided": decided,
        "admitted": admitted,
        "redis_calls_per_admission": calls / admitted,
        "redis_commands_per_admission": commands / admitted,
        "client_cpu_us_per_admission": cpu / admitted * 1e6,
        "admissions_per_s": admitted / wall,
        "snapshot_calls_per_decision": (snapshots() - reads) / decided,
    }


async def two_gateways(url: str, requests: int, concurrency: int,
                       hold_s: float) -> dict[str, float]:
    """Two gates (two replicas' worth) on one pool too small for the load: each decides on a
    view that misses the other's latest changes, and the reserve refuses what no longer fits."""
    import redis

    from extproc import config
    from extproc.fleet.capacity import StaticCapacity
    from extproc.gateway.gate import Gate
    from extproc.ledger.redis import RedisLedger
    from extproc.observability.metrics import Metrics

    small = settings(url)
    small["pools"] = [{"name": "llm", "replicas": 1, "bytes_per_token": 4.0,
                       "engine": {"max_num_seqs": 4}}]
    small["classes"] = {"latency": {"deadline_ms": DEADLINE_MS}}
    cfg = config.from_mapping(small)
    gates = []
    for _ in range(2):
        ledger = RedisLedger.from_config(cfg.ledger, ["llm"])
        gates.append((Gate(cfg, ledger, StaticCapacity(cfg.pools), Metrics()), ledger))
    route = cfg.route("/v1/chat/completions")
    admin = redis.Redis.from_url(url)
    admitted = decided = 0

    async def client(i: int) -> None:
        nonlocal admitted, decided
        for k in range(requests // concurrency):
            gate = gates[(i + k) % 2][0]
            verdict = await gate.check(route, "/v1/chat/completions", {}, LONG)
            decided += 1
            if verdict.ticket is not None:
                admitted += 1
                await asyncio.sleep(hold_s)
                await gate.settle(verdict.ticket)
            else:
                await asyncio.sleep(hold_s / 4)

    def calls(op: str) -> float:
        return sum(g.metrics.registry.get_sample_value(
            "extproc_ledger_call_duration_seconds_count", {"op": op}) or 0.0 for g, _ in gates)

    try:
        admin.config_resetstat()
        wall = time.perf_counter()
        await asyncio.gather(*(client(i) for i in range(concurrency)))
        wall = time.perf_counter() - wall
        await asyncio.sleep(0.05)
        stats = admin.info("commandstats")
        scripts = sum(stats.get(k, {}).get("calls", 0)
                      for k in ("cmdstat_evalsha", "cmdstat_eval"))
        assert (await gates[0][1].snapshot("llm")).inflight == 0
    finally:
        for _, ledger in gates:
            await ledger.close()
        admin.close()
    return {"decided": decided, "admitted": admitted,
            "admitted_share": admitted / decided,
            "redis_calls_per_decision": scripts / decided,
            "reserve_calls_per_decision": calls("reserve") / decided,
            "snapshot_calls_per_decision": calls("snapshot") / decided,
            "admissions_per_s": admitted / wall}


async def variant(url: str, requests: int, concurrency: int, rate: float,
                  hold_ms: float) -> dict[str, Any]:
    import redis

    from extproc import config
    from extproc.fleet.capacity import StaticCapacity
    from extproc.gateway import leases
    from extproc.gateway.gate import Gate
    from extproc.ledger.redis import RedisLedger
    from extproc.observability.metrics import Metrics

    if "LEDGER_CALLS_FRESH_MS" in os.environ:
        leases.FRESH_MS = float(os.environ["LEDGER_CALLS_FRESH_MS"])  # type: ignore[attr-defined]
    cfg = config.from_mapping(settings(url))
    ledger = RedisLedger.from_config(cfg.ledger, [p.name for p in cfg.pools])
    metrics = Metrics()
    gate = Gate(cfg, ledger, StaticCapacity(cfg.pools), metrics)
    admin = redis.Redis.from_url(url)
    try:
        await phase(gate, admin, metrics, "saturating", 500, concurrency, rate, 0.0)  # warm
        out = {"code": str(Path(sys.modules["extproc"].__file__ or "").parent)}
        out["saturating"] = await phase(gate, admin, metrics, "saturating", requests,
                                        concurrency, rate, 0.0)
        out["moderate"] = await phase(gate, admin, metrics, "moderate", int(rate * 5),
                                      concurrency, rate, hold_ms / 1000.0)
        snap = await ledger.snapshot(cfg.pools[0].name)
        assert snap.inflight == 0, snap  # every admission was released exactly once
    finally:
        await ledger.close()
        admin.close()
    out["two gateways"] = await two_gateways(url, requests // 4, 16, hold_ms / 1000.0)
    return out


def worker(args: argparse.Namespace) -> int:
    import uvloop  # what ``extproc serve`` runs on

    result = uvloop.run(variant(args.url, args.requests, args.concurrency, args.rate,
                                args.hold_ms))
    print(json.dumps(result))
    return 0


# --- the run: one Redis, every variant -------------------------------------------------------

def base_rev(asked: str | None) -> str:
    """``--base``, or where this branch left main (the code before this change)."""
    if asked:
        return asked
    found = subprocess.run(["git", "merge-base", "HEAD", "main"], cwd=ROOT, capture_output=True,
                           text=True, check=False)
    if found.returncode != 0:
        raise SystemExit("no main branch: pass --base REV")
    return found.stdout.strip()


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the runs of one variant (the runs kept too)."""
    out: dict[str, Any] = {"code": runs[0]["code"], "runs": runs}
    for ph in PHASES:
        out[ph] = {key: statistics.median(r[ph][key] for r in runs) for key in runs[0][ph]}
    return out


def run_variant(name: str, url: str, args: argparse.Namespace, base: Path) -> dict[str, Any]:
    env = dict(os.environ)
    code = base if name == "before" else ROOT
    env["PYTHONPATH"] = os.pathsep.join([str(code), str(ROOT)])
    if name.startswith("after, FRESH_MS="):
        env["LEDGER_CALLS_FRESH_MS"] = name.split("=", 1)[1]
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--url", url,
           "--requests", str(args.requests), "--concurrency", str(args.concurrency),
           "--rate", str(args.rate), "--hold-ms", str(args.hold_ms)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tempfile.gettempdir(),
                          check=False)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", help="the revision 'before' runs (default: merge-base with main)")
    p.add_argument("--requests", type=int, default=4_000, help="saturating phase requests")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--rate", type=float, default=200.0, help="moderate phase, requests/s")
    p.add_argument("--hold-ms", type=float, default=20.0, help="moderate phase hold")
    p.add_argument("--repeat", type=int, default=3, help="runs per variant (medians shown)")
    p.add_argument("--fresh-ms", type=float, nargs="*", default=[],
                   help="more 'after' columns with these FRESH_MS bounds")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/ledger_calls.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    sys.path.insert(0, str(ROOT))
    from tests.redis_server import RedisServer

    rev = base_rev(args.base)
    with tempfile.TemporaryDirectory() as tmp, RedisServer() as server:
        archive = subprocess.run(["git", "archive", rev, "extproc"], cwd=ROOT,
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        variants = [*VARIANTS, *(f"after, FRESH_MS={ms:g}" for ms in args.fresh_ms)]
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
        for _ in range(args.repeat):  # interleaved: the machine's other load hits each alike
            for name in variants:
                runs[name].append(run_variant(name, server.url, args, Path(tmp)))
    results = {name: median_of(done) for name, done in runs.items()}
    commit = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.strip()
    report = {"benchmark": "ledger_calls", "base": f"{rev} ({commit})",
              "settings": {"requests": args.requests, "concurrency": args.concurrency,
                           "rate": args.rate, "hold_ms": args.hold_ms},
              "variants": results}
    rows = (("redis_calls_per_admission", "Redis calls / admission", "{:.2f}"),
            ("redis_commands_per_admission", "Redis commands / admission", "{:.2f}"),
            ("client_cpu_us_per_admission", "client CPU µs / admission", "{:.0f}"),
            ("admissions_per_s", "admissions/s", "{:.0f}"),
            ("snapshot_calls_per_decision", "snapshot calls / decision", "{:.3f}"))
    contended_rows = (("admitted_share", "admitted / decision", "{:.3f}"),
                      ("redis_calls_per_decision", "Redis calls / decision", "{:.2f}"),
                      ("reserve_calls_per_decision", "reserve calls / decision", "{:.3f}"),
                      ("snapshot_calls_per_decision", "snapshot calls / decision", "{:.3f}"),
                      ("admissions_per_s", "admissions/s", "{:.0f}"))
    whats = {"saturating": f"{args.concurrency} closed-loop clients",
             "moderate": f"{args.rate:g}/s Poisson, held {args.hold_ms:g} ms",
             "two gateways": f"16 clients over two gates, a 4-slot pool, held {args.hold_ms:g} ms"}
    for ph in PHASES:
        print(f"\n{ph} ({whats[ph]})")
        print(f"{'':30}" + "".join(f"{v:>20}" for v in variants))
        for key, label, fmt in contended_rows if ph == "two gateways" else rows:
            print(f"{label:30}" + "".join(f"{fmt.format(results[v][ph][key]):>20}"
                                          for v in variants))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nbase: {report['base']}; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
