"""The `extproc` command as a user runs it: real processes and real signals (marked
integration), and its arguments through ``main`` in-process (no process to start)."""

import argparse
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.cli import main, parser
from extproc_dev.stack import free_port, wait_http

# starts processes (Envoy, extproc, helm, an interpreter): the tests that do carry it
integration = pytest.mark.integration


def run_main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``extproc ARGS`` in-process: its exit status (argparse exits, main returns), stdout and
    stderr. An exception escaping main fails the test: that is the traceback a user would see."""
    try:
        status = main(args)
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 1
    out = capsys.readouterr()
    return status, out.out, out.err


def subcommands() -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


@integration
def test_bad_config_exits_2_naming_every_bad_key(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("mode: loud\npools:\n  - name: p\n    engine: {max_num_seqs: 0}\n")
    result = subprocess.run([sys.executable, "-m", "extproc", "serve", "--config", str(cfg)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "mode: must be one of" in result.stderr
    assert "pools[0].engine.max_num_seqs: must be > 0 (got 0)" in result.stderr
    assert "Traceback" not in result.stderr


@integration
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
    (["serve", "--workers", "zero"], "must be a whole number >= 1"),
    (["--log-level", "loud", "serve"], "not a log level: 'loud'"),
    # issue 26: each of these ended in a traceback, or in a message that named no flag
    (["demo", "--overload", "0"], "argument --overload: must be a number > 0 (got '0')"),
    (["demo", "--duration", "-5"], "argument --duration: must be a number > 0 (got '-5')"),
    (["demo", "--duration", "inf"], "argument --duration: must be a number > 0 (got 'inf')"),
    (["fake-backend", "--max-num-seqs", "0"],
     "argument --max-num-seqs/--max-running: must be a whole number >= 1 (got '0')"),
    (["fake-backend", "--block-size", "0"], "argument --block-size: must be a whole number >= 1"),
    (["fake-backend", "--num-gpu-blocks", "-1"],
     "argument --num-gpu-blocks: must be a whole number >= 0 (got '-1')"),
    (["fake-backend", "--ms-per-token", "-0.5"],
     "argument --ms-per-token: must be a number >= 0 (got '-0.5')"),
    (["fake-backend", "--kv-cache-tokens", "-1"],
     "argument --kv-cache-tokens: must be a whole number >= 0 (got '-1')"),
    (["fake-backend", "--time-scale", "-1"],
     "argument --time-scale: must be a number >= 0 (got '-1')"),
    (["replay", "--scenario", "incident", "--timeout", "0"],
     "argument --timeout: must be a number > 0 (got '0')"),
    (["replay", "--scenario", "incident", "--fleet-scale", "-1"],
     "argument --fleet-scale: must be a number > 0 (got '-1')"),
    (["replay", "--scenario", "incident", "--scale", "0"],
     "argument --scale: must be a number > 0 (got '0')"),
    (["replay", "--scenario", "incident", "--rate-x", "-2"],
     "argument --rate-x: must be a number > 0 (got '-2')"),
    (["replay", "--scenario", "incident", "--replicas", "0"],
     "argument --replicas: must be a whole number >= 1 (got '0')"),
    (["replay", "--scenario", "incident", "--max-tokens", "0"],
     "argument --max-tokens: must be a whole number >= 1 (got '0')"),
    (["eval", "--seeds", "0"], "argument --seeds: must be a whole number >= 1 (got '0')"),
    (["eval", "--jobs", "-1"], "argument --jobs: must be a whole number >= 0 (got '-1')"),
    (["eval", "--loads", "0.8,-1"], "argument --loads: each load must be a number > 0 (got '-1')"),
    (["eval", "--loads", "high"], "argument --loads: each load must be a number > 0"),
])
def test_bad_arguments_are_one_clear_line_never_a_traceback(
        args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run_main(args, capsys)
    assert status == 2, err
    assert message in err.splitlines()[-1], err  # the one error line, after the usage
    assert out == ""  # nothing half-written, no config with a bad port in it


def test_good_values_pass_the_bounds() -> None:
    """The bounds refuse only what makes no sense: 0 where it means something is taken."""
    args = parser().parse_args(["fake-backend", "--time-scale", "0", "--num-gpu-blocks", "0",
                                "--kv-cache-tokens", "0", "--ms-per-token", "0.05"])
    assert (args.time_scale, args.num_gpu_blocks, args.kv_cache_tokens) == (0.0, 0, 0)
    args = parser().parse_args(["eval", "--jobs", "0", "--loads", "0.8, 1.5,3"])
    assert (args.jobs, args.loads) == (0, [0.8, 1.5, 3.0])
    args = parser().parse_args(["replay", "--scenario", "incident", "--fleet-scale", "0.25",
                                "--timeout", "0.5"])
    assert (args.fleet_scale, args.timeout) == (0.25, 0.5)


def test_an_engine_flag_out_of_bounds_is_one_message(capsys: pytest.CaptureFixture[str]) -> None:
    """Not two that contradict each other (>= 1 and >= 0 for the same value), and named by
    the flag the user typed rather than the engine's field."""
    status, out, err = run_main(["fake-backend", "--max-num-seqs", "-1"], capsys)
    assert status == 2 and out == ""
    assert err.count("must be") == 1, err
    assert err.splitlines()[-1].endswith(
        "argument --max-num-seqs/--max-running: must be a whole number >= 1 (got '-1')")


