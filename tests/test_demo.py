"""``extproc demo`` end to end: real Envoy, ``extproc serve`` and fake backends, both modes."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest

from extproc_dev import demo, loadgen

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

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
    assert (workdir / demo.PLOT_NAME).read_bytes().startswith(PNG_MAGIC)
    assert stack_processes(workdir) == []


# ---- progress and plot, on recorded samples (no processes) ----

WORKLOAD = loadgen.Workload(seed=0, rate_rps=2.0, duration_s=3.0, requests=tuple(
    loadgen.Planned(at_s=at, prompt_tokens=100, output_tokens=50, max_tokens=512)
    for at in (0.1, 0.6, 1.2, 1.5, 2.9)))
RESULTS = [  # deadline 30 s, TTFT objective 2 s
    loadgen.Result(0, 200, 5.0, ttft_s=0.3, tokens=50, completed=True),  # within SLO
    loadgen.Result(1, 200, 6.0, ttft_s=2.5, tokens=50, completed=True),  # ok, TTFT too late
    loadgen.Result(2, 429, 0.01),
    loadgen.Result(3, 0, 30.0, abandoned=True),
    loadgen.Result(4, 200, 31.0, ttft_s=0.5, tokens=50, completed=True),  # past the deadline
]


def tally_of(results: list[loadgen.Result], sent: int) -> loadgen.Tally:
    tally = loadgen.Tally(sent=sent)
    for r in results:
        tally.add(r)
    return tally


def test_progress_off_a_terminal_is_a_plain_line_every_ten_seconds() -> None:
    out = io.StringIO()
    progress = demo.RunProgress("shadow", 5, 70.0, out)
    tally = tally_of(RESULTS[:3], sent=4)
    for elapsed in (0.0, 1.0, 5.0, 9.9, 10.1, 11.0, 19.0, 31.5):
        progress.update(tally, elapsed)
    progress.close(tally_of(RESULTS, sent=5), 40.0)

    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert [line.split(":")[0] for line in lines] == [
        "  shadow    10 s of at most 70", "  shadow    32 s of at most 70",
        "  shadow   ended after 40 s"]
    assert lines[0].endswith("sent 4/5, answered 200 2, 429 1, gave up 0, failed 0,"
                             " in flight 1")
    assert lines[-1].endswith("sent 5/5, answered 200 3, 429 1, gave up 1, failed 0,"
                              " in flight 0")


def test_progress_on_a_terminal_redraws_one_short_line() -> None:
    out = io.StringIO()
    progress = demo.RunProgress("enforce", 5, 70.0, out, tty=True)
    progress.update(tally_of(RESULTS[:3], sent=4), 12.0)
    progress.close(tally_of(RESULTS, sent=5), 40.0)

    text = out.getvalue()
    assert text.endswith("\n") and text.count("\n") == 1  # one line, drawn over in place
    draws = text.rstrip("\n").split("\r")[1:]
    assert len(draws) == 2
    assert "sent   4  200   2  429   1  gave up   0  in flight   1" in draws[0]
    assert "sent   5  200   3  429   1  gave up   1  in flight   0" in draws[1]
    assert "100%" in draws[1]
    assert all(len(d) < 80 for d in draws)  # a wrapped line would not redraw in place


def test_timeline_bins_each_request_by_its_arrival_second() -> None:
    tl = demo.timeline(RESULTS, WORKLOAD, deadline_s=30.0, ttft_s=2.0)

    assert tl.bin_s == 1.0
    assert tl.within_slo == (1, 0, 0)
    assert tl.late == (1, 0, 1)  # TTFT past the objective; latency past the deadline
    assert tl.rejected == (0, 1, 0)
    assert tl.gave_up == (0, 1, 0)
    assert tl.latency_p95_s == (pytest.approx(5.95), None, 31.0)
    assert tl.ttft_p95_s == (pytest.approx(2.39), None, 0.5)


def test_plot_writes_both_runs_into_one_png(tmp_path: Path) -> None:
    tl = demo.timeline(RESULTS, WORKLOAD, deadline_s=30.0, ttft_s=2.0)
    path = tmp_path / "sub" / demo.PLOT_NAME

    demo.plot({"shadow": tl, "enforce": tl}, path, deadline_s=30.0, ttft_s=2.0, title="t")

    assert path.read_bytes().startswith(PNG_MAGIC)


def test_an_interrupted_run_does_not_draw_the_bar_full() -> None:
    out = io.StringIO()
    progress = demo.RunProgress("shadow", 5, 70.0, out, tty=True)
    progress.update(tally_of(RESULTS[:1], sent=2), 7.0)
    progress.close(tally_of(RESULTS[:1], sent=2), 8.0, finished=False)

    assert out.getvalue().endswith("\n") and "100%" not in out.getvalue()
