"""Real ``redis-server`` processes for the tests and the benchmark, never on port 6379.

Each server gets free loopback ports and a temporary directory of its own (config, log, socket,
nodes file), no persistence, and is stopped (SIGTERM, then SIGKILL) by ``stop``. Forms:

- ``RedisServer()``: standalone, TCP; ``unix=True`` adds a unix socket (and ``port=0`` drops
  TCP); ``tls=Certs(...)`` serves TLS only; ``acl=[...]`` adds ``user`` lines;
  ``settings`` adds any other directive (e.g. ``maxmemory-policy``).
- ``RedisSentinel(master)``: one Sentinel watching ``master`` as service ``mymaster``.
- ``RedisClusterNodes()``: three primaries sharing the 16,384 slots, ready when every node
  reports ``cluster_state:ok``.

Faults for the fault tests: ``pause`` (SIGSTOP: a black hole that accepts connections and
never answers), ``resume`` (SIGCONT), ``kill`` (SIGKILL: connections refused) and ``start``
again on the same port (an empty Redis: the data died with it).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import redis

from extproc_dev.stack import free_port

READY_TIMEOUT_S = 10.0


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found is None:
        raise FileNotFoundError("redis-server not found: run `make setup` (installs it)")
    return found


def poll(predicate: Callable[[], bool], timeout: float, what: str,
         interval: float = 0.02) -> None:
    """Wait until ``predicate()`` is true, or fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached after {timeout:.1f}s")
        time.sleep(interval)


@dataclass(frozen=True)
class Certs:
    """A throw-away CA and a server certificate for 127.0.0.1/localhost, made with openssl."""

    ca: Path
    cert: Path
    key: Path

    @classmethod
    def make(cls, directory: Path) -> Certs:
        openssl = shutil.which("openssl")
        if openssl is None:
            raise FileNotFoundError("openssl not found: run `make setup` (installs it)")
        directory.mkdir(parents=True, exist_ok=True)
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")

        def run(*args: str) -> None:
            subprocess.run([openssl, *args], cwd=directory, check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1",
            "-subj", "/CN=extproc-test-ca")
        run("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost")
        run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "server.crt", "-days", "1", "-extfile", "san.ext")
        return cls(directory / "ca.crt", directory / "server.crt", directory / "server.key")


class RedisServer:
    def __init__(self, *, port: int | None = None, unix: bool = False, tls: Certs | None = None,
                 acl: Iterable[str] = (), settings: Mapping[str, str] | None = None,
                 sentinel: bool = False) -> None:
        # short paths: a unix socket path must fit in 107 bytes
        self.dir = Path(tempfile.mkdtemp(prefix="redis-"))
        self.port = free_port() if port is None else port
        self.unix = unix
        self.tls = tls
        self.acl = list(acl)
        self.settings = dict(settings or {})
        self.sentinel = sentinel
        self.socket = self.dir / "redis.sock"
        self.log_path = self.dir / "redis.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._offset = 0

    @property
    def url(self) -> str:
        if self.unix and self.port == 0:
            return f"unix://{self.socket}"
        scheme = "rediss" if self.tls is not None else "redis"
        return f"{scheme}://127.0.0.1:{self.port}"

    def _config(self) -> str:
        lines = [
            "bind 127.0.0.1", f"dir {self.dir}", f"logfile {self.log_path}", "daemonize no",
            "protected-mode no", 'save ""', "appendonly no",
        ]
        if self.tls is not None:
            lines += ["port 0", f"tls-port {self.port}", f"tls-cert-file {self.tls.cert}",
                      f"tls-key-file {self.tls.key}", f"tls-ca-cert-file {self.tls.ca}",
                      "tls-auth-clients no"]
        else:
            lines.append(f"port {self.port}")
        if self.unix:
            lines += [f"unixsocket {self.socket}", "unixsocketperm 700"]
        lines += [f"user {rule}" for rule in self.acl]
        lines += [f"{k} {v}" for k, v in self.settings.items()]
        return "\n".join(lines) + "\n"

    def start(self) -> Self:
        """Start (or start again, on the same port, empty) and wait until it serves."""
        self.launch()
        self.wait_ready()
        return self

    def launch(self) -> None:
        config = self.dir / ("sentinel.conf" if self.sentinel else "redis.conf")
        if not (self.sentinel and config.exists()):  # Sentinel rewrites its own file
            config.write_text(self._config())
        self._offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        argv = [redis_server_binary(), str(config)] + (["--sentinel"] if self.sentinel else [])
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)

    def wait_ready(self) -> None:
        marker = "Sentinel ID is" if self.sentinel else "to accept connections"

        def ready() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited ({self.proc.returncode}):\n"
                                   + self.log()[-2000:])
            return self.log_path.exists() and marker in self.log(self._offset)

        poll(ready, READY_TIMEOUT_S, f"redis-server on port {self.port} ready")

    def log(self, offset: int = 0) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def client(self, **kwargs: Any) -> redis.Redis:
        """A plain synchronous client for setting up and checking (admin rights)."""
        if self.unix and self.port == 0:
            return redis.Redis(unix_socket_path=str(self.socket), socket_timeout=5, **kwargs)
        if self.tls is not None:
            kwargs.update(ssl=True, ssl_ca_certs=str(self.tls.ca))
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, **kwargs)

    def _signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def pause(self) -> None:
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Self:
        try:
            self.start()
            return self
        except BaseException:
            self.remove()
            raise

    def __exit__(self, *exc: object) -> None:
        self.remove()


