"""The `extproc` command as a user runs it: real processes, real signals."""

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc_dev.stack import free_port, wait_http

pytestmark = pytest.mark.integration  # starts processes (Envoy, extproc, helm, an interpreter)


def test_bad_config_exits_2_naming_every_bad_key(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("mode: loud\npools:\n  - name: p\n    engine: {max_num_seqs: 0}\n")
    result = subprocess.run([sys.executable, "-m", "extproc", "serve", "--config", str(cfg)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "mode: must be one of" in result.stderr
    assert "pools[0].engine.max_num_seqs: must be > 0 (got 0)" in result.stderr
    assert "Traceback" not in result.stderr


def test_serve_reports_health_and_exits_cleanly_on_sigterm(tmp_path: Path) -> None:
    grpc_port, metrics_port = free_port(), free_port()
    cfg = tmp_path / "ok.yaml"
    cfg.write_text(f"listen: 127.0.0.1:{grpc_port}\nmetrics_listen: 127.0.0.1:{metrics_port}\n"
                   "drain_grace_s: 10\n")
    proc = subprocess.Popen([sys.executable, "-m", "extproc", "serve", "--config", str(cfg)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{metrics_port}/metrics", proc=proc)  # type: ignore[arg-type]
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            check = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert check.status == health_pb2.HealthCheckResponse.SERVING
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert time.monotonic() - started < 5  # idle: no need to wait out the grace period
        assert b"draining" in (proc.stdout.read() if proc.stdout else b"")
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize(("args", "message"), [
    (["envoy-config", "--backend", "nonsense"], "expected HOST:PORT"),
    (["envoy-config", "--backend", "10.0.0.1:99999"], "not a TCP port (1-65535): '99999'"),
    (["envoy-config", "--port", "70000"], "not a TCP port (1-65535): '70000'"),
    (["envoy-config", "--admin-port", "0"], "not a TCP port"),
    (["envoy-config", "--workers", "0"], "must be a whole number >= 1"),
    (["fake-backend", "--replicas", "0"], "--replicas: must be a whole number >= 1 (got '0')"),
    (["fake-backend", "--port", "-1"], "not a TCP port"),
    (["fake-backend", "--time-scale", "-1"], "--time-scale must be >= 0"),
    (["fake-backend", "--max-num-seqs", "0"], "fake-backend:"),
    (["serve", "--workers", "zero"], "must be a whole number >= 1"),
    (["--log-level", "loud", "serve"], "not a log level: 'loud'"),
    (["demo", "--overload", "0"], "--overload: must be a number > 0 (got '0')"),
    (["demo", "--duration", "-5"], "--duration: must be a number > 0 (got '-5')"),
    (["replay", "--scenario", "incident", "--timeout", "0"], "--timeout: must be a number > 0"),
    (["replay", "--scenario", "incident", "--fleet-scale", "-1"], "--fleet-scale: must be"),
    (["replay", "--scenario", "incident", "--replicas", "0"], "--replicas: must be a whole"),
    (["replay", "--trace", "/no/such.csv"], "--trace: no such file: /no/such.csv"),
    (["eval", "--seeds", "0"], "--seeds: must be a whole number >= 1"),
])
def test_bad_arguments_are_one_clear_line_never_a_traceback(args: list[str],
                                                            message: str) -> None:
    result = subprocess.run([sys.executable, "-m", "extproc", *args], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""  # nothing half-written, no config with a bad port in it


def test_an_engine_flag_out_of_bounds_is_one_message() -> None:
    """Not two that contradict each other (>= 1 and >= 0 for the same value)."""
    result = subprocess.run([sys.executable, "-m", "extproc", "fake-backend", "--max-num-seqs",
                             "-1"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.count("max_num_seqs") == 1, result.stderr
    assert "max_num_seqs must be >= 1, got -1" in result.stderr


def test_version_and_every_flag_has_help_with_its_default() -> None:
    from importlib.metadata import version

    result = subprocess.run([sys.executable, "-m", "extproc", "--version"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.split() == [
        "extproc", version("envoy-llm-admission")]
    from extproc.cli import parser

    commands = parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    for name in ("envoy-config", "fake-backend"):
        for action in commands[name]._actions:
            assert action.help, (name, action.option_strings)
        text = commands[name].format_help()
        assert "(default: 10000)" in text if name == "envoy-config" else "(default: 8000)" in text


def test_envoy_config_takes_good_backends_and_log_levels_in_any_case() -> None:
    result = subprocess.run([sys.executable, "-m", "extproc", "--log-level", "debug",
                             "envoy-config", "--backend", "10.0.0.7:8001", "--port", "65535"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "10.0.0.7" in result.stdout and "8001" in result.stdout and "65535" in result.stdout


def test_a_config_with_an_impossible_port_never_reaches_envoys_config(tmp_path: Path) -> None:
    cfg = tmp_path / "ports.yaml"
    cfg.write_text("listen: 127.0.0.1:70000\nmetrics_listen: 127.0.0.1:99999\n")
    result = subprocess.run([sys.executable, "-m", "extproc", "envoy-config", "--config",
                             str(cfg)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    assert "listen: the port must be 0-65535 (got '127.0.0.1:70000')" in result.stderr
    assert "metrics_listen: the port must be 0-65535 (got '127.0.0.1:99999')" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_port_in_use_is_one_line_for_serve_and_fake_backend(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cfg = tmp_path / "busy.yaml"
        cfg.write_text(f"listen: 127.0.0.1:{port}\nmetrics_listen: 127.0.0.1:0\n")
        for args in (["serve", "--config", str(cfg)], ["fake-backend", "--port", str(port)]):
            result = subprocess.run([sys.executable, "-m", "extproc", *args],
                                    capture_output=True, text=True, timeout=60)
            assert result.returncode == 1, result.stderr
            assert "extproc: cannot listen" in result.stderr and str(port) in result.stderr
            assert "Traceback" not in result.stderr, result.stderr


def test_envoy_config_renders_one_trip_unless_two_are_asked_for(tmp_path: Path) -> None:
    """One trip by default (docs/performance.md): a clean admission POST skips the headers
    phase and a buffer filter holds its headers back; --two-trips renders neither."""
    import yaml

    from extproc.cli import main

    def modes(*flags: str) -> tuple[set[str], list[str]]:
        out = tmp_path / f"envoy{len(flags)}.yaml"
        assert main(["envoy-config", "-o", str(out), *flags]) == 0
        hcm = yaml.safe_load(out.read_text())["static_resources"]["listeners"][0][
            "filter_chains"][0]["filters"][0]["typed_config"]
        routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
        skipped = {r["match"].get("path", "") for r in routes
                   if "envoy.filters.http.ext_proc" in r.get("typed_per_filter_config", {})}
        return skipped, [f["name"] for f in hcm["http_filters"]]

    skipped, filters = modes()
    assert "/v1/chat/completions" in skipped and "envoy.filters.http.buffer" in filters
    assert modes("--two-trips") == (set(), ["envoy.filters.http.ext_proc",
                                            "envoy.filters.http.router"])
