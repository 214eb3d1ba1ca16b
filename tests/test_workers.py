"""``extproc serve --workers N``: N processes on consecutive ports sharing the Redis ledger, a
supervisor that restarts a dead worker and drains them all on SIGTERM."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc import config
from extproc.errors import ConfigError
from extproc.workers import check, shifted, worker_config
from extproc_dev.stack import wait_http
from tests.redis_server import RedisServer


def consecutive_ports(n: int) -> int:
    """A base port with the ``n`` ports from it free (retried: another process may race)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + n > 65535:
            continue
        try:
            probes = []
            for port in range(base, base + n):
                sock = socket.socket()
                probes.append(sock)
                sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for sock in probes:
                sock.close()
        return base
    raise RuntimeError("no run of free ports")


def test_worker_addresses_follow_the_first_one() -> None:
    assert shifted("127.0.0.1:50051", 0) == "127.0.0.1:50051"
    assert shifted("0.0.0.0:50051", 2) == "0.0.0.0:50053"
    assert shifted("[::1]:7000", 1) == "[::1]:7001"
    assert shifted("unix:/run/extproc.sock", 1) == "unix:/run/extproc.sock.1"
    cfg = config.from_mapping({"ledger": {"kind": "redis", "url": "redis://r:6379"},
                               "keda_listen": "127.0.0.1:6000",
                               "decision_log": "/tmp/decisions.jsonl"})
    second = worker_config(cfg, 1)
    assert (second.listen, second.metrics_listen) == ("127.0.0.1:50052", "127.0.0.1:9465")
    assert second.keda_listen is None and second.decision_log == "/tmp/decisions.jsonl.1"
    assert worker_config(cfg, 0) is cfg


def test_more_than_one_worker_needs_the_shared_ledger_and_fixed_ports() -> None:
    with pytest.raises(ConfigError) as err:
        check(config.from_mapping({"listen": "127.0.0.1:0"}), 2)
    assert "ledger.kind" in str(err.value) and "listen" in str(err.value)
    check(config.from_mapping({}), 1)  # one worker: anything goes
    done = subprocess.run([sys.executable, "-m", "extproc", "serve", "--workers", "2"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "ledger.kind" in done.stderr


def serving(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=2)
        return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)


def workers(supervisor: int) -> dict[int, int]:
    """Worker index -> pid of the supervisor's children."""
    found = {}
    for pid in subprocess.run(["pgrep", "-P", str(supervisor)], capture_output=True,
                              text=True).stdout.split():
        with contextlib.suppress(OSError, ValueError):  # a dead child has no command line
            argv = Path(f"/proc/{pid}/cmdline").read_text().split("\x00")
            found[int(argv[argv.index("--worker-index") + 1])] = int(pid)
    return found


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


def test_workers_serve_on_consecutive_ports_are_restarted_and_drain_together(
        tmp_path: Path, redis: RedisServer) -> None:
    grpc_base, metrics_base = consecutive_ports(2), consecutive_ports(2)
    path = tmp_path / "extproc.yaml"
    path.write_text(yaml.safe_dump({
        "listen": f"127.0.0.1:{grpc_base}", "metrics_listen": f"127.0.0.1:{metrics_base}",
        "drain_grace_s": 2, "ledger": {"kind": "redis", "url": redis.url}}))
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "extproc", "serve", "--config", str(path),
                             "--workers", "2"], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        urls = [f"http://127.0.0.1:{metrics_base + i}/metrics" for i in range(2)]
        for url in urls:
            wait_http(url, timeout=30, proc=proc)
        assert serving(grpc_base) and serving(grpc_base + 1)
        before = workers(proc.pid)
        assert sorted(before) == [0, 1]
        os.kill(before[1], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while workers(proc.pid).get(1, before[1]) == before[1]:  # started again
            assert time.monotonic() < deadline, "worker 1 was not restarted"
            time.sleep(0.2)
        wait_http(urls[1], timeout=30, proc=proc)  # on the same ports
        assert workers(proc.pid)[0] == before[0]
        assert serving(grpc_base + 1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True).stdout == b""
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()
    text = (tmp_path / "serve.log").read_text()
    assert "worker 1 exited with -9" in text
