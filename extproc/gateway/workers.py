"""``extproc serve --workers N``: N server processes, one endpoint each, behind one Envoy.

Why processes: one Python process decides on one core at most (the GIL; only tokenizing long
prompts runs beside it, on threads). Why one endpoint each rather than one shared port
(``SO_REUSEPORT``): the kernel spreads *connections*, and Envoy carries every ext_proc stream
of one of its worker threads over one HTTP/2 connection, so a shared port would send most
streams to whichever process accepted the busiest connection. With N endpoints in the
processor cluster Envoy's least-request balancer spreads the *streams* (``extproc
envoy-config --workers N`` renders them).

Addresses: worker ``i`` listens on ``listen`` with the port plus ``i`` (a ``unix:`` path gets
``.i`` appended), serves metrics on ``metrics_listen``'s port plus ``i``, writes its own
decision log (``.i`` appended) and only worker 0 serves the KEDA scaler. Fixed ports are needed
(Envoy must know them), so port 0 is refused.

The workers must share one view of the work in flight: N in-process ledgers would each admit a
whole fleet's worth, so more than one worker requires the Redis ledger.

The supervisor is this process: it starts the workers, restarts one that dies (after a back-off
that doubles up to ``MAX_BACKOFF_S`` while it keeps dying young), forwards SIGTERM/SIGINT so
every worker drains as a single server would, and exits once all have.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from types import FrameType
from typing import TYPE_CHECKING

from extproc.errors import ConfigError

if TYPE_CHECKING:
    from extproc.config import Config

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0
STABLE_S = 60.0  # a worker that lived this long starts its back-off afresh when it dies
POLL_S = 0.2


def shifted(address: str, i: int) -> str:
    """``address`` of worker ``i``: the port plus ``i``, or a unix path with ``.i``."""
    if i == 0:
        return address
    if address.startswith("unix:"):
        return f"{address}.{i}"
    host, _, port = address.rpartition(":")
    return f"{host}:{int(port) + i}"


def check(config: Config, workers: int) -> None:
    """Refuse settings that cannot run as ``workers`` processes (errors name the key)."""
    problems = []
    if workers < 1:
        problems.append(f"--workers: must be at least 1 (got {workers})")
    if workers > 1:
        if config.ledger.kind != "redis":
            problems.append("ledger.kind: --workers above 1 needs the shared redis ledger (each"
                            " worker's memory ledger would admit a whole fleet's worth)")
        for key in ("listen", "metrics_listen"):
            value: str = getattr(config, key)
            if not value.startswith("unix:") and value.endswith(":0"):
                problems.append(f"{key}: --workers needs a fixed port, not 0 ({value})")
    if problems:
        raise ConfigError(problems)


def worker_config(config: Config, i: int) -> Config:
    """The settings worker ``i`` serves with (module docstring)."""
    if i == 0:
        return config
    return dataclasses.replace(
        config, listen=shifted(config.listen, i),
        metrics_listen=shifted(config.metrics_listen, i), keda_listen=None,
        decision_log=f"{config.decision_log}.{i}" if config.decision_log else None)


class Supervisor:
    """Runs ``argv(i)`` for each worker until asked to stop; see the module docstring."""

    def __init__(self, workers: int, argv: Sequence[str], stop_grace_s: float) -> None:
        self.argv = list(argv)
        self.stop_grace_s = stop_grace_s
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * workers
        self.started = [0.0] * workers
        self.backoff = [0.0] * workers
        self.due = [0.0] * workers  # when a dead worker may start again
        self.stopping = False

    def _start(self, i: int) -> None:
        self.procs[i] = subprocess.Popen([*self.argv, "--worker-index", str(i)],
                                         stdin=subprocess.DEVNULL)
        self.started[i] = time.monotonic()

    def _on_signal(self, signum: int, _: FrameType | None) -> None:
        if not self.stopping:
            log.info("signal received: draining %d workers", len(self.procs))
        self.stopping = True
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signum)

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        for i in range(len(self.procs)):
            self._start(i)
        log.info("started %d workers", len(self.procs))
        while not self.stopping:
            now = time.monotonic()
            for i, proc in enumerate(self.procs):
                if proc is not None and proc.poll() is not None:
                    lived = now - self.started[i]
                    self.backoff[i] = (1.0 if lived >= STABLE_S or not self.backoff[i]
                                       else min(MAX_BACKOFF_S, 2 * self.backoff[i]))
                    self.due[i] = now + self.backoff[i]
                    log.error("worker %d exited with %s after %.1f s; restarting in %.0f s",
                              i, proc.returncode, lived, self.backoff[i])
                    self.procs[i] = None
                elif proc is None and now >= self.due[i]:
                    self._start(i)
            time.sleep(POLL_S)
        return self._wait()

    def _wait(self) -> int:
        """Every worker drains on its own; one that outlives the grace is killed."""
        until = time.monotonic() + self.stop_grace_s
        for proc in self.procs:
            if proc is None:
                continue
            try:
                proc.wait(max(0.1, until - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return 0


def supervise(config: Config, workers: int, config_path: str | None, log_level: str) -> int:
    check(config, workers)
    argv = [sys.executable, "-m", "extproc", "--log-level", log_level, "serve"]
    if config_path:
        argv += ["--config", config_path]
    return Supervisor(workers, argv, config.drain_grace_s + 5.0).run()
