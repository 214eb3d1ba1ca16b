"""``extproc serve --workers N``: N processes on consecutive ports sharing the Redis ledger, a
supervisor that restarts a dead worker and drains them all on SIGTERM."""

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc import config
from extproc.errors import ConfigError
from extproc.gateway.workers import check, shifted, worker_config
from extproc_dev.stack import free_port, scrape, wait_http
from tests.redis_server import RedisServer
from tests.traffic import wait_until

pytestmark = pytest.mark.integration  # starts processes (Envoy, extproc, helm, an interpreter)


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
    grpc_base, metrics_base = free_port(2), free_port(2)
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


def test_envoy_stops_sending_to_a_killed_worker_and_takes_it_back_once_restarted(
        tmp_path: Path, redis: RedisServer) -> None:
    """``serve --workers 2`` behind the Envoy ``envoy-config --workers 2`` renders, under load:
    ``kill -9`` of worker 1 takes it out of Envoy's rotation (health flags set) within 2 s and
    no request fails after that (fail-closed: a stream sent to the dead worker would be a
    503); once the supervisor has restarted it, Envoy's health checks put it back and it
    decides again."""
    from extproc_dev.stack import Process, envoy_binary, free_port
    from tests.traffic import Ask, Traffic, count

    grpc_base, metrics_base = free_port(2), free_port(2)
    backend, envoy_port, admin = free_port(), free_port(), free_port()
    path = tmp_path / "extproc.yaml"
    path.write_text(yaml.safe_dump({
        "listen": f"127.0.0.1:{grpc_base}", "metrics_listen": f"127.0.0.1:{metrics_base}",
        "drain_grace_s": 0, "pools": [{"name": "llama", "models": ["*"], "replicas": 1,
                                       "engine": {"max_num_seqs": 16}}],
        "ledger": {"kind": "redis", "url": redis.url}}))
    envoy_yaml = tmp_path / "envoy.yaml"
    subprocess.run([sys.executable, "-m", "extproc", "envoy-config", "--config", str(path),
                    "--workers", "2", "--fail-closed", "--port", str(envoy_port),
                    "--admin-port", str(admin), "--backend", f"127.0.0.1:{backend}",
                    "-o", str(envoy_yaml)], check=True, timeout=60)
    procs = [Process("backend", [sys.executable, "-m", "extproc", "fake-backend", "--port",
                                 str(backend), "--max-running", "32", "--time-scale", "0.2"],
                     tmp_path)]
    supervisor = Process("serve", [sys.executable, "-m", "extproc", "serve", "--config",
                                   str(path), "--workers", "2"], tmp_path)
    procs.append(supervisor)
    try:
        wait_http(f"http://127.0.0.1:{backend}/health", proc=procs[0].popen)
        for i in range(2):
            wait_http(f"http://127.0.0.1:{metrics_base + i}/metrics", timeout=30,
                      proc=supervisor.popen)
        procs.append(Process("envoy", [envoy_binary(), "-c", str(envoy_yaml), "--log-level",
                                       "warn", "--base-id", str(admin)], tmp_path))
        wait_http(f"http://127.0.0.1:{envoy_port}/health", proc=procs[-1].popen)
        host = f"extproc::127.0.0.1:{grpc_base + 1}::health_flags::"

        def flagged() -> bool:
            with urllib.request.urlopen(f"http://127.0.0.1:{admin}/clusters",
                                        timeout=2) as resp:
                return any(line.startswith(host) and "failed" in line
                           for line in resp.read().decode().splitlines())

        def decided(i: int) -> float:
            return scrape(f"http://127.0.0.1:{metrics_base + i}/metrics",
                          "extproc_admission_decisions_total")

        async def run() -> tuple[Traffic, float, float, float]:
            async with Traffic(f"http://127.0.0.1:{envoy_port}", Ask(output_tokens=8),
                               timeout_s=30.0) as traffic:
                stop = asyncio.Event()
                load = asyncio.create_task(traffic.open(20.0, stop))
                await asyncio.sleep(1.5)
                assert decided(1) > 0  # worker 1 had its share
                os.kill(workers(supervisor.pid)[1], signal.SIGKILL)
                killed = time.monotonic()
                out_s = await wait_until(flagged, 10.0, "dead worker flagged")
                back_s = await wait_until(lambda: not flagged() and decided(1) > 0, 30.0,
                                          "restarted worker back in rotation")
                await asyncio.sleep(1.0)
                stop.set()
                await load
            return traffic, killed, out_s, back_s

        traffic, killed, out_s, back_s = asyncio.run(run())
    finally:
        for proc in reversed(procs):
            proc.stop()
    late = traffic.between(killed + 2.0, time.monotonic())
    print(f"flagged_s={out_s:.3f} back_s={back_s:.2f} all={count(traffic.replies)}"
          f" after_2s={count(late)}")
    assert out_s <= 2.0
    assert set(count(late)) <= {"200", "429"}, count(late)
