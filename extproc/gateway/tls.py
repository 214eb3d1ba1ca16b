"""Mutual TLS on the ext_proc listener, with the certificate files re-read when they change.

gRPC's ``dynamic_ssl_server_credentials`` asks a fetcher for the certificate configuration
before each new connection's handshake (this works with ``grpc.aio`` in grpcio 1.85: the
tests rotate a certificate under a running server). ``ServerCertificates.fetch`` is that
fetcher. At most every ``reload_interval_s`` it compares the three files' (mtime, size, inode)
with what it serves; when any changed (an in-place write, a rename over the file, the symlink
swap of a mounted Kubernetes Secret) it reads them, checks them (the key belongs to the
certificate, the CA file holds a certificate) and hands gRPC the new set. Connections made
before keep the certificate they were made with; Envoy's next connection gets the new one.

A set that does not check out (half-written, key and certificate from different rotations)
is not served: the previous set stays, one warning is logged per bad state, and the next
check tries again. The files are read twice around the check and must not differ, so what
was checked is what is served. At start-up the same problems are a ``ConfigError``.

Client authentication is always required: a client (Envoy) must present a certificate signed
by ``client_ca_file``; a client without one, or with one from another CA, fails the
handshake. Private keys must be unencrypted PEM (as Kubernetes TLS Secrets hold them).
"""

from __future__ import annotations

import logging
import os
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from extproc.errors import ConfigError

if TYPE_CHECKING:
    from extproc.config import ServerTls

log = logging.getLogger(__name__)

_Stamp = tuple[tuple[int, int, int], ...]


class ServerCertificates:
    """The listener's certificate, key and client CA; ``credentials()`` for ``add_secure_port``.

    ``on_reload(ok)`` is told of every change found: served (True) or refused (False).
    """

    def __init__(self, config: ServerTls, *, clock: Callable[[], float] = time.monotonic,
                 on_reload: Callable[[bool], None] | None = None) -> None:
        self.config = config
        self._clock = clock
        self._on_reload = on_reload
        self._paths = (config.cert_file, config.key_file, config.client_ca_file)
        self._stamp = self._stat()
        self._initial = self._load()
        self._checked = clock()
        self._refused: _Stamp | None = None

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._initial, self.fetch, require_client_authentication=True)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """Called by gRPC before a handshake: a new configuration, or None to keep the one
        served. Never raises (gRPC would fail the handshake)."""
        try:
            return self._fetch()
        except Exception:  # a bug here must not fail every handshake
            log.exception("TLS certificate reload failed")
            return None

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        now = self._clock()
        if now - self._checked < self.config.reload_interval_s:
            return None
        self._checked = now
        try:
            stamp = self._stat()
        except OSError as exc:  # a file is missing (mid-swap?): keep serving, look again
            self._refuse((), f"{exc.filename}: {exc.strerror}")
            return None
        if stamp == self._stamp:
            return None
        try:
            loaded = self._load()
        except ConfigError as exc:
            self._refuse(stamp, "; ".join(exc.problems))
            return None
        self._stamp = stamp
        self._refused = None
        log.info("TLS certificate files reloaded", extra={"cert_file": self.config.cert_file})
        if self._on_reload is not None:
            self._on_reload(True)
        return loaded

    def _refuse(self, stamp: _Stamp, why: str) -> None:
        if stamp == self._refused:
            return  # said once for this state of the files
        self._refused = stamp
        log.warning("new TLS certificate files not served, keeping the previous ones: %s", why)
        if self._on_reload is not None:
            self._on_reload(False)

    def _stat(self) -> _Stamp:
        stamps = []
        for path in self._paths:
            st = os.stat(path)
            stamps.append((st.st_mtime_ns, st.st_size, st.st_ino))
        return tuple(stamps)

    def _load(self) -> grpc.ServerCertificateConfiguration:
        """Read, check, read again; raise ``ConfigError`` naming the key at fault."""
        first = self._read()
        _check(self.config)
        if self._read() != first:
            raise ConfigError(["tls: the certificate files changed while being read"])
        cert, key, ca = first
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def _read(self) -> tuple[bytes, bytes, bytes]:
        keys = ("cert_file", "key_file", "client_ca_file")
        out = []
        for key, path in zip(keys, self._paths, strict=True):
            try:
                out.append(Path(path).read_bytes())
            except OSError as exc:
                raise ConfigError([f"tls.{key}: cannot read ({exc.strerror})"]) from exc
        return out[0], out[1], out[2]


def _check(config: ServerTls) -> None:
    """What gRPC would only find at the first handshake, found now (by OpenSSL)."""
    problems = []
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(config.cert_file, config.key_file, password=_no_password)
    except ssl.SSLError as exc:
        problems.append(f"tls.key_file: not the unencrypted private key of tls.cert_file's"
                        f" certificate, or either is not PEM ({exc.reason or exc})")
    try:
        ctx.load_verify_locations(cafile=config.client_ca_file)
    except ssl.SSLError as exc:
        problems.append(f"tls.client_ca_file: no PEM CA certificate ({exc.reason or exc})")
    else:
        if not ctx.get_ca_certs():
            problems.append("tls.client_ca_file: holds no CA certificate")
    if problems:
        raise ConfigError(problems)


def _no_password() -> str:
    """An encrypted key fails the check (OpenSSL would otherwise prompt on the terminal)."""
    return ""
