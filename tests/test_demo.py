"""``extproc demo`` end to end: real Envoy, ``extproc serve`` and fake backends, both modes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from extproc_dev import demo

RUN_KEYS = {
    "sent", "ok", "rejected_429", "share_429", "abandoned", "failed", "latency_p50_s",
    "latency_p95_s", "latency_p99_s", "ttft_p50_s", "ttft_p95_s", "within_deadline",
    "within_deadline_share", "goodput_rps", "slo_goodput_rps", "good_tokens_per_s",
    "decisions", "decision_ms_mean", "backends_drained",
}


def stack_processes(workdir: Path) -> list[str]:
    """Live children of this process, and any process started with a path in ``workdir``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # it ended while we looked
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if state != "Z" and (int(ppid) == os.getpid() or str(workdir) in cmdline):
            found.append(f"{entry.name}: {cmdline}")
    return found


@pytest.mark.integration
def test_demo_prints_a_summary_and_leaves_nothing_running(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workdir = tmp_path / "demo"
    # half speed everywhere (backends, cost model, deadline, client timeout): ~45 s in all
    code = demo.main(duration_s=8.0, rate_x=3.0, workdir=str(workdir), time_scale=0.5)
    out = capsys.readouterr().out

    assert code == 0, out
    lines = [line for line in out.splitlines() if line.startswith("DEMO-SUMMARY ")]
    assert len(lines) == 1, out
    summary = json.loads(lines[0].removeprefix("DEMO-SUMMARY "))
    for mode in ("shadow", "enforce"):
        assert summary[mode].keys() >= RUN_KEYS, mode
        assert summary[mode]["sent"] == summary["requests"] > 0
        assert summary[mode]["failed"] == 0
        assert summary[mode]["backends_drained"] is True
    assert summary["shadow"]["share_429"] == 0
    assert summary["enforce"]["share_429"] > 0
    assert summary["capacity_rps"] > 0 and summary["retries"] is False
    assert stack_processes(workdir) == []
