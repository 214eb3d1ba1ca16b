"""The README as a manual: its configuration block is examples/extproc.yaml and loads; its
"Run it yourself" commands, curl call and OpenAI SDK call work as written (on free ports, so
that tests running side by side never collide; nothing else is changed)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from extproc import config
from extproc_dev.stack import free_port, wait_http

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
EXAMPLE = ROOT / "examples" / "extproc.yaml"
# the ports the manual names, each replaced by a free one
PORTS = (8000, 50051, 9464, 10000, 9901)


def _section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end]


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.DOTALL)


def test_configuration_block_is_the_example_file_and_it_loads() -> None:
    [block] = _blocks(_section("Configuration"), "yaml")
    assert block == EXAMPLE.read_text()
    loaded = config.load(str(EXAMPLE))
    assert loaded.listen == "127.0.0.1:50051" and loaded.metrics_listen == "127.0.0.1:9464"
    assert loaded.pools[0].name == "default"


def test_quickstart_is_the_two_commands() -> None:
    [block] = _blocks(_section("Quickstart"), "")
    assert [line.split()[:2] for line in block.strip().splitlines()] == [
        ["make", "demo"], ["make", "test"]]


@pytest.fixture()
def ports() -> dict[int, int]:
    return {port: free_port() for port in PORTS}


def _local(text: str, ports: dict[int, int], workdir: Path) -> str:
    for documented, free in ports.items():
        text = re.sub(rf"(?<![0-9]){documented}(?![0-9])", str(free), text)
    return text.replace("examples/extproc.yaml", str(workdir / "extproc.yaml")).replace(
        "-o envoy.yaml", f"-o {workdir / 'envoy.yaml'}").replace(
        "-c envoy.yaml", f"-c {workdir / 'envoy.yaml'}").replace(
        ".venv/bin/", str(Path(sys.executable).parent) + "/")


@pytest.fixture()
def manual_stack(ports: dict[int, int], tmp_path: Path) -> Iterator[dict[int, int]]:
    (tmp_path / "extproc.yaml").write_text(_local(EXAMPLE.read_text(), ports, tmp_path))
    [block] = _blocks(_section("Run it yourself"), "sh")[:1]
    lines = block.replace("\\\n", " ").splitlines()  # join continued lines
    commands = [shlex.split(_local(line, ports, tmp_path)) for line in lines if line.strip()]
    assert [c[1:2] for c in commands] == [["fake-backend"], ["serve"], ["envoy-config"],
                                          ["-c"]]
    running: list[subprocess.Popen[bytes]] = []
    try:
        for argv in commands:
            if argv[1] == "envoy-config":  # runs once and exits
                subprocess.run(argv, cwd=ROOT, check=True, timeout=60)
                continue
            proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
            running.append(proc)
            if argv[1] == "fake-backend":
                wait_http(f"http://127.0.0.1:{ports[8000]}/health", proc=proc)
            elif argv[1] == "serve":
                wait_http(f"http://127.0.0.1:{ports[9464]}/metrics", proc=proc)
        wait_http(f"http://127.0.0.1:{ports[9901]}/ready", proc=running[-1])
        wait_http(f"http://127.0.0.1:{ports[10000]}/health", proc=running[-1])
        yield ports
    finally:
        for proc in reversed(running):
            proc.terminate()
            proc.wait(timeout=30)


@pytest.mark.integration
def test_run_it_yourself_works_as_written(manual_stack: dict[int, int], tmp_path: Path) -> None:
    section = _section("Run it yourself")
    curl, burst = _blocks(section, "sh")[1:3]
    assert shutil.which("curl"), "the manual's calls use curl"
    done = subprocess.run(["bash", "-c", _local(curl, manual_stack, tmp_path)],
                          capture_output=True, text=True, timeout=60, check=True)
    assert '"content": "' + " tok" * 16 + '"' in done.stdout, done.stdout
    [sdk] = _blocks(section, "python")
    done = subprocess.run([sys.executable, "-c", _local(sdk, manual_stack, tmp_path)],
                          capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == ("tok " * 16).strip(), done.stdout
    done = subprocess.run(["bash", "-c", _local(burst, manual_stack, tmp_path)],
                          capture_output=True, text=True, timeout=120, check=True)
    counts = {int(code): int(n) for n, code in
              (line.split() for line in done.stdout.splitlines() if "extproc" not in line)}
    assert set(counts) == {200, 429} and sum(counts.values()) == 200, done.stdout
    assert counts[429] >= 100, counts
    # Refused by the decision (deadline) or, before it, by the sidecar's own shedding
    # (processor_overloaded): on a loaded 2-core machine 200 curls at once may all queue for
    # the sidecar past shed_wait_ms, as the README says.
    reasons = set(re.findall(r'outcome="reject",pool="[^"]*",reason="([a-z_]+)"', done.stdout))
    assert reasons and reasons <= {"deadline", "processor_overloaded"}, done.stdout