class RedisSentinel(RedisServer):
    """A Sentinel watching ``master`` as ``mymaster`` (quorum 1, fast failure detection)."""

    SERVICE = "mymaster"

    def __init__(self, master: RedisServer, replicas_of: Iterable[RedisServer] = ()) -> None:
        super().__init__(sentinel=True)
        self.master = master
        self.replicas = list(replicas_of)

    def _config(self) -> str:
        return super()._config() + (
            f"sentinel monitor {self.SERVICE} 127.0.0.1 {self.master.port} 1\n"
            f"sentinel down-after-milliseconds {self.SERVICE} 500\n"
            f"sentinel failover-timeout {self.SERVICE} 2000\n")

    def master_address(self) -> tuple[str, int]:
        host, port = self.client().execute_command(
            "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.SERVICE)
        return host.decode(), int(port)


class RedisClusterNodes:
    """Three primaries, slots split evenly, joined with CLUSTER MEET."""

    def __init__(self, size: int = 3) -> None:
        self.nodes = [RedisServer(settings={
            "cluster-enabled": "yes", "cluster-config-file": "nodes.conf",
            "cluster-node-timeout": "2000", "cluster-port": str(free_port()),
        }) for _ in range(size)]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self) -> RedisClusterNodes:
        # Launched together: each node waits ~2 s after its start before it turns writable
        # (Redis's CLUSTER_WRITABLE_DELAY), and those waits overlap.
        for node in self.nodes:
            node.launch()
        for node in self.nodes:
            node.wait_ready()
        clients = [n.client() for n in self.nodes]
        step = 16384 // len(clients)
        for i, c in enumerate(clients):
            last = 16383 if i == len(clients) - 1 else (i + 1) * step - 1
            c.execute_command("CLUSTER", "ADDSLOTSRANGE", i * step, last)
        for node in self.nodes[1:]:
            clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", node.port,
                                       node.settings["cluster-port"])

        def ok() -> bool:
            for c in clients:
                info = c.execute_command("CLUSTER", "INFO").decode()
                if ("cluster_state:ok" not in info
                        or f"cluster_known_nodes:{len(clients)}" not in info):
                    return False
            return True

        poll(ok, READY_TIMEOUT_S, "cluster_state:ok on every node", interval=0.05)
        for c in clients:
            c.close()
        return self

    def remove(self) -> None:
        for node in self.nodes:
            node.remove()

    def __enter__(self) -> RedisClusterNodes:
        try:
            return self.start()
        except BaseException:
            self.remove()
            raise

    def __exit__(self, *exc: object) -> None:
        self.remove()