def test_version_is_the_installed_packages(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    status, out, err = run_main(["--version"], capsys)
    assert status == 0, err
    assert out == f"extproc {version('envoy-llm-admission')}\n"


def test_every_flag_has_help_and_shows_its_default() -> None:
    """Every flag of every command says what it is for; a default that means something
    (0 and 1 included) is printed after it; None (not given) and a switch's False are not."""
    for name, command in subcommands().items():
        text = " ".join(command.format_help().split())  # as if never wrapped
        for action in command._actions:
            if action.help == argparse.SUPPRESS:
                continue
            assert action.help, (name, action.option_strings)
            says_nothing = action.default is None or action.default is False
            if not says_nothing and action.default != argparse.SUPPRESS:
                assert f"(default: {action.default})" in text, (name, action.option_strings)
        assert "(default: None)" not in text and "(default: False)" not in text, name
    fake = " ".join(subcommands()["fake-backend"].format_help().split())
    assert "(default: 8000)" in fake and "(default: 127.0.0.1)" in fake
    assert "most sequences running at once (default: 1024 in llama-70b-fp8-2xh100" in fake
    envoy = " ".join(subcommands()["envoy-config"].format_help().split())
    assert "(default: 10000)" in envoy and "(default: 9901)" in envoy


@pytest.mark.parametrize("args", [
    ["replay", "--trace", "{missing}"],
    ["replay", "--scenario", "incident", "--config", "{missing}"],
    ["serve", "--config", "{missing}"],
    ["envoy-config", "--config", "{missing}"],
])
def test_a_missing_file_is_named_as_missing_not_as_bad_configuration(
        args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "no" / "such.csv")
    status, out, err = run_main([a.format(missing=missing) for a in args], capsys)
    assert status == 2 and out == ""
    assert f"no such file: {missing!r}" in err.splitlines()[-1], err
    assert "invalid configuration" not in err


def test_a_directory_is_not_a_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run_main(["replay", "--trace", str(tmp_path)], capsys)
    assert status == 2
    assert f"--trace: a directory, not a file: {str(tmp_path)!r}" in err


def test_an_output_that_cannot_be_written_is_named_not_called_a_listener(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "no-such-folder" / "envoy.yaml"
    status, out, err = run_main(["envoy-config", "-o", str(target)], capsys)
    assert status == 1 and out == ""
    assert err == f"extproc: {target}: No such file or directory\n"


@integration
def test_envoy_config_takes_good_backends_and_log_levels_in_any_case() -> None:
    result = subprocess.run([sys.executable, "-m", "extproc", "--log-level", "debug",
                             "envoy-config", "--backend", "10.0.0.7:8001", "--port", "65535"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "10.0.0.7" in result.stdout and "8001" in result.stdout and "65535" in result.stdout


@integration
def test_a_config_with_an_impossible_port_never_reaches_envoys_config(tmp_path: Path) -> None:
    cfg = tmp_path / "ports.yaml"
    cfg.write_text("listen: 127.0.0.1:70000\nmetrics_listen: 127.0.0.1:99999\n")
    result = subprocess.run([sys.executable, "-m", "extproc", "envoy-config", "--config",
                             str(cfg)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    assert "listen: the port must be 0-65535 (got '127.0.0.1:70000')" in result.stderr
    assert "metrics_listen: the port must be 0-65535 (got '127.0.0.1:99999')" in result.stderr
    assert "Traceback" not in result.stderr


@integration
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
